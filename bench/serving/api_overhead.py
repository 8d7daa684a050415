"""``inferscale serve`` over a model-free engine: the API-server process measured alone.

    python bench/serving/api_overhead.py --step-ms 16 -- --port 8124 --max-batch 256 [serve flags]

runs the real ``serve`` (API process, engine core process, ZMQ, uvicorn, the app) with the core's
engine replaced by ``bench/lib/paced_engine.py``: one token per running request every
``--step-ms``, no model.  Then drive it like any server, e.g.

    python bench/serving/serve.py --url http://127.0.0.1:8124 --server-pid PID --concurrency 256 \\
        --context none --max-tokens 64 --num-requests 2048

and the report's "server" CPU is the API process's own work per streamed token: the figure that
says how many tokens per second one API process can stream (``bench/NOTES.md``).  ``--context
none``: the paced engine registers no segments.  PID: the "API server process" pid ``serve`` prints.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=16.0,
                    help="wall time of one fake engine step (default: 16, the H200's 256-row served step)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the API process (default: Python's, 5 ms)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: inferscale serve's flags")
    args = ap.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    os.environ["INFERSCALE_PACED_STEP_MS"] = str(args.step_ms)  # (read by the spawned core process)
    import paced_engine
    from inferscale_cli import main as cli
    from inferscale_cli import serve

    serve.build_engine = paced_engine.build  # the core process is spawned with this function
    rest = [a for a in args.serve_args if a != "--"]
    return cli.main(["serve", "--no-warmup", *rest])


if __name__ == "__main__":
    sys.exit(main())
