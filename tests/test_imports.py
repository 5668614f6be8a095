"""The package's layers, as docs/architecture.md lists them and its imports draw them: no module
imports one that imports it back (directly or around a cycle), no package imports one of a layer
above it, the root package holds only the public API, and no runtime package imports the benchmarks.

Oracle: the import statements of every module (read with ast, function-level imports included,
`if TYPE_CHECKING:` blocks left out since they never run).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "quickdraft"

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def documented_layers() -> list[set[str]]:
    """The layers as docs/architecture.md lists them (its first `text` block), lowest first: a line's
    names before its description (two spaces or more apart)."""
    text = ARCHITECTURE.read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    return [set(line.split("  ")[0].split()) for line in reversed(block.strip().splitlines())]


LAYERS = documented_layers()
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
ROOT_MODULES = {"__init__", "__main__", "api", "errors", "extras"}  # the public API and what it raises


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path) -> set[str]:
    """The quickdraft modules `name` imports, at any depth of its code but under TYPE_CHECKING."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            # `from quickdraft import kernels` imports a module; `from quickdraft.api import LLM` a name
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def part(module: str) -> str:
    """The layer's unit a module belongs to: its top package or root module ("quickdraft": the package's own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one node (Tarjan), each a cycle or several."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part_ = [stack.pop()]
            while part_[-1] != v:
                part_.append(stack.pop())
            if len(part_) > 1:
                found.append(sorted(part_))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_around_a_cycle() -> None:
    assert cycles(GRAPH) == []


def test_no_package_imports_its_way_back() -> None:
    packages: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        packages.setdefault(part(module), set()).update(part(d) for d in deps if part(d) != part(module))
    packages.pop("__init__", None)  # the root's lazy public names (PEP 562) import nothing at import time
    assert cycles(packages) == []


def test_every_part_has_a_layer_and_imports_none_above_it() -> None:
    parts = {part(m) for m in MODULES} - {"__init__"}
    assert parts <= set(LAYER), f"add {sorted(parts - set(LAYER))} to LAYERS"
    upward = sorted((m, d) for m, deps in GRAPH.items() for d in deps
                    if part(m) != "__init__" and part(d) != "__init__" and LAYER[part(d)] > LAYER[part(m)])
    assert upward == []


def test_the_root_holds_only_the_public_api() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_the_engine_has_no_mixins() -> None:
    """One class that holds its parts (admission, placement, scheduler) as fields, not as bases."""
    from quickdraft.engine.batch import Engine
    assert Engine.__mro__ == (Engine, object)


def test_no_runtime_package_imports_the_benchmarks() -> None:
    assert sorted(m for m, deps in GRAPH.items() for d in deps
                  if part(d) == "bench" and part(m) not in ("bench", "cli")) == []


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/support (by theme), so a test module can move or go alone."""
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in [*tests.glob("*.py"), *tests.glob("support/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert offenders == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected) -> None:
    """The negative control: a cycle is found, a diamond-free chain is not."""
    assert cycles(graph) == expected
