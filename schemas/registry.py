"""The schema registry: subjects, versions and global ids, kept in a log topic.

Confluent Schema Registry's model: a **subject** (``<topic>-key`` / ``<topic>-value``)
has versions 1, 2, … of a schema; every distinct schema has one **global id** (the
same schema under two subjects has one id). Identity is the identity form of
:mod:`schemas.canonical` (Avro parsing canonical form plus logical types, defaults and
custom properties). Registering a schema a subject already has returns that version
(idempotent). A new version must pass the subject's **compatibility level**
(:class:`~schemas.compat.CompatibilityLevel`, default ``BACKWARD``), settable per subject.

Storage: every change is one keyed record appended to a :class:`SchemaStore`; the log
implementation (``eventstore.schema_store``) is the compacted topic ``__schemas`` (1
partition), the Kafka one (``eventstore.kafka.schema_store``) Kafka's ``_schemas``, as
Confluent's registry keeps it (``schemas.rest`` serves a registry over Confluent's REST
API). The state is a function of the last value of each key, so compaction never
changes what a replay yields. Record layout (keys: JSON with sorted keys and no spaces,
so equal keys are equal bytes — the Kafka store writes Confluent's field order instead;
values: JSON)::

    schema   key    {"keytype":"SCHEMA","magic":1,"subject":<str>,"version":<int ≥ 1>}
             value  {"deleted":false,"id":<int ≥ 1>,"schema":<schema JSON text>,
                     "subject":<str>,"version":<int>}
    config   key    {"keytype":"CONFIG","magic":0,"subject":<str> | null}
             value  {"compatibilityLevel":"BACKWARD|…|NONE"}
             null   (tombstone) the subject is back to the registry's level
             (subject null: the registry's own level, which defaults to ``default_level``)

These are Confluent Schema Registry's ``_schemas`` records (its NOOP records, which
its leader writes to find the end of the topic, are skipped silently); a key of another
``keytype`` or ``magic`` (a newer writer) is skipped with a warning.
Invariants a replay checks: one id ↔ one identity form (a second schema claiming a used
id is ignored with an error log; it cannot happen under the lock below), and versions of
a subject are dense from 1.

Crash policy: a registration is visible only once its record is durable in the store
(the log store appends, flushes and fsyncs before returning); a torn tail is truncated
by the log on open, so a crash mid-append leaves the registration absent, never half.
Nothing is written for a rejected (incompatible or invalid) schema.

Concurrency: the state is rebuilt by replaying the store on open, and refreshed (the
records appended since) before every lookup that misses and before every write. Writes
— refresh, check, pick the next id and version, append — run under ``store.locked()``
(the log store: ``fcntl.flock`` on ``<log>/__schemas.lock``; the Kafka store: a
transactional producer that a newer writer fences, see ``eventstore.kafka.schema_store``),
so registries in several processes over one store never hand out one id twice and agree
on every subject. A store whose exclusion is optimistic raises
:class:`~schemas.errors.SchemaStoreConflictError` from ``append`` when another writer
took over meanwhile (nothing written); the write is then redone from the refresh, at
most ``WRITE_ATTEMPTS`` times. :class:`SchemaRegistry` is thread-safe: ``_lock`` (an RLock) guards the state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson

from schemas.canonical import identity_form, parse, schema_json
from schemas.compat import CompatibilityLevel, Incompatibility, check_compatibility
from schemas.errors import IncompatibleSchemaError, SchemaStoreConflictError, UnknownSchemaError

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_KEYTYPE = "SCHEMA"
CONFIG_KEYTYPE = "CONFIG"
NOOP_KEYTYPE = "NOOP"  # Confluent's leader writes these to find the end of the topic: no state
SCHEMA_KEY_MAGIC = 1
CONFIG_KEY_MAGIC = 0
DEFAULT_LEVEL = CompatibilityLevel.BACKWARD
WRITE_ATTEMPTS = 5  # a write redone after SchemaStoreConflictError (another writer took the store over)


class SchemaStore(Protocol):
    """Where the registry keeps its records: an append-only, ordered, keyed sequence.

    ``append`` returns only once the record is durable (and readable by ``read_from``).
    ``read_from(position)`` returns the records from ``position`` on, in append order,
    and the position after them (start with 0). ``locked()`` is an exclusive section
    across every process sharing the store: a lock, or (optimistically) a claim that
    ``append`` checks, raising SchemaStoreConflictError with nothing written when another
    process has claimed the store since.
    """

    def append(self, key: bytes, value: bytes | None) -> None: ...

    def read_from(self, position: int) -> tuple[list[tuple[bytes, bytes | None]], int]: ...

    def locked(self) -> AbstractContextManager[None]: ...


class MemorySchemaStore:
    """A :class:`SchemaStore` in a Python list, for unit tests and throwaway registries. Thread-safe."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []
        self._lock = threading.RLock()

    def append(self, key: bytes, value: bytes | None) -> None:
        with self._lock:
            self.records.append((key, value))

    def read_from(self, position: int) -> tuple[list[tuple[bytes, bytes | None]], int]:
        with self._lock:
            return self.records[position:], len(self.records)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield


