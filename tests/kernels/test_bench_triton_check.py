"""bench/tools/triton_check.py: the engine's attention kernels lowered for CUDA on the CPU, their Triton IR
captured with each kernel's grid, warps and stages (the compile for sm_90 needs the ``triton`` package, which is
not a project dependency, so CI checks what comes before it), and its occupancy arithmetic against what Nsight
Compute read on an H200 (bench/NOTES.md, run BE)."""

import importlib.util
import os
import re

from tests.support import bench_smoke

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("triton_check", os.path.join(ROOT, "bench", "tools",
                                                                                "triton_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_occupancy_is_what_nsight_compute_read_on_the_h200():
    occupancy = _tool().occupancy
    # run BE: the spread step's shared kernel, 205 registers and 112 KB: 2 blocks an SM, by both alike
    assert occupancy(205, 114688, 4) == (2, "registers and shared memory")
    # its ragged kernel: 201 registers, 2 blocks, by registers
    assert occupancy(201, 32768, 4) == (2, "registers")
    # registers go 256 a warp: 168 a thread (5376 a warp) fit 3 blocks of 4 warps, 169 (5632) only 2
    assert occupancy(168, 0, 4)[0] == 3 and occupancy(169, 0, 4)[0] == 2
    assert occupancy(24, 0, 16) == (4, "warps")  # 64 warps an SM
    assert occupancy(16, 0, 1) == (32, "blocks")


def test_the_spread_steps_kernels_are_captured_with_their_launch(tmp_path):
    ir = tmp_path / "ir"
    stdout, report = bench_smoke("tools/triton_check.py", tmp_path, "triton_check.md", "--no-compile",
                                 "--variants", "engine", "w=8", "INFERSCALE_MIXED_RAGGED=st=2+bk=16", "--ir", str(ir))
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| spread |")]
    got = {(r[1], r[2].split("_")[0] + "_" + r[2].split("_")[1]): (int(r[4]), int(r[5].rstrip(" |"))) for r in rows}
    # (the engine's shared part at 4 warps and 3 stages, the ragged kernel at its 1 stage; the switches took)
    assert got[("engine", "cascade_shared")] == (4, 3) and got[("engine", "ragged_paged")][1] == 1
    assert got[("w=8", "cascade_shared")] == (8, 3)
    assert got[("INFERSCALE_MIXED_RAGGED=st=2+bk=16", "ragged_paged")][1] == 2
    assert any("_bk16_" in r[2] for r in rows if r[1].startswith("INFERSCALE_MIXED_RAGGED"))
    files = sorted(os.listdir(ir))
    assert len(files) == len(rows) >= 6
    for name in files:
        text = (ir / name).read_text()
        kernel = re.match(r"module @(\w+)", text).group(1)
        assert name.endswith(f"_{kernel}.ttir") and "tt.dot" in text and "tt.func public" in text
