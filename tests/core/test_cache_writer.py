"""The runner is the only writer of the page pool's arrays (``runner.py``: its steps, copies and
splices, and ``ModelRunner.write`` for the tiers' scatters and blend's recompute): no other module
of the package assigns a runner's ``cache``.  A write elsewhere would bypass the runner's ordering
of device work (and a future core that batches KV chores into its steps)."""

import ast
import pathlib

from tests.support import REPO

PACKAGES = ("inferscale_jax", "serving", "inferscale_cli")


def runner_cache_writes(path: pathlib.Path) -> list[str]:
    """``<...runner...>.cache = ...`` (or augmented / annotated) assignments in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "cache" and "runner" in ast.unparse(sub.value):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_only_the_runner_writes_the_page_pool():
    root = pathlib.Path(REPO)
    writes = [w for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py")) if p.name != "runner.py"
              for w in runner_cache_writes(p)]
    assert not writes, "the page pool written outside runner.py (use ModelRunner.write):\n" + "\n".join(writes)


def test_the_check_sees_a_write(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("def f(self, x, e):\n    self.runner.cache = x\n    e.runner.cache += x\n    self.cache = x\n")
    assert runner_cache_writes(bad) == ["probe.py:2: self.runner.cache = x", "probe.py:3: e.runner.cache += x"]
