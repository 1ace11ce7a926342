"""Frozen dataclasses ↔ JSON-ready values, driven by the dataclass type hints.

Events, commands and aggregate states are plain frozen dataclasses so that the same
values cross every boundary: a jsonb column, an HTTP body, a Spark row. Supported
field types: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Enum`` (by value),
``Decimal``, ``datetime``, ``date``, ``UUID``, nested dataclasses, ``tuple[X, ...]``,
``frozenset[X]`` (stored as a sorted list), ``list[X]``, ``dict[K, X]`` (``K``: ``str``,
or one of the four value types below, as its string), ``X | None`` and ``Any`` (passed
through).

The value types are JSON strings (as Pydantic, Marten and Axon write them), so that
they survive a jsonb column, orjson and Spark exactly:

- ``Decimal``: ``str(d)``, exact and never a float, scale kept: ``Decimal("10.50")`` →
  ``"10.50"``, ``Decimal("1E+2")`` → ``"1E+2"``. Decoding takes only such a string
  (``[+-]digits[.digits][E[+-]digits]``; a JSON number, even an integer, is refused, as
  are ``"NaN"``/``"Infinity"``); encoding refuses NaN and infinities.
- ``datetime``: ISO 8601 (``isoformat()``): ``"2024-05-01T12:30:00.250000+02:00"``. An
  aware datetime keeps its UTC offset (a ``ZoneInfo`` comes back as that fixed offset:
  the same instant, equal); a naive one is written without an offset and comes back
  naive (aware and naive datetimes do not compare: use aware ones for instants).
  Decoding takes ``YYYY-MM-DD[T ]HH:MM…`` with an optional offset or ``Z``; a bare date
  is refused (it is a ``date``).
- ``date``: ``"YYYY-MM-DD"``.
- ``UUID``: the canonical lowercase hyphenated form, ``"12345678-1234-5678-1234-567812345678"``
  (decoding accepts what ``uuid.UUID(str)`` does).

``from_json(T, to_json(x)) == x`` for every supported ``x``; a missing field takes its
dataclass default, an unknown key is an error (it would be data loss on the next write).
Every error is a :class:`CodecError` naming the field path and the value
(``Account.balance: expected Decimal …, got float 10.5``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import functools
import re
import types
import typing
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from commands.errors import CodecError

T = TypeVar("T")
JsonValue = Any  # what orjson/json can dump: dict, list, str, int, float, bool, None


_SCALARS = frozenset({str, int, float, bool, type(None)})


def to_json(value: Any) -> JsonValue:
    """A JSON-ready form of ``value`` (dataclasses become dicts of their fields).

    Raises CodecError naming the path of a value it cannot encode (``Account.balance: …``).
    """
    cls: Any = type(value)
    if cls in _SCALARS:
        return value
    names = _field_names(cls) if hasattr(cls, "__dataclass_fields__") else None
    if names is not None:
        try:  # free unless raised (3.11); the path is worked out only then
            return {name: to_json(getattr(value, name)) for name in names}
        except CodecError:
            raise _located(value) from None
    encode_value = _VALUE_ENCODERS.get(cls)
    if encode_value is not None:
        return encode_value(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value  # subclasses of the scalars (IntEnum members are enums: handled next)
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    try:
        if isinstance(value, frozenset | set):
            return sorted((to_json(v) for v in value), key=_sort_key)
        if isinstance(value, tuple | list):
            return [to_json(v) for v in value]
        if isinstance(value, dict):
            return {k if type(k) is str else _key(k): to_json(v) for k, v in value.items()}
    except CodecError:
        raise _located(value) from None
    for base, encode_base in _VALUE_ENCODERS.items():  # subclasses (datetime before date)
        if isinstance(value, base):
            return encode_base(value)
    raise CodecError(f"cannot encode {type(value).__name__} value {value!r} as JSON")


def _key(key: Any) -> str:
    """A dict key's JSON form: a value type's string (a ``datetime`` in ISO 8601), else ``str(key)``."""
    for base, encode_base in _VALUE_ENCODERS.items():
        if isinstance(key, base):
            return cast(str, encode_base(key))
    return str(key)


def _encode_decimal(value: decimal.Decimal) -> str:
    if not value.is_finite():
        raise CodecError(f"cannot encode Decimal value {value!r} as JSON: NaN and infinities are refused")
    return decimal.Decimal.__str__(value)  # exact, scale kept ('10.50', '1E+2')


# Exact classes first (one dict lookup); the order matters for subclasses: datetime is a date.
_VALUE_ENCODERS: dict[type, Callable[[Any], JsonValue]] = {
    decimal.Decimal: _encode_decimal,
    dt.datetime: dt.datetime.isoformat,
    dt.date: dt.date.isoformat,
    uuid.UUID: uuid.UUID.__str__,
}


def _located(value: Any, where: str | None = None) -> CodecError:
    """The error of encoding the container ``value`` (a dataclass, list, tuple, set or dict),
    naming the path of the first value inside it that cannot be encoded. Only runs once
    encoding failed: the fast path keeps no paths."""
    cls: Any = type(value)
    where = _name(cls) if where is None else where
    children: list[tuple[str, Any]] = []
    if hasattr(cls, "__dataclass_fields__"):
        children = [(f"{where}.{name}", getattr(value, name)) for name in _field_names(cls)]
    elif isinstance(value, dict):
        for k in value:
            if type(k) is not str:
                try:
                    _key(k)
                except CodecError as e:
                    return CodecError(f"{where} (a key): {e}")
        children = [(f"{where}.{k}", v) for k, v in value.items()]
    elif isinstance(value, tuple | list):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, frozenset | set):
        children = [(f"{where}[…]", v) for v in value]
    for path, child in children:
        try:
            to_json(child)
        except CodecError as e:
            if _is_container(child):
                return _located(child, path)
            return CodecError(f"{path}: {e}")
    return CodecError(f"{where}: cannot encode {type(value).__name__} value as JSON")  # not reached


def _is_container(value: Any) -> bool:
    """Whether :func:`to_json` encodes ``value`` item by item (and locates its errors itself)."""
    if hasattr(type(value), "__dataclass_fields__"):
        return True
    if isinstance(value, str | int | float | bool | enum.Enum):
        return False
    return isinstance(value, frozenset | set | tuple | list | dict)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (``dataclasses.fields`` rebuilds its tuple on every call)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _sort_key(v: Any) -> tuple[str, str]:
    return (type(v).__name__, repr(v))


def from_json(tp: type[T], data: JsonValue) -> T:
    """Decode ``data`` (as produced by :func:`to_json`) into an instance of ``tp``."""
    return cast(T, _decoder(cast(Any, tp))(data, _name(tp)))


Decoder = Callable[[JsonValue, str], Any]


@functools.cache
def _decoder(tp: Any) -> Decoder:
    """A decoding function for ``tp``, built once per type (folds decode every stored event)."""
    if tp is Any:
        return lambda data, where: data
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return _union_decoder(tp)
    if origin is not None:
        return _generic_decoder(tp, origin)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if tp is float:
        return _float
    if tp in _VALUE_DECODERS:
        return _VALUE_DECODERS[tp]
    if tp in (str, int, bool):
        return _exact(tp)
    if tp is type(None):
        return _none
    raise CodecError(f"unsupported field type {_name(tp)}")


def _mismatch(tp: Any, data: JsonValue, where: str) -> CodecError:
    if data is None:
        return CodecError(f"{where}: null where {_name(tp)} is required")
    return CodecError(f"{where}: expected {_name(tp)}, got {type(data).__name__} {data!r}")


def _exact(tp: type) -> Decoder:
    def decode(data: JsonValue, where: str) -> Any:
        if type(data) is tp:
            return data
        raise _mismatch(tp, data, where)

    return decode


def _float(data: JsonValue, where: str) -> float:
    if isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    raise _mismatch(float, data, where)


def _none(data: JsonValue, where: str) -> None:
    if data is not None:
        raise _mismatch(type(None), data, where)


# The value types: a JSON string of one shape each (the module docstring); anything else is refused.
_DECIMAL_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_DATETIME_TEXT = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}")  # a prefix: the time and offset follow
_DATE_TEXT = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _refused(tp: type, form: str, data: JsonValue, where: str) -> CodecError:
    if data is None:
        return _mismatch(tp, data, where)
    return CodecError(f"{where}: expected {tp.__name__} as {form}, got {type(data).__name__} {data!r}")


def _decimal(data: JsonValue, where: str) -> decimal.Decimal:
    if type(data) is str and _DECIMAL_TEXT.fullmatch(data):
        try:
            return decimal.Decimal(data)
        except ArithmeticError:  # an exponent beyond the decimal module's limits
            pass
    raise _refused(decimal.Decimal, "a string of a finite decimal number such as '10.50'", data, where)


def _datetime(data: JsonValue, where: str) -> dt.datetime:
    if type(data) is str and _DATETIME_TEXT.match(data):
        try:
            return dt.datetime.fromisoformat(data)
        except ValueError:
            pass
    raise _refused(dt.datetime, "an ISO 8601 string such as '2024-05-01T12:30:00+00:00'", data, where)


def _date(data: JsonValue, where: str) -> dt.date:
    if type(data) is str and _DATE_TEXT.fullmatch(data):
        try:
            return dt.date.fromisoformat(data)
        except ValueError:
            pass
    raise _refused(dt.date, "an ISO 8601 date string such as '2024-05-01'", data, where)


def _uuid(data: JsonValue, where: str) -> uuid.UUID:
    if type(data) is str:
        try:
            return uuid.UUID(data)
        except ValueError:
            pass
    raise _refused(uuid.UUID, "a string such as '12345678-1234-5678-1234-567812345678'", data, where)


_VALUE_DECODERS: dict[type, Decoder] = {
    decimal.Decimal: _decimal,
    dt.datetime: _datetime,
    dt.date: _date,
    uuid.UUID: _uuid,
}


def _enum_decoder(tp: type[enum.Enum]) -> Decoder:
    def decode(data: JsonValue, where: str) -> Any:
        try:
            return tp(data)
        except ValueError as e:
            raise CodecError(f"{where}: {data!r} is not a {tp.__name__}") from e

    return decode


def _union_decoder(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    optional = type(None) in args
    decoders = [_decoder(a) for a in args if a is not type(None)]
    if optional and len(decoders) == 1:  # ``X | None``: X's own error, without a loop
        only = decoders[0]

        def decode_optional(data: JsonValue, where: str) -> Any:
            return None if data is None else only(data, where)

        return decode_optional

    def decode(data: JsonValue, where: str) -> Any:
        if data is None and optional:
            return None
        errors = []
        for d in decoders:
            try:
                return d(data, where)
            except CodecError as e:
                errors.append(str(e))
        raise CodecError(f"{where}: {data!r} fits none of {_name(tp)} ({'; '.join(errors)})")

    return decode


def _generic_decoder(tp: Any, origin: Any) -> Decoder:
    args = typing.get_args(tp)
    if origin in (tuple, list, frozenset, set):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return _fixed_tuple_decoder(tp, args)
        item = _decoder(args[0])

        def decode_items(data: JsonValue, where: str) -> Any:
            if not isinstance(data, list):
                raise CodecError(f"{where}: expected a list for {_name(tp)}, got {type(data).__name__}")
            return origin(item(v, f"{where}[{i}]") for i, v in enumerate(data))

        return decode_items
    if origin is dict:
        key, value = _decoder(args[0]), _decoder(args[1])

        def decode_dict(data: JsonValue, where: str) -> Any:
            if not isinstance(data, dict):
                raise CodecError(f"{where}: expected an object for {_name(tp)}, got {type(data).__name__}")
            return {key(k, where): value(v, f"{where}.{k}") for k, v in data.items()}

        return decode_dict
    raise CodecError(f"unsupported field type {_name(tp)}")


def _fixed_tuple_decoder(tp: Any, args: tuple[Any, ...]) -> Decoder:
    items = [_decoder(a) for a in args]

    def decode(data: JsonValue, where: str) -> Any:
        if not isinstance(data, list) or len(data) != len(items):
            raise CodecError(f"{where}: expected a list of {len(items)} items for {_name(tp)}, got {data!r}")
        return tuple(d(v, f"{where}[{i}]") for i, (d, v) in enumerate(zip(items, data, strict=True)))

    return decode


def _dataclass_decoder(cls: type) -> Decoder:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = frozenset(f.name for f in fields)
    plan = [
        (f.name, _decoder(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in fields
    ]

    top = cls.__name__  # the usual ``where`` (a top-level decode): its field paths are made once
    top_paths = {name: f"{top}.{name}" for name in names}

    def decode(data: JsonValue, where: str) -> Any:
        if not isinstance(data, dict):
            raise CodecError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
        if not names.issuperset(data):
            unknown = ", ".join(sorted(set(data) - names))
            raise CodecError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
        kwargs: dict[str, Any] = {}
        for name, field_decoder, required in plan:
            if name in data:
                kwargs[name] = field_decoder(data[name], top_paths[name] if where == top else f"{where}.{name}")
            elif required:
                raise CodecError(f"{where}: missing field {name!r} of {cls.__name__}")
        return cls(**kwargs)

    return decode


def _name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp)
