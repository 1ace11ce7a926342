"""Postgres column values → exact Python values → JSON.

Two entry points share one per-type table: :func:`convert` takes a value as wal2json
format-version 2 puts it in a change (after JSON parsing with ``Decimal`` for
non-integer numbers), :func:`convert_text` takes the type's *text output*, i.e. its
output function's text, which is what wal2json prints and what a text-format query
result carries for an *uncast* column. Both give the same Python value for the same
stored value, so a snapshot row and a streamed row compare equal (exceptions: [1], [8]).
:func:`dumps` writes those values as JSON for the change-event envelope.

Read the snapshot's columns uncast (e.g. ``cursor.pgresult.get_value``): ``col::text``
is *not* the output function for every type: it trims character(n) padding ('ab ' →
'ab') and writes inet's /32 netmask ('10.0.0.1' → '10.0.0.1/32').

Mapping (``docs/capture-types.md`` holds the same table; keep the two in step)::

  Postgres type (OID)          Python value                         wal2json v2 value        JSON envelope
  ---------------------------  -----------------------------------  -----------------------  ---------------------------
  smallint 21, integer 23,     int                                  number                   number
  bigint 20, oid 26
  numeric 1700 (any typmod)    Decimal with every digit;            bare number; NaN and     string of the exact digits:
                               Decimal('NaN'), Decimal('Infinity'),  ±Infinity arrive as      "12.30", "NaN",
                               Decimal('-Infinity') from text       null (→ None) [1]        "Infinity", "-Infinity"
  real 700, double             float [7]; NaN/±Infinity as          number; NaN/±Infinity    number; "NaN", "Infinity",
  precision 701                NonFiniteFloat (a float subclass)    arrive as null [1]       "-Infinity"
  boolean 16                   bool                                 true / false             true / false
  text 25, varchar 1043,       str (character(n) keeps its          string                   string
  character 1042, name 19,     blank padding)
  "char" 18, citext
  json 114, jsonb 3802         JsonText: the JSON text itself, not  string (JSON text)       the JSON value itself,
                               parsed (written as it came) [2]                               numbers with every digit
  uuid 2950                    uuid.UUID                            string                   "a0eebc99-9c0b-…"
  bytea 17                     bytes                                hex string, no \\x        base64 (standard, padded)
  date 1082                    datetime.date [3]                    "2024-03-31"             "2024-03-31"
  timestamp 1114               naive datetime.datetime (µs) [3]     "2024-03-31 01:30:00.5"  "…T01:30:00.500000" [6]
  timestamptz 1184             aware datetime.datetime with the     "2024-03-31 01:30:00+00" "2024-03-31T01:30:00+00:00"
                               offset as rendered [3][4]                                     (offset seconds kept)
  time 1083                    datetime.time [3]                    "04:05:06.789"           "04:05:06.789000" [6]
  timetz 1266                  datetime.time with tzinfo            "04:05:06+05:30"         "04:05:06+05:30"
  interval 1186                Interval(months, days, microseconds) "1 year 2 mons 04:05:06" ISO 8601: "P1Y2MT4H5M6S"
  arrays: "T[]", "_T",         list (nested per dimension) of T's   array literal string     JSON array
  or the array OID [9]         values, NULL → None; bounds dropped
  enum, domain [5], inet,      str: the text output                 string                   string
  cidr, macaddr, money, bit,
  xml, point, ranges,
  tsvector, … any other type

  [1] wal2json writes null for NaN/Infinity of numeric, real and double precision: in a
      change they are indistinguishable from NULL (Capabilities.numeric_nan_distinct is
      False). The text path (snapshot) keeps them, and arrays keep them in both paths.
  [2] json/jsonb values travel as their text (:class:`JsonText`), rendered into the
      envelope as raw JSON (``orjson.Fragment``): never parsed and re-serialized on the
      way, so every number keeps its digits and json (not jsonb) keeps its exact text,
      whitespace and duplicate keys included. :func:`json_value` gives the Python value
      (dicts, lists, ints of any size, JsonNumber for fractions) where one is needed.
  [3] Values Python cannot hold stay the Postgres text (a str): 'infinity',
      '-infinity', BC dates ('0044-03-15 BC'), years after 9999, time '24:00:00'.
  [4] timestamptz is rendered in the session's TimeZone, both by wal2json (the
      walsender's) and by ::text: set SESSION_SETTINGS on both connections. Historic
      local-mean-time offsets have seconds ('+05:53:28'); they are kept.
  [5] wal2json names a domain by its own name and OID and writes its value as text (even
      over integer or numeric), so a domain is a str on both paths. With wal2json's
      ``include-domain-data-type`` the stream names the base type, which this module would
      convert like the base type (the name decides for an unknown OID); the snapshot would
      then have to name it the same way (capture.decoders.wal2json leaves that option off).
  [6] Python's isoformat(): fractions as 6 digits (".500000", ".789000"), none when zero.
  [7] real: the shortest decimal that round-trips in float4 ("1.1"), read as a double.
  [8] -0 of real/double arrives from wal2json as the JSON integer -0, read as 0: a change
      carries 0.0 where the snapshot reads -0.0 (arrays keep -0.0 on both paths).
  [9] box 603 is text like any other type, but its arrays separate elements with ';'.

Type names arrive as wal2json prints them ("character varying(20)", "numeric(12,2)[]",
"timestamp(3) with time zone"): typmods are stripped for dispatch. A nonzero known OID
dispatches first; otherwise the name.

Both paths assume the text formats of SESSION_SETTINGS (DateStyle ISO, IntervalStyle
postgres, bytea_output hex, extra_float_digits ≥ 1); other formats raise ValueError.

Cost: one dict lookup per value (cached per (OID, type name)) then a C-level
conversion for ints, text, numeric, floats, uuid, bytea and dates; arrays, intervals and
JSON documents go through Python parsers.

Thread safety: everything here is pure except the converter caches, whose races are
benign (two threads may compute the same entry).
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

import orjson

from schemas.jsontext import JsonText

__all__ = [
    "SESSION_OPTIONS",
    "SESSION_SETTINGS",
    "InexactValueError",
    "Interval",
    "JsonNumber",
    "JsonText",
    "NonFiniteFloat",
    "OffsetSecondsDatetime",
    "PlainTime",
    "ZonedTime",
    "convert",
    "convert_text",
    "converter",
    "dumps",
    "dumps_values",
    "json_default",
    "json_value",
    "parse_array",
    "parse_interval",
    "text_converter",
]

# Settings under which wal2json and a text-format query result print the formats parsed here.
SESSION_SETTINGS: dict[str, str] = {
    "DateStyle": "ISO",
    "IntervalStyle": "postgres",
    "TimeZone": "UTC",
    "bytea_output": "hex",
    "extra_float_digits": "1",
}
# The same as a libpq ``options`` value (also for the replication connection).
SESSION_OPTIONS = " ".join(f"-c {name}={value}" for name, value in SESSION_SETTINGS.items())


class InexactValueError(ValueError):
    """A numeric value arrived as a binary float: the payload must be parsed with Decimal."""


class NonFiniteFloat(float):
    """NaN, Infinity or -Infinity of real/double precision (JSON: "NaN", "Infinity", "-Infinity").

    A float in every other respect; the subclass exists so that :func:`dumps` can write
    these as strings (orjson would silently write null for a plain float NaN).
    """

    __slots__ = ()


class JsonNumber(Decimal):
    """A non-integer number inside a json/jsonb value: exact, and written back as a bare JSON number
    spelled as it was read (``str()`` is that text: Decimal's own would turn ``0.0000001`` into ``1E-7``).

    >>> str(JsonNumber("0.0000001")), str(JsonNumber("1e-7")), JsonNumber("0.0000001") == Decimal("1E-7")
    ('0.0000001', '1e-7', True)
    """

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> JsonNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple[type[JsonNumber], tuple[str]]:  # pickled (the key state) with its spelling
        return (JsonNumber, (self.text,))


@dataclass(frozen=True, slots=True)
class Interval:
    """A Postgres interval: its three independent fields (a month is not 30 days, a day not 24 h)."""

    months: int
    days: int
    microseconds: int

    def to_iso8601(self) -> str:
        """ISO 8601 duration exactly as Postgres prints it under IntervalStyle iso_8601.

        >>> Interval(14, 3, 14_706_789_000).to_iso8601()
        'P1Y2M3DT4H5M6.789S'
        """
        years, months = _trunc_divmod(self.months, 12)
        hours, rest = _trunc_divmod(self.microseconds, 3_600_000_000)
        minutes, rest = _trunc_divmod(rest, 60_000_000)
        seconds, fraction = _trunc_divmod(rest, 1_000_000)
        if not (years or months or self.days or hours or minutes or seconds or fraction):
            return "PT0S"
        parts = ["P", _iso_part(years, "Y"), _iso_part(months, "M"), _iso_part(self.days, "D")]
        if hours or minutes or seconds or fraction:
            parts += ["T", _iso_part(hours, "H"), _iso_part(minutes, "M")]
            if seconds or fraction:
                sign = "-" if seconds < 0 or fraction < 0 else ""
                frac = f".{abs(fraction):06d}".rstrip("0") if fraction else ""
                parts.append(f"{sign}{abs(seconds)}{frac}S")
        return "".join(parts)


def _trunc_divmod(value: int, divisor: int) -> tuple[int, int]:
    """divmod truncating toward zero, as C does (both parts carry the sign of ``value``)."""
    quotient = abs(value) // divisor
    quotient = -quotient if value < 0 else quotient
    return quotient, value - quotient * divisor


def _iso_part(value: int, unit: str) -> str:
    return f"{value}{unit}" if value else ""


# -- scalar text parsers ---------------------------------------------------------------

_BOOLS = {"t": True, "f": False, "true": True, "false": False}


def _bool_text(text: str) -> bool:
    value = _BOOLS.get(text)
    if value is None:
        raise ValueError(f"not a boolean: {text[:20]!r}")
    return value


def _float_text(text: str) -> float:
    value = float(text)
    return value if value - value == 0.0 else NonFiniteFloat(value)  # inf - inf and nan - nan are nan


def _json_text(text: str) -> JsonText:
    """The text, checked to be JSON (it goes into envelopes as raw JSON): orjson's parse is the fast check;
    what it cannot hold (numbers past a double) is checked by the exact parser."""
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        _json_value(text)  # raises ValueError when the text is not JSON at all
    return JsonText(text)


def json_value(value: JsonText | str) -> Any:
    """The Python value of JSON text: exact (fractions as JsonNumber, integers of any size)."""
    return _json_value(value.text if isinstance(value, JsonText) else value)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text, parse_float=JsonNumber)
    except ValueError as e:
        if "integer string conversion" not in str(e):
            raise
    # An integer of more than 4300 digits (jsonb prints 1e5000 in full): Python's int()
    # refuses it, so such integers become JsonNumber.
    return json.loads(text, parse_float=JsonNumber, parse_int=_json_int)


def _json_int(text: str) -> int | JsonNumber:
    return int(text) if len(text) <= 4000 else JsonNumber(text)


def _bytea_text(text: str) -> bytes:
    if not text.startswith("\\x"):
        raise ValueError(f"bytea text is not in hex format (bytea_output=hex): {text[:20]!r}")
    return bytes.fromhex(text[2:])


def _special_datetime(text: str, error: ValueError) -> str:
    """Keep the text of a date/time Python cannot hold; re-raise for anything else."""
    if text in ("infinity", "-infinity") or text.endswith(" BC") or text.find("-") > 4:
        return text
    raise error


def _date_text(text: str) -> date | str:
    try:
        return date.fromisoformat(text)
    except ValueError as e:
        return _special_datetime(text, e)


class OffsetSecondsDatetime(datetime):
    """An aware datetime whose UTC offset has seconds (historic local mean time, '+05:53:28').

    Equal to the plain datetime; its own class only so that :func:`dumps_values` sends it
    through :func:`json_default` (orjson's own output would drop the offset's seconds).
    """


class ZonedTime(time):
    """A time with a zone (timetz): its own class so that :func:`dumps_values` renders it (orjson refuses it)."""


class PlainTime(time):
    """A time without a zone of 10,000–99,999 µs past the second: its own class so that :func:`dumps_values`
    renders it with ``isoformat()``. orjson 3.13 writes those microseconds with five digits (``13:49:19.011106``
    as ``"13:49:19.11106"``, a different time); found by the native core's differential test."""


def _datetime_text(text: str) -> datetime | str:
    try:
        moment = datetime.fromisoformat(text)  # naive for timestamp, aware with the offset for timestamptz
    except ValueError as e:
        return _special_datetime(text, e)
    offset = moment.utcoffset()
    if offset is not None and (offset.seconds % 60 or offset.microseconds):
        return OffsetSecondsDatetime.fromisoformat(text)
    return moment


def _time_text(text: str) -> time | str:
    try:
        value = time.fromisoformat(text)
    except ValueError:
        if text.startswith("24:00:00"):
            return text
        raise
    if value.tzinfo is not None:
        return ZonedTime.fromisoformat(text)
    return PlainTime.fromisoformat(text) if 10_000 <= value.microsecond < 100_000 else value


_INTERVAL = re.compile(
    r"(?:(?P<years>[+-]?\d+) years? ?)?"
    r"(?:(?P<months>[+-]?\d+) mons? ?)?"
    r"(?:(?P<days>[+-]?\d+) days? ?)?"
    r"(?:(?P<sign>[+-])?(?P<hours>\d+):(?P<minutes>\d\d):(?P<seconds>\d\d)(?:\.(?P<fraction>\d{1,6}))?)?"
)


def parse_interval(text: str) -> Interval:
    """Parse an interval in Postgres' default ``IntervalStyle=postgres`` output.

    >>> parse_interval("-1 years -2 mons +3 days -04:05:06.789")
    Interval(months=-14, days=3, microseconds=-14706789000)
    """
    match = _INTERVAL.fullmatch(text)
    if match is None or not text:
        raise ValueError(f"not an interval in IntervalStyle postgres: {text!r}")
    years, months, days, sign, hours, minutes, seconds, fraction = match.groups()
    micros = 0
    if hours is not None:
        micros = ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * 1_000_000
        micros += int(fraction.ljust(6, "0")) if fraction else 0
        micros = -micros if sign == "-" else micros
    return Interval(int(years or 0) * 12 + int(months or 0), int(days or 0), micros)


# -- array literals ----------------------------------------------------------------------

_QUOTED = re.compile(r'"((?:[^"\\]+|\\.)*)"', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_UNQUOTED: dict[str, re.Pattern[str]] = {}


def parse_array(literal: str, element: Callable[[str], Any] = str, delimiter: str = ",") -> list[Any]:
    """Parse a Postgres array literal into (nested) lists, converting each element with ``element``.

    Unquoted ``NULL`` is None, quoted ``"NULL"`` the string; dimension decorations
    (``[0:1]={1,2}``) are dropped.

    >>> parse_array('{{1,2},{3,NULL}}', int)
    [[1, 2], [3, None]]
    >>> parse_array('{"a b","q\\\\"x",NULL,"NULL"}')
    ['a b', 'q"x', None, 'NULL']
    """
    text = literal
    if text.startswith("["):
        text = text[text.index("=") + 1 :]
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        raise ValueError(f"not an array literal: {literal[:40]!r}")
    inner = text[1:-1]
    if not inner:
        return []
    if '"' not in inner and "{" not in inner and "\\" not in inner:  # flat, nothing quoted
        tokens = inner.split(delimiter)
        if "" in tokens or "}" in inner:
            raise ValueError(f"empty element or stray brace in array literal: {literal[:40]!r}")
        return [None if item == "NULL" else element(item) for item in tokens]
    items, end = _parse_dimension(text, 0, element, delimiter)
    if end != len(text):
        raise ValueError(f"junk after array literal at {end}: {literal[:40]!r}")
    return items


def _parse_dimension(text: str, pos: int, element: Callable[[str], Any], delimiter: str) -> tuple[list[Any], int]:
    """Parse the ``{…}`` starting at ``pos``; return its items and the position after ``}``."""
    unquoted = _UNQUOTED.get(delimiter)
    if unquoted is None:
        unquoted = _UNQUOTED[delimiter] = re.compile(r'[^"{}' + re.escape(delimiter) + r"]*")
    items: list[Any] = []
    pos += 1
    if text[pos] == "}":
        return items, pos + 1
    while True:
        char = text[pos]
        if char == "{":
            sub, pos = _parse_dimension(text, pos, element, delimiter)
            items.append(sub)
        elif char == '"':
            quoted = _QUOTED.match(text, pos)
            if quoted is None:
                raise ValueError(f"unterminated quoted array element at {pos}")
            value = quoted.group(1)
            items.append(element(_ESCAPE.sub(r"\1", value) if "\\" in value else value))
            pos = quoted.end()
        else:
            match = unquoted.match(text, pos)
            assert match is not None  # the pattern matches the empty string
            token = match.group()
            if not token:
                raise ValueError(f"empty array element at {pos}")
            items.append(None if token == "NULL" else element(_ESCAPE.sub(r"\1", token)))
            pos = match.end()
        char = text[pos]
        pos += 1
        if char == "}":
            return items, pos
        if char != delimiter:
            raise ValueError(f"expected {delimiter!r} or '}}' at {pos - 1}, found {char!r}")


# -- the type table ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PgType:
    names: tuple[str, ...]  # format_type() name first (what wal2json prints), then aliases
    oid: int
    array_oid: int
    from_text: Callable[[str], Any]
    delimiter: str = ","


def _same(text: str) -> str:
    return text


_TYPES = [
    _PgType(("smallint", "int2"), 21, 1005, int),
    _PgType(("integer", "int4", "int"), 23, 1007, int),
    _PgType(("bigint", "int8"), 20, 1016, int),
    _PgType(("oid",), 26, 1028, int),
    _PgType(("numeric", "decimal"), 1700, 1231, Decimal),
    _PgType(("real", "float4"), 700, 1021, _float_text),
    _PgType(("double precision", "float8"), 701, 1022, _float_text),
    _PgType(("boolean", "bool"), 16, 1000, _bool_text),
    _PgType(("text",), 25, 1009, _same),
    _PgType(("character varying", "varchar"), 1043, 1015, _same),
    _PgType(("character", "bpchar", "char"), 1042, 1014, _same),
    _PgType(("name",), 19, 1003, _same),
    _PgType(('"char"',), 18, 1002, _same),
    _PgType(("citext",), 0, 0, _same),  # an extension: its OID differs per database
    _PgType(("json",), 114, 199, _json_text),
    _PgType(("jsonb",), 3802, 3807, _json_text),
    _PgType(("uuid",), 2950, 2951, uuid.UUID),
    _PgType(("bytea",), 17, 1001, _bytea_text),
    _PgType(("date",), 1082, 1182, _date_text),
    _PgType(("timestamp without time zone", "timestamp"), 1114, 1115, _datetime_text),
    _PgType(("timestamp with time zone", "timestamptz"), 1184, 1185, _datetime_text),
    _PgType(("time without time zone", "time"), 1083, 1183, _time_text),
    _PgType(("time with time zone", "timetz"), 1266, 1270, _time_text),
    _PgType(("interval",), 1186, 1187, parse_interval),
    _PgType(("box",), 603, 1020, _same, delimiter=";"),  # the one built-in type whose arrays use ';'
]
_BY_OID = {t.oid: t for t in _TYPES if t.oid}
_BY_NAME = {name: t for t in _TYPES for name in t.names}
_ARRAY_OIDS = {t.array_oid: t for t in _TYPES if t.array_oid}

_TYPMOD = re.compile(r"\(\s*\d+(?:\s*,\s*-?\d+)?\s*\)")


def _base_name(type_name: str) -> str:
    """'timestamp(3) with time zone' → 'timestamp with time zone'; 'interval day to second' → 'interval'."""
    name = " ".join(_TYPMOD.sub("", type_name).split()).removeprefix("pg_catalog.")
    return "interval" if name.startswith("interval ") else name


def _resolve(type_name: str, type_oid: int) -> tuple[_PgType | None, bool]:
    """The table entry and whether the column is an array of it (None: unknown type → text)."""
    if type_oid in _BY_OID:
        return _BY_OID[type_oid], False
    if type_oid in _ARRAY_OIDS:
        return _ARRAY_OIDS[type_oid], True
    name = _base_name(type_name)
    if name.endswith("[]"):
        return _BY_NAME.get(_base_name(name.rstrip("[]"))), True
    if name.startswith("_") and name[1:] in _BY_NAME:
        return _BY_NAME[name[1:]], True
    return _BY_NAME.get(name), False


def _array_text(pg_type: _PgType | None) -> Callable[[str], list[Any]]:
    if pg_type is None:
        return parse_array
    element, delimiter = pg_type.from_text, pg_type.delimiter
    return lambda text: parse_array(text, element, delimiter)


_TEXT_CONVERTERS: dict[tuple[int, str], Callable[[str], Any]] = {}
_JSON_CONVERTERS: dict[tuple[int, str], Callable[[Any], Any]] = {}


def text_converter(type_name: str, type_oid: int) -> Callable[[str], Any]:
    """The function turning this type's text output (never None) into its Python value."""
    key = (type_oid, type_name)
    found = _TEXT_CONVERTERS.get(key)
    if found is None:
        pg_type, is_array = _resolve(type_name, type_oid)
        if is_array:
            found = _array_text(pg_type)
        elif pg_type is None:
            found = _same
        else:
            found = pg_type.from_text
        _TEXT_CONVERTERS[key] = found
    return found


def converter(type_name: str, type_oid: int) -> Callable[[Any], Any]:
    """The function turning a non-null wal2json v2 value of this type into its Python value."""
    key = (type_oid, type_name)
    found = _JSON_CONVERTERS.get(key)
    if found is None:
        pg_type, is_array = _resolve(type_name, type_oid)
        special = None if is_array or pg_type is None else _JSON_SPECIAL.get(pg_type.from_text)
        found = special or _text_only(text_converter(type_name, type_oid), type_name)
        _JSON_CONVERTERS[key] = found
    return found


def _text_only(from_text: Callable[[str], Any], type_name: str) -> Callable[[Any], Any]:
    """wal2json gives this type as a JSON string: anything else is a bad payload."""
    if from_text is _same:
        return _json_str

    def convert_string(value: Any) -> Any:
        if type(value) is not str:
            raise TypeError(f"expected a string for {type_name}, got {type(value).__name__}")
        return from_text(value)

    return convert_string


def _json_str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int_json(value: Any) -> int:
    if type(value) is int:
        return value
    if type(value) is str:  # a domain over an integer type, named by its base type
        return int(value)
    raise TypeError(f"expected an integer, got {type(value).__name__} {value!r}")


def _numeric_json(value: Any) -> Decimal:
    kind = type(value)
    if kind is Decimal:
        return value  # type: ignore[no-any-return]
    if kind is int:
        return Decimal(value)
    if kind is str:
        return Decimal(value)
    if kind is float:
        raise InexactValueError(f"numeric value {value!r} was parsed as a binary float")
    raise TypeError(f"expected a number for numeric, got {kind.__name__} {value!r}")


def _float_json(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value  # type: ignore[no-any-return]
    if kind is int or kind is Decimal:
        return float(value)
    if kind is str:
        return _float_text(value)
    raise TypeError(f"expected a number for a float type, got {kind.__name__} {value!r}")


def _bool_json(value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) is str:
        return _bool_text(value)
    raise TypeError(f"expected a boolean, got {type(value).__name__} {value!r}")


def _bytea_json(value: Any) -> bytes:
    if type(value) is not str:
        raise TypeError(f"expected a hex string for bytea, got {type(value).__name__}")
    # wal2json drops the \x of the hex output; a domain's value (as text) keeps it.
    return bytes.fromhex(value[2:] if value.startswith("\\x") else value)


# Types wal2json writes as JSON numbers/booleans (or, for bytea, hex without "\x").
_JSON_SPECIAL: dict[Callable[[str], Any], Callable[[Any], Any]] = {
    int: _int_json,
    Decimal: _numeric_json,
    _float_text: _float_json,
    _bool_text: _bool_json,
    _bytea_text: _bytea_json,
}


def convert(type_name: str, type_oid: int, raw: Any) -> Any:
    """A wal2json format-version 2 column value (JSON-parsed, Decimal for fractions) → Python value.

    Raises ValueError/TypeError for a value that does not fit its type, and
    :class:`InexactValueError` for a numeric value parsed as a binary float.

    >>> convert("numeric(12,2)", 1700, Decimal("12.30"))
    Decimal('12.30')
    >>> convert("integer[]", 1007, "{1,2,NULL}")
    [1, 2, None]
    """
    return None if raw is None else converter(type_name, type_oid)(raw)


def convert_text(type_name: str, type_oid: int, text: str | None) -> Any:
    """A value in its type's text output (an uncast column, text format) → the same value as :func:`convert`.

    >>> convert_text("numeric", 1700, "NaN")
    Decimal('NaN')
    >>> convert_text("interval", 1186, "1 day -00:00:01")
    Interval(months=0, days=1, microseconds=-1000000)
    """
    return None if text is None else text_converter(type_name, type_oid)(text)


# -- JSON ----------------------------------------------------------------------------------

_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_default(obj: Any) -> Any:
    """``default=`` for orjson: how the values of this module look in the JSON envelope.

    Use it with ``orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS`` (as
    :func:`dumps` does): orjson's own datetime output drops the seconds of an offset and
    refuses a time with a zone, and it would write an Interval as an object.
    """
    if type(obj) is JsonText:
        return orjson.Fragment(obj.text)
    if isinstance(obj, Decimal):
        if isinstance(obj, JsonNumber):
            return orjson.Fragment(str(obj))
        return format(obj, "f")  # every digit, never an exponent: "12.30", "0.0000001", "NaN"
    if isinstance(obj, NonFiniteFloat):
        return _NON_FINITE[repr(float(obj))]
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, (datetime, date, time)):
        return obj.isoformat()
    if isinstance(obj, Interval):
        return obj.to_iso8601()
    raise TypeError(f"type {type(obj).__name__} is not JSON serializable")


_DUMPS_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_VALUES_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS


def dumps_values(value: Any) -> bytes:
    """:func:`dumps` for values made by this module's converters only: the change events' hot path.

    orjson writes plain ``datetime``/``date``/``time`` values itself (the same text as
    ``isoformat()``, measured ≈ 1 µs a value faster than through ``json_default``); the two
    cases where its text would differ — an offset with seconds, a time with a zone — are
    built by the converters as :class:`OffsetSecondsDatetime` and :class:`ZonedTime` (and a time orjson
    would write wrongly as :class:`PlainTime`),
    which go through ``json_default``. A datetime from elsewhere with an offset in seconds
    would lose them here: use :func:`dumps` for such values.

    >>> dumps_values([_datetime_text("1900-01-01 00:00:00+05:53:28"), _datetime_text("2024-03-31 01:30:00.5+00")])
    b'["1900-01-01T00:00:00+05:53:28","2024-03-31T01:30:00.500000+00:00"]'
    """
    try:
        return orjson.dumps(value, default=json_default, option=_VALUES_OPTIONS)
    except TypeError as e:
        if "64-bit" not in str(e):
            raise
    return orjson.dumps(_big_ints_as_fragments(value), default=json_default, option=_VALUES_OPTIONS)


def dumps(value: Any) -> bytes:
    """JSON bytes of a value built from this module's types (see the mapping table).

    >>> dumps({"n": Decimal("12.30"), "b": b"\\x00\\xff", "j": json.loads('[1.10]', parse_float=JsonNumber)})
    b'{"n":"12.30","b":"AP8=","j":[1.10]}'
    """
    try:
        return orjson.dumps(value, default=json_default, option=_DUMPS_OPTIONS)
    except TypeError as e:
        if "64-bit" not in str(e):
            raise
    # An integer beyond 64 bits (only inside json/jsonb values): orjson refuses it
    # without asking default=, so write such integers as raw JSON numbers.
    return orjson.dumps(_big_ints_as_fragments(value), default=json_default, option=_DUMPS_OPTIONS)


def _big_ints_as_fragments(value: Any) -> Any:
    if type(value) is int and not -(2**63) <= value < 2**64:
        return orjson.Fragment(str(value))
    if isinstance(value, dict):
        return {k: _big_ints_as_fragments(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_big_ints_as_fragments(v) for v in value]
    return value
