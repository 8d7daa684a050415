"""bench/kernels/glue.py runs end to end in its --smoke mode (tiny shapes, interpret mode): the add + norm kernel
in each knob variant equals XLA's form beside its matmul, and the qkv + RoPE kernel equals the model's jnp."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/glue.py", tmp_path, "glue.md", "--variants", "r1,w4", "r4,w8",
                                 "--rope-variants", "t4,w4")
    assert "FAIL" not in report and "failed" not in stdout
    for case in ("o", "down"):
        for form in ("xla", "r1,w4", "r4,w8"):
            assert f"| {case} | 16 | {form} |" in report, (case, form)
    assert "| rope | 16 | xla |" in report and "| rope | 16 | t4,w4 |" in report
    # (sum, normed) x 2 input sets x 2 kernel forms x (o, down) x 2 row counts; (q, k, v) x 2 x 2 of the RoPE kernel
    assert stdout.count("check ") == 32 + 12
