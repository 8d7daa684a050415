"""The engine package's modules import one another without a circle (issue 30, item 6).

Every ``import`` of an ``inferscale_jax`` module counts, at module level or inside a function (a
lazy import hides a circle, it does not remove it); only imports under ``if TYPE_CHECKING:`` are
left out (they never run).  A circle means two modules cannot be understood, tested or replaced
one without the other.
"""

from __future__ import annotations

import ast
import os

PKG = "inferscale_jax"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), PKG)


def import_graph(root: str = ROOT, pkg: str = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports (any level, TYPE_CHECKING blocks left out)."""
    mods = {f[:-3] for f in os.listdir(root) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for m in sorted(mods):
        with open(os.path.join(root, f"{m}.py")) as f:
            tree = ast.parse(f.read())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == pkg:
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(pkg + "."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith(pkg + ".")}
        graph[m] = deps & mods - {m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_are_found():
    """The check itself: a made-up circle through a lazy import is reported, a chain is not."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_engine_package_has_no_import_circle():
    graph = import_graph()
    assert {"engine", "scheduler", "distributed", "snapshot", "broadcast"} <= graph.keys()
    assert "broadcast" in graph["distributed"] and "engine" in graph["distributed"]
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " -> ".join(c) + f" (each imports: {({m: sorted(graph[m] & set(c)) for m in c})})" for c in found)
