"""One connector's ``tideline_native.Core``, and what it holds, with one owner.

**Enums.** The core is made with the plugin whose payloads it reads and the value format it writes, as
members of the extension's own enums (``tideline_native.Plugin``, ``tideline_native.ValueFormat``; a
string is a TypeError there). :func:`core_plugin` and :func:`core_value_format` are the one place where
capture's enums (capture.messages.Plugin, capture.config.ValueFormat) become those: a member whose
capabilities say the native core does not take it, or that has no counterpart (a plugin added to capture
but not to native/src/lib.rs), raises :class:`~capture.config.NativeUnavailableError` naming it — it is
never read as another one. mypy holds the matches exhaustive (a member left out is a type error), and
tests/capture/test_native_boundary.py holds each member's capability to its mapping.

**Registrations.** The core keeps, in Rust, the tables it may handle (by id and by name), each one's Avro
layout, and (pgoutput) the Relation messages it decodes row messages with. The Python side must know
what the core holds — to give it a table or a relation once and again only when it changed, to find a run's
tables and topics by id, to forget what the decoder or the catalog replaced. capture/native.py kept that
knowledge in three caches of its own, each updated by hand next to the call that changed the core's: the
registered tables (``_ids`` with ``_tables`` and ``_topics`` by id), the schema ids each Avro layout was
read from (``_schema_ids``), and the relations given (``_relations``). They could drift, and one path did: a
table unregistered because the stream was at another shape than the catalog lost its relations in the core
(``unregister_table`` drops them) but not in ``_relations``, so once the table was registered again its
Relation message counted as given and was not given again (its changes took the Python path until the
decoder read a new one). :class:`CoreHandle` is
now the only holder of the Rust object: each method that changes what the core holds changes the record
in the same place (a table's registration with its Avro layout; unregistering a table drops its
relations on both sides, by table id as the core does), so the two cannot drift. Its record is what it
gave the core (a relation with a column named twice is given but refused by the core, whose changes then
take the Python path: giving it again would change nothing).

**Outputs.** :func:`binary_array` and :func:`changed_keys` read the buffers a run returns (used by
capture.native.core and capture.native.verify).

Thread-safety: none; owned by the connector thread's NativeCore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Never, NoReturn

import pyarrow as pa
import pyarrow.compute as pc

from capture.config import NativeUnavailableError, ValueFormat
from capture.messages import Plugin
from capture.native import extension
from capture.native.avro import layout_of

if TYPE_CHECKING:
    import tideline_native

    from capture.decoders.pgoutput import Relation
    from capture.tables import TableInfo
    from schemas.tables import TableSchemaIds

# One process call's results: (handled, next event index, total_order, per-table counts, outputs)
Processed = tuple[int, int, int, list[tuple[str, int]], list["tideline_native.Output"]]


def _unmapped(what: str, member: Never) -> NoReturn:
    """A member of capture's enum with no counterpart in the extension (typed Never: mypy flags a match that
    leaves a member out; at run time, whatever reached here is named)."""
    raise NativeUnavailableError(f"{what} {member!r} has no counterpart in the native core (tideline_native): "
                                 "add it to native/src/lib.rs and to capture/native/handle.py")  # fmt: skip


def core_plugin(plugin: Plugin) -> tideline_native.Plugin:
    """The extension's member for ``plugin``."""
    members = extension.CorePlugin
    if members is None:
        raise NativeUnavailableError(extension.unavailable_reason())
    if isinstance(plugin, Plugin) and not plugin.capabilities.native_core:
        raise NativeUnavailableError(f"the native core does not decode plugin {plugin.value}")
    match plugin:
        case Plugin.WAL2JSON:
            return members.WAL2JSON
        case Plugin.PGOUTPUT:
            return members.PGOUTPUT
        case _:
            _unmapped("plugin", plugin)


def core_value_format(value_format: ValueFormat) -> tideline_native.ValueFormat:
    """The extension's member for ``value_format``."""
    members = extension.CoreValueFormat
    if members is None:
        raise NativeUnavailableError(extension.unavailable_reason())
    if isinstance(value_format, ValueFormat) and not value_format.capabilities.native_changes:
        raise NativeUnavailableError(f"the native core does not write --value-format {value_format.value}")
    match value_format:
        case ValueFormat.JSON:
            return members.JSON
        case ValueFormat.AVRO:
            return members.AVRO
        case _:
            _unmapped("value format", value_format)


@dataclass(frozen=True, slots=True)
class Registration:
    """A table as the core holds it."""

    id: int  # the core's table id: a run's outputs name their table by it
    table: TableInfo  # the catalog entry it was registered from (a new entry registers it again)
    topic: str
    schema_ids: TableSchemaIds | None  # Avro: the registered schemas its layout was read from (None: JSON)
    avro: bool  # Avro: the core has its layout (False: one it cannot write, the Python path keeps the table)


