"""The native capture core: wal2json or pgoutput row changes → envelopes and keys in compiled code, a run at a time.

``tideline_native`` is a Rust extension (PyO3, built by maturin from ``native/``: ``make
native``; imported by capture.native.extension only, its core made and its registrations kept by
capture.native.handle). :class:`NativeCore` drives it for the streaming source (capture.streaming): the
source hands it a run of XLogData messages inside a transaction, as they came off the wire, in
one buffer (capture.replication.XLogRun, read by the extension's ``read_xlog`` with libpq's own
calls: no Python object per message; the header's data start is a pgoutput row
message's LSN); the extension parses each payload, converts its values, renders
the envelope and the key — the same bytes the Python reference path (capture.decoders.wal2json
or capture.decoders.pgoutput → capture.events → capture.converters.JsonConverter or
AvroConverter) writes —
and stops at the first payload it does not handle, which then takes the Python path; then
the next run starts. The results come back per table as Arrow binary arrays' buffers (keys and
values: no Python object per record) and the key-state changes as two key sets, the keys put and
the keys deleted (capture.keystate.KeySet: a buffer and its spans, written by SQLite a set per
statement), added with one call each: no ChangeMessage, Column, image dict, Event, record or key
bytes object is made for a natively handled change.

Native: INSERT, UPDATE and DELETE records (wal2json) or Insert, Update and Delete messages
(pgoutput) of a registered table (a captured table, not the outbox table, no excluded or
masked columns) whose values are all NULL or of a built-in type with a
fixed OID: integers, numeric, real/double, boolean, the text types, json/jsonb, uuid, bytea,
date, timestamp(tz), time(tz), box — in the forms PostgreSQL prints under the connector's
session settings (pgoutput: the types' text output, NaN and ±Infinity of numeric and
real/double included). pgoutput's row messages name their relation by OID: the core is given
the Relation message the decoder holds for a table (:meth:`NativeCore.sync`, after the Python
path handled a change of it) and forgets it as soon as the decoder has read any Relation
message for that OID again (checked at the start of every run), so the core always decodes
with the Relation the Python decoder would use; a Relation message with other columns than the
catalog's is not given (the core checks a change against the catalog's columns: capture.shapes).

Avro (``--value-format avro``): the core writes the Confluent-framed Avro keys and envelopes
itself (native/src/avro.rs). A table's registration carries what capture.native.avro reads from
the schemas the Python path registered for its current columns (``AvroEncoder.ids``): the key
and value schema ids, each row field's Avro kind, catalog type OID and union branches, and the
envelope's, ``source``'s and ``transaction``'s fields in order; it is replaced whenever the
table's catalog entry or those ids change (:meth:`NativeCore.sync`), so the core never frames
with a stale id. Native per value: the kinds schemas.pgvalues writes for the types above (int,
long, float, double, boolean, string, json/uuid/timetz as strings, bytes, decimal(p,s) and its
DecimalSpecial branch, VariableScaleDecimal, date, timestamp, timestamptz, time).

Python (the reference path, for that payload only, in stream order): BEGIN/COMMIT records,
TRUNCATE, logical messages; pgoutput's Relation, Type, Origin and Stream messages, and every
change of a streamed transaction (spilled by the decoder, replayed through the Python path at
Stream Commit); a table seen for the first time (it is registered after the
Python path handled its first change) or not captured; a pgoutput relation the core was not
given; arrays, interval, enums, domains and
other types without a fixed OID; unusual forms of a value (an infinite or BC timestamp,
``24:00:00``, a numeric written with an exponent or leading zeros, ``-0`` where the reference
reads it as 0); a missing (unchanged-TOAST, pgoutput ``u``) column, a row big enough to be
TOASTed (≥ 1 KiB of TOAST-able values: the TOAST cache
keeps it), a primary-key change, a table whose columns changed (the Python path reads the
catalog again); anything malformed (the Python path raises the reference error); a
transaction partly stored before a restart; Avro: a column whose type OID differs from the
catalog's, NULL in a key column, a numeric that does not fit its numeric(p,s) or needs more
than 38 digits, an integer outside its Avro int/long, a real too large for float.

Checked against the reference as it runs when ``TIDELINE_NATIVE_VERIFY=1`` (capture.native.verify:
the test suite does so for every test).

Choice: ``CaptureConfig.core`` (``--core``, default from ``TIDELINE_CAPTURE_CORE``):
``auto`` uses the extension when it is importable and the plugin and value format are the core's
(their capabilities: ``Capabilities.native_core``, ``FormatCapabilities.native_changes``; today
both plugins, JSON and Avro), ``python`` never, ``native`` requires it (a clear error otherwise:
``CaptureConfig.validate``).

Reported (:func:`core_report` → capture.status.CoreReport, kept current by :meth:`NativeCore.sync`): the
core the connector runs and, per table, ``native`` or ``python`` with the reason — for every table
at once: ``--core python``, the extension not built (capture.native.extension.UNAVAILABLE: the import's
error, or a build older than its sources), a plugin or value format the core does not take, excluded or
masked columns; per table: a column whose type the core does
not convert (:func:`table_reason`: arrays, interval, enums, domains, extension types), the outbox table,
an Avro layout it cannot write, a partitioned table whose plugin names its partitions in its changes, and,
until the stream reaches it, a catalog at another shape of the table
than the stream's (:data:`SHAPE_REASON`: a DDL between the two; the core checks a change against the catalog's
columns, capture.shapes). A table's occasional change on the Python path (its first, a TOASTed
row, an infinite timestamp …) is not a fallback of the table and is not reported.

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from capture.avro import AvroEncoder, SchemaChangeError
from capture.config import ENV, CoreChoice, NativeUnavailableError, ValueFormat
from capture.converters import AvroConverter, JsonConverter
from capture.decoders.pgoutput import PgOutputDecoder
from capture.keystate import KeySet
from capture.messages import Plugin
from capture.native import extension
from capture.native.handle import CoreHandle, binary_array, changed_keys
from capture.native.verify import ReferenceCheck
from capture.native.verify import enabled as verify_enabled
from capture.status import NATIVE, PYTHON, CoreReport, TableCore
from eventstore.topic import now_ms

if TYPE_CHECKING:
    from capture.config import CaptureConfig
    from capture.converters import ValueConverter
    from capture.events import EventBuilder, TxnContext
    from capture.messages import Decoder
    from capture.replication import XLogRun
    from capture.status import Stats
    from capture.tables import TableCatalog, TableInfo
    from capture.writer import LogWriter
    from schemas.tables import TableSchemaIds

log = logging.getLogger("capture.connector")

RUN_LIMIT = 512  # payloads per native call at most (the batch's byte bound is checked after each run)
# A table whose changes in the stream have another shape than the catalog's (capture.shapes): the catalog ahead
# of a backlog (columns added, dropped or renamed since), or behind a DDL until it is read again.
SHAPE_REASON = ("the stream is at another shape of the table than the catalog (a DDL between them): its changes "
                "take the Python path until the stream reaches the catalog's shape")  # fmt: skip


def connector_reason(config: CaptureConfig, converter: ValueConverter) -> str | None:
    """Why every table takes the Python path (None: the native core runs)."""
    if config.core is CoreChoice.PYTHON:
        return f"--core python (or {ENV}=python) asks for the Python path"
    if not extension.available():
        return extension.unavailable_reason()
    unsupported = config.native_unsupported()
    if unsupported is not None:
        return unsupported
    if not isinstance(converter, JsonConverter | AvroConverter):
        return f"the value converter {type(converter).__name__} is not covered by the native core (JSON and Avro are)"
    if config.table_filter.exclude_columns or config.table_filter.mask_columns:
        return "--exclude-columns or --mask-columns is set: the native core writes whole rows"
    return None


def table_reason(config: CaptureConfig, table: TableInfo) -> str | None:
    """Why ``table``'s changes take the Python path while the native core runs (None: they take the core):
    the outbox table, a partitioned table whose plugin names its partitions in their changes, or columns of
    types the core does not convert (their non-NULL values). Needs the extension."""
    if table.qualified == config.outbox_table:
        return "the outbox table: its rows are routed by the Python path"
    if table.partitioned and config.plugin.capabilities.names_partitions:
        return (
            f"a partitioned table captured whole with {config.plugin.value}, which names each partition in its "
            "changes (the core knows the captured tables' names; pgoutput publishes them as the root's)"
        )
    # the core's own test of a type (native/src/convert.rs, kind_of)
    uncovered = [f"column {c.name}: {c.type_name} not covered by the native core" for c in table.columns
                 if not extension.converts(c.type_oid)]  # fmt: skip
    return "; ".join(uncovered) or None


def core_report(config: CaptureConfig, converter: ValueConverter, tables: list[TableInfo]) -> CoreReport:
    """The core the connector runs with ``converter`` for the captured ``tables``, per table (see the module
    docstring, "Reported")."""
    reason = connector_reason(config, converter)
    report = CoreReport(config.core.value, reason, chosen=config.core is CoreChoice.PYTHON)
    for table in tables:
        why = reason if reason is not None else table_reason(config, table)
        report.set_table(table.qualified, TableCore(NATIVE) if why is None else TableCore(PYTHON, why))
    return report


def native_core_for(
    config: CaptureConfig,
    catalog: TableCatalog,
    builder: EventBuilder,
    writer: LogWriter,
    stats: Stats,
    decoder: Decoder | None = None,
) -> NativeCore | None:
    """The native core the configuration asks for (None: the Python path). ``decoder``: the stream's
    decoder (pgoutput: the core decodes row messages with the Relation messages it read)."""
    if config.core is CoreChoice.NATIVE:
        refusal = config.native_refusal()
        if refusal is not None:
            raise NativeUnavailableError(refusal)
        if not isinstance(builder.converter, JsonConverter | AvroConverter):
            raise NativeUnavailableError("--core native covers the JSON and Avro value converters only")
    if connector_reason(config, builder.converter) is not None:
        return None  # every table on the Python path (stats.core says why)
    if config.plugin is Plugin.PGOUTPUT and not isinstance(decoder, PgOutputDecoder):
        raise TypeError("the native core for pgoutput needs the stream's PgOutputDecoder")
    pgoutput = decoder if isinstance(decoder, PgOutputDecoder) else None
    return NativeCore(config, catalog, builder, writer, stats, pgoutput)


class NativeCore:
    """The extension's core for one connector: table registrations, runs, and their results into the batch."""

    def __init__(
        self,
        config: CaptureConfig,
        catalog: TableCatalog,
        builder: EventBuilder,
        writer: LogWriter,
        stats: Stats,
        pgoutput: PgOutputDecoder | None = None,
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.builder = builder
        self.writer = writer
        self.stats = stats
        # pgoutput: the decoder whose Relation messages the core mirrors (None: wal2json payloads)
        self.pgoutput = pgoutput
        # Avro: the encoder whose registered schemas the core writes with (None: JSON values)
        self.avro: AvroEncoder | None = (
            builder.converter.encoder if isinstance(builder.converter, AvroConverter) else None
        )
        if (self.avro is not None) != (config.value_format is ValueFormat.AVRO):
            raise TypeError(f"the native core for --value-format {config.value_format.value} needs its converter, "
                            f"not {type(builder.converter).__name__}")  # fmt: skip
        # the Rust core and every registration it holds, each with the Python side's record of it
        self.handle = CoreHandle(builder.prefix, builder.db, config.plugin, config.value_format)
        self._relations_read = 0
        self._reasons: dict[str, str | None] = {}  # a registered table → why the Python path keeps it (None: not)
        self._generation = catalog.generation
        self.changes = 0  # handled natively (status, tests)
        # TIDELINE_NATIVE_VERIFY: every run checked against the Python reference (capture.native.verify)
        self.verify = ReferenceCheck(builder, pgoutput) if verify_enabled() else None

    # ------------------------------------------------------------------ tables

    def sync(self, table: TableInfo) -> None:
        """After the Python path handled a change of ``table``: let the core handle the next ones.

        Avro: the registration carries the schema ids ``AvroEncoder.ids(table)`` gives (those the Python path
        writes this change with); when they differ from the ones the core has, the table is registered again,
        so the core never frames with an id the Python path would no longer write."""
        if table.qualified == self.config.outbox_table:
            return
        registered = self.handle.registration(table.schema, table.name)
        if not self._stream_at_catalog(table):
            # the stream is at another shape of the table than the catalog (capture.shapes); the core checks a
            # change against the catalog only, so its changes take the Python path until the stream shows the
            # catalog's shape (nor are the catalog's schemas registered ahead of the stream, with Avro)
            self.handle.unregister(table.schema, table.name)
            self._report(table.qualified, table_reason(self.config, table) or SHAPE_REASON)
            return
        ids = self._current_ids(table)
        if registered is not None and registered.table is table and registered.schema_ids is ids:
            if self.pgoutput is not None:
                self._sync_relation(registered.id, table)
            return
        # (again: an Avro layout it had is gone, the core handles the table again once it has the new one)
        registered = self.handle.register(table, self.builder.topic(table), ids)
        reason = table_reason(self.config, table)
        if ids is not None and not registered.avro and reason is None:
            reason = "Avro: the native core cannot write the layout of its registered schemas"
        self._reasons[table.qualified] = reason
        self._report(table.qualified, reason)
        if self.pgoutput is not None:
            self._sync_relation(registered.id, table)

    def _report(self, table: str, reason: str | None) -> None:
        """Record the core of ``table``'s changes in the connector's report; a new fallback is logged."""
        report = self.stats.core
        if report is None:
            return
        core = TableCore(NATIVE) if reason is None else TableCore(PYTHON, reason)
        if report.set_table(table, core) and reason is not None:
            log.warning("capture: table %s takes the Python core: %s", table, reason)

    def _stream_at_catalog(self, table: TableInfo) -> bool:
        """Whether the stream is at the catalog's shape of ``table``: wal2json, the tracked shape (capture.shapes);
        pgoutput, the Relation message in force (none yet: checked when one comes, :meth:`_sync_relation`). With
        Avro the column types must be the catalog's too (the core writes under the catalog's schemas)."""
        avro = self.avro is not None
        if self.pgoutput is None:
            return self.builder.shapes.is_catalog_shape(table, self.builder.topic(table), types=avro)
        relation = self.pgoutput.relation_named(table.schema, table.name)
        if relation is None:
            return True
        types = {c.name: c.type_name for c in table.columns}
        return len(relation.shape.names) == len(types) and all(
            n in types and (not avro or types[n] == t)
            for n, t in zip(relation.shape.names, relation.shape.types, strict=True)
        )

    def _current_ids(self, table: TableInfo) -> TableSchemaIds | None:
        """Avro: the table's registered schemas, as the Python path is about to write its change with (called
        before it: the same registrations, in the same order). None: JSON values, or columns the subject refuses
        (the Python path raises that error with this change, before writing anything)."""
        if self.avro is None:
            return None
        try:
            return self.avro.ids(table)
        except SchemaChangeError:
            return None

    def _sync_relation(self, table_id: int, table: TableInfo) -> None:
        """pgoutput: give the core the Relation message the decoder holds for ``table`` (its row messages are
        decoded with it), unless it has it already."""
        assert self.pgoutput is not None
        relation = self.pgoutput.relation_named(table.schema, table.name)
        if relation is None or self.handle.relation(relation.oid) is relation:
            return
        if not self._stream_at_catalog(table):
            # the Relation message in force is another shape of the table than the catalog's, which the core
            # checks a change against (an unchanged TOASTed column left out may make a change look like the
            # catalog's): its changes take the Python path, which builds them with the Relation message
            # (capture.shapes), until the two agree again (a Relation message after the DDL, or the catalog
            # read again)
            self.handle.forget_relation(relation.oid)
            self._report(table.qualified, self._reasons.get(table.qualified) or SHAPE_REASON)
            return
        self._report(table.qualified, self._reasons.get(table.qualified))
        self.handle.give_relation(relation, table_id)

    def _resync_relations(self) -> None:
        """pgoutput: the decoder read Relation messages since the last run: forget every relation whose
        message it replaced (the Python path registers the new one with the next change of its table)."""
        assert self.pgoutput is not None
        self._relations_read = self.pgoutput.relations_read
        for relation in self.handle.relations():
            if self.pgoutput.relation(relation.oid) is not relation:
                self.handle.forget_relation(relation.oid)

    def _resync(self) -> None:
        """The catalog was read again: every registration follows its current table info (or goes)."""
        self._generation = self.catalog.generation
        for registered in self.handle.registrations():
            schema, name = registered.table.schema, registered.table.name
            current = self.catalog.current(schema, name)
            if current is None:
                self.handle.unregister(schema, name)  # its relations too
                if self.stats.core is not None:
                    self.stats.core.drop_table(f"{schema}.{name}")
            elif current is not registered.table:
                self.sync(current)

    # ------------------------------------------------------------------ runs

    def run(self, messages: XLogRun, start: int, ctx: TxnContext, index: int) -> tuple[int, int]:
        """Handle ``messages[start:]`` of the transaction ``ctx`` from event ``index`` on, until one needs the
        Python path. ``messages``: XLogData messages as they came, in one buffer (capture.replication.XLogRun:
        b"w", the header, whose data start is a pgoutput row's LSN, then the payload).
        Returns ``(messages handled, next event index)``; the events are in the batch."""
        if self.catalog.generation != self._generation:
            self._resync()
        if not self.handle:
            return 0, index
        if self.pgoutput is not None:
            if self.pgoutput.in_stream:
                return 0, index  # row messages of a streamed transaction are spilled by the decoder
            if self.pgoutput.relations_read != self._relations_read:
                self._resync_relations()
        if ctx.per_table is None:
            ctx.per_table = {}
        now = now_ms()
        first = index
        handled, index, total_order, counts, outputs = self.handle.process(
            messages.data, messages.offsets, start, RUN_LIMIT, ctx.xid, ctx.commit_lsn, ctx.ts_ms, ctx.snapshot,
            ctx.total_order, ctx.per_table, index, now,
        )  # fmt: skip
        if not handled:
            return 0, index
        if self.verify is not None:
            registrations = self.handle.registrations()
            table_of = {(r.table.schema, r.table.name): (r.table, r.topic) for r in registrations}
            topic_of = {r.id: r.topic for r in registrations}
            self.verify.check([messages.message(i) for i in range(start, start + handled)], ctx, first, now, table_of,
                              (index, total_order, counts, outputs), topic_of)  # fmt: skip
        ctx.total_order = total_order
        for qualified, n in counts:
            ctx.per_table[qualified] = n
        writer, keystate, toast = self.writer, self.writer.keystate, self.builder.toast
        for table_id, _changes, key_buffers, value_buffers, nbytes, puts, deletes in outputs:
            registered = self.handle.registered(table_id)
            table, topic = registered.table, registered.topic
            keys, values = binary_array(key_buffers), binary_array(value_buffers)
            writer.ensure_table_topic(table, topic)
            writer.add_arrays(topic, keys, values, nbytes)
            if puts is not None or deletes is not None:
                keystate.put_sets(topic, None if puts is None else KeySet(*puts),
                                  None if deletes is None else KeySet(*deletes))  # fmt: skip
            if toast.entries:  # each change's row is small: its key leaves the cache (objects made only then)
                toast.drop_many(topic, changed_keys(keys))
            self.stats.events += len(values)
        self.changes += handled
        return handled, index
