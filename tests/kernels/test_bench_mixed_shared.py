"""bench/kernels/mixed_shared.py runs end to end in its --smoke mode (tiny shapes, interpret mode): every
variant of the mixed step's shared part, and the ragged kernel over whole page lists, equal the engine's."""

from tests.support import bench_smoke


def test_smoke_run_writes_the_report(tmp_path):
    stdout, report = bench_smoke("kernels/mixed_shared.py", tmp_path, "mixed_shared.md", "--steps",
                                 "cohort,spread,c64q3")
    assert "FAIL" not in report and "failed" not in stdout
    for step in ("cohort", "spread", "c64q3"):
        for variant in ("engine", "ragged", "sp=1", "br=16,sp=2", "cb=32,cw=8"):
            assert f"| {step} | {variant} |" in report
    assert stdout.count("vs engine: rel err") == 12  # ragged and three variants, each step


def test_a_variant_may_set_another_switch(tmp_path):
    """``INFERSCALE_X=value`` as a variant sets that switch (here the shared part gathering its own queries) and is
    checked against the engine's output like the others; ``+`` joins settings (the gathering kernel with 16-key
    tiles)."""
    stdout, report = bench_smoke("kernels/mixed_shared.py", tmp_path, "mixed_shared.md", "--steps", "spread",
                                 "--variants", "INFERSCALE_SHARED_Q=kernel", "INFERSCALE_SHARED_Q=kernel+bk=16")
    assert "FAIL" not in report and "failed" not in stdout
    assert "| spread | INFERSCALE_SHARED_Q=kernel |" in report
    assert "| spread | INFERSCALE_SHARED_Q=kernel+bk=16 |" in report
    assert "sets INFERSCALE_SHARED_Q=kernel, INFERSCALE_MIXED_SHARED=bk=16" in stdout
    assert stdout.count("vs engine: rel err") == 3  # ragged and the variants
