"""capture.pgtypes: the per-type conversions, array and interval parsers, JSON output (pure logic).

The same conversions against a real server (stream vs ::text vs psycopg) are in
test_wal2json.py.
"""

from __future__ import annotations

import base64
import doctest
import json
import math
import re
import struct
import uuid
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from capture import pgtypes
from capture.pgtypes import (
    InexactValueError,
    Interval,
    JsonNumber,
    JsonText,
    NonFiniteFloat,
    OffsetSecondsDatetime,
    ZonedTime,
    convert,
    convert_text,
    dumps,
    dumps_values,
    json_default,
    json_value,
    parse_array,
    parse_interval,
)
from tideline.pgharness import LocalPostgres


def test_docstring_examples_run() -> None:
    assert doctest.testmod(pgtypes).failed == 0


def test_values_orjson_would_misrender_get_their_own_classes() -> None:
    """dumps_values relies on these: orjson drops an offset's seconds and refuses a zoned time."""
    lmt = convert_text("timestamp with time zone", 1184, "1900-01-01 05:21:10+05:21:10")
    assert type(lmt) is OffsetSecondsDatetime
    assert dumps_values([lmt]) == b'["1900-01-01T05:21:10+05:21:10"]'
    assert type(convert_text("timestamp with time zone", 1184, "2024-03-31 01:30:00+00")) is datetime
    zoned = convert_text("time with time zone", 1266, "04:05:06+05:30")
    assert type(zoned) is ZonedTime
    assert dumps_values([zoned]) == b'["04:05:06+05:30"]'
    assert type(convert_text("time without time zone", 1083, "04:05:06")) is time


# -- array literals --------------------------------------------------------------------

ARRAY_CASES: list[tuple[str, Any]] = [
    ("{}", []),
    ("{1,2,NULL}", ["1", "2", None]),
    ("{NULL}", [None]),
    ('{"NULL"}', ["NULL"]),
    ('{""}', [""]),
    ('{"",""}', ["", ""]),
    ('{"a b","c,d","q\\"x",NULL,"NULL"}', ["a b", "c,d", 'q"x', None, "NULL"]),
    ('{"back\\\\slash","brace{","brace}"}', ["back\\slash", "brace{", "brace}"]),
    ('{"line\nbreak"," lead","trail "}', ["line\nbreak", " lead", "trail "]),
    ("{{1,2},{3,4}}", [["1", "2"], ["3", "4"]]),
    ("{{1,NULL},{NULL,4}}", [["1", None], [None, "4"]]),
    ("{{{1},{2}},{{3},{4}}}", [[["1"], ["2"]], [["3"], ["4"]]]),
    ('{{"a,b",c},{"{}",NULL}}', [["a,b", "c"], ["{}", None]]),
    ("[0:1]={1,2}", ["1", "2"]),
    ("[-2:-1]={x,y}", ["x", "y"]),
    ("[1:2][3:4]={{1,2},{3,4}}", [["1", "2"], ["3", "4"]]),
    ('{"(1,2)","(3,4)"}', ["(1,2)", "(3,4)"]),
    ("{héllo,wörld,😀}", ["héllo", "wörld", "😀"]),
    ('{"\\\\x00","\\\\xff"}', ["\\x00", "\\xff"]),
    ('{"{\\"a\\": 1}",[1.5]}', ['{"a": 1}', "[1.5]"]),
]


@pytest.mark.parametrize(("literal", "expected"), ARRAY_CASES)
def test_parse_array(literal: str, expected: Any) -> None:
    assert parse_array(literal) == expected


@pytest.mark.parametrize(
    ("literal", "element", "expected"),
    [
        ("{1,2,NULL}", int, [1, 2, None]),
        ("{{1,2},{3,4}}", int, [[1, 2], [3, 4]]),
        ('{1.10,NaN,"3"}', Decimal, [Decimal("1.10"), Decimal("NaN"), Decimal("3")]),
    ],
)
def test_parse_array_converts_elements(literal: str, element: Any, expected: Any) -> None:
    assert repr(parse_array(literal, element)) == repr(expected)