class CoreHandle:
    """The extension's core for one connector and the record of its registrations (see the module docstring)."""

    def __init__(self, prefix: str, db: str, plugin: Plugin, value_format: ValueFormat) -> None:
        core = extension.Core
        if core is None:
            raise NativeUnavailableError(extension.unavailable_reason())
        self._core = core(prefix, db, core_plugin(plugin), core_value_format(value_format))
        self._by_name: dict[tuple[str, str], Registration] = {}
        self._by_id: list[Registration | None] = []  # None: unregistered (an id is not given to another table)
        self._relations: dict[int, tuple[Relation, int]] = {}  # pgoutput: OID → the Relation given, its table id

    # ------------------------------------------------------------------ tables

    def __bool__(self) -> bool:
        """Whether the core holds any table (a run without one needs no call)."""
        return bool(self._by_name)

    def registration(self, schema: str, name: str) -> Registration | None:
        return self._by_name.get((schema, name))

    def registered(self, table_id: int) -> Registration:
        """The registration a run's output names (only registered tables have outputs)."""
        registration = self._by_id[table_id]
        if registration is None:
            raise KeyError(f"the native core returned table id {table_id}, which is not registered")
        return registration

    def registrations(self) -> list[Registration]:
        return list(self._by_name.values())

    def register(self, table: TableInfo, topic: str, schema_ids: TableSchemaIds | None) -> Registration:
        """Give the core ``table`` (again: under its id, replacing its columns and dropping its Avro layout),
        then, with Avro, the layout of ``schema_ids`` when it is one the core can write."""
        key = (table.schema, table.name)
        known = self._by_name.get(key)
        table_id = len(self._by_id) if known is None else known.id
        self._core.register_table(table_id, table.schema, table.name, [c.name for c in table.columns],
                                  list(table.key), list(table.toastable_columns), table.replica_identity)  # fmt: skip
        layout = None if schema_ids is None else layout_of(schema_ids, table)
        if layout is not None:
            self._core.register_avro(table_id, layout.key_id, layout.value_id, layout.columns, layout.envelope,
                                     layout.source, layout.transaction)  # fmt: skip
        registration = Registration(table_id, table, topic, schema_ids, layout is not None)
        self._by_name[key] = registration
        if known is None:
            self._by_id.append(registration)
        else:
            self._by_id[table_id] = registration
        return registration

    def unregister(self, schema: str, name: str) -> bool:
        """Forget the table ``schema.name`` and the relations given for it; whether it was registered."""
        registration = self._by_name.pop((schema, name), None)
        if registration is None:
            return False
        self._core.unregister_table(schema, name)  # the core drops the table's relations with it
        self._by_id[registration.id] = None
        for oid in [oid for oid, (_, table_id) in self._relations.items() if table_id == registration.id]:
            del self._relations[oid]
        return True

    # ------------------------------------------------------------------ relations (pgoutput)

    def relation(self, oid: int) -> Relation | None:
        """The Relation message last given for ``oid`` (None: none, or forgotten since)."""
        given = self._relations.get(oid)
        return None if given is None else given[0]

    def relations(self) -> list[Relation]:
        return [relation for relation, _ in self._relations.values()]

    def give_relation(self, relation: Relation, table_id: int) -> None:
        """Have the core decode row messages of ``relation.oid`` with ``relation``, for the registered table
        ``table_id``."""
        self.registered(table_id)  # a relation of a table the core does not hold would route its changes nowhere
        self._core.register_relation(relation.oid, table_id, [c.name for c in relation.columns],
                                     [c.type_oid for c in relation.columns],
                                     [c.is_key for c in relation.columns])  # fmt: skip
        self._relations[relation.oid] = (relation, table_id)

    def forget_relation(self, oid: int) -> None:
        if self._relations.pop(oid, None) is not None:
            self._core.forget_relation(oid)

    # ------------------------------------------------------------------ runs

    def process(
        self,
        data: bytes,
        offsets: bytes,
        start: int,
        limit: int,
        xid: int | None,
        commit_lsn: int,
        ts_ms: int,
        snapshot: str,
        total_order: int,
        per_table: dict[str, int],
        index: int,
        now_ms: int,
    ) -> Processed:
        """The core's ``process`` (see native/src/lib.rs); registrations are not changed by a run."""
        return self._core.process(data, offsets, start, limit, xid, commit_lsn, ts_ms, snapshot, total_order,
                                  per_table, index, now_ms)  # fmt: skip


def binary_array(buffers: tideline_native.Column) -> pa.Array:
    """An Arrow binary array from the core's buffers ``(data, offsets, validity or None, null count, length)``."""
    data, offsets, validity, nulls, length = buffers
    bitmap = None if validity is None else pa.py_buffer(validity)
    return pa.Array.from_buffers(pa.binary(), length, [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)], nulls)


def changed_keys(keys: pa.Array) -> list[bytes]:
    """The distinct keys of a run's records (a delete's tombstone repeats its key; a keyless table has none)."""
    distinct: list[bytes] = pc.unique(keys.drop_null()).to_pylist()
    return distinct
