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
from typing import Any, TypeVar, cast

from commands.errors import CodecError

T = TypeVar("T")
JsonValue = Any  # what orjson/json can dump: dict, list, str, int, float, bool, None


def to_json(value: Any) -> JsonValue:
    """A JSON-ready form of ``value`` (dataclasses become dicts of their fields)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, frozenset | set):
        return sorted((to_json(v) for v in value), key=_sort_key)
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    raise CodecError(f"cannot encode {type(value).__name__} value {value!r} as JSON")


def _sort_key(v: Any) -> tuple[str, str]:
    return (type(v).__name__, repr(v))


def from_json(tp: type[T], data: JsonValue) -> T:
    """Decode ``data`` (as produced by :func:`to_json`) into an instance of ``tp``."""
    return cast(T, _decode(tp, data, tp.__name__ if isinstance(tp, type) else str(tp)))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(tp: Any, data: JsonValue, where: str) -> Any:
    if tp is Any:
        return data
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return _decode_union(tp, data, where)
    if data is None:
        if tp is type(None):
            return None
        raise CodecError(f"{where}: null where {_name(tp)} is required")
    if origin is not None:
        return _decode_generic(tp, origin, data, where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError as e:
            raise CodecError(f"{where}: {data!r} is not a {tp.__name__}") from e
    if tp is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if tp in (str, int, bool) and type(data) is tp:
        return data
    raise CodecError(f"{where}: expected {_name(tp)}, got {type(data).__name__} {data!r}")


def _decode_union(tp: Any, data: JsonValue, where: str) -> Any:
    args = typing.get_args(tp)
    if data is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _decode(arg, data, where)
        except CodecError as e:
            errors.append(str(e))
    raise CodecError(f"{where}: {data!r} fits none of {_name(tp)} ({'; '.join(errors)})")


def _decode_generic(tp: Any, origin: Any, data: JsonValue, where: str) -> Any:
    args = typing.get_args(tp)
    if origin in (tuple, list, frozenset, set):
        if not isinstance(data, list):
            raise CodecError(f"{where}: expected a list for {_name(tp)}, got {type(data).__name__}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(data):
                raise CodecError(f"{where}: expected {len(args)} items for {_name(tp)}, got {len(data)}")
            return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
        items = [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data)]
        return origin(items)
    if origin is dict:
        if not isinstance(data, dict):
            raise CodecError(f"{where}: expected an object for {_name(tp)}, got {type(data).__name__}")
        key_type, value_type = args
        return {_decode(key_type, k, where): _decode(value_type, v, f"{where}.{k}") for k, v in data.items()}
    raise CodecError(f"{where}: unsupported field type {_name(tp)}")


def _decode_dataclass(cls: type, data: JsonValue, where: str) -> Any:
    if not isinstance(data, dict):
        raise CodecError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - set(fields)
    if unknown:
        raise CodecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _decode(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise CodecError(f"{where}: missing field {name!r} of {cls.__name__}")
    return cls(**kwargs)


def _name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp)
