"""Column values: capture's Python values → Avro datums → Tideline's JSON form.

``to_avro`` takes the Python values capture produces (see capture/pgtypes.py; duck-typed,
nothing imported from capture) and returns datums of the Avro types of
:mod:`schemas.pgavro`, using the *underlying* Avro values (ints for dates, times and
timestamps; unscaled bytes for decimals) so fastavro's logical-type conversion is
never needed to write. ``to_json`` takes a datum — underlying values (decoded with
``AvroWire(..., logical_types=False)``) or fastavro's logical objects — and returns the
value exactly as capture's JSON envelope writes it: ``orjson.dumps`` of it gives the
bytes ``capture.pgtypes.dumps`` gives for the original value. JSON values come back as
``orjson.Fragment`` (their exact text).

Two departures, both documented in docs/schemas.md: a ``timestamptz`` keeps its instant
but not its offset (it decodes in UTC, which is what capture renders under its UTC
session); a ``numeric(p,s)`` value NaN/±Infinity has no Avro ``decimal`` form and raises
:class:`~schemas.errors.ValueConversionError` (unconstrained numeric carries them).

Thread-safety: pure functions and immutable converter objects.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import numpy as np
import orjson

from schemas.errors import ValueConversionError
from schemas.jsontext import JsonText
from schemas.pgavro import ColumnType, Kind, PgColumn
from schemas.pgtime import (
    MICROS_PER_DAY,
    date_text_to_days,
    days_to_date_text,
    micros_to_timestamp_text,
    timestamp_text_to_micros,
)

Converter = Callable[[Any], Any]

EPOCH_DATE = date(1970, 1, 1)
EPOCH_ORDINAL = EPOCH_DATE.toordinal()
EPOCH_NAIVE = datetime(1970, 1, 1)
EPOCH_UTC = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
_SPECIALS = {"NaN": "NaN", "sNaN": "NaN", "Infinity": "Infinity", "-Infinity": "NegativeInfinity"}
_SPECIAL_JSON = {"NaN": "NaN", "Infinity": "Infinity", "NegativeInfinity": "-Infinity"}


# ---------------------------------------------------------------------------- to Avro


def _unscaled(d: Decimal) -> tuple[int, int]:
    """``(unscaled, scale ≥ 0)`` of a finite Decimal, exactly (no context rounding)."""
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    unscaled = int("".join(map(str, digits)) or "0")
    if exponent > 0:
        unscaled, exponent = unscaled * 10**exponent, 0
    return (-unscaled if sign else unscaled), -exponent


def _int_bytes(n: int) -> bytes:
    return n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)


def _decimal_to_avro(precision: int, scale: int) -> Converter:
    def convert(value: Any) -> bytes | str:
        d = value if isinstance(value, Decimal) else Decimal(value)
        if not d.is_finite():  # numeric(p,s) holds NaN and ±Infinity: the union's DecimalSpecial branch
            return _SPECIALS["NaN" if d.is_nan() else ("-Infinity" if d < 0 else "Infinity")]
        unscaled, own_scale = _unscaled(d)
        if own_scale > scale:
            raise ValueConversionError(f"{d} has more than {scale} fraction digits: decimal({precision},{scale})")
        unscaled *= 10 ** (scale - own_scale)
        if len(str(abs(unscaled))) > precision:
            raise ValueConversionError(f"{d} has more than {precision} digits: decimal({precision},{scale})")
        return _int_bytes(unscaled)

    return convert


def _variable_decimal_to_avro(value: Any) -> dict[str, Any]:
    d = value if isinstance(value, Decimal) else Decimal(value)
    if not d.is_finite():
        return {"scale": 0, "value": b"", "special": _SPECIALS[str(d).lstrip("+")]}
    unscaled, scale = _unscaled(d)
    return {"scale": scale, "value": _int_bytes(unscaled), "special": None}


def _timestamp_to_avro(value: Any) -> int:
    if isinstance(value, str):
        return timestamp_text_to_micros(value)
    if value.tzinfo is not None:
        raise ValueConversionError(f"timestamp without time zone got an aware datetime {value}")
    return int((value - EPOCH_NAIVE) // MICROSECOND)


def _timestamptz_to_avro(value: Any) -> int:
    if isinstance(value, str):
        return timestamp_text_to_micros(value)
    if value.tzinfo is None:
        raise ValueConversionError(f"timestamp with time zone got a naive datetime {value}: its instant is unknown")
    return int((value - EPOCH_UTC) // MICROSECOND)


def _date_to_avro(value: Any) -> int:
    if isinstance(value, str):
        return date_text_to_days(value)
    return int(value.toordinal() - EPOCH_ORDINAL)


def _time_to_avro(value: Any) -> int:
    if isinstance(value, str):
        if value.startswith("24:00:00"):
            return MICROS_PER_DAY
        value = time.fromisoformat(value)
    return int(((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond)


def _text_to_avro(value: Any) -> str:
    """timetz / interval / uuid: their ISO text (``isoformat``, ``to_iso8601`` or ``str``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, time):
        return value.isoformat()
    to_iso = getattr(value, "to_iso8601", None)
    return str(to_iso()) if to_iso is not None else str(value)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Decimal):
        return orjson.Fragment(str(obj))  # capture's JsonNumber: every digit, a bare number
    raise TypeError(f"type {type(obj).__name__} is not a JSON value")


