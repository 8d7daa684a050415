"""bench/kernels/glue.py runs end to end in its --smoke mode (tiny shapes, interpret mode): the add + norm kernel
in each knob variant equals XLA's form beside its matmul, and the RoPE case runs."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/glue.py", tmp_path, "glue.md", "--variants", "r1,w4", "r4,w8")
    assert "FAIL" not in report and "failed" not in stdout
    for case in ("o", "down"):
        for form in ("xla", "r1,w4", "r4,w8"):
            assert f"| {case} | 16 | {form} |" in report, (case, form)
    assert "| rope | 16 | xla |" in report
    assert stdout.count("check ") == 32  # (sum, normed) x 2 input sets x 2 pallas forms x (o, down) x 2 row counts
