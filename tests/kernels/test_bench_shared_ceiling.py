"""bench/kernels/shared_ceiling.py runs end to end in its --smoke mode (tiny shapes, the CPU): the engine's
shared part, dense jnp attention and the head-folded rows the Mosaic GPU form is fed agree, and the Mosaic GPU
call lowers for CUDA."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/shared_ceiling.py", tmp_path, "shared_ceiling.md")
    assert "FAIL" not in report and "failed" not in stdout
    for form in ("engine", "xla (dense jnp)", "folded rows (jnp)"):
        assert f"| smoke | {form} |" in report
    assert stdout.count("vs engine: rel err") == 2 and "mosaic: lowers for CUDA" in stdout
