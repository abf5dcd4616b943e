"""No import cycle in backend/ (STYLE §11: move the shared piece down, never a lazy import back up): neither
between modules, counting imports inside functions too, nor between its packages (checkpoint, export,
compare, library, runs). Read from the source with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parent.parent / "backend"
KNOWN: set[str] = set()  # a cycle would be allowed only inside this set: none is


def module_name(path: Path) -> str:
    parts = list(path.relative_to(BACKEND).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the backend modules it imports anywhere in its body (``from . import sub`` counts the
    submodule); importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``."""
    paths = {module_name(p): p for p in BACKEND.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue  # backend imports itself relatively (STYLE §12)
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}".strip(".")
                target = target if target in paths else base
                parts = target.split(".") if target else []
                for k in range(1, len(parts) + 1):
                    dep = ".".join(parts[:k])
                    if dep in paths and dep != name and not name.startswith(dep + "."):
                        deps.add(dep)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    top = stack.pop()
                    comp.add(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_import_cycle_between_backend_modules():
    found = [sorted(c) for c in cycles(import_graph()) if not c <= KNOWN]
    assert not found, f"import cycles in backend/: {found}"


def test_no_import_cycle_between_backend_packages():
    graph = import_graph()
    packages = {n for n in graph if (BACKEND / n.replace(".", "/") / "__init__.py").exists()}

    def layer(name: str) -> str:
        top = name.split(".")[0]
        return top if top in packages else name

    layers: dict[str, set[str]] = {}
    for name, deps in graph.items():
        layers.setdefault(layer(name), set()).update(layer(d) for d in deps if layer(d) != layer(name))
    assert not cycles(layers), f"packages of backend/ import each other: {cycles(layers)}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
