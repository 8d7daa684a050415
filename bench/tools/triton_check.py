"""What the engine's Pallas attention kernels compile to for an H100 / H200 (sm_90), on a machine without a GPU.

    python -m venv /tmp/triton && /tmp/triton/bin/pip install triton    # the PyPI release, ~300 MB; not a
    python bench/tools/triton_check.py --triton-python /tmp/triton/bin/python \\   # project dependency
        --steps spread,cohort --variants engine w=8 w=8,st=2

For each mixed step of ``bench/kernels/mixed_shared.py`` (its ``step_case``: 8 segments of 4096 tokens, the
decode rows and questions of the named step) and each variant (an ``INFERSCALE_MIXED_SHARED`` value, or a switch
``INFERSCALE_X=value``, ``+`` joining several, as in ``mixed_shared.py``; ``engine``: the defaults), the engine's
attention call (``kv_cache._attend`` with the Pallas kernels) is lowered for CUDA here: JAX lowers Pallas
Triton kernels without a GPU.  Each kernel's Triton IR is captured as it is lowered, with its grid,
``num_warps`` and ``num_stages`` (from the lowered call), and the ``triton`` package compiles it for sm_90 in a
child process (``--triton-python``: a Python with ``triton`` installed; default this one).  Reported per kernel:
registers a thread and local memory a thread (where spills go; ``cuobjdump``), shared memory, the blocks an SM can hold by registers, by shared
memory and by warps (sm_90: 65536 registers, 228 KB of shared memory with 1 KB reserved a block, 64 warps, 32
blocks), the warps an SM that gives, and from the compiled Triton GPU IR: the loads the pipeliner issues ahead
(``cp.async`` copies into shared memory), the warpgroup matmuls (wgmma) and the waits on them.

**Caveat: the PyPI release is not XLA's own copy of Triton.** For run BE's spread-step shared kernel
(``cascade_shared_g16_r64_bk64_sp2_nq``, 4 warps, 3 stages) Nsight Compute on the H200 read 205 registers and
115 KB of shared memory; triton 3.9.0 here reads 244 registers and the same shared memory to the byte
(bench/NOTES.md, session 47).  So registers are an upper estimate; shared memory and the IR's structure (what is
pipelined, where the waits sit) are what to trust.  ``--no-compile`` lists the kernels and writes their IR only
(``--ir DIR``); ``--quick``: tiny shapes (the smoke test).  Writes ``triton_check.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

SM90 = dict(regs=65536, smem=233472, smem_reserved=1024, warps=64, blocks=32)  # per SM (an H100 / H200)

COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
cubin = path + ".cubin"
open(cubin, "wb").write(k.asm["cubin"])
ttgir = k.asm["ttgir"]
open(path + ".ttgir", "w").write(ttgir)
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
reg = re.search(r"REG:(\d+)", usage)
local = re.search(r"LOCAL:(\d+)", usage)
print(json.dumps(dict(triton=triton.__version__, regs=int(reg.group(1)) if reg else None,
                      local=int(local.group(1)) if local else None,
                      smem=int(k.metadata.shared), async_copies=ttgir.count("async_copy_global_to_local"),
                      wgmma=len(re.findall(r"ttng\.warp_group_dot ", ttgir)),
                      waits=ttgir.count("warp_group_dot_wait"))))
"""