def _big_ints(value: Any) -> Any:
    if type(value) is int and not -(2**63) <= value < 2**64:
        return orjson.Fragment(str(value))
    if isinstance(value, dict):
        return {k: _big_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_big_ints(v) for v in value]
    return value


def _json_to_avro(value: Any) -> str:
    if type(value) is JsonText:
        return value.text  # capture's json/jsonb values: their text, as the server printed it
    try:
        return orjson.dumps(value, default=_json_default).decode()
    except TypeError as e:
        if "64-bit" not in str(e):
            raise
    return orjson.dumps(_big_ints(value), default=_json_default).decode()


def _bytes_to_avro(value: Any) -> bytes:
    return bytes(value)


def _same(value: Any) -> Any:
    return value


def _float_to_avro(value: Any) -> float:
    return float(value)


_TO_AVRO: dict[Kind, Converter] = {
    Kind.INT: _same, Kind.LONG: _same, Kind.BOOLEAN: _same, Kind.STRING: _same,
    Kind.FLOAT: _float_to_avro, Kind.DOUBLE: _float_to_avro,
    Kind.VARIABLE_DECIMAL: _variable_decimal_to_avro, Kind.TIMESTAMP: _timestamp_to_avro,
    Kind.TIMESTAMPTZ: _timestamptz_to_avro, Kind.DATE: _date_to_avro, Kind.TIME: _time_to_avro,
    Kind.TIMETZ: _text_to_avro, Kind.INTERVAL: _text_to_avro, Kind.UUID: _text_to_avro,
    Kind.JSON: _json_to_avro, Kind.BYTES: _bytes_to_avro,
}  # fmt: skip


# ---------------------------------------------------------------------------- to JSON


def _decimal_json(scale: int) -> Converter:
    def convert(value: Any) -> str:
        if isinstance(value, str):  # the DecimalSpecial branch
            return _SPECIAL_JSON[value]
        if isinstance(value, Decimal):
            return format(value, "f")
        unscaled = int.from_bytes(value, "big", signed=True)
        return format(Decimal(f"{unscaled}E-{scale}"), "f")

    return convert


def _variable_decimal_json(value: Any) -> str:
    if value["special"] is not None:
        return _SPECIAL_JSON[value["special"]]
    unscaled = int.from_bytes(value["value"], "big", signed=True)
    return format(Decimal(f"{unscaled}E{-int(value['scale'])}"), "f")


def _nonfinite_json(value: float) -> Any:
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _float4_json(value: Any) -> Any:
    """The shortest decimal that round-trips in float4 (what Postgres prints for real), as a float."""
    if not math.isfinite(value):
        return _nonfinite_json(value)
    return float(str(np.float32(value)))  # numpy prints the shortest round-tripping digits


def _double_json(value: Any) -> Any:
    return value if math.isfinite(value) else _nonfinite_json(value)


