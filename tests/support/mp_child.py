"""One process of test_multiprocess.py: ``jax.distributed`` over two local processes (gloo), a
tensor-parallel mesh of one CPU device from each.  Process 0 leads (its ``LockstepEngine`` calls are
repeated in process 1, which follows) and prints its outputs as one JSON line.

    python tests/support/mp_child.py PROCESS_ID PORT DISK_DIR

Each process keeps its own shards of demoted segments in its pinned host memory and its disk tier
(``DISK_DIR/process-I-of-2``).
"""

import json
import os
import sys

# Run as a file: the repository root goes on sys.path (tests.support, inferscale_jax, models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inferscale_jax import distributed  # noqa: E402


def main(pid: int, port: int, disk_dir: str) -> None:
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from tests.support.mp_common import CASES, GREEDY, config, fill, model, segment

    from inferscale_jax import SamplingParams

    params, cfg = model()
    conf = config(tensor_parallel=2, disk_dir=disk_dir, host_pages=0)  # demoted KV goes on to disk
    engine = distributed.LockstepEngine(params, cfg, None, distributed.lockstep_config(conf))
    if not distributed.is_leader():
        distributed.follow(engine)
        print("FOLLOWER_DONE", flush=True)
        return
    engine.register_segment("a", token_ids=segment())
    outs = engine.generate_batch(CASES)
    # pool pressure: more segments than the pool holds demote the least recently used ones to each
    # process's pinned host memory (its own shards); naming one promotes it back in both processes
    fill(engine)
    tiers = {"a_before": engine.segment_tier("a")}
    promoted = engine.generate(prompt_token_ids=[9, 8, 7], segments=["a"], sampling=GREEDY)
    tiers["a_after"] = engine.segment_tier("a")
    engine.delete_segment("a")
    try:
        engine.generate(prompt_token_ids=[1, 2], segments=["a"])  # raises in both processes alike
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    # both processes still in step; unseeded sampling gets one seed from the leader
    again = engine.generate(prompt_token_ids=[5, 6, 7], sampling=GREEDY)
    engine.generate(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4, temperature=1.0))
    # segment versions and sessions run in lockstep too (the leader's clock decides session expiry)
    engine.register_segment("b", token_ids=segment()[:9])
    engine.append_segment("b", token_ids=[4, 5, 6])
    appended = engine.generate(prompt_token_ids=[3, 2], segments=["b"], sampling=GREEDY)
    engine.save_session("s", token_ids=[7, 8, 9, 10])
    turn = engine.generate(prompt_token_ids=[7, 8, 9, 10, 11, 12], session="s", sampling=GREEDY)
    engine.close()
    print("MP_RESULT " + json.dumps({"tokens": [o.token_ids for o in outs], "error": err, "tiers": tiers,
                                     "promoted": promoted.token_ids, "appended": appended.token_ids,
                                     "turn": turn.token_ids, "turn_cached": turn.metrics.cached_tokens,
                                     "again": again.token_ids, "mesh": engine.stats()["mesh"]["tensor_parallel"]}),
          flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