def test_parse_array_box_delimiter() -> None:
    assert parse_array("{(1,1),(0,0);(2,2),(1,1)}", str, ";") == ["(1,1),(0,0)", "(2,2),(1,1)"]
    assert convert_text("box[]", 1020, "{(1,1),(0,0);(2,2),(1,1)}") == ["(1,1),(0,0)", "(2,2),(1,1)"]


@pytest.mark.parametrize(
    "literal",
    ["", "1,2", "{1,2", "1,2}", '{"unterminated}', "{1,,2}", "{{1},2", "{1}}", "{1} ", '{"a"b}', "[1:2]{1,2}"],
)
def test_parse_array_rejects_malformed_literals(literal: str) -> None:
    with pytest.raises(ValueError):
        parse_array(literal)


# -- intervals ---------------------------------------------------------------------------

INTERVAL_CASES: list[tuple[str, Interval, str | None]] = [
    # (IntervalStyle postgres, fields, IntervalStyle iso_8601 as Postgres prints it)
    ("00:00:00", Interval(0, 0, 0), "PT0S"),
    ("1 year 2 mons 3 days 04:05:06.789", Interval(14, 3, 14_706_789_000), "P1Y2M3DT4H5M6.789S"),
    ("-1 years -2 mons +3 days -04:05:06.789", Interval(-14, 3, -14_706_789_000), "P-1Y-2M3DT-4H-5M-6.789S"),
    ("-1 days +02:00:00", Interval(0, -1, 7_200_000_000), "P-1DT2H"),
    ("1 day -00:00:01", Interval(0, 1, -1_000_000), "P1DT-1S"),
    ("-00:00:00.5", Interval(0, 0, -500_000), "PT-0.5S"),
    ("00:00:00.000001", Interval(0, 0, 1), "PT0.000001S"),
    ("100:00:00", Interval(0, 0, 360_000_000_000), "PT100H"),
    ("1 mon -1 days", Interval(1, -1, 0), "P1M-1D"),
    ("-1 years", Interval(-12, 0, 0), "P-1Y"),
    ("1 year 00:00:01", Interval(12, 0, 1_000_000), "P1YT1S"),
    ("1 day", Interval(0, 1, 0), "P1D"),
    ("2 days", Interval(0, 2, 0), "P2D"),
    ("11 mons", Interval(11, 0, 0), "P11M"),
    ("-178000000 years", Interval(-2_136_000_000, 0, 0), "P-178000000Y"),
    ("-2147483648 days -2562047788:00:00", Interval(0, -2147483648, -9_223_372_036_800_000_000), None),
    ("00:01:00", Interval(0, 0, 60_000_000), "PT1M"),
    ("01:00:00.25", Interval(0, 0, 3_600_250_000), "PT1H0.25S"),
]


@pytest.mark.parametrize(("text", "expected", "iso"), INTERVAL_CASES)
def test_parse_interval(text: str, expected: Interval, iso: str | None) -> None:
    assert parse_interval(text) == expected
    if iso is not None:
        assert expected.to_iso8601() == iso


@pytest.mark.parametrize("text", ["", "1", "1 fortnight", "@ 1 year", "P1Y", "1:2:3", "04:05:06.1234567", "1 year ago"])
def test_parse_interval_rejects_other_styles(text: str) -> None:
    with pytest.raises(ValueError):
        parse_interval(text)


# -- scalars: both paths ---------------------------------------------------------------

