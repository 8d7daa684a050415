"""bench/kernels/skinny_gemm.py runs end to end in its --smoke mode (tiny shapes, interpret mode): the kernel in each
knob variant equals XLA's dot, and the report names every point and the best form per shape."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/skinny_gemm.py", tmp_path, "skinny_gemm.md", "--variants", "default",
                                 "n32,k32,s2", "n16,k16,s2,p2")
    assert "FAIL" not in report and "failed" not in stdout
    for case in ("qkv", "down"):
        for m in (1, 5):
            for form in ("xla", "default", "n32,k32,s2", "n16,k16,s2,p2"):
                assert f"| {case} | {m} | {form} |" in report, (case, m, form)
    assert "The kernel's best form against XLA's dot" in report
    assert stdout.count("check ") == 2 * 2 * 3 * 2  # (cases x rows x kernel forms x 2 input sets, against xla)
