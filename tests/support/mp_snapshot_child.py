"""One process of test_multiprocess.py's snapshot test: two processes (TP=2, one CPU device each)
share one ``snapshot_dir``; each writes its own shards into one orbax checkpoint
(``inferscale_jax/snapshot_processes.py``).

    python tests/support/mp_snapshot_child.py PROCESS_ID PORT SNAPSHOT_DIR save|restore

``save``: register "a" and "b", ``save_snapshot``, register "c", close (the final snapshot holds all
three).  ``restore``: a new pair of processes restores them and generates over "a" and "c".  Every
process prints its snapshot stats as one JSON line (``MP_RESULT`` from the leader, ``MP_FOLLOWER``
from the other).
"""

import json
import os
import sys

# Run as a file: the repository root goes on sys.path (tests.support, inferscale_jax, models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inferscale_jax import distributed  # noqa: E402


def main(pid: int, port: int, snapshot_dir: str, phase: str) -> None:
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from tests.support.mp_common import GREEDY, config, model, segment

    params, cfg = model()
    conf = config(tensor_parallel=2, snapshot_dir=snapshot_dir, snapshot_interval_s=None)
    engine = distributed.LockstepEngine(params, cfg, None, distributed.lockstep_config(conf))
    out = {}
    if distributed.is_leader():
        if phase == "save":
            engine.register_segment("a", token_ids=segment())
            engine.register_segment("b", token_ids=segment()[5:])
            out["first"] = engine.save_snapshot()["step"]
            engine.register_segment("c", token_ids=segment()[:11])
        else:
            out["tiers"] = [engine.segment_tier(s) for s in "abc"]
            out["a"] = engine.generate(prompt_token_ids=[9, 8, 7], segments=["a"], sampling=GREEDY).token_ids
            out["c"] = engine.generate(prompt_token_ids=[3, 2], segments=["c"], sampling=GREEDY).token_ids
        engine.close()
    else:
        distributed.follow(engine)
    snap = engine.stats()["snapshot"]
    out.update({k: snap[k] for k in ("last_step", "restored_step", "restored_hbm", "recomputed")})
    print(("MP_RESULT " if pid == 0 else "MP_FOLLOWER ") + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
