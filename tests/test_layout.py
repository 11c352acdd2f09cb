"""Tiers import only downwards, and the public names are exported in order."""

import ast
from pathlib import Path

import linattn
import linattn.convert
import linattn.datasets
import linattn.experiments
import linattn.train

SRC = Path(linattn.__file__).parent
TOP = {"bench", "cli", "train", "experiments", "convert"}
HIGHER = {"functional": {"nn", "models"} | TOP, "nn": {"models"} | TOP, "models": TOP,
          "datasets": {"functional", "nn", "models"} | TOP}


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
                   linattn.convert):
        assert list(module.__all__) == sorted(module.__all__), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_nothing_imports_experiments():
    for tier in ("bench", "train", "datasets"):
        for path in (SRC / tier).glob("*.py"):
            assert "experiments" not in _imported_packages(path), f"{path.relative_to(SRC)} imports experiments"
