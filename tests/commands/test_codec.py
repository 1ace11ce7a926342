"""commands.codec: frozen dataclasses ↔ JSON values, driven by type hints (pure logic, no database)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from commands.codec import from_json, to_json
from commands.errors import CodecError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Inner:
    n: int
    label: str = "x"


@dataclass(frozen=True, slots=True)
class Outer:
    name: str
    ratio: float
    flag: bool
    colour: Colour
    inner: Inner
    items: tuple[Inner, ...] = ()
    tags: frozenset[str] = frozenset()
    scores: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    pair: tuple[int, str] = (0, "")
    maybe: int | None = None
    either: int | str = 0
    anything: Any = None


VALUE = Outer(
    name="o'brien \\ é",
    ratio=1.5,
    flag=True,
    colour=Colour.BLUE,
    inner=Inner(1),
    items=(Inner(2, "a"), Inner(3)),
    tags=frozenset({"b", "a"}),
    scores={"x": 1},
    names=["p", "q"],
    pair=(7, "seven"),
    maybe=None,
    either="text",
    anything={"free": [1, 2]},
)


def test_round_trip_through_json_text() -> None:
    encoded = to_json(VALUE)
    assert encoded["tags"] == ["a", "b"] and encoded["colour"] == "blue" and encoded["inner"] == {"n": 1, "label": "x"}
    assert from_json(Outer, orjson.loads(orjson.dumps(encoded))) == VALUE


def test_defaults_fill_missing_fields_and_int_widens_to_float() -> None:
    decoded = from_json(Outer, {"name": "n", "ratio": 2, "flag": False, "colour": "red", "inner": {"n": 5}})
    assert decoded == Outer("n", 2.0, False, Colour.RED, Inner(5, "x")) and isinstance(decoded.ratio, float)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": 1}, "Outer.name: expected str, got int 1"),
        ({"inner": {"n": "1"}}, "Outer.inner.n: expected int, got str '1'"),
        ({"items": [{"n": 1}, {"n": True}]}, r"Outer.items\[1\].n: expected int, got bool True"),
        ({"colour": "green"}, "Outer.colour: 'green' is not a Colour"),
        ({"flag": None}, "Outer.flag: null where bool is required"),
        ({"scores": {"x": "1"}}, "Outer.scores.x: expected int, got str '1'"),
        ({"bogus": 1}, "Outer: unknown field.s. bogus for Outer"),
        ({"inner": {"label": "y"}}, "Outer.inner: missing field 'n' of Inner"),
        ({"either": 1.5}, r"Outer.either: 1.5 fits none of"),
        ({"pair": [1]}, r"Outer.pair: expected a list of 2 items"),
    ],
)
def test_errors_name_the_field_path(data: dict[str, Any], message: str) -> None:
    base = {"name": "n", "ratio": 1.0, "flag": True, "colour": "red", "inner": {"n": 1}}
    with pytest.raises(CodecError, match=message):
        from_json(Outer, {**base, **data})


def test_unsupported_values_are_refused() -> None:
    with pytest.raises(CodecError, match="cannot encode object value"):
        to_json(object())
