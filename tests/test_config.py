"""linattn.config: the one Config base (dict round trip, the unknown-key check) and the one
override parser."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from linattn.config import Config, apply_overrides, check_keys, did_you_mean, parse_value, read_config_file


@dataclass(frozen=True)
class Inner(Config):
    """An inner section.

    Attributes:
        width: a number.
        name: a string.
    """

    width: int = 4
    name: str = "a"


@dataclass(frozen=True)
class Outer(Config):
    """A config with a nested one.

    Attributes:
        inner: the nested section.
        sizes: a tuple.
        out: a folder.
        optional: an optional nested section.
    """

    inner: Inner = field(default_factory=Inner)
    sizes: tuple[int, ...] = (1, 2)
    out: str = "runs/x"
    optional: Inner | None = None

    renamed = {"out_dir": "out"}


def test_round_trip_through_json_with_nested_configs():
    c = Outer(inner=Inner(width=7, name="b"), sizes=(3,), out="o", optional=Inner(width=1))
    d = json.loads(json.dumps(c.to_dict()))
    assert d["inner"] == {"width": 7, "name": "b"} and d["sizes"] == [3] and d["optional"]["width"] == 1
    back = Outer.from_dict(d)
    assert back.inner == c.inner and back.optional == c.optional and back.out == "o"
    assert back.sizes == (3,) and back == c


def test_unknown_keys_are_named_with_the_closest_field_and_renamed_ones_with_their_new_name():
    with pytest.raises(ValueError, match=r"Outer: unknown field\(s\) 'innr' \(did you mean 'inner'\?\); known: "):
        Outer.from_dict({"innr": {}})
    with pytest.raises(ValueError, match=r"'out_dir' was renamed to 'out'"):
        Outer.from_dict({"out_dir": "x"})
    with pytest.raises(ValueError, match=r"Inner: unknown field\(s\) 'widht' \(did you mean 'width'\?\)"):
        Outer.from_dict({"inner": {"widht": 3}})  # nested sections go through the same check
    with pytest.raises(TypeError, match="Inner: expected a dict of its fields, got list"):
        check_keys(Inner, [1])


def test_str_fields_are_found_in_nested_sections():
    assert Outer.str_fields() == {"out", "inner.name", "optional.name"}


def test_overrides_read_json_values_except_for_str_fields():
    d = apply_overrides(Outer().to_dict(), ["inner.width=9", "out=2024", "sizes=[5, 6]", "new.deep.key=true"],
                        str_fields=Outer.str_fields())
    assert d["inner"]["width"] == 9 and d["out"] == "2024" and d["sizes"] == [5, 6]
    assert d["new"] == {"deep": {"key": True}}
    assert parse_value("abc") == "abc" and parse_value("1e-3") == 1e-3 and parse_value("null") is None
    assert parse_value(".001") == 0.001 and parse_value("1.") == 1.0 and parse_value("1_000") == 1000
    assert parse_value("True") is True and parse_value("None") is None and parse_value("nan") == "nan"
    assert parse_value("inf") == float("inf") and parse_value("-inf") == float("-inf")


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=1", ".a=1"])
def test_malformed_overrides_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match="is not of the form dotted.key=value"):
        apply_overrides({}, [bad])


def test_an_override_cannot_descend_into_a_value():
    with pytest.raises(ValueError, match=r"override 'out.x=1': out is 'runs/x', not a section"):
        apply_overrides(Outer().to_dict(), ["out.x=1"])


def test_config_files(tmp_path):
    (tmp_path / "c.json").write_text('{"out": "j"}')
    (tmp_path / "c.toml").write_text('out = "t"\n[inner]\nwidth = 2\n')
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "c.yaml").write_text("out: y")
    assert read_config_file(tmp_path / "c.json") == {"out": "j"}
    assert Outer.from_dict(read_config_file(tmp_path / "c.toml")).inner.width == 2
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_config_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="must hold an object/table, got list"):
        read_config_file(tmp_path / "list.json")
    with pytest.raises(ValueError, match="expected a .json or .toml file"):
        read_config_file(tmp_path / "c.yaml")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_config_file(tmp_path / "missing.json")


def test_did_you_mean():
    assert did_you_mean("locl", ["local", "linear"]) == " (did you mean 'local'?)"
    assert did_you_mean("zzzz", ["local", "linear"]) == ""