def _timestamp_json(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    try:
        return (EPOCH_NAIVE + timedelta(microseconds=value)).isoformat()
    except OverflowError:
        return micros_to_timestamp_text(value, utc=False)


def _timestamptz_json(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    try:
        return (EPOCH_UTC + timedelta(microseconds=value)).isoformat()
    except OverflowError:
        return micros_to_timestamp_text(value, utc=True)


def _date_json(value: Any) -> str:
    if isinstance(value, date):
        return value.isoformat()
    if 1 - EPOCH_ORDINAL <= value <= date.max.toordinal() - EPOCH_ORDINAL:
        return date.fromordinal(value + EPOCH_ORDINAL).isoformat()
    return days_to_date_text(value)


def _time_json(value: Any) -> str:
    if isinstance(value, time):
        return value.isoformat()
    if value == MICROS_PER_DAY:
        return "24:00:00"
    seconds, micros = divmod(value, 1_000_000)
    return time(seconds // 3600, seconds // 60 % 60, seconds % 60, micros).isoformat()


def _uuid_json(value: Any) -> str:
    return str(value)


def _json_json(value: Any) -> Any:
    return orjson.Fragment(value)


def _bytes_json(value: Any) -> str:
    return base64.b64encode(value).decode("ascii")


_TO_JSON: dict[Kind, Converter] = {
    Kind.INT: _same, Kind.LONG: _same, Kind.BOOLEAN: _same, Kind.STRING: _same,
    Kind.FLOAT: _float4_json, Kind.DOUBLE: _double_json, Kind.VARIABLE_DECIMAL: _variable_decimal_json,
    Kind.TIMESTAMP: _timestamp_json, Kind.TIMESTAMPTZ: _timestamptz_json, Kind.DATE: _date_json,
    Kind.TIME: _time_json, Kind.TIMETZ: _same, Kind.INTERVAL: _same, Kind.UUID: _uuid_json,
    Kind.JSON: _json_json, Kind.BYTES: _bytes_json,
}  # fmt: skip


# ---------------------------------------------------------------------------- per column


def _nullable(convert: Converter) -> Converter:
    return lambda value: None if value is None else convert(value)


def _array_to_avro(convert: Converter, max_depth: int | None = None) -> Converter:
    """A nested list (any depth, items may be None) → ``{"dims": [...], "items": [...]}`` (row-major).

    ``max_depth``: for element types whose values may themselves be lists (json/jsonb), the
    nesting that is the array's (its declared dimensions); deeper lists are elements.
    """
    item = _nullable(convert)

    def flatten(value: Any) -> dict[str, Any]:
        if not isinstance(value, list):
            raise ValueConversionError(f"expected a list, got {type(value).__name__}")
        dims: list[int] = []
        level: Any = value
        while isinstance(level, list) and (max_depth is None or len(dims) < max_depth):
            dims.append(len(level))
            if not level:
                break
            level = level[0]
        if dims == [0]:
            return {"dims": [], "items": []}
        items: list[Any] = []
        _flatten(value, dims, 0, item, items, max_depth is not None)
        return {"dims": dims, "items": items}

    return flatten


def _flatten(
    value: list[Any], dims: list[int], depth: int, item: Converter, out: list[Any], lists_are_elements: bool = False
) -> None:
    if len(value) != dims[depth]:
        raise ValueConversionError(f"array is not rectangular: {len(value)} elements where {dims[depth]} were")
    if depth == len(dims) - 1:
        for v in value:
            if isinstance(v, list) and not lists_are_elements:
                raise ValueConversionError("array is not rectangular: a sub-array where an element was")
            out.append(item(v))
        return
    for v in value:
        if not isinstance(v, list):
            raise ValueConversionError("array is not rectangular: an element where a sub-array was")
        _flatten(v, dims, depth + 1, item, out, lists_are_elements)


def _array_from_avro(convert: Converter) -> Converter:
    """``{"dims", "items"}`` → the nested lists capture writes (items converted, None kept)."""
    item = _nullable(convert)

    def nest(value: Any) -> list[Any]:
        dims, flat = list(value["dims"]), [item(v) for v in value["items"]]
        if not dims:
            return []
        for size in reversed(dims[1:]):
            flat = [flat[i : i + size] for i in range(0, len(flat), size)]
        return flat

    return nest


def to_avro_converter(ctype: ColumnType) -> Converter:
    """Python value (capture's) → Avro datum, for one non-null value of ``ctype``."""
    if ctype.kind is Kind.DECIMAL:
        assert ctype.precision is not None and ctype.scale is not None
        base = _decimal_to_avro(ctype.precision, ctype.scale)
    else:
        base = _TO_AVRO[ctype.kind]
    if not ctype.dimensions:
        return base
    return _array_to_avro(base, ctype.dimensions if ctype.kind is Kind.JSON else None)


def to_json_converter(ctype: ColumnType) -> Converter:
    """Avro datum → the JSON form capture writes, for one non-null value of ``ctype``."""
    base = _decimal_json(ctype.scale or 0) if ctype.kind is Kind.DECIMAL else _TO_JSON[ctype.kind]
    return _array_from_avro(base) if ctype.dimensions else base


def _json_default_form(datum: Any) -> Any:
    """An Avro datum in the JSON form of schema defaults: bytes as one char per byte (U+0000–U+00FF)."""
    if isinstance(datum, bytes):
        return datum.decode("latin-1")
    if isinstance(datum, dict):
        return {k: _json_default_form(v) for k, v in datum.items()}
    if isinstance(datum, list):
        return [_json_default_form(v) for v in datum]
    return datum


def avro_default_json(ctype: ColumnType, value: Any) -> str | None:
    """The Avro field default (JSON text) for a capture value of ``ctype``; None if Avro cannot say it.

    Arrays with non-null elements cannot be a default under ``["null", T]`` items (a union's
    default is its first branch), nor can ``numeric(p,s)`` NaN; and bytes-based values
    (bytea, numeric) are left out because fastavro hands such defaults to readers as the
    raw JSON string instead of bytes or a Decimal. Those columns default to null.
    """
    if value is None or ctype.kind in (Kind.BYTES, Kind.DECIMAL, Kind.VARIABLE_DECIMAL):
        return None
    if ctype.dimensions and any(v is not None for v in _array_to_avro(_same)(value)["items"]):
        return None
    try:
        datum = to_avro_converter(ctype)(value)
    except (ValueError, TypeError, AttributeError):
        return None
    return json.dumps(_json_default_form(datum), sort_keys=True)


class RowCodec:
    """Row images of one table: ``{column: capture value}`` ↔ Avro row datum ↔ JSON form.

    >>> codec = RowCodec([PgColumn("id", "bigint", 20, True), PgColumn("amount", "numeric(12,2)", 1700)])
    >>> codec.to_json(codec.to_avro({"id": 1, "amount": Decimal("9.50")}))
    {'id': 1, 'amount': '9.50'}
    """

    def __init__(self, columns: Sequence[PgColumn]) -> None:
        self.columns = list(columns)
        types = [c.column_type for c in self.columns]
        self._to_avro = [(c.name, to_avro_converter(t)) for c, t in zip(self.columns, types, strict=True)]
        self._to_json = [(c.name, to_json_converter(t)) for c, t in zip(self.columns, types, strict=True)]

    def to_avro(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The Avro datum of a row image; a column missing from ``row`` is NULL."""
        out: dict[str, Any] = {}
        for name, convert in self._to_avro:
            value = row.get(name)
            if value is None:
                out[name] = None
                continue
            try:
                out[name] = convert(value)
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueConversionError(f"column {name!r}: {e}") from e
        return out

    def to_json(self, datum: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON form of a decoded row datum (``orjson.dumps`` gives capture's bytes)."""
        out: dict[str, Any] = {}
        for name, convert in self._to_json:
            value = datum.get(name)
            out[name] = None if value is None else convert(value)
        return out

    def envelope_to_avro(
        self,
        *,
        op: str,
        before: Mapping[str, Any] | None,
        after: Mapping[str, Any] | None,
        source: Mapping[str, Any],
        ts_ms: int | None,
        transaction: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The datum of a change event (the ``.Envelope`` schema of :func:`schemas.pgavro.table_schemas`)."""
        return {
            "before": None if before is None else self.to_avro(before),
            "after": None if after is None else self.to_avro(after),
            "source": source,
            "op": op,
            "ts_ms": ts_ms,
            "transaction": transaction,
        }

    def envelope_to_json(self, datum: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON form of a decoded change event: the dict capture's JSON envelope holds."""
        return {
            "before": None if datum["before"] is None else self.to_json(datum["before"]),
            "after": None if datum["after"] is None else self.to_json(datum["after"]),
            "source": datum["source"],
            "op": datum["op"],
            "ts_ms": datum["ts_ms"],
            "transaction": datum["transaction"],
        }
