"""bench/tools/profile_graph.py's floors follow the ceilings measured with the capture (an H100's
are not an H200's), and fall back to the H200's figures for raw data recorded without them."""

import importlib.util
import os

from tests.support.server_util import REPO


def load():
    spec = importlib.util.spec_from_file_location("profile_graph", os.path.join(REPO, "bench", "tools", "profile_graph.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CFG = dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, head_dim=128, vocab=128256, page_size=16)
DECODE = dict(kind="decode", tokens=1, rows=1, shared_tokens=0, shared_pairs=0, private_tokens=4096,
              private_pairs=4096)
PREFILL = dict(DECODE, kind="mixed", tokens=2048, rows=1, private_pairs=2048 * 4096)


def test_floors_follow_the_measured_ceilings():
    pg = load()
    default = pg.floors(DECODE, CFG)
    assert default == pg.floors(DECODE, CFG, None) == pg.floors(DECODE, CFG, {})
    slow = pg.floors(DECODE, CFG, dict(bandwidth=pg.BANDWIDTH / 2, compute=pg.COMPUTE))
    # one row: every part is read-bound, so half the bandwidth doubles each floor
    for part, sec in default.items():
        assert abs(slow[part] - 2 * sec) <= 1e-9 * sec + 1e-15, part
    # 2048 tokens: the gate-up matmul is compute-bound, so only the matmul rate moves it
    full = pg.floors(PREFILL, CFG)
    half_compute = pg.floors(PREFILL, CFG, dict(bandwidth=pg.BANDWIDTH, compute=pg.COMPUTE / 2))
    assert abs(half_compute["gemm gate_up"] - 2 * full["gemm gate_up"]) < 1e-9
    assert half_compute["kv write"] == full["kv write"]


def test_the_top_kernels_table_carries_each_kernels_launch():
    """The report's top-kernel table names each kernel's launch as the trace reports it (theoretical occupancy and
    CUPTI's kernel details), and stays a valid table when a trace has neither (the CPU's)."""
    pg = load()
    stats = dict(theoretical_occupancy_pct="25", kernel_details="regs:168 static_shared:0 dynamic_shared:66560 "
                 "grid:48,8,2 block:128,1,1")
    win = [dict(name="cascade_shared_g16_r64_bk64_sp2_nq", start=0, end=4000, hlo_op=None, stats=stats),
           dict(name="ragged_paged_attention_bq16_bkv64_g4_s1_i2", start=4000, end=6000, hlo_op=None, stats={})]
    res = pg.summarize([win, win], pg.Classifier(None, CFG))
    rows = pg.top_kernels(res)
    assert rows[2].count("|") == rows[4].count("|") == rows[5].count("|") == 6
    shared = next(r for r in rows if "cascade_shared" in r)
    assert "occupancy 25%; regs:168 static_shared:0 dynamic_shared:66560 grid:48,8,2 block:128,1,1" in shared
    assert next(r for r in rows if "ragged" in r).endswith("|  |")
