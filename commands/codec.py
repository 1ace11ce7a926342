"""Frozen dataclasses ↔ JSON-ready values, driven by the dataclass type hints.

Events, commands and aggregate states are plain frozen dataclasses so that the same
values cross every boundary: a jsonb column, an HTTP body, a Spark row. Supported
field types: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Enum`` (by value),
nested dataclasses, ``tuple[X, ...]``, ``frozenset[X]`` (stored as a sorted list),
``list[X]``, ``dict[str, X]``, ``X | None`` and ``Any`` (passed through).

``from_json(T, to_json(x)) == x`` for every supported ``x``; a missing field takes its
dataclass default, an unknown key is an error (it would be data loss on the next write).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar, cast

from commands.errors import CodecError

T = TypeVar("T")
JsonValue = Any  # what orjson/json can dump: dict, list, str, int, float, bool, None


_SCALARS = frozenset({str, int, float, bool, type(None)})


def to_json(value: Any) -> JsonValue:
    """A JSON-ready form of ``value`` (dataclasses become dicts of their fields)."""
    cls: Any = type(value)
    if cls in _SCALARS:
        return value
    names = _field_names(cls) if hasattr(cls, "__dataclass_fields__") else None
    if names is not None:
        return {name: to_json(getattr(value, name)) for name in names}
    if value is None or isinstance(value, str | int | float | bool):
        return value  # subclasses of the scalars (IntEnum members are enums: handled next)
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if isinstance(value, frozenset | set):
        return sorted((to_json(v) for v in value), key=_sort_key)
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    raise CodecError(f"cannot encode {type(value).__name__} value {value!r} as JSON")


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
