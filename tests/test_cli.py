"""The command line's manners, shared by every command: usage of the failing sub-command,
did-you-mean, one-line validation errors, --version, help without raw reStructuredText, and the
shared vocabulary (--attention, --mechanisms, flags generated from config dataclasses)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from linattn.cli import COMMANDS, main
from linattn.cli.common import (
    CommandParser,
    add_attention_arguments,
    add_config_arguments,
    add_mechanisms_argument,
    attention_from_args,
    config_overrides,
)
from linattn.config import Config
from linattn.nn import LinearConfig, LocalConfig, MECHANISMS, FavorConfig

# every (sub-)command whose help is checked; a new command belongs here
HELPS = [["demo"], ["bench"], ["bench", "sweep"], ["bench", "core"], ["bench", "favor"], ["bench", "family"],
         ["bench", "full"], ["bench", "generate"], ["bench", "gated"], ["train"], ["experiment"], ["convert"], ["convert", "fidelity"],
         ["convert", "distill"], ["convert", "long"], ["convert", "report"]]


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_version(capsys):
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and re.fullmatch(r"linattn \S+\n", out)


def test_no_command_and_unknown_commands(capsys):
    code, _, err = _run([], capsys)
    assert code == 2 and "COMMAND" in err
    code, _, err = _run(["benh"], capsys)
    assert code == 2 and "unknown command 'benh' (did you mean 'bench'?)" in err
    code, out, _ = _run(["-h"], capsys)
    assert code == 0 and all(name in out for name in COMMANDS)


def test_a_sub_command_error_prints_that_sub_command_usage_and_a_suggestion(capsys):
    code, _, err = _run(["bench", "swep"], capsys)
    assert code == 2 and err.startswith("usage: linattn bench ") and "(did you mean 'sweep'?)" in err
    code, _, err = _run(["bench", "sweep", "--nss", "256"], capsys)
    assert code == 2 and err.startswith("usage: linattn bench sweep ")
    assert "unrecognized arguments: --nss 256 (did you mean '--ns'?)" in err


def test_abbreviated_flags_are_refused(capsys):
    code, _, err = _run(["bench", "family", "--n-loc", "4"], capsys)
    assert code == 2 and "unrecognized arguments: --n-loc" in err


def test_a_validation_error_is_one_line(capsys):
    parser = CommandParser(prog="linattn thing")
    with pytest.raises(SystemExit) as e:
        parser.fail("--lr: must be > 0, got -1")
    assert e.value.code == 2
    assert capsys.readouterr().err == "linattn thing: error: --lr: must be > 0, got -1\n"


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_is_plain_text_and_lists_choices(argv, capsys):
    code, out, _ = _run([*argv, "-h"], capsys)
    assert code == 0 and out.startswith(f"usage: linattn {' '.join(argv)}")
    for raw in ("``", ":func:", ":class:", ":mod:", ":meth:"):
        assert raw not in out, f"raw reStructuredText {raw!r} in `linattn {' '.join(argv)} -h`"


@dataclass(frozen=True)
class _Section(Config):
    """A section.

    Attributes:
        depth: how deep, see ``other`` and :class:`linattn.nn.LocalConfig`.
        mode: how it runs.
    """

    depth: int = 2
    mode: str = field(default="fast", metadata={"choices": ("fast", "slow")})


def test_flags_generated_from_a_config(capsys):
    parser = CommandParser(prog="t")
    add_config_arguments(parser, _Section, prefix="section.")
    text = parser.format_help()
    assert "--depth" in text and "how deep, see other and linattn.nn.LocalConfig." in " ".join(text.split())
    assert "One of: fast, slow." in " ".join(text.split()) and "(default: fast)" in text
    args = parser.parse_args(["--depth", "5"])
    assert config_overrides(args) == ["section.depth=5"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "medium"])
    assert "invalid choice: 'medium'" in capsys.readouterr().err


def _attention_parser():
    parser = CommandParser(prog="t")
    add_attention_arguments(parser, default="linear")
    return parser


def test_attention_by_name_json_and_options():
    p = _attention_parser()
    assert attention_from_args(p.parse_args([])) is None
    assert attention_from_args(p.parse_args(["--attention", "local"])) == LocalConfig()
    assert attention_from_args(p.parse_args(["--attention", "local", "--attention-window", "64"])) == LocalConfig(64)
    assert attention_from_args(p.parse_args(["--attention", '{"name": "local", "window": 8}'])) == LocalConfig(8)
    assert attention_from_args(p.parse_args(["--attention-feature-map", "relu"]),
                               base=LinearConfig()) == LinearConfig("relu")
    with pytest.raises(ValueError, match=r"--attention-window: 'linear' attention has no option 'window'"):
        attention_from_args(p.parse_args(["--attention", "linear", "--attention-window", "3"]))
    with pytest.raises(ValueError, match=r"unknown attention mechanism 'locl' \(did you mean 'local'\?\)"):
        attention_from_args(p.parse_args(["--attention", "locl"]))


def test_every_option_of_every_mechanism_has_a_flag():
    flags = {s for a in _attention_parser()._actions for s in a.option_strings}
    for spec in MECHANISMS.values():
        for name in spec.config_type.__dataclass_fields__:
            assert "--attention-" + name.replace("_", "-") in flags


def test_mechanisms_argument(capsys):
    parser = CommandParser(prog="t")
    add_mechanisms_argument(parser, default=None, what="contenders")
    args = parser.parse_args(["--mechanisms", '["linear", {"name": "favor", "num_features": 8}]'])
    assert args.mechanisms == (LinearConfig(), FavorConfig(num_features=8))
    with pytest.raises(SystemExit):
        parser.parse_args(["--mechanisms", "linear,locl"])
    assert "did you mean 'local'" in capsys.readouterr().err