def occupancy(regs: int, smem: int, warps: int) -> tuple[int, str]:
    """Blocks of ``warps`` warps an sm_90 SM holds with ``regs`` registers a thread and ``smem`` bytes of shared
    memory a block, and what limits it (registers are allocated 256 a warp at a time)."""
    per_warp = -(-regs * 32 // 256) * 256
    by = dict(registers=SM90["regs"] // (per_warp * warps), shared_memory=SM90["smem"] // (smem + SM90["smem_reserved"]),
              warps=SM90["warps"] // warps, blocks=SM90["blocks"])
    least = min(by.values())
    return least, " and ".join(k.replace("_", " ") for k, v in by.items() if v == least)


def capture(fn, *args) -> list[dict]:
    """Lower ``fn(*args)`` for CUDA with the kernels' compiled path; return each Triton kernel's name, grid,
    num_warps, num_stages and IR text."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    from pallas_kernels import common
    irs, orig, interpret = {}, reg.lowering.lower_jaxpr_to_triton_module, common.default_interpret

    def keep(*a, **kw):
        result = orig(*a, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        irs[re.match(r"module @([\w$.]+)", text).group(1)] = text
        return result

    # (the kernels' compiled path, as on a GPU: on a CPU they would default to interpret mode; the split counts
    # already assume an H100's / H200's 132 SMs, common.num_sms)
    reg.lowering.lower_jaxpr_to_triton_module, common.default_interpret = keep, lambda: False
    try:
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module, common.default_interpret = orig, interpret
    kernels = []
    for call in re.findall(r"@__gpu\$xla\.gpu\.triton\([^)]*\) \{backend_config = \"\", mhlo\.backend_config = "
                           r"\{(.*?)\}, operand_layouts", hlo):
        field = dict(re.findall(r"(\w+) = (\"[^\"]*\"|[\w]+)", re.sub(r'ir = "[^"]*"', "", call)))
        name = field["name"].strip('"')
        kernels.append(dict(name=name, grid=tuple(int(field[f"grid_{a}"]) for a in "xyz"),
                            warps=int(field["num_warps"]), stages=int(field["num_stages"]), ir=irs.get(name)))
    return kernels


def compile_sm90(python: str, ir: str, warps: int, stages: int, workdir: str) -> dict:
    """Compile Triton IR for sm_90 in a child ``python`` (with the ``triton`` package); its report as a dict."""
    path = os.path.join(workdir, f"k{abs(hash((ir, warps, stages)))}.ttir")
    with open(path, "w") as f:
        f.write(ir)
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([python, "-c", COMPILE, path, str(warps), str(stages)], capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {path} failed: {proc.stderr.strip()[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="spread", help="mixed_shared.py's steps: cohort, spread, c64, c64q3")
    ap.add_argument("--variants", nargs="*", default=["engine"], help="INFERSCALE_MIXED_SHARED values ('engine': "
                    "none), or INFERSCALE_X=value, '+' joining several")
    ap.add_argument("--kernels", default="", help="a regex: only kernels whose name matches (default: all)")
    ap.add_argument("--triton-python", default=sys.executable, help="a Python with the triton package installed")
    ap.add_argument("--no-compile", action="store_true", help="list the kernels and write their IR only")
    ap.add_argument("--ir", help="also write each kernel's Triton IR (and, compiled, its GPU IR) under this folder")
    ap.add_argument("--quick", "--smoke", action="store_true", help="tiny shapes (the smoke test)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    # (imported here, not at the top: the tests load this file for `occupancy` into a process where another
    # package may already own the name `kernels`, which mixed_shared.py's imports need to be bench/kernels/)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "lib"), os.path.join(ROOT, "bench", "kernels")]
    from mixed_shared import FULL, SMOKE, step_case, variant_env

    from inferscale_jax import kv_cache
    cfg = dict(SMOKE if args.quick else FULL)
    workdir = os.path.abspath(args.ir) if args.ir else tempfile.mkdtemp(prefix="triton-check-")
    os.makedirs(workdir, exist_ok=True)
    rows, seen = [], {}
    for step in args.steps.split(","):
        kp, vp, sets, real, _, _ = step_case(cfg, *cfg["steps"][step])
        q, casc, _ = sets[0]
        print(f"{step}: {real} tokens", flush=True)
        for variant in args.variants:
            spec = "" if variant == "engine" else variant
            env = variant_env(spec)
            os.environ.update(env)
            try:
                kernels = capture(lambda k, v, q, meta: kv_cache._attend(q[None], k, v, None, meta, "pallas")[0],
                                  kp, vp, q, casc)
            finally:
                for var in env:
                    os.environ.pop(var, None)
            for kern in kernels:
                if args.kernels and not re.search(args.kernels, kern["name"]):
                    continue
                if kern["ir"] is None:
                    raise SystemExit(f"no Triton IR was captured for {kern['name']}")
                row = dict(step=step, variant=variant, **{k: v for k, v in kern.items() if k != "ir"})
                if args.ir:
                    with open(os.path.join(workdir, f"{step}_{variant}_{kern['name']}.ttir".replace("/", "_")), "w") as f:
                        f.write(kern["ir"])
                if not args.no_compile:
                    key = (kern["ir"], kern["warps"], kern["stages"])
                    if key not in seen:
                        seen[key] = compile_sm90(args.triton_python, *key, workdir)
                    row.update(seen[key])
                    blocks, limit = occupancy(row["regs"], row["smem"], row["warps"])
                    row.update(blocks=blocks, limit=limit)
                rows.append(row)
                print("  " + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("step",)), flush=True)
    write_report(args, rows)


def write_report(args, rows):
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "triton_check.md")
    cols = ["step", "variant", "name", "grid", "warps", "stages"]
    if not args.no_compile:
        cols += ["regs", "local", "smem", "blocks", "limit", "warps_sm", "async_copies", "wgmma", "waits"]
    with open(path, "w") as f:
        f.write("# The engine's Pallas attention kernels compiled for sm_90 (without a GPU)\n\n")
        f.write(f"`python bench/tools/triton_check.py {' '.join(sys.argv[1:])}`; jax {jax.__version__}"
                + (f", triton {rows[0]['triton']}" if rows and "triton" in rows[0] else "") + ".  Registers from "
                "the PyPI triton read above XLA's own (205 on the GPU against 244 here for run BE's shared kernel); "
                "shared memory and the pipelined loads are what to trust (the tool's docstring).\n\n")
        f.write("| " + " | ".join(c.replace("_", " ") for c in cols) + " |\n|" + "---|" * len(cols) + "\n")
        for row in rows:
            if "blocks" in row:
                row["warps_sm"] = row["blocks"] * row["warps"]
                row["smem"] = f"{row['smem'] / 1024:.1f} KB"
            f.write("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
