"""What every command of ``linattn`` shares: its parser class, the argument types, the flags that
mean the same thing in every command, and flags generated from config dataclasses.

The vocabulary (one name per concept, the same in every command):

- ``--mechanisms a,b`` wherever several mechanisms are compared: registered names, or a JSON list of
  names and config objects (``'["linear", {"name": "local", "window": 64}]'``);
- ``--attention NAME`` (or a JSON config object) wherever one is chosen, with its options as
  ``--attention-OPTION VALUE`` (``--attention local --attention-window 64``);
- ``--out`` for every output folder (or file, for a document);
- ``--set dotted.key=value`` (repeatable) for any config field, wherever a config is built; the
  flags generated from a config's fields are the same overrides spelled as flags;
- config fields and their flags share a name (``n_layers`` is ``--n-layers`` everywhere).

Errors: a usage error (unknown flag, bad choice, missing argument) prints the usage of the
(sub-)command that failed, then one line with a "did you mean" where one is close; a validation
error found after parsing (a config that does not hold together) prints one line naming the flag
or field, via :meth:`CommandParser.fail`. Both exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import re
import shlex
import sys
import typing
from typing import Any, Iterable, Iterator, Sequence

from ..config import did_you_mean

__all__ = [
    "CommandParser",
    "add_attention_arguments",
    "add_config_arguments",
    "add_mechanisms_argument",
    "add_out_argument",
    "add_set_argument",
    "attention_from_args",
    "attention_option_names",
    "command_line",
    "config_overrides",
    "field_help",
    "int_list",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "refuse_unused",
    "reported",
]


class CommandParser(argparse.ArgumentParser):
    """An argparse parser whose errors are short and point at the (sub-)command that failed.

    ``allow_abbrev`` is off: ``--n`` must not silently mean ``--n-local``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def _chosen(self, ns: argparse.Namespace) -> "CommandParser":
        """The deepest sub-command parser ``ns`` went through (self when there is none)."""
        parser: argparse.ArgumentParser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            chosen = getattr(ns, sub.dest, None) if sub is not None else None
            if chosen is None or chosen not in sub.choices:
                return parser  # type: ignore[return-value]
            parser = sub.choices[chosen]

    def _suggestion(self, message: str) -> str:
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            flags = [s for s in self._option_string_actions if s.startswith("--")]
            for token in m.group(1).split():
                if token.startswith("--"):
                    hint = did_you_mean(token.split("=")[0], flags)
                    if hint:
                        return hint
            return ""
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            return did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
        return ""

    def error(self, message: str) -> typing.NoReturn:  # argparse's usage errors
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def fail(self, message: str) -> typing.NoReturn:
        """A validation error: one line, no usage, status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


@contextlib.contextmanager
def reported(parser: CommandParser, *errors: type[BaseException]) -> Iterator[None]:
    """Turn ``errors`` (default ValueError, TypeError, FileNotFoundError, FileExistsError) raised
    inside the block into :meth:`CommandParser.fail`: one line, status 2, no traceback."""
    errors = errors or (ValueError, TypeError, FileNotFoundError, FileExistsError)
    try:
        yield
    except errors as e:
        parser.fail(str(e))


def command_line(argv: Sequence[str]) -> str:
    """``linattn ...`` as typed, quoted so that it can be pasted back (recorded in result files)."""
    return "linattn " + shlex.join(argv)


# ---------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    """A finite number > 0 (a budget, a timeout): ``-1``, ``0``, ``nan`` and ``inf`` are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """``"256,1024"`` -> ``(256, 1024)``; every entry >= 1."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def _mechanisms(text: str):
    from ..nn.registry import parse_mechanisms

    try:
        return parse_mechanisms(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Flags with one meaning in every command
# ---------------------------------------------------------------------------------------------


def add_out_argument(parser: argparse.ArgumentParser, default: str | None, what: str) -> None:
    """``--out``: the output folder (or document) of a command."""
    required = default is None
    parser.add_argument("--out", default=default, required=required, metavar="PATH",
                        help=what + ("" if required else f" (default: {default})"))


def add_set_argument(parser: argparse.ArgumentParser, *, example: str = "lr=3e-4") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``; ``example`` is shown in the help."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help=f"override any config field by its dotted name, e.g. --set {example} (repeatable; "
                        "a value is read as JSON or a number when it parses as one, else as text)")


def add_mechanisms_argument(parser: argparse.ArgumentParser, *, default: str | None, what: str,
                            names: Iterable[str] | None = None) -> None:
    """``--mechanisms``: several mechanisms, parsed into a tuple of attention configs.

    ``names`` lists what this command accepts (default: every registered mechanism), for the help.
    """
    from ..nn.registry import MECHANISMS

    allowed = ", ".join(names if names is not None else MECHANISMS)
    parser.add_argument("--mechanisms", type=_mechanisms, default=default, metavar="A,B",
                        help=f"{what}: comma-separated names from {allowed}, or a JSON list of names and "
                        "config objects such as '[\"linear\", {\"name\": \"local\", \"window\": 64}]'"
                        + ("" if default is None else f" (default: {default})"))


@functools.cache
def attention_option_names() -> dict[str, list[str]]:
    """``{option: [mechanisms that have it]}`` over every registered mechanism's config."""
    from ..nn.registry import MECHANISMS

    out: dict[str, list[str]] = {}
    for spec in MECHANISMS.values():
        for f in dataclasses.fields(spec.config_type):
            out.setdefault(f.name, []).append(spec.name)
    return out


