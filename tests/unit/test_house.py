"""The house's rules, checked on the code itself: imports go one way (no circle among the
modules of ``orchestrator`` and ``agents``, counting imports inside functions and under
TYPE_CHECKING), no module over 600 lines, no class over 400."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODULE, MAX_CLASS = 600, 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in [*ROOT.glob("orchestrator/**/*.py"), *ROOT.glob("agents/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ours that ``name`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    out.add(full)
                elif node.module in modules:
                    out.add(node.module)
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_go_one_way():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 80 and graph["orchestrator.controller"]
    assert _circles(graph) == []
    # The rule the test applies would see one: a circle of two made up here is found.
    assert _circles({**graph, "agents.fields": graph["agents.fields"] | {"agents.protocol"}})


def test_no_module_over_600_lines_and_no_class_over_400():
    too_big = []
    for name, path in _modules().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE:
            too_big.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_CLASS:
                    too_big.append(f"{name}.{node.name}: {lines} lines")
    assert too_big == []