SCALAR_CASES: list[tuple[str, int, Any, str, Any]] = [
    # (type name as wal2json prints it, OID, wal2json value, text output, Python value)
    ("smallint", 21, -32768, "-32768", -32768),
    ("integer", 23, 42, "42", 42),
    ("bigint", 20, 9223372036854775807, "9223372036854775807", 9223372036854775807),
    ("oid", 26, 4294967295, "4294967295", 4294967295),
    ("numeric(12,2)", 1700, Decimal("12.30"), "12.30", Decimal("12.30")),
    ("numeric", 1700, 12345678901234567890123, "12345678901234567890123", Decimal("12345678901234567890123")),
    ("numeric", 1700, "0.0000001", "0.0000001", Decimal("0.0000001")),  # quoted by the decoder
    ("real", 700, 1.5, "1.5", 1.5),
    ("double precision", 701, 5e-324, "5e-324", 5e-324),
    ("double precision", 701, Decimal("0.1"), "0.1", 0.1),
    ("boolean", 16, True, "t", True),
    ("boolean", 16, False, "f", False),
    ("text", 25, "héllo\n", "héllo\n", "héllo\n"),
    ("character varying(20)", 1043, "x", "x", "x"),
    ("character(3)", 1042, "ab ", "ab ", "ab "),
    ("name", 19, "nm", "nm", "nm"),
    ('"char"', 18, "c", "c", "c"),
    ("citext", 0, "MiXed", "MiXed", "MiXed"),
    (
        "jsonb",
        3802,
        '{"a": [1, 2.50, null, true]}',
        '{"a": [1, 2.50, null, true]}',
        {"a": [1, JsonNumber("2.50"), None, True]},
    ),
    ("json", 114, "1.10", "1.10", JsonNumber("1.10")),
    (
        "uuid",
        2950,
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ),
    ("bytea", 17, "00ff27225c", "\\x00ff27225c", b"\x00\xff'\"\\"),
    ("bytea", 17, "", "\\x", b""),
    ("date", 1082, "2024-03-31", "2024-03-31", date(2024, 3, 31)),
    ("date", 1082, "infinity", "infinity", "infinity"),
    ("date", 1082, "-infinity", "-infinity", "-infinity"),
    ("date", 1082, "0044-03-15 BC", "0044-03-15 BC", "0044-03-15 BC"),
    ("date", 1082, "10000-01-01", "10000-01-01", "10000-01-01"),
    (
        "timestamp(3) without time zone",
        1114,
        "2024-03-31 01:30:00.123",
        "2024-03-31 01:30:00.123",
        datetime(2024, 3, 31, 1, 30, 0, 123000),
    ),
    ("timestamp without time zone", 1114, "0044-03-15 12:00:00 BC", "0044-03-15 12:00:00 BC", "0044-03-15 12:00:00 BC"),
    (
        "timestamp with time zone",
        1184,
        "2024-03-31 01:30:00+00",
        "2024-03-31 01:30:00+00",
        datetime(2024, 3, 31, 1, 30, tzinfo=UTC),
    ),
    (
        "timestamp with time zone",
        1184,
        "2024-03-31 07:00:00.5+05:30",
        "2024-03-31 07:00:00.5+05:30",
        datetime(2024, 3, 31, 7, 0, 0, 500000, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    ),
    (
        "timestamp with time zone",
        1184,
        "1900-01-01 05:21:10+05:21:10",
        "1900-01-01 05:21:10+05:21:10",
        datetime(1900, 1, 1, 5, 21, 10, tzinfo=timezone(timedelta(hours=5, minutes=21, seconds=10))),
    ),
    ("timestamp with time zone", 1184, "infinity", "infinity", "infinity"),
    (
        "timestamp with time zone",
        1184,
        "0044-03-15 12:00:00+00 BC",
        "0044-03-15 12:00:00+00 BC",
        "0044-03-15 12:00:00+00 BC",
    ),
    (
        "timestamp with time zone",
        1184,
        "294276-01-01 05:30:00+05:30",
        "294276-01-01 05:30:00+05:30",
        "294276-01-01 05:30:00+05:30",
    ),
    ("time without time zone", 1083, "04:05:06.789", "04:05:06.789", time(4, 5, 6, 789000)),
    ("time without time zone", 1083, "24:00:00", "24:00:00", "24:00:00"),
    ("time with time zone", 1266, "04:05:06-08", "04:05:06-08", time(4, 5, 6, tzinfo=timezone(timedelta(hours=-8)))),
    ("interval", 1186, "1 day", "1 day", Interval(0, 1, 0)),
    ("interval day to second(3)", 1186, "1 day", "1 day", Interval(0, 1, 0)),
    ("mood", 16385, "happy", "happy", "happy"),  # an enum
    ("inet", 869, "10.0.0.1/8", "10.0.0.1/8", "10.0.0.1/8"),
    ("money", 790, "$12.34", "$12.34", "$12.34"),
    ("bit(3)", 1560, "101", "101", "101"),
    ("int4range", 3904, "[1,5)", "[1,5)", "[1,5)"),
    ("xml", 142, "<a>x</a>", "<a>x</a>", "<a>x</a>"),
    ("money2", 16418, "12.3400", "12.3400", "12.3400"),  # a domain, named by itself
    ("numeric(20,4)", 16418, "12.3400", "12.3400", Decimal("12.3400")),  # include-domain-data-type
    ("integer", 16420, "5", "5", 5),  # include-domain-data-type
    ("boolean", 16421, "t", "t", True),  # include-domain-data-type
    ("bytea", 16422, "\\x00ff", "\\x00ff", b"\x00\xff"),  # include-domain-data-type
]


def _shape(value: Any) -> Any:
    """Types, recursively: makes 1 vs 1.0 vs Decimal('1') vs True distinct."""
    if isinstance(value, list):
        return ["list", [_shape(v) for v in value]]
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, datetime | time):  # OffsetSecondsDatetime / ZonedTime count as their base class
        return ("datetime" if isinstance(value, datetime) else "time", value.utcoffset())
    return type(value).__name__