@dataclass(frozen=True, slots=True)
class RegisteredSchema:
    """One version of one subject: ``schema`` is the JSON text as first registered."""

    subject: str
    version: int
    id: int
    schema: str


@dataclass(frozen=True, slots=True)
class CompatibilityReport:
    """What :meth:`SchemaRegistry.check` found; ``compatible`` iff ``incompatibilities`` is empty."""

    subject: str
    level: CompatibilityLevel
    compatible: bool
    incompatibilities: list[Incompatibility]
    existing_version: int | None  # the version this exact schema already is, if any


@dataclass(slots=True)
class _State:
    position: int = 0
    by_id: dict[int, str] = field(default_factory=dict)  # id → schema text (first registered)
    id_by_identity: dict[str, int] = field(default_factory=dict)
    versions: dict[str, dict[int, RegisteredSchema]] = field(default_factory=dict)
    levels: dict[str, CompatibilityLevel] = field(default_factory=dict)
    registry_level: CompatibilityLevel | None = None  # the persisted registry-wide level, if set


def schema_key(subject: str, version: int) -> bytes:
    return orjson.dumps(
        {"keytype": SCHEMA_KEYTYPE, "magic": SCHEMA_KEY_MAGIC, "subject": subject, "version": version},
        option=orjson.OPT_SORT_KEYS,
    )


def config_key(subject: str | None) -> bytes:
    """The key of a subject's level; ``None``: of the registry-wide level."""
    return orjson.dumps(
        {"keytype": CONFIG_KEYTYPE, "magic": CONFIG_KEY_MAGIC, "subject": subject}, option=orjson.OPT_SORT_KEYS
    )


def subject_for(topic: str, *, is_key: bool) -> str:
    """Confluent's TopicNameStrategy: ``<topic>-key`` or ``<topic>-value``."""
    return f"{topic}-key" if is_key else f"{topic}-value"


