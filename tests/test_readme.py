"""The README's usage example really runs."""

import pathlib
import re


def test_readme_usage_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def _readme_commands() -> list[list[str]]:
    """Every ``linattn ...`` (or ``torchrun ... -m linattn ...``) line of the README's shell blocks,
    continuation lines joined and comments dropped, as argument lists after ``linattn``."""
    import shlex

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    out = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["linattn"]:
                out.append(words[1:])
            elif words[:1] == ["torchrun"] and "linattn" in words:
                out.append(words[words.index("linattn") + 1:])
    return out


def test_readme_commands_parse_with_the_current_flags():
    """A renamed or removed flag cannot stay in the README: each command line there is parsed
    (not run) by the command's own parser."""
    import importlib

    commands = _readme_commands()
    assert len(commands) >= 10, commands
    for argv in commands:
        module = importlib.import_module(f"linattn.cli.{argv[0]}")
        module.build_parser(f"linattn {argv[0]}").parse_args(argv[1:])  # SystemExit(2) on a stale flag


def test_stated_demo_duration_is_the_committed_runs():
    """README and docs/benchmarks/README state how long `linattn demo` took; the figure must be the
    committed run's own (demo.json's elapsed_seconds), rerun or not."""
    import json

    root = pathlib.Path(__file__).parents[1]
    elapsed = json.loads((root / "docs/benchmarks/demo/demo.json").read_text())["elapsed_seconds"]
    for doc in ("README.md", "docs/benchmarks/README.md"):
        stated = re.findall(r"took (\d+) s", (root / doc).read_text())
        assert stated, f"{doc} no longer states the demo's duration"
        assert {int(s) for s in stated} == {round(elapsed)}, (doc, stated, elapsed)