def _parsed(value: Any) -> Any:
    """json/jsonb values (JsonText) parsed, recursively; they are also written exactly as their text."""
    if isinstance(value, JsonText):
        assert dumps(value) == value.text.encode() == dumps_values(value)  # raw JSON: never re-serialized
        return json_value(value)
    if isinstance(value, list):
        return [_parsed(v) for v in value]
    return value


def assert_same(actual: Any, expected: Any) -> None:
    """Equal as values, in type, and in every digit (Decimal('1.10') is not Decimal('1.1'))."""
    actual = _parsed(actual)
    assert _shape(actual) == _shape(expected)
    assert dumps(actual) == dumps(expected)
    # the change events' fast path writes converter output exactly as the general one
    assert dumps_values(actual) == dumps(actual)


@pytest.mark.parametrize(("type_name", "oid", "raw", "text", "expected"), SCALAR_CASES)
def test_both_paths_give_the_same_value(type_name: str, oid: int, raw: Any, text: str, expected: Any) -> None:
    assert_same(convert(type_name, oid, raw), expected)
    assert_same(convert_text(type_name, oid, text), expected)
    if oid < 16384:  # a built-in type: the name alone dispatches the same way
        assert_same(convert_text(type_name, 0, text), expected)


def test_null_is_none_on_both_paths() -> None:
    for type_name, oid, *_ in SCALAR_CASES:
        assert convert(type_name, oid, None) is None
        assert convert_text(type_name, oid, None) is None


@pytest.mark.parametrize(
    ("type_name", "text", "expected"),
    [
        ("numeric", "NaN", "NaN"),
        ("numeric", "Infinity", "Infinity"),
        ("numeric", "-Infinity", "-Infinity"),
        ("real", "NaN", "NaN"),
        ("double precision", "Infinity", "Infinity"),
        ("double precision", "-Infinity", "-Infinity"),
    ],
)
def test_non_finite_numbers_from_text(type_name: str, text: str, expected: str) -> None:
    value = convert_text(type_name, 0, text)
    assert dumps(value) == json.dumps(expected).encode()
    if type_name == "numeric":
        assert type(value) is Decimal and not value.is_finite()
    else:
        assert type(value) is NonFiniteFloat and not math.isfinite(value)
        assert math.isnan(value) == (expected == "NaN")


def test_numeric_never_goes_through_a_float() -> None:
    with pytest.raises(InexactValueError):
        convert("numeric(38,10)", 1700, 1.1)
    digits = "1234567890123456789012345678.0123456789"
    assert str(convert("numeric(38,10)", 1700, Decimal(digits))) == digits
    assert str(convert("numeric(38,10)", 1700, digits)) == digits


