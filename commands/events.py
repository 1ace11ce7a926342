"""Domain events: frozen dataclasses with a type name and a schema version, and the
registry that encodes them for the ``events`` table and decodes (upcasting) on read.

An event class names itself and its current schema::

    @registry.register
    @dataclass(frozen=True, slots=True)
    class SeatReserved(Event):
        event_type: ClassVar[str] = "SeatReserved"
        schema_version: ClassVar[int] = 1
        reservation_id: str
        seat: str

When a payload's shape changes, raise ``schema_version`` and register an upcaster from
each old version to the next one: a pure ``dict -> dict`` on the stored payload. Stored
rows are never rewritten (the table is append-only); upcasting happens on every read,
old version by old version, until the class's current version is reached.

Thread safety: register everything at import time; afterwards a registry is read-only
and may be shared by threads and processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from commands.codec import from_json, to_json
from commands.errors import UnknownEventError

E = TypeVar("E", bound="type[Event]")
Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]


class Event:
    """Base of domain events. Subclasses are frozen dataclasses that set both class variables."""

    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event as stored in a row of ``events``."""

    event_type: str  # the class's event_type
    schema_version: int  # the class's schema_version when it was written
    payload: Payload  # the dataclass fields as JSON values


class EventRegistry:
    """Event classes by type name, and the upcasters from each old schema version."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Event]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, cls: E) -> E:
        """Class decorator: make ``cls`` decodable under its ``event_type``."""
        name = getattr(cls, "event_type", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} must set the class variable event_type")
        if cls.schema_version < 1:
            raise TypeError(f"{cls.__name__}.schema_version must be ≥ 1")
        if name in self._classes and self._classes[name] is not cls:
            raise TypeError(f"event type {name!r} is already registered by {self._classes[name].__name__}")
        self._classes[name] = cls
        return cls

    def upcaster(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator: ``fn(payload at from_version) -> payload at from_version + 1``."""

        def add(fn: Upcaster) -> Upcaster:
            key = (event_type, from_version)
            if key in self._upcasters:
                raise TypeError(f"an upcaster for {event_type} v{from_version} is already registered")
            self._upcasters[key] = fn
            return fn

        return add

    def event_class(self, event_type: str) -> type[Event]:
        try:
            return self._classes[event_type]
        except KeyError:
            raise UnknownEventError(f"unknown event type {event_type!r}: register its class") from None

    def encode(self, event: Event) -> EncodedEvent:
        """The stored form of ``event`` (its current schema version)."""
        cls = type(event)
        if self._classes.get(cls.event_type) is not cls:
            raise UnknownEventError(f"{cls.__name__} is not registered under {cls.event_type!r}")
        payload = to_json(event)
        assert isinstance(payload, dict)
        return EncodedEvent(cls.event_type, cls.schema_version, payload)

    def upcast(self, event_type: str, schema_version: int, payload: Payload) -> Payload:
        """``payload`` brought from ``schema_version`` to the class's current version."""
        current = self.event_class(event_type).schema_version
        if schema_version > current:
            raise UnknownEventError(
                f"{event_type} v{schema_version} is newer than this code (v{current}): deploy the newer code"
            )
        while schema_version < current:
            try:
                step = self._upcasters[(event_type, schema_version)]
            except KeyError:
                raise UnknownEventError(
                    f"no upcaster from {event_type} v{schema_version} to v{schema_version + 1}"
                ) from None
            payload = step(dict(payload))
            schema_version += 1
        return payload

    def decode(self, event_type: str, schema_version: int, payload: Payload) -> Event:
        """The event class instance for a stored row, upcast to the current schema."""
        cls = self.event_class(event_type)
        return from_json(cls, self.upcast(event_type, schema_version, payload))
