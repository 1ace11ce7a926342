"""commands.codec: frozen dataclasses ↔ JSON values, driven by type hints (pure logic, no database)."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, cast
from zoneinfo import ZoneInfo

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


# -- the value types: Decimal, datetime, date, UUID ------------------------------------------

UTC = dt.UTC
PLUS_2 = dt.timezone(dt.timedelta(hours=2))
ID_A = uuid.UUID("0189b7a2-3c4d-7e5f-8a9b-0c1d2e3f4a5b")
ID_B = uuid.UUID("f47ac10b-58cc-4372-a567-0e02b2c3d479")


@dataclass(frozen=True, slots=True)
class Money:
    amount: Decimal
    currency: str = "EUR"


@dataclass(frozen=True, slots=True)
class Ledger:
    account_id: uuid.UUID
    balance: Decimal
    opened_at: dt.datetime
    value_date: dt.date
    money: Money
    parts: tuple[Decimal, ...] = ()
    by_day: dict[str, dt.date] = field(default_factory=dict)
    rates: frozenset[Decimal] = frozenset()
    ids: frozenset[uuid.UUID] = frozenset()
    days: frozenset[dt.date] = frozenset()
    history: tuple[Money, ...] = ()
    per_account: dict[uuid.UUID, Decimal] = field(default_factory=dict)
    per_date: dict[dt.date, Decimal] = field(default_factory=dict)
    per_instant: dict[dt.datetime, str] = field(default_factory=dict)
    limit: Decimal | None = None
    closed_at: dt.datetime | None = None
    due: dt.date | None = None
    parent: uuid.UUID | None = None
    stamps: list[dt.datetime] = field(default_factory=list)
    day_or_instant: dt.date | dt.datetime | None = None
    instant_or_day: dt.datetime | dt.date | None = None


LEDGER = Ledger(
    account_id=ID_A,
    balance=Decimal("10.50"),
    opened_at=dt.datetime(2024, 5, 1, 12, 30, 0, 250_000, tzinfo=PLUS_2),
    value_date=dt.date(2024, 5, 2),
    money=Money(Decimal("-0.00")),
    parts=(Decimal("1E+2"), Decimal("0.0000001"), Decimal("12345678901234567890.123456789012345678901234567890")),
    by_day={"mon": dt.date(2024, 1, 1), "tue": dt.date(1, 1, 1)},
    rates=frozenset({Decimal("2.5"), Decimal("10"), Decimal("-3")}),
    ids=frozenset({ID_B, ID_A}),
    days=frozenset({dt.date(2024, 12, 31), dt.date(2023, 1, 1)}),
    history=(Money(Decimal("5"), "USD"), Money(Decimal("0E-8"))),
    per_account={ID_B: Decimal("1.10")},
    per_date={dt.date(2024, 2, 29): Decimal("3.000")},
    per_instant={dt.datetime(2024, 1, 1, tzinfo=UTC): "new year"},
    limit=Decimal("1000.00"),
    closed_at=dt.datetime(2024, 6, 1, 8, 0),  # naive: stays naive
    due=dt.date(2024, 7, 1),
    parent=ID_B,
    stamps=[dt.datetime(2024, 3, 31, 1, 59, 59, 999_999, tzinfo=ZoneInfo("Europe/Paris")), dt.datetime.max],
    day_or_instant=dt.date(2024, 1, 1),
    instant_or_day=dt.date(2024, 1, 2),
)


def test_value_types_encode_as_strings() -> None:
    encoded = to_json(LEDGER)
    assert encoded["account_id"] == "0189b7a2-3c4d-7e5f-8a9b-0c1d2e3f4a5b"
    assert encoded["balance"] == "10.50"  # the scale is kept, never a float
    assert encoded["opened_at"] == "2024-05-01T12:30:00.250000+02:00"
    assert encoded["value_date"] == "2024-05-02"
    assert encoded["money"] == {"amount": "-0.00", "currency": "EUR"}
    assert encoded["parts"] == ["1E+2", "1E-7", "12345678901234567890.123456789012345678901234567890"]
    assert encoded["by_day"] == {"mon": "2024-01-01", "tue": "0001-01-01"}
    assert encoded["rates"] == ["-3", "10", "2.5"]  # sorted by their JSON form: a stable stored order
    assert encoded["ids"] == [str(ID_A), str(ID_B)]
    assert encoded["days"] == ["2023-01-01", "2024-12-31"]
    assert encoded["per_account"] == {str(ID_B): "1.10"}
    assert encoded["per_date"] == {"2024-02-29": "3.000"}
    assert encoded["per_instant"] == {"2024-01-01T00:00:00+00:00": "new year"}
    assert encoded["closed_at"] == "2024-06-01T08:00:00"
    assert encoded["stamps"] == ["2024-03-31T01:59:59.999999+01:00", "9999-12-31T23:59:59.999999"]
    assert orjson.loads(orjson.dumps(encoded)) == encoded  # plain JSON: orjson writes it as is


def test_value_types_round_trip_exactly() -> None:
    decoded = from_json(Ledger, orjson.loads(orjson.dumps(to_json(LEDGER))))
    assert decoded == LEDGER
    # What == does not see: a Decimal's scale and sign, a datetime's offset and naivety, the exact types.
    assert decoded.balance.as_tuple() == Decimal("10.50").as_tuple()
    assert decoded.money.amount.as_tuple() == Decimal("-0.00").as_tuple()
    assert [p.as_tuple() for p in decoded.parts] == [p.as_tuple() for p in LEDGER.parts]
    assert [h.amount.as_tuple() for h in decoded.history] == [h.amount.as_tuple() for h in LEDGER.history]
    assert decoded.per_account[ID_B].as_tuple() == Decimal("1.10").as_tuple()
    assert decoded.opened_at.utcoffset() == dt.timedelta(hours=2)
    assert decoded.closed_at is not None and decoded.closed_at.tzinfo is None
    assert decoded.stamps[0].utcoffset() == dt.timedelta(hours=1)  # a ZoneInfo comes back as its offset
    assert decoded.stamps[1].tzinfo is None
    assert type(decoded.day_or_instant) is dt.date and type(decoded.instant_or_day) is dt.date
    assert all(type(x) is uuid.UUID for x in (decoded.account_id, *decoded.ids, *decoded.per_account))
    assert all(type(x) is dt.date for x in (*decoded.days, *decoded.per_date))
    assert isinstance(decoded.rates, frozenset) and isinstance(decoded.parts, tuple)


def test_a_union_of_date_and_datetime_keeps_each() -> None:
    instant = dt.datetime(2024, 1, 1, tzinfo=UTC)
    for value in (dt.date(2024, 1, 1), instant, dt.datetime(2024, 1, 1)):
        again = from_json(Ledger, to_json(replace(LEDGER, day_or_instant=value, instant_or_day=value)))
        assert (type(again.day_or_instant), type(again.instant_or_day)) == (type(value), type(value))
        assert again.day_or_instant == value == again.instant_or_day


def test_utc_z_and_other_iso_forms_decode() -> None:
    base = to_json(LEDGER)
    decoded = from_json(Ledger, {**base, "opened_at": "2024-05-01T10:30:00Z", "account_id": str(ID_A).upper()})
    assert decoded.opened_at == dt.datetime(2024, 5, 1, 10, 30, tzinfo=UTC) and decoded.account_id == ID_A
    assert from_json(Ledger, {**base, "opened_at": "2024-05-01 10:30"}).opened_at == dt.datetime(2024, 5, 1, 10, 30)
    assert from_json(Ledger, {**base, "balance": ".5"}).balance.as_tuple() == Decimal("0.5").as_tuple()


def test_subclasses_encode_as_their_base() -> None:
    class Stamp(dt.datetime):
        pass

    class Id(uuid.UUID):
        def __str__(self) -> str:
            return "not the canonical form"

    value = replace(LEDGER, opened_at=Stamp(2024, 1, 1, tzinfo=UTC), account_id=Id(str(ID_A)))
    encoded = to_json(value)
    assert (encoded["opened_at"], encoded["account_id"]) == ("2024-01-01T00:00:00+00:00", str(ID_A))
    assert from_json(Ledger, encoded) == value


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"balance": "abc"}, "Ledger.balance: expected Decimal as a string of a finite decimal number such as "
         "'10.50', got str 'abc'"),
        ({"balance": 10.5}, "Ledger.balance: expected Decimal as a string .*, got float 10.5"),
        ({"balance": 10}, "Ledger.balance: expected Decimal as a string .*, got int 10"),
        ({"balance": True}, "Ledger.balance: expected Decimal as a string .*, got bool True"),
        ({"balance": None}, "Ledger.balance: null where Decimal is required"),
        ({"balance": "NaN"}, "Ledger.balance: expected Decimal .*, got str 'NaN'"),
        ({"balance": "-Infinity"}, "Ledger.balance: expected Decimal .*, got str '-Infinity'"),
        ({"balance": "sNaN"}, "Ledger.balance: expected Decimal .*, got str 'sNaN'"),
        ({"balance": "1_000"}, "Ledger.balance: expected Decimal .*, got str '1_000'"),
        ({"balance": " 1"}, "Ledger.balance: expected Decimal .*, got str ' 1'"),
        ({"balance": "\u0661"}, "Ledger.balance: expected Decimal .*, got str '\u0661'"),  # an Arabic-Indic one
        ({"balance": "1e999999999999999999999999"}, "Ledger.balance: expected Decimal .*, got str '1e9"),
        ({"money": {"amount": "1,5"}}, "Ledger.money.amount: expected Decimal .*, got str '1,5'"),
        ({"parts": ["1", 2.5]}, r"Ledger.parts\[1\]: expected Decimal .*, got float 2.5"),
        ({"rates": ["1", "x"]}, r"Ledger.rates\[1\]: expected Decimal .*, got str 'x'"),
        ({"limit": 1.5}, "Ledger.limit: expected Decimal as a string .*, got float 1.5"),
        ({"due": "2024-05"}, "Ledger.due: expected date .*, got str '2024-05'"),
        ({"per_account": {str(ID_A): 1}}, f"Ledger.per_account.{ID_A}: expected Decimal .*, got int 1"),
        ({"opened_at": "2024-13-01T00:00:00"}, "Ledger.opened_at: expected datetime as an ISO 8601 string such as "
         "'2024-05-01T12:30:00\\+00:00', got str '2024-13-01T00:00:00'"),
        ({"opened_at": "2024-05-01"}, "Ledger.opened_at: expected datetime .*, got str '2024-05-01'"),  # a date
        ({"opened_at": 1714560000}, "Ledger.opened_at: expected datetime .*, got int 1714560000"),
        ({"opened_at": "yesterday"}, "Ledger.opened_at: expected datetime .*, got str 'yesterday'"),
        ({"opened_at": "2024-05-01T10:00:00+25:00"}, "Ledger.opened_at: expected datetime .*'2024-05-01T10:00:00"),
        ({"stamps": ["2024-05-01T10:00:00", "2024-05-01T10:00:00 junk"]}, r"Ledger.stamps\[1\]: expected datetime"),
        ({"value_date": "2024-02-30"}, "Ledger.value_date: expected date as an ISO 8601 date string such as "
         "'2024-05-01', got str '2024-02-30'"),
        ({"value_date": "2024-05-01T00:00:00"}, "Ledger.value_date: expected date .*, got str '2024-05-01T00:00:00'"),
        ({"value_date": "20240501"}, "Ledger.value_date: expected date .*, got str '20240501'"),
        ({"by_day": {"mon": "2024-1-1"}}, "Ledger.by_day.mon: expected date .*, got str '2024-1-1'"),
        ({"per_date": {"someday": "1"}}, "Ledger.per_date: expected date .*, got str 'someday'"),
        ({"account_id": "not-a-uuid"}, "Ledger.account_id: expected UUID as a string such as "
         "'12345678-1234-5678-1234-567812345678', got str 'not-a-uuid'"),
        ({"account_id": 123}, "Ledger.account_id: expected UUID .*, got int 123"),
        ({"ids": [str(ID_A), str(ID_B)[:-1]]}, rf"Ledger.ids\[1\]: expected UUID .*, got str '{str(ID_B)[:-1]}'"),
    ],
)  # fmt: skip
def test_value_type_errors_name_the_field_path_and_value(data: dict[str, Any], message: str) -> None:
    with pytest.raises(CodecError, match=message):
        from_json(Ledger, {**to_json(LEDGER), **data})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (replace(LEDGER, balance=Decimal("NaN")), r"Ledger.balance: cannot encode Decimal value Decimal\('NaN'\)"),
        (replace(LEDGER, money=Money(Decimal("Infinity"))), r"Ledger.money.amount: cannot encode Decimal value"),
        (replace(LEDGER, parts=(Decimal(1), Decimal("-sNaN"))), r"Ledger.parts\[1\]: cannot encode Decimal value"),
        (replace(LEDGER, rates=frozenset({Decimal("NaN")})), r"Ledger.rates\[…\]: cannot encode Decimal value"),
        (replace(LEDGER, per_account={ID_A: Decimal("NaN")}), rf"Ledger.per_account.{ID_A}: cannot encode Decimal"),
        (
            replace(LEDGER, per_date=cast(Any, {Decimal("NaN"): Decimal(1)})),
            r"Ledger.per_date \(a key\): cannot encode Decimal",
        ),
        (replace(LEDGER, limit=Decimal("-Infinity")), r"Ledger.limit: cannot encode Decimal value .*infinities"),
        (
            replace(LEDGER, stamps=cast(Any, [dt.datetime.min, object()])),
            r"Ledger.stamps\[1\]: cannot encode object value",
        ),
        (Decimal("NaN"), r"^cannot encode Decimal value Decimal\('NaN'\) as JSON"),
        ([Decimal(1), Decimal("NaN")], r"^list\[1\]: cannot encode Decimal value"),
    ],
)
def test_unencodable_values_name_their_path(value: Any, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        to_json(value)


def test_an_unencodable_value_in_an_existing_type_names_its_path() -> None:
    with pytest.raises(CodecError, match=r"^Outer.anything\[0\]: cannot encode object value"):
        to_json(replace(VALUE, anything=[object()]))
