"""No import cycles, between tokenmill's modules or between its subpackages, counting every
import statement (a lazy import inside a function too; only ``if TYPE_CHECKING:`` blocks are
left out): layers import downwards, and each module can be imported on its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The tokenmill modules ``path`` imports (``from a import b`` counts a.b if a module)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {
        id(node)
        for stmt in ast.walk(tree)
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
        for node in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycles() -> None:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    # A package's __init__ is not a dependency of its own submodules for this check: edges
    # go to the module named, and a package counts only where it is imported by name.
    graph = {name: _imports(path, modules) - {name} for name, path in files.items()}
    assert _cycles(graph) == []


def test_no_cycles_between_subpackages() -> None:
    """tokenmill.jobs -> tokenmill.engine -> tokenmill.kernels, never back (io and the rest
    likewise): each subpackage's modules, taken together, import downwards only."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph.setdefault(top(name), set()).update(
            top(dep) for dep in _imports(path, modules) if top(dep) != top(name)
        )
    assert _cycles(graph) == []


def test_the_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
