"""Child process of the crash tests (test_persistence.py): registers segments, prints one JSON line
per acknowledged step on stdout, and waits to be killed with SIGKILL.

    python tests/support/tiers_child.py DIR after_register   # acks, generations, then idle: no snapshot ever taken
    python tests/support/tiers_child.py DIR mid_snapshot     # snapshot 1, more acks and a delete, then snapshot 2
                                               # paused between its data and its commit
    python tests/support/tiers_child.py DIR mid_update:STAGE # s0 registered and snapshotted, then an update of s0
                                               # paused at STAGE (segment_updates.py: computed|committed)
"""

import json
import os
import sys
import time

# Run as a file: the repository root goes on sys.path (tests.support, inferscale_jax, models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support.tiers_common import gen, make_engine, seg_tokens  # noqa: E402


def say(**kw):
    print(json.dumps(kw), flush=True)


def mid_update(snapshot_dir: str, stage: str) -> None:
    engine = make_engine(snapshot_dir=snapshot_dir)
    engine.register_segment("s0", token_ids=seg_tokens(0), tenant="t")
    say(ack="s0")
    toks, lps = gen(engine, "s0", tenant="t")
    say(gen="s0", tokens=toks, logprobs=[{str(k): v for k, v in d.items()} for d in lps])
    engine.save_snapshot()
    os.environ["INFERSCALE_TEST_UPDATE_PAUSE"] = f"{stage}:600"
    os.environ["INFERSCALE_TEST_UPDATE_PAUSE_MARKER"] = os.path.join(snapshot_dir, "..", "update-paused")
    say(updating=True)
    engine.update_segment("s0", token_ids=seg_tokens(9, 27), tenant="t")  # paused until killed
    say(error="the update was not paused")


def main(snapshot_dir: str, mode: str) -> None:
    if mode.startswith("mid_update:"):
        return mid_update(snapshot_dir, mode.split(":", 1)[1])
    engine = make_engine(snapshot_dir=snapshot_dir)
    ids = ["s0", "s1", "s2"]
    for i, sid in enumerate(ids[:2] if mode == "mid_snapshot" else ids):
        engine.register_segment(sid, token_ids=seg_tokens(i), tenant="t", pin=(i == 0))
        say(ack=sid)
    if mode == "mid_snapshot":
        say(snapshot=engine.save_snapshot()["step"])
        engine.register_segment("s2", token_ids=seg_tokens(2), tenant="t")
        say(ack="s2")
        engine.delete_segment("s1", tenant="t")
        say(deleted="s1")
    for sid in [s.id for s in engine.list_segments("t")]:
        toks, lps = gen(engine, sid, tenant="t")
        say(gen=sid, tokens=toks, logprobs=[{str(k): v for k, v in d.items()} for d in lps])
    if mode == "mid_snapshot":
        os.environ["INFERSCALE_TEST_SNAPSHOT_PAUSE_S"] = "600"
        os.environ["INFERSCALE_TEST_SNAPSHOT_PAUSE_MARKER"] = os.path.join(snapshot_dir, "..", "paused")
        say(saving=2)
        engine.save_snapshot()  # pauses before its commit until the parent kills us
        say(error="the snapshot was not paused")
    say(ready=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