class SchemaRegistry:
    """Subjects, versions and ids over a :class:`SchemaStore`.

    >>> registry = SchemaRegistry(MemorySchemaStore())
    >>> registry.register("orders-value", '{"type": "record", "name": "O", "fields": []}').id
    1
    """

    def __init__(self, store: SchemaStore, *, default_level: CompatibilityLevel = DEFAULT_LEVEL) -> None:
        self.store = store
        self.default_level = default_level
        self._lock = threading.RLock()
        self._state = _State()
        self.refresh()

    # ------------------------------------------------------------------ replay

    def refresh(self) -> None:
        """Apply the records appended to the store since the last refresh (by any process)."""
        with self._lock:
            records, position = self.store.read_from(self._state.position)
            for key, value in records:
                self._apply(key, value)
            self._state.position = position

    def _apply(self, key: bytes, value: bytes | None) -> None:
        try:
            k = orjson.loads(key)
            keytype = k["keytype"]
            if keytype == SCHEMA_KEYTYPE and k.get("magic") == SCHEMA_KEY_MAGIC:
                self._apply_schema(str(k["subject"]), int(k["version"]), value)
            elif keytype == CONFIG_KEYTYPE and k.get("magic") == CONFIG_KEY_MAGIC:
                subject = k.get("subject")
                self._apply_config(None if subject is None else str(subject), value)
            elif keytype == NOOP_KEYTYPE:
                return
            else:
                log.warning("skipping schema-store record of unknown kind: key %r", key[:120])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("skipping unreadable schema-store record %r: %s", key[:120], e)

    def _apply_schema(self, subject: str, version: int, value: bytes | None) -> None:
        state = self._state
        if value is None:
            state.versions.get(subject, {}).pop(version, None)
            return
        body = orjson.loads(value)
        if body.get("deleted"):
            state.versions.get(subject, {}).pop(version, None)
            return
        schema_id, text = int(body["id"]), str(body["schema"])
        identity = identity_form(text)
        known = state.by_id.get(schema_id)
        if known is not None and identity_form(known) != identity:
            log.error("schema-store record %s v%d claims id %d, which is another schema: ignored",
                      subject, version, schema_id)  # fmt: skip
            return
        state.by_id.setdefault(schema_id, text)
        state.id_by_identity.setdefault(identity, schema_id)
        state.versions.setdefault(subject, {})[version] = RegisteredSchema(
            subject, version, schema_id, state.by_id[schema_id]
        )

    def _apply_config(self, subject: str | None, value: bytes | None) -> None:
        level = None if value is None else CompatibilityLevel.parse(str(orjson.loads(value)["compatibilityLevel"]))
        if subject is None:
            self._state.registry_level = level
        elif level is None:
            self._state.levels.pop(subject, None)
        else:
            self._state.levels[subject] = level

    # ------------------------------------------------------------------ reads

    def subjects(self) -> list[str]:
        """Every subject with at least one version, sorted."""
        self.refresh()
        with self._lock:
            return sorted(s for s, versions in self._state.versions.items() if versions)

    def versions(self, subject: str) -> list[int]:
        self.refresh()
        with self._lock:
            return sorted(self._state.versions.get(subject, {}))

    def latest(self, subject: str) -> RegisteredSchema:
        """The highest version of ``subject``; UnknownSchemaError if it has none."""
        self.refresh()
        with self._lock:
            versions = self._state.versions.get(subject)
            if not versions:
                raise UnknownSchemaError(f"subject {subject!r} not found")
            return versions[max(versions)]

    def get_version(self, subject: str, version: int) -> RegisteredSchema:
        self.refresh()
        with self._lock:
            found = self._state.versions.get(subject, {}).get(version)
        if found is None:
            raise UnknownSchemaError(f"subject {subject!r} has no version {version}")
        return found

    def schema_by_id(self, schema_id: int) -> str:
        """The schema text registered under ``schema_id``; UnknownSchemaError if none."""
        with self._lock:
            text = self._state.by_id.get(schema_id)
        if text is None:
            self.refresh()  # another process may have registered it
            with self._lock:
                text = self._state.by_id.get(schema_id)
        if text is None:
            raise UnknownSchemaError(f"schema id {schema_id} not found")
        return text

    def lookup(self, subject: str, schema: str | dict[str, Any]) -> RegisteredSchema | None:
        """The version of ``subject`` that is this schema (by identity form), or None."""
        identity = identity_form(schema)
        self.refresh()
        with self._lock:
            return self._find(subject, identity)

    def _find(self, subject: str, identity: str) -> RegisteredSchema | None:
        schema_id = self._state.id_by_identity.get(identity)
        if schema_id is None:
            return None
        for registered in self._state.versions.get(subject, {}).values():
            if registered.id == schema_id:
                return registered
        return None

    def compatibility(self, subject: str | None) -> CompatibilityLevel:
        """The level in force for ``subject`` (its own setting, else the registry's); None: the registry's."""
        self.refresh()
        with self._lock:
            return self._level(subject)

    def configured_compatibility(self, subject: str | None) -> CompatibilityLevel | None:
        """``subject``'s own setting (None: the registry-wide setting), or None where nothing is set."""
        self.refresh()
        with self._lock:
            return self._state.registry_level if subject is None else self._state.levels.get(subject)

    def _level(self, subject: str | None) -> CompatibilityLevel:
        state = self._state
        registry_level = state.registry_level or self.default_level
        return registry_level if subject is None else state.levels.get(subject, registry_level)

    def check(self, subject: str, schema: str | dict[str, Any]) -> CompatibilityReport:
        """Would ``schema`` be accepted as the next version of ``subject``? Writes nothing."""
        identity = identity_form(schema)
        self.refresh()
        with self._lock:
            return self._report(subject, schema, identity)

    def _report(self, subject: str, schema: str | dict[str, Any], identity: str) -> CompatibilityReport:
        level = self._level(subject)
        existing = self._find(subject, identity)
        if existing is not None:
            return CompatibilityReport(subject, level, True, [], existing.version)
        versions = self._state.versions.get(subject, {})
        previous = [parse(versions[v].schema) for v in sorted(versions)]
        found = check_compatibility(level, parse(schema), previous)
        return CompatibilityReport(subject, level, not found, found, None)

    # ------------------------------------------------------------------ writes

    def register(self, subject: str, schema: str | dict[str, Any]) -> RegisteredSchema:
        """Register ``schema`` under ``subject``: its id and version, new or existing.

        Raises SchemaParseError for an invalid schema and IncompatibleSchemaError (naming
        each field and rule) when the subject's level refuses it; nothing is written then.
        """
        text = _schema_text(schema)
        identity = identity_form(text)

        def write() -> RegisteredSchema:
            self.refresh()
            report = self._report(subject, text, identity)
            if report.existing_version is not None:
                return self._state.versions[subject][report.existing_version]
            if not report.compatible:
                raise IncompatibleSchemaError(subject, report.level.value, report.incompatibilities)
            schema_id = self._state.id_by_identity.get(identity)
            if schema_id is None:
                schema_id = max(self._state.by_id, default=0) + 1
            version = max(self._state.versions.get(subject, {}), default=0) + 1
            value = {"deleted": False, "id": schema_id, "schema": text, "subject": subject, "version": version}
            self.store.append(schema_key(subject, version), orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
            self.refresh()
            return self._state.versions[subject][version]

        return self._exclusively(write)

    def set_compatibility(self, subject: str | None, level: CompatibilityLevel | None) -> None:
        """Set ``subject``'s level (persisted); None returns it to the registry's level.

        ``subject`` None sets the registry-wide level (what subjects without their own
        setting use); ``level`` None then returns it to ``default_level``.
        """
        value = None if level is None else orjson.dumps({"compatibilityLevel": level.value})

        def write() -> None:
            self.store.append(config_key(subject), value)
            self.refresh()

        self._exclusively(write)

    def _exclusively(self, write: Callable[[], T]) -> T:
        """Run ``write`` inside the store's exclusive section; redo it when another writer took the store over."""
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                with self._lock, self.store.locked():
                    return write()
            except SchemaStoreConflictError as e:
                if attempt == WRITE_ATTEMPTS:
                    raise
                log.info("schema registry: another writer took the store over (%s); writing again", e)
        raise AssertionError("unreachable")


def _schema_text(schema: str | dict[str, Any]) -> str:
    """The text to store: a given text as is (once it parses), JSON values compactly."""
    parse(schema)  # validates
    if isinstance(schema, str):
        return schema
    return orjson.dumps(schema_json(schema)).decode()