@pytest.mark.parametrize(
    ("type_name", "oid", "raw"),
    [
        ("integer", 23, "x"),
        ("integer", 23, 1.5),
        ("boolean", 16, "yes"),
        ("uuid", 2950, "not-a-uuid"),
        ("uuid", 2950, 5),
        ("bytea", 17, "zz"),
        ("date", 1082, "2024-02-30"),
        ("timestamp with time zone", 1184, "yesterday"),
        ("interval", 1186, "@ 1 year"),
        ("jsonb", 3802, "{bad json"),
        ("integer[]", 1007, "{1,x}"),
        ("integer[]", 1007, 5),
        ("text", 25, 5),
    ],
)
def test_bad_values_raise(type_name: str, oid: int, raw: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        convert(type_name, oid, raw)


def test_bytea_text_requires_hex_output() -> None:
    with pytest.raises(ValueError, match="bytea_output=hex"):
        convert_text("bytea", 17, "abc")  # escape format


# -- dispatch ------------------------------------------------------------------------------

ARRAY_TYPE_CASES: list[tuple[str, int, str, Any]] = [
    ("integer[]", 1007, "{1,2,NULL}", [1, 2, None]),
    ("integer[]", 0, "{{1,2},{3,4}}", [[1, 2], [3, 4]]),
    ("_int4", 0, "{1}", [1]),
    ("bigint[]", 1016, "[0:1]={1,2}", [1, 2]),
    ("text[]", 1009, '{"a b",NULL,"NULL"}', ["a b", None, "NULL"]),
    ("character varying(20)[]", 1015, '{"x,y"}', ["x,y"]),
    ("character varying[]", 0, "{x}", ["x"]),
    ("numeric(10,2)[]", 1231, "{1.10,NaN,3.00}", [Decimal("1.10"), Decimal("NaN"), Decimal("3.00")]),
    ("numeric[]", 0, "{-Infinity}", [Decimal("-Infinity")]),
    ("real[]", 1021, "{1.5,NaN,Infinity}", [1.5, NonFiniteFloat("nan"), NonFiniteFloat("inf")]),
    ("boolean[]", 1000, "{t,f,NULL}", [True, False, None]),
    ("jsonb[]", 3807, '{"{\\"a\\": 1.5}",[2]}', [{"a": JsonNumber("1.5")}, [2]]),
    ("bytea[]", 1001, '{"\\\\x00","\\\\xff"}', [b"\x00", b"\xff"]),
    ("uuid[]", 2951, "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}", [uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")]),
    ("date[]", 1182, "{2024-01-01,infinity}", [date(2024, 1, 1), "infinity"]),
    (
        "timestamp with time zone[]",
        1185,
        '{"2024-01-01 00:00:00+00",infinity}',
        [datetime(2024, 1, 1, tzinfo=UTC), "infinity"],
    ),
    ("timestamp(3) with time zone[]", 0, '{"2024-01-01 00:00:00+00"}', [datetime(2024, 1, 1, tzinfo=UTC)]),
    ("interval[]", 1187, '{"1 day","-00:00:01"}', [Interval(0, 1, 0), Interval(0, 0, -1_000_000)]),
    ("mood[]", 16384, "{sad,happy}", ["sad", "happy"]),  # enum array: elements as text
    ("inet[]", 1041, "{10.0.0.1}", ["10.0.0.1"]),
    ("_text", 0, '{"a b"}', ["a b"]),
]


@pytest.mark.parametrize(("type_name", "oid", "literal", "expected"), ARRAY_TYPE_CASES)
def test_arrays_convert_their_elements(type_name: str, oid: int, literal: str, expected: Any) -> None:
    assert_same(convert(type_name, oid, literal), expected)
    assert_same(convert_text(type_name, oid, literal), expected)


def test_oid_wins_over_the_name() -> None:
    # A nonzero known OID decides; the name is only a fallback.
    assert convert("whatever", 23, 5) == 5
    assert convert("integer", 25, "5") == "5"
    # "_T" names an array only when T is a known type: a user type may start with "_".
    assert convert("_mood", 0, "{sad}") == "{sad}"


# -- JSON output -------------------------------------------------------------------------


def test_dumps_writes_the_documented_forms() -> None:
    kolkata_lmt = timezone(timedelta(hours=5, minutes=21, seconds=10))
    row = {
        "numeric": Decimal("12.30"),
        "tiny": Decimal("0.0000001"),
        "nan": Decimal("NaN"),
        "inf": Decimal("-Infinity"),
        "float_nan": NonFiniteFloat("nan"),
        "float_inf": NonFiniteFloat("-inf"),
        "float": 0.1,
        "bytes": bytes(range(256)),
        "interval": Interval(14, 3, 14_706_789_000),
        "uuid": uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        "date": date(2024, 3, 31),
        "ts": datetime(2024, 3, 31, 1, 30, 0, 123000),
        "tstz": datetime(2024, 3, 31, 1, 30, tzinfo=UTC),
        "tstz_lmt": datetime(1900, 1, 1, 5, 21, 10, tzinfo=kolkata_lmt),
        "time": time(4, 5, 6, 789000),
        "timetz": time(4, 5, 6, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        "jsonb": convert_text("jsonb", 3802, '{"a": 12345678901234567890.12345678901234567890, "b": [1.10]}'),
        "array": [[1, None], [3, 4]],
        "special": "infinity",
    }
    assert orjson.loads(dumps(row)) == {
        "numeric": "12.30",
        "tiny": "0.0000001",
        "nan": "NaN",
        "inf": "-Infinity",
        "float_nan": "NaN",
        "float_inf": "-Infinity",
        "float": 0.1,
        "bytes": base64.b64encode(bytes(range(256))).decode(),
        "interval": "P1Y2M3DT4H5M6.789S",
        "uuid": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "date": "2024-03-31",
        "ts": "2024-03-31T01:30:00.123000",
        "tstz": "2024-03-31T01:30:00+00:00",
        "tstz_lmt": "1900-01-01T05:21:10+05:21:10",
        "time": "04:05:06.789000",
        "timetz": "04:05:06+05:30",
        "jsonb": {"a": 12345678901234567890.12345678901234567890, "b": [1.1]},
        "array": [[1, None], [3, 4]],
        "special": "infinity",
    }
    # jsonb numbers keep every digit in the output bytes, not only in Python
    assert b'"jsonb":{"a": 12345678901234567890.12345678901234567890, "b": [1.10]}' in dumps(row)  # its own text


def test_dumps_big_integers_inside_json() -> None:
    big = 10**30
    value = convert_text("jsonb", 3802, f'{{"n": {big}, "list": [{-big}], "small": 1}}')
    assert json_value(value) == {"n": big, "list": [-big], "small": 1}
    assert dumps(value) == f'{{"n": {big}, "list": [{-big}], "small": 1}}'.encode()  # the text itself
    assert dumps(json_value(value)) == f'{{"n":{big},"list":[{-big}],"small":1}}'.encode()  # and parsed
    huge = "1" + "0" * 5000  # jsonb prints 1e5000 in full; Python's int() refuses > 4300 digits
    text = convert_text("jsonb", 3802, f"[{huge}]")
    parsed = json_value(text)
    assert parsed == [Decimal(huge)] and isinstance(parsed[0], JsonNumber)
    assert dumps(parsed) == f"[{huge}]".encode() == dumps(text)


def test_json_numbers_read_back_from_the_log_keep_their_spelling() -> None:
    """Regression (seen in the pgoutput kill -9 scenario): the key state, rebuilt from the log after a crash,
    parses stored envelopes; an unchanged TOASTed jsonb filled from it was written back with Decimal's
    spelling (``0.0000001`` → ``1E-7``), so the crashed log differed from an uninterrupted one."""
    import pickle

    from capture.converters import JsonConverter
    from capture.tables import TableInfo

    texts = ["0.0000001", "1e-7", "1E+2", "1.10", "-0.0", "123456789012345678901234567890.5"]
    stored = b'{"op":"u","after":{"id":1,"j":[' + ",".join(texts).encode() + b"]}}"
    table = TableInfo.make("public", "t", (), ("id",), "primary key", "d")
    _, after = JsonConverter().read_change(table, stored)
    assert after is not None and dumps(after["j"]) == f"[{','.join(texts)}]".encode()
    assert dumps(pickle.loads(pickle.dumps(after["j"]))) == dumps(after["j"])  # the key state pickles them
    assert [str(n) for n in after["j"]] == texts and after["j"][0] == Decimal("1E-7")


def test_json_default_rejects_unknown_types() -> None:
    with pytest.raises(TypeError, match="object"):
        json_default(object())
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_session_options_cover_every_setting() -> None:
    assert pgtypes.SESSION_OPTIONS == (
        "-c DateStyle=ISO -c IntervalStyle=postgres -c TimeZone=UTC -c bytea_output=hex -c extra_float_digits=1"
    )


# -- against the server ------------------------------------------------------------------


def test_interval_parser_and_iso8601_agree_with_postgres(postgres: LocalPostgres) -> None:
    """Random intervals: parse IntervalStyle postgres output, print what IntervalStyle iso_8601 prints."""
    query = """
        SELECT i, make_interval(
            years => (random() * 400 - 200)::int, months => (random() * 40 - 20)::int,
            days => (random() * 4000 - 2000)::int, hours => (random() * 400 - 200)::int,
            mins => (random() * 400 - 200)::int, secs => round((random() * 400 - 200)::numeric, (i % 7))
        ) * (CASE WHEN i % 5 = 0 THEN 0 ELSE 1 END) + (i % 3) * interval '1 microsecond' AS v
        FROM generate_series(1, 300) i
    """
    with psycopg.connect(postgres.dsn, autocommit=True, options=pgtypes.SESSION_OPTIONS) as conn:
        conn.execute("SELECT setseed(0.42)")
        conn.execute(f"CREATE TEMP TABLE intervals AS {query}".encode())
        postgres_style = [row[0] for row in conn.execute("SELECT v::text FROM intervals ORDER BY i")]
        conn.execute("SET IntervalStyle = iso_8601")
        iso_style = [row[0] for row in conn.execute("SELECT v::text FROM intervals ORDER BY i")]
    assert len(postgres_style) == 300
    for text, iso in zip(postgres_style, iso_style, strict=True):
        assert parse_interval(text).to_iso8601() == iso, text


def test_float_text_agrees_with_the_binary_value(postgres: LocalPostgres) -> None:
    """Shortest round-trip text (extra_float_digits=1) reads back as the very same float8/float4."""
    with psycopg.connect(postgres.dsn, autocommit=True, options=pgtypes.SESSION_OPTIONS) as conn:
        conn.execute("SELECT setseed(0.7)")
        rows = conn.execute(
            "SELECT x, x::text, r, r::text FROM ("
            " SELECT x, CASE WHEN x = 0 OR abs(x) BETWEEN 1e-37 AND 1e38 THEN x::real END AS r FROM ("
            "  SELECT (random() - 0.5) * 10 ^ (random() * 600 - 300)::int AS x FROM generate_series(1, 500)"
            "  UNION ALL SELECT unnest('{0,-0,1e-323,1.7976931348623157e308,0.1,1e23}'::float8[])) v) w",
            binary=True,  # psycopg unpacks the IEEE bytes: independent of any text parsing
        ).fetchall()
    for double, double_text, single, single_text in rows:
        value = convert_text("double precision", 701, double_text)
        assert struct.pack("!d", value) == struct.pack("!d", double), double_text
        if single is not None:  # real: the shortest digits that round-trip in float4, read as a double
            assert struct.pack("!f", convert_text("real", 700, single_text)) == struct.pack("!f", single), single_text


def test_docs_table_and_module_table_name_every_type() -> None:
    """docs/capture-types.md and the module docstring hold the same table: both name every type."""
    docs = (Path(__file__).parents[2] / "docs" / "capture-types.md").read_text()
    for text, where in ((docs, "docs/capture-types.md"), (pgtypes.__doc__ or "", "capture/pgtypes.py")):
        for pg_type in pgtypes._TYPES:
            names = [r"\s+".join(map(re.escape, name.split())) for name in pg_type.names]
            assert re.search("|".join(names), text), (pg_type.names, where)
            if pg_type.oid:
                assert re.search(rf"\b{pg_type.oid}\b", text), (pg_type.names, pg_type.oid, where)
