"""bench/kernels/cascade_groups.py runs end to end in its --smoke mode (tiny shapes, interpret mode)."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    _, report = bench_smoke("kernels/cascade_groups.py", tmp_path, "cascade_groups.md")
    assert "FAIL" not in report
    for name in ("plain", "single", "multi", "multi BR=16", "ragged", "ragged + multi"):
        for n in (1, 3):  # every strategy at 6 rows over 1 and 3 segments
            assert f"| 6 | {n} | {name} |" in report
