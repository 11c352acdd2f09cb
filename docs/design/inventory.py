"""Inventory of linattn's upper tiers, for issue 19's before/after: every command's flags, the line
counts of the upper tiers, private names imported across files and module-level import cycles.

    python docs/design/inventory.py --src PATH/src --label NAME --out docs/design/inventory_NAME.json

``--src`` is the source tree to read (a checkout of any commit); the flags are read from each
command's ``--help`` run against that tree (PYTHONPATH), so the same script reads the old
single-file CLI and the new package.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

COMMANDS = [
    ["demo"], ["bench", "sweep"], ["bench", "core"], ["bench", "favor"], ["bench", "family"], ["bench", "full"],
    ["bench", "generate"], ["bench", "gated"], ["train"], ["experiment"], ["experiment", "copy"], ["experiment", "mnist"],
    ["experiment", "shakespeare"], ["experiment", "proteins"], ["experiment", "report"], ["convert", "fidelity"],
    ["convert", "distill"],
    ["convert", "long"], ["convert", "report"],
]
UPPER = ("cli", "cli.py", "train", "bench", "experiments", "convert", "config.py", "progress.py", "extras.py")


def flags(src: Path, command: list[str]) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-m", "linattn", *command, "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    text = out.stdout + out.stderr
    # option strings at the start of a help entry (not ones quoted inside help sentences)
    found = re.findall(r"^\s{2,}(--?[A-Za-z][\w-]*)", text, flags=re.M)
    found += re.findall(r"^\s{2,}-\w, (--[\w-]+)", text, flags=re.M)
    return sorted(set(found) - {"-h", "--help"})


def line_counts(src: Path) -> dict[str, int]:
    root = src / "linattn"
    out = {}
    for name in UPPER:
        path = root / name
        files = [path] if path.is_file() else sorted(path.rglob("*.py")) if path.is_dir() else []
        if files:
            out[name] = sum(len(f.read_text().splitlines()) for f in files)
    return out


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(src: Path, module_level_only: bool = True) -> tuple[list[str], list[list[str]]]:
    """Private names imported across files, and the cycles of imports (module-level ones only, or
    every import, those inside functions included)."""
    root = src / "linattn"
    modules = {_module_name(root, p): p for p in root.rglob("*.py")}
    private, graph = [], {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _resolve(mod, is_package, node)
            if not target.startswith("linattn"):
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                dest = full if full in modules else target
                if a.name.startswith("_") or any(p.startswith("_") and not p.startswith("__")
                                                 for p in target.split(".")):
                    private.append(f"{mod} <- {target}.{a.name}")
                if dest in modules and dest != mod and (id(node) in top_level or not module_level_only):
                    graph[mod].add(dest)
    cycles, seen = [], set()
    for start in graph:  # two-module cycles and longer ones, each reported once
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and len(path) > 1:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        cycles.append(path + [start])
                elif nxt not in path and len(path) < 6 and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return sorted(private), cycles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    src = Path(a.src).resolve()
    private, cycles = imports(src)
    _, lazy_cycles = imports(src, module_level_only=False)
    result = {"label": a.label, "command": " ".join(["python", *sys.argv]),
              "flags": {" ".join(c): flags(src, c) for c in COMMANDS}, "lines": line_counts(src),
              "private_imports": private, "import_cycles": cycles,
              "import_cycles_counting_imports_inside_functions": lazy_cycles}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}: {sum(map(len, result['flags'].values()))} flags, {len(private)} private imports, "
          f"{len(cycles)} cycles, {sum(result['lines'].values())} upper-tier lines")


if __name__ == "__main__":
    main()
