"""Tiers import only downwards, modules import each other without cycles and without private
names, and the public names are exported in order."""

import ast
import textwrap
from pathlib import Path

import linattn
import linattn.convert
import linattn.datasets
import linattn.distributed
import linattn.experiments
import linattn.train

SRC = Path(linattn.__file__).parent
TOP = {"bench", "cli", "train", "experiments", "convert", "integrations"}
# distributed (context parallelism) sits at the functional tier: it may import functional only
HIGHER = {"functional": {"nn", "models", "distributed"} | TOP, "nn": {"models"} | TOP, "models": TOP,
          "datasets": {"functional", "nn", "models"} | TOP,
          "distributed": {"nn", "models", "datasets"} | TOP}


def _imported_packages(path: Path) -> set[str]:
    """First component under linattn of every relative or absolute linattn import in ``path``."""
    tier_depth = len(path.relative_to(SRC).parts) - 1  # 1 for linattn/<tier>/file.py
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1  # levels above the file's package
                if up >= tier_depth:  # reaches linattn itself
                    parts = (node.module or "").split(".")
                    out.add(parts[0] if parts[0] else "<linattn>")
            elif node.module and node.module.startswith("linattn"):
                parts = node.module.split(".")
                out.add(parts[1] if len(parts) > 1 else "<linattn>")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("linattn"):
                    parts = a.name.split(".")
                    out.add(parts[1] if len(parts) > 1 else "<linattn>")
    return out


def test_tiers_import_downwards():
    for tier, forbidden in HIGHER.items():
        for path in (SRC / tier).glob("*.py"):
            bad = _imported_packages(path) & (forbidden | {"<linattn>"})
            assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


def test_public_names_sorted_and_present():
    for module in (linattn, linattn.nn, linattn.models, linattn.train, linattn.datasets, linattn.experiments,
                   linattn.convert, linattn.distributed):
        assert list(module.__all__) == sorted(module.__all__), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_nothing_imports_experiments():
    for tier in ("bench", "train", "datasets"):
        for path in (SRC / tier).glob("*.py"):
            assert "experiments" not in _imported_packages(path), f"{path.relative_to(SRC)} imports experiments"


# ------------------------------------------------------------------------------------------------
# The import graph of a package, from the source (ast): no cycles, no private names across files.
# ------------------------------------------------------------------------------------------------


def _module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file for every ``.py`` under ``root`` (the folder of ``package``); a
    package's ``__init__.py`` is the package itself."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module, *, functions: bool, type_checking: bool) -> list[ast.AST]:
    """Import statements of a module, in line order: those at module level, plus those inside
    functions (``functions``) and under ``if TYPE_CHECKING:`` (``type_checking``)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if not functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not type_checking and _is_type_checking(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _imports(name: str, path: Path, modules: dict[str, Path], package: str, **which: bool):
    """``(module imported, names taken from it, line)`` for every import of ``package`` modules in
    module ``name`` (``which``: see :func:`_import_nodes`): relative imports resolved,
    ``from pkg import sub`` read as importing module ``pkg.sub``."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # the package it sits in
    out = []
    for node in _import_nodes(ast.parse(path.read_text()), **which):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == package]
            continue
        if node.level:
            base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] != package:
            continue
        names = []
        for a in node.names:
            if f"{target}.{a.name}" in modules:  # a submodule
                out.append((f"{target}.{a.name}", [], node.lineno))
            else:
                names.append(a.name)
        if names or not node.names:
            out.append((target, names, node.lineno))
    return out


def import_graph(root: Path, package: str, *, module_level: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports: at module level, and unless
    ``module_level``, also inside functions (a deferred import is still a dependency: moving one
    side of a cycle into a function hides the cycle from Python, not from the reader). Imports
    under ``if TYPE_CHECKING:`` never run and do not count."""
    modules = _module_files(root, package)
    which = dict(functions=not module_level, type_checking=False)
    return {name: {t for t, _, _ in _imports(name, path, modules, package, **which) if t in modules and t != name}
            for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_imports(root: Path, package: str) -> list[str]:
    """Every import, anywhere in a module (functions and ``TYPE_CHECKING`` blocks included), of a
    name starting with an underscore from another module of ``package``, or of a module whose name starts with one
    (``__init__``/``__main__`` and other dunder names aside)."""
    modules = _module_files(root, package)
    found = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path, modules, package, functions=True, type_checking=True):
            where = f"{path.relative_to(root.parent)}:{line}"
            if any(_private(part) for part in target.split(".")):
                found.append(f"{where} imports private module {target}")
            bad = [n for n in names if _private(n)]
            if bad:
                found.append(f"{where} imports {', '.join(bad)} from {target}")
    return found


def test_no_import_cycles():
    cycles = import_cycles(import_graph(SRC, "linattn"))
    assert not cycles, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_private_names_across_files():
    found = private_imports(SRC, "linattn")
    assert not found, "private names imported across files:\n" + "\n".join(found)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_the_import_checks_find_what_they_look_for(tmp_path):
    """The two checks above, on a package made to break them: they must be able to fail."""
    root = _fake_package(tmp_path, {
        "__init__.py": "from . import a\n",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": """\
            from typing import TYPE_CHECKING
            from ..a import public
            from pkg.sub._hidden import helper
            if TYPE_CHECKING:
                from ..d import Thing, _Other
            def f():
                from ..c import _late, __version__
                from . import _hidden
            """,
        "sub/_hidden.py": "",
        "d.py": "",
        "c.py": """\
            from .sub.b import (
                ok,
                _private,
            )
            """,
    })
    loading = import_graph(root, "pkg", module_level=True)
    assert loading["pkg"] == {"pkg.a"}
    assert loading["pkg.sub.b"] == {"pkg.a", "pkg.sub._hidden"}  # not the TYPE_CHECKING or function ones
    assert import_cycles(loading) == [["pkg.a", "pkg.sub.b"]]
    graph = import_graph(root, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.c", "pkg.sub._hidden"}  # and the one inside f, not pkg.d
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    found = private_imports(root, "pkg")
    assert found == [
        "pkg/c.py:1 imports _private from pkg.sub.b",
        "pkg/sub/b.py:3 imports private module pkg.sub._hidden",
        "pkg/sub/b.py:5 imports _Other from pkg.d",
        "pkg/sub/b.py:7 imports _late from pkg.c",
        "pkg/sub/b.py:8 imports private module pkg.sub._hidden",
    ], found