def add_attention_arguments(parser: argparse.ArgumentParser, *, default: str) -> None:
    """``--attention NAME|JSON`` and one ``--attention-OPTION`` per option any mechanism has."""
    from ..nn.registry import MECHANISMS

    group = parser.add_argument_group("attention (the mechanism and its options)")
    group.add_argument("--attention", default=None, metavar="NAME",
                       help=f"the mechanism: one of {', '.join(MECHANISMS)}, or a JSON config object such as "
                       f"'{{\"name\": \"local\", \"window\": 64}}' (default: {default})")
    for option, owners in sorted(attention_option_names().items()):
        # the option's docstring entry in each config that has it, with that config's default
        texts = []
        for owner in owners:
            config_type = MECHANISMS[owner].config_type
            default = getattr(config_type(), option)
            texts.append(f"{owner}: {field_help(config_type).get(option, '').rstrip('.')} (default: {default})")
        group.add_argument("--attention-" + option.replace("_", "-"), dest="attention_option:" + option,
                           default=None, metavar="VALUE", help="; ".join(texts) + ".")


def attention_from_args(args: argparse.Namespace, base=None):
    """The attention config chosen by ``--attention`` and ``--attention-OPTION`` flags.

    ``base``: the config the command would use otherwise; options given without ``--attention``
    apply to it. Returns None when no attention flag was given (the command keeps its own).
    ValueError naming the flag when an option does not belong to the chosen mechanism.
    """
    from ..config import parse_value
    from ..nn.registry import attention_config_from_dict, attention_config_to_dict, parse_attention

    options = {name: getattr(args, "attention_option:" + name) for name in attention_option_names()}
    options = {k: v for k, v in options.items() if v is not None}
    if args.attention is None and not options:
        return None
    if args.attention is not None:
        chosen = parse_attention(args.attention)
    elif base is not None:
        chosen = base
    else:
        raise ValueError(f"--attention-{next(iter(options)).replace('_', '-')} needs --attention NAME")
    d = attention_config_to_dict(chosen)
    known = [f.name for f in dataclasses.fields(type(chosen))]
    as_text = type(chosen).str_fields()  # a text option keeps its text, as --set reads it
    for k, raw in options.items():
        if k not in known:
            raise ValueError(f"--attention-{k.replace('_', '-')}: {d['name']!r} attention has no option {k!r}; "
                             f"its options: {sorted(known)}")
        d[k] = raw if k in as_text else parse_value(raw)
    return attention_config_from_dict(d)


# ---------------------------------------------------------------------------------------------
# Flags generated from a config dataclass
# ---------------------------------------------------------------------------------------------


def _plain(text: str) -> str:
    """Docstring reStructuredText as plain help text: ``x`` and :func:`x` become x."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "")
    return " ".join(text.split())


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``{field: its description}`` from the ``Attributes:`` section of ``cls``'s docstring (every
    ancestor's too, nearest first), as plain text."""
    import docstring_parser

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = docstring_parser.parse(klass.__doc__ or "")
        for p in doc.params:
            out[p.arg_name] = _plain(p.description or "")
    return out


def _choices(cls: type, f: dataclasses.Field) -> tuple | None:
    if "choices" in f.metadata:
        return tuple(f.metadata["choices"])
    tp = typing.get_type_hints(cls).get(f.name)
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return None


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, prefix: str = "", flag_prefix: str = "",
                         skip: Iterable[str] = (), title: str | None = None) -> None:
    """One flag per scalar field of the dataclass ``cls``: ``--<flag_prefix><field>`` (underscores
    as dashes), its help the field's docstring entry, its default and its allowed values.

    A flag's text is applied as the override ``<prefix><field>=<text>`` (see
    :func:`config_overrides`), so a flag and ``--set`` are one mechanism. Fields whose value is
    another config (or an attention config) get no flag; ``skip`` names more.
    """
    from ..config import Config

    skip = set(skip)
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title or f"{cls.__name__} fields (each is --set {prefix}FIELD=VALUE)")
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        nested = isinstance(tp, type) and issubclass(tp, Config)
        if f.name in skip or nested or f.name in ("attention", "layer_attention"):
            continue
        choices = _choices(cls, f)
        text = helps.get(f.name, "")
        if choices:
            text += f" One of: {', '.join(map(str, choices))}."
        if f.name in defaults:
            text += f" (default: {defaults[f.name]})"
        flag = "--" + (flag_prefix + f.name).replace("_", "-")
        group.add_argument(flag, dest="field:" + prefix + f.name, default=None, metavar="VALUE",
                           choices=[str(c) for c in choices] if choices else None, help=text.strip())


def refuse_unused(parser: CommandParser, args: argparse.Namespace, flags: Iterable[str], why: str) -> None:
    """Fail naming the first of ``flags`` (``"--n"``; its default must be None, so that giving it
    shows) that was given although what the command was told to do will not read it: a flag must
    never be accepted and then ignored. ``why`` completes "... is not used: <why>"."""
    for flag in flags:
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            parser.fail(f"{flag} is not used: {why}")


def config_overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` values, then the generated flags that were given, as ``dotted.key=text`` strings."""
    out = list(getattr(args, "overrides", []) or [])
    for dest, value in vars(args).items():
        if dest.startswith("field:") and value is not None:
            out.append(f"{dest[len('field:'):]}={value}")
    return out
