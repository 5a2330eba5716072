"""The package's import graph, read from the source with ``ast``: no cycles, and neither the
checkpoint package nor the hooks name the Trainer (hooks see it as ``hooks.base.TrainerView``).

Every import counts, without exception: module-level, inside functions, and under
``if TYPE_CHECKING:`` (an import deferred into a function to dodge a cycle is still a cycle; one
under ``TYPE_CHECKING`` still ties the modules together for a reader). An edge goes to the
module named (``from recsys_trainer.checkpoint import layout`` -> ``checkpoint.layout``;
``from recsys_trainer.checkpoint import CheckpointManager`` -> the ``checkpoint`` package's
``__init__``); executing parent packages' ``__init__`` first is not counted as an edge (every
module would then depend on the root package).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import recsys_trainer

PKG_DIR = Path(recsys_trainer.__file__).parent
ROOT = "recsys_trainer"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_checking: bool


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        parts = list(path.relative_to(PKG_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([ROOT, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, under_type_checking: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement with whether it sits under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, under_type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), under_type_checking)
        else:
            yield from _imports(node, under_type_checking)


def edges(modules: dict[str, Path]) -> list[Edge]:
    out = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for node, tc in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                if t in modules and t != name:
                    out.append(Edge(name, t, node.lineno, tc))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def graph_of(es: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in es:
        graph.setdefault(e.source, set()).add(e.target)
    return graph


def test_the_package_has_no_import_cycle() -> None:
    modules = module_names()
    es = edges(modules)
    cycles = find_cycles(graph_of(es))
    detail = sorted({
        f"{e.source} -> {e.target} (line {e.line}{', TYPE_CHECKING' if e.type_checking else ''})"
        for comp in cycles for e in es if e.source in comp and e.target in comp
    })
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_checkpoint_package_never_imports_the_trainer_and_only_the_hook_base() -> None:
    modules = module_names()
    bad = [e for e in edges(modules) if e.source.startswith(f"{ROOT}.checkpoint")
           and (e.target == f"{ROOT}.trainer"
                or (e.target.startswith(f"{ROOT}.hooks") and e.target != f"{ROOT}.hooks.base"))]
    assert not bad, bad


def test_no_hook_module_imports_the_trainer() -> None:
    # The hook contract is hooks.base.TrainerView; the Trainer imports the default hooks to
    # build itself, so a hook naming it (even for an annotation) would close a circle.
    modules = module_names()
    bad = [e for e in edges(modules) if e.source.startswith(f"{ROOT}.hooks")
           and e.target == f"{ROOT}.trainer"]
    assert not bad, bad


def test_the_cycle_finder_sees_deferred_and_type_checking_imports() -> None:
    # The test above can only fail if the reader sees every kind of import: check it on a
    # made-up pair of modules that import each other inside a function and under TYPE_CHECKING.
    a = ast.parse("def f():\n    from recsys_trainer.b import x\n")
    b = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import recsys_trainer.a\n")
    seen_a = [(n.module, tc) for n, tc in _imports(a) if isinstance(n, ast.ImportFrom)]
    seen_b = [(n.names[0].name, tc) for n, tc in _imports(b) if isinstance(n, ast.Import)]
    assert seen_a == [("recsys_trainer.b", False)] and seen_b == [("recsys_trainer.a", True)]
    graph = graph_of([Edge("recsys_trainer.a", "recsys_trainer.b", 2, False),
                      Edge("recsys_trainer.b", "recsys_trainer.a", 3, True)])
    assert find_cycles(graph) == [["recsys_trainer.a", "recsys_trainer.b"]]


def test_no_name_in_a_package_hides_one_of_its_modules() -> None:
    # `import recsys_trainer.dynamic.x as m` binds the package's attribute `x`: a function named
    # like its module (re-exported by the package's __init__) would be bound instead.
    import importlib
    import pkgutil

    hidden = []
    for info in pkgutil.walk_packages(recsys_trainer.__path__, f"{ROOT}."):
        module = importlib.import_module(info.name)
        parent, _, leaf = info.name.rpartition(".")
        bound = getattr(importlib.import_module(parent), leaf, None)
        if bound is not module:
            hidden.append(f"{info.name} (the package's {leaf!r} is a {type(bound).__name__})")
    assert not hidden, hidden
