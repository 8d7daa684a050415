"""bench/kernels/sampler.py runs end to end in its --smoke mode (a small vocabulary on the CPU): both draws at
each row count and mix, the model step's own (no draw) for greedy rows, the greedy rows' tokens equal between
all three."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/sampler.py", tmp_path, "sampler.md", "--rows", "1,8")
    assert "FAIL" not in report and "failed" not in stdout
    for n in (1, 8):
        for mix in ("greedy", "sampled"):
            for draw in ("gumbel", "cdf"):
                assert f"| {n} | {mix} | {draw} |" in report, (n, mix, draw)
        assert f"| {n} | greedy | none |" in report, n  # (the model step's own: no draw)
        assert f"| {n} | sampled | none |" not in report, n
    assert stdout.count("greedy tokens equal") == 4  # (cdf's and none's, each row count)
