"""Typed configs: the one base class of every config dataclass, and the one override syntax.

Below every tier (imports nothing from linattn, and not torch): the mechanism configs of
:mod:`linattn.nn`, :class:`linattn.TransformerConfig`, the training, experiment, distillation and
benchmark configs all derive from :class:`Config`, so a dict or a config file is read with one
unknown-key check, and ``key=value`` overrides are read by one parser wherever they are accepted.

Overrides are ``dotted.key=value`` strings applied to a config's dict form before it is validated:
``lr=3e-4``, ``model.d_model=128``, ``model.attention.window=64``,
``model.attention={"name": "local", "window": 64}``. A value is read as JSON when it parses
(numbers, true/false, null, lists, objects) and as a plain string otherwise, except that a field
typed ``str`` keeps the text as given (``out=2024`` is a folder, not a number).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import typing
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

__all__ = [
    "Config",
    "apply_overrides",
    "check_keys",
    "did_you_mean",
    "parse_value",
    "read_config_file",
    "split_override",
]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``word``, or ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(cls: type, d: Any) -> None:
    """Raise unless ``d`` is a mapping whose keys are all fields of the dataclass ``cls``.

    TypeError for a non-mapping; ValueError naming each unknown key (with the closest field, or the
    new name of a renamed one from ``cls.renamed``) and listing the known ones.
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"{cls.__name__}: expected a dict of its fields, got {type(d).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        renamed = getattr(cls, "renamed", {})
        hints = [f"{k!r} was renamed to {renamed[k]!r}" if k in renamed else f"{k!r}{did_you_mean(k, known)}"
                 for k in unknown]
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(hints)}; known: {sorted(known)}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of ``cls`` (string annotations evaluated in their modules)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that names a type only imported under TYPE_CHECKING
        return {}


def _nested_config(tp: Any) -> type | None:
    """The Config subclass ``tp`` is, or is ``Optional`` of; None otherwise."""
    if isinstance(tp, type) and issubclass(tp, Config):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], Config):
        return args[0]
    return None


def _is_str_field(tp: Any) -> bool:
    return tp is str or set(typing.get_args(tp)) == {str, type(None)}


class Config:
    """Base of every config dataclass (``@dataclass(frozen=True) class XConfig(Config)``).

    ``to_dict()`` is JSON-serialisable (nested configs become dicts, tuples lists);
    ``from_dict(d)`` is its inverse and raises for unknown keys (:func:`check_keys`); a dict value
    of a field typed as another Config is read by that class's ``from_dict``, and a list given to
    a field typed as a tuple becomes a tuple. Subclasses with a
    field that needs another form (the attention configs of a model, chosen by name) override
    :meth:`encode_field` / :meth:`decode_field` for that field only.

    ``renamed`` maps an old field name to its new one, so that an old file's key is refused with
    the new name in the message instead of a bare "unknown".
    """

    renamed: ClassVar[dict[str, str]] = {}

    def encode_field(self, name: str, value: Any) -> Any:
        """The JSON form of field ``name``."""
        if isinstance(value, Config):
            return value.to_dict()
        if isinstance(value, tuple):
            return [v.to_dict() if isinstance(v, Config) else v for v in value]
        return value

    @classmethod
    def decode_field(cls, name: str, value: Any) -> Any:
        """The value of field ``name`` from its JSON form (inverse of :meth:`encode_field`)."""
        tp = _field_types(cls).get(name)
        nested = _nested_config(tp)
        if nested is not None and isinstance(value, Mapping):
            return nested.from_dict(value)
        if isinstance(value, list) and typing.get_origin(tp) is tuple:  # JSON has lists only
            return tuple(value)
        return value

    def to_dict(self) -> dict[str, Any]:
        return {f.name: self.encode_field(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        check_keys(cls, d)
        return cls(**{k: cls.decode_field(k, v) for k, v in d.items()})

    @classmethod
    def str_fields(cls, prefix: str = "") -> set[str]:
        """Dotted names of the fields typed ``str`` (or ``str | None``), nested configs included:
        an override of one keeps its text as given."""
        out = set()
        for f in dataclasses.fields(cls):
            tp = _field_types(cls).get(f.name)
            nested = _nested_config(tp)
            if nested is not None:
                out |= nested.str_fields(f"{prefix}{f.name}.")
            elif _is_str_field(tp):
                out.add(prefix + f.name)
        return out


_WORDS = {"True": True, "False": False, "None": None}  # as help texts print Python defaults


def parse_value(text: str) -> Any:
    """JSON when ``text`` parses as JSON; else a number in Python's spelling (``.001``, ``1.``,
    ``1_000``, ``inf``: a limit that never comes, where a field allows it); else
    ``True``/``False``/``None`` as Python prints them; else the text itself (``nan``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for number in (int, float):
        try:
            value = number(text)
        except ValueError:
            continue
        if value == value:  # "nan" stays a word: no field takes it
            return value
    return _WORDS.get(text.strip(), text)


def split_override(item: str) -> tuple[list[str], str]:
    """``"a.b=text"`` -> ``(["a", "b"], "text")``; ValueError naming the override otherwise."""
    key, sep, raw = str(item).partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ValueError(f"override {item!r} is not of the form dotted.key=value (e.g. model.d_model=128)")
    return key.split("."), raw


def apply_overrides(d: Mapping[str, Any], overrides: Iterable[str], *,
                    str_fields: Iterable[str] = ()) -> dict[str, Any]:
    """A deep copy of the dict ``d`` with every ``"dotted.key=value"`` of ``overrides`` applied in
    order. A key in ``str_fields`` (dotted) keeps its text; other values go through
    :func:`parse_value`. Setting a key inside a section the dict lacks creates the section.

    Raises ValueError for a malformed override or one that descends into a value that is not a
    section.
    """
    out = json.loads(json.dumps(d))
    str_fields = set(str_fields)
    for item in overrides:
        path, raw = split_override(item)
        *parents, leaf = path
        node = out
        for i, p in enumerate(parents):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"override {item!r}: {'.'.join(parents[: i + 1])} is {nxt!r}, not a section")
            node = nxt
        node[leaf] = raw if ".".join(path) in str_fields else parse_value(raw)
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The dict held by a ``.json`` or ``.toml`` file; FileNotFoundError / ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix == ".json":
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    elif path.suffix == ".toml":
        import tomllib

        try:
            d = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    else:
        raise ValueError(f"config file {path}: expected a .json or .toml file")
    if not isinstance(d, dict):
        raise ValueError(f"config file {path} must hold an object/table, got {type(d).__name__}")
    return d
