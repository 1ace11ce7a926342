"""The pgoutput decoder: PostgreSQL 15's logical replication protocol (versions 1 to 3) → ChangeMessages.

One payload (the body of an XLogData message, or a ``data`` of
``pg_logical_slot_get_binary_changes``) holds one protocol message. Integers are
big-endian; a String is NUL-terminated (UTF-8: the database encoding must be UTF8);
``[xid]`` is an Int32 present only inside a streamed transaction (protocol ≥ 2, between
Stream Start and Stream Stop). Layouts, as the decoder reads them::

  B  Begin          Int64 final (commit) LSN, Int64 commit time, Int32 xid
  C  Commit         Int8 flags (0), Int64 commit LSN, Int64 end LSN, Int64 commit time
  O  Origin         Int64 commit LSN on the origin, String origin name            (ignored)
  R  Relation       [xid] Int32 relation OID, String namespace ("" = pg_catalog), String name,
                    Int8 replica identity ('d', 'n', 'f', 'i'), Int16 column count, per column:
                    Int8 flags (1 = part of the replica identity key), String name,
                    Int32 type OID, Int32 typmod
  Y  Type           [xid] Int32 type OID, String namespace, String name
  I  Insert         [xid] Int32 relation OID, Byte1 'N', TupleData (new row)
  U  Update         [xid] Int32 relation OID, optional (Byte1 'K' old key | 'O' old row, TupleData),
                    Byte1 'N', TupleData (new row)
  D  Delete         [xid] Int32 relation OID, Byte1 'K' | 'O', TupleData (old key / old row)
  T  Truncate       [xid] Int32 relation count, Int8 options (1 CASCADE, 2 RESTART IDENTITY),
                    Int32 relation OID per relation
  M  Message        [xid] Int8 flags (1 = transactional), Int64 LSN, String prefix, Int32 length, content
  S  Stream Start   Int32 xid, Int8 first segment (1 = first)                      (protocol ≥ 2)
  E  Stream Stop    (nothing)                                                      (protocol ≥ 2)
  c  Stream Commit  Int32 xid, Int8 flags (0), Int64 commit LSN, Int64 end LSN, Int64 commit time
  A  Stream Abort   Int32 xid, Int32 subtransaction xid (= xid: the whole transaction)
  TupleData         Int16 column count, per column: Byte1 kind, then for 't' (text) and 'b' (binary)
                    Int32 length and the value's bytes; 'n' is NULL, 'u' an unchanged TOASTed value

Protocol 3 adds two-phase commit messages (b, P, K, r, p), sent only when the slot was
asked for ``two_phase``; the decoder never asks, so version 3 streams as version 2 does,
and a two-phase message is refused by name.

What comes out, compared with wal2json's decoder (the differential test checks it):

* B, C: ``lsn`` = the commit record (Begin's final LSN, Commit's commit LSN), as wal2json.
  Commit's ``next_lsn`` is the end of the transaction; **Begin's is None**: pgoutput's
  Begin does not carry the end (capture.streaming takes it from the Commit).
* Row messages carry no LSN of their own: ``lsn`` is the ``lsn`` given to
  :meth:`PgOutputDecoder.decode`, the XLogData message's WAL start (the same LSN
  wal2json writes into the row; 0 when not given). ``xid`` and ``timestamp_ms`` come from
  the enclosing Begin (every row of a transaction carries them, as with wal2json).
* ``identity``: the old key (only the replica identity's key columns of a 'K' tuple,
  whose other columns are NULL) or the old row ('O', REPLICA IDENTITY FULL). An UPDATE
  that did not change the key carries no old tuple: ``identity`` is then the new row's
  key columns, as wal2json gives it. ``primary_key`` stays empty: pgoutput does not say
  which columns are the primary key (``Capabilities.emits_primary_key`` is False).
* **Unchanged TOAST** ('u'): the column is left out of ``columns`` exactly as wal2json
  omits it, so capture's TOAST filling (capture.events) applies unchanged. Unlike wal2json,
  each row message also says which columns the table had: ``shape``, its Relation message's
  names and types (capture.shapes), so exactly the 'u' columns are filled.
* Values ('t') are the types' text output, converted by
  :func:`capture.pgtypes.text_converter`, the snapshot's converters: numeric and
  real/double **NaN and ±Infinity stay distinct from NULL** (``Decimal('NaN')``,
  ``NonFiniteFloat``), which wal2json cannot do, and -0 of real/double keeps its sign
  (wal2json: 0.0). Binary values ('b') are refused: the decoder never asks for ``binary``.
* Type names: format_type's, from :mod:`capture.decoders.pgoutput.types` (built-in
  table, then the optional resolver, then pgoutput's Type messages).
* T: one pgoutput message for all truncated relations → one TRUNCATE per relation (as
  wal2json), each with ``truncate_cascade`` / ``truncate_restart_identity``.
* M: ``lsn`` is the message's own LSN; a non-transactional message has xid and
  timestamp None, as with wal2json. Its content is exact (wal2json cuts it at a NUL).
* Empty transactions (no published change) are not sent at all by pgoutput 15; wal2json
  sends their B and C.
* Stored generated columns are not sent by pgoutput 15 (neither in Relation nor in row
  messages); wal2json sends them (``Capabilities.emits_generated_columns``: a table's
  catalog columns and snapshot must leave them out too, or every INSERT looks like an
  ALTER TABLE to capture.streaming's column check).
* The one-byte ``"char"`` type is named ``"char"`` (format_type, the snapshot's name);
  wal2json names it ``char``.
* Streamed transactions (protocol ≥ 2 with ``streaming``): the payloads between Stream
  Start and Stop are spilled raw to a file per transaction
  (:mod:`capture.decoders.pgoutput.streams`); Stream Commit returns an *iterator* that
  decodes them then, as one ordinary Begin … Commit (Begin with the commit LSN and time,
  as B carries them); Stream Abort drops the transaction's file, or discards a rolled-back
  subtransaction's payloads (raising ``StreamedAbortAmbiguous`` in the one case the stream
  cannot tell: see that module). Memory stays bounded whatever the transaction's size,
  and nothing of a transaction that aborts is ever decoded.

Positions in errors are byte offsets into the payload; every DecodeError names the
message type and the payload's LSN.

Thread safety: none (it caches relations and holds the open transaction): one decoder per stream.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.decoders.pgoutput.reader import PayloadReader
from capture.decoders.pgoutput.streams import SpilledTransactions
from capture.decoders.pgoutput.types import CatalogTypeResolver, TypeResolver, builtin_type_name, catalog_type_name
from capture.messages import ChangeMessage, Column, DecoderSettings, Kind, Plugin, RowShape
from capture.pgtypes import text_converter

log = logging.getLogger(__name__)

DEFAULT_PUBLICATION = "tideline"

_BEGIN = struct.Struct("!QqI")  # final LSN, commit time, xid
_COMMIT = struct.Struct("!BQQq")  # flags, commit LSN, end LSN, commit time
_ORIGIN = struct.Struct("!Q")  # commit LSN on the origin
_UINT8 = struct.Struct("!B")  # column flags
_UINT32 = struct.Struct("!I")  # relation OID (read by PayloadReader.uint32)
_INT16 = struct.Struct("!H")  # column count
_IDENTITY = struct.Struct("!BH")  # replica identity, column count
_ATTRIBUTE_TYPE = struct.Struct("!Ii")  # type OID, typmod
_TRUNCATE = struct.Struct("!IB")  # relation count, options
_MESSAGE = struct.Struct("!BQ")  # flags, LSN
_STREAM_START = struct.Struct("!IB")  # xid, first segment
_STREAM_ABORT = struct.Struct("!II")  # xid, subtransaction xid
_STREAMED_XID = struct.Struct("!xI")  # message type, then the [xid] of a message inside a stream block

PROTO_VERSIONS = (1, 2, 3)  # PostgreSQL 15's; streaming needs 2 or more
_IN_STREAM = frozenset(b"RYIUDTM")  # the messages that carry [xid] inside a stream block (spilled there)

_NULL, _UNCHANGED_TOAST, _TEXT, _BINARY = b"nutb"  # TupleData column kinds
_KEY_COLUMN = 1  # Relation column flag: part of the replica identity key
_TRUNCATE_CASCADE = 1
_TRUNCATE_RESTART_IDENTITY = 2
_TRANSACTIONAL = 1
_PG_EPOCH_MS = 946_684_800_000  # 2000-01-01 in Unix milliseconds
_MESSAGE_NAMES = {
    "B": "Begin", "C": "Commit", "O": "Origin", "R": "Relation", "Y": "Type", "I": "Insert", "U": "Update",
    "D": "Delete", "T": "Truncate", "M": "Message", "S": "Stream Start", "E": "Stream Stop", "c": "Stream Commit",
    "A": "Stream Abort",
}  # fmt: skip
_TWO_PHASE = {"b": "Begin Prepare", "P": "Prepare", "K": "Commit Prepared", "r": "Rollback Prepared",
              "p": "Stream Prepare"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RelationColumn:
    """One column of a Relation message, with its type's name and converter resolved."""

    name: str
    is_key: bool  # part of the replica identity key (flags & 1)
    type_oid: int
    typmod: int
    type_name: str
    convert: Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class Relation:
    """What a Relation message says about a table, cached by relation OID until the next one."""

    oid: int
    schema: str
    table: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[RelationColumn, ...]
    shape: RowShape  # the columns' names and types: every row message of the relation carries it (ChangeMessage)


@dataclass(slots=True)
class _Transaction:
    xid: int | None
    timestamp_ms: int | None


class PgOutputDecoder:
    """Decodes pgoutput payloads (see the module docstring for the layouts and the mapping).

    ``publication``: the publication (or publications) whose tables the slot streams;
    ``proto_version`` 1, 2 or 3 (2 and 3 also understand streamed transactions,
    requested with ``streaming=True``, spilled to ``spill_dir``: None is the system's
    temporary directory); ``type_resolver(type_oid, typmod) -> format_type name`` names
    non-built-in types (without it, or when it answers None, pgoutput's Type messages
    name them: see :mod:`~capture.decoders.pgoutput.types`).

    Not thread-safe: one per replication stream (it caches Relation messages).

    >>> decoder = PgOutputDecoder("pub")
    >>> decoder.slot_options()
    {'proto_version': '1', 'publication_names': 'pub', 'messages': 'true'}
    >>> relation = (b"R" + (16385).to_bytes(4, "big") + b"public\\0t\\0d" + (1).to_bytes(2, "big")
    ...     + b"\\1n\\0" + (1700).to_bytes(4, "big") + (-1).to_bytes(4, "big", signed=True))
    >>> decoder.decode(relation)
    []
    >>> [m] = decoder.decode(b"I" + (16385).to_bytes(4, "big") + b"N\\0\\1t\\0\\0\\0\\3NaN", lsn=0x16B3748)
    >>> m.kind, m.lsn, m.table, m.columns[0].value
    (<Kind.INSERT: 'I'>, 23803720, 't', Decimal('NaN'))
    """

    plugin = Plugin.PGOUTPUT

    def __init__(
        self,
        publication: str | Sequence[str] = DEFAULT_PUBLICATION,
        *,
        proto_version: int = 1,
        streaming: bool = False,
        type_resolver: TypeResolver | None = None,
        spill_dir: Path | None = None,
    ) -> None:
        if proto_version not in PROTO_VERSIONS:
            raise ValueError(f"pgoutput proto_version must be 1, 2 or 3, not {proto_version}")
        if streaming and proto_version < 2:
            raise ValueError("streaming of in-progress transactions needs proto_version 2 or 3")
        self.publications = (publication,) if isinstance(publication, str) else tuple(publication)
        if not self.publications:
            raise ValueError("pgoutput needs at least one publication")
        self.proto_version, self.streaming = proto_version, streaming
        self._resolver = type_resolver
        self._relations: dict[int, Relation] = {}
        self._relations_by_name: dict[tuple[str, str], Relation] = {}  # the last Relation message of a name
        self.relations_read = 0  # Relation messages read so far: the native core re-checks its copies when it moves
        self._type_names: dict[int, str] = {}  # from Type messages
        self._transaction: _Transaction | None = None
        self._stream_xid: int | None = None  # set between Stream Start and Stream Stop
        self._replaying: _Transaction | None = None  # set while a Stream Commit replays its transaction
        self._spilled = SpilledTransactions(spill_dir)

    @classmethod
    def configured(cls, settings: DecoderSettings) -> PgOutputDecoder:
        """The connector's decoder: its publications, protocol and spill directory, types named by the catalog."""
        resolver = CatalogTypeResolver(settings.dsn) if settings.dsn is not None else None
        return cls(
            settings.publications or DEFAULT_PUBLICATION,
            proto_version=settings.proto_version,
            streaming=settings.streaming and settings.proto_version >= 2,
            type_resolver=resolver,
            spill_dir=settings.spill_dir,
        )

    @property
    def publication(self) -> str:
        """The first (main) publication."""
        return self.publications[0]

    @property
    def in_stream(self) -> bool:
        """Between Stream Start and Stream Stop: row messages are spilled, not decoded."""
        return self._stream_xid is not None

    def relation(self, oid: int) -> Relation | None:
        """The Relation message held for ``oid`` (what a row message of it is decoded with)."""
        return self._relations.get(oid)

    def relation_named(self, schema: str, table: str) -> Relation | None:
        """The last Relation message read for the table ``schema.table``."""
        return self._relations_by_name.get((schema, table))

    @property
    def spilled(self) -> SpilledTransactions:
        """The streamed transactions waiting for their commit (sizes for logs and tests)."""
        return self._spilled

    def slot_options(self) -> dict[str, str]:
        """Options for ``START_REPLICATION … LOGICAL … (options)`` or ``pg_logical_slot_get_binary_changes``."""
        options = {
            "proto_version": str(self.proto_version),
            "publication_names": ",".join(_quote_identifier(name) for name in self.publications),
            "messages": "true",
        }
        if self.streaming:
            options["streaming"] = "on"
        return options

    def close(self) -> None:
        """Delete the files of streamed transactions still open, close the type resolver's connection."""
        self._spilled.close()
        close = getattr(self._resolver, "close", None)
        if close is not None:
            close()

    def decode(self, payload: bytes, lsn: int = 0) -> Iterable[ChangeMessage]:
        """Messages of one payload; ``lsn`` is its XLogData WAL start (the LSN of a row change).

        A list, but for Stream Commit: an iterator over the whole streamed transaction,
        decoded from its spill file as it is consumed (consume it before the next call).
        Raises DecodeError naming the message, the byte offset and the payload's LSN.
        """
        if self._stream_xid is not None and payload and payload[0] in _IN_STREAM:
            if len(payload) < _STREAMED_XID.size:
                raise PayloadReader(payload, lsn).error("truncated: a streamed message without its xid")
            (subxid,) = _STREAMED_XID.unpack_from(payload)
            self._spilled.append(self._stream_xid, subxid, lsn, payload)  # decoded at Stream Commit
            return ()
        return self._decode(payload, lsn)

    def _decode(self, payload: bytes, lsn: int) -> Iterable[ChangeMessage]:
        reader = PayloadReader(payload, lsn)
        tag = reader.byte("message type")
        handle = _HANDLERS.get(tag)
        if handle is None:
            reader.pos = 0
            if tag in _TWO_PHASE:
                raise reader.error(f"two-phase message {_TWO_PHASE[tag]!r} ('{tag}'): two_phase is not supported")
            raise reader.error(f"unknown message type {tag!r} (0x{ord(tag):02x})")
        reader.what = f"{_MESSAGE_NAMES[tag]} message ('{tag}')"
        messages = handle(self, reader)
        reader.end()
        return messages

    # -- transactions --------------------------------------------------------------------

    def _begin(self, reader: PayloadReader) -> list[ChangeMessage]:
        final_lsn, commit_time, xid = reader.unpack(_BEGIN, "final LSN, commit time, xid")
        timestamp_ms = _epoch_ms(commit_time)
        self._transaction = _Transaction(xid, timestamp_ms)
        # next_lsn stays None: Begin does not carry the transaction's end (Commit does).
        return [ChangeMessage(Kind.BEGIN, final_lsn, xid=xid, timestamp_ms=timestamp_ms)]

    def _commit(self, reader: PayloadReader) -> list[ChangeMessage]:
        _flags, commit_lsn, end_lsn, commit_time = reader.unpack(_COMMIT, "flags, commit LSN, end LSN, commit time")
        transaction, self._transaction = self._transaction, None
        xid = transaction.xid if transaction is not None else None
        return [ChangeMessage(Kind.COMMIT, commit_lsn, xid=xid, timestamp_ms=_epoch_ms(commit_time), next_lsn=end_lsn)]

    def _origin(self, reader: PayloadReader) -> list[ChangeMessage]:
        reader.unpack(_ORIGIN, "origin commit LSN")
        reader.string("origin name")
        return []  # changes replicated from elsewhere: their origin does not matter to capture

    # -- catalog messages ----------------------------------------------------------------

    def _relation(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        oid = reader.uint32("relation OID")
        schema = reader.string("namespace") or "pg_catalog"  # "" means pg_catalog
        table = reader.string("relation name")
        identity, count = reader.unpack(_IDENTITY, "replica identity, column count")
        columns = []
        for i in range(count):
            (flags,) = reader.unpack(_UINT8, f"column {i} flags")
            name = reader.string(f"column {i} name")
            type_oid, typmod = reader.unpack(_ATTRIBUTE_TYPE, f"column {name!r} type OID, typmod")
            type_name = self._type_name(type_oid, typmod)
            convert = text_converter(type_name, type_oid)
            columns.append(RelationColumn(name, bool(flags & _KEY_COLUMN), type_oid, typmod, type_name, convert))
        shape = RowShape(tuple(c.name for c in columns), tuple(c.type_name for c in columns))
        relation = self._relations[oid] = Relation(oid, schema, table, chr(identity), tuple(columns), shape)
        self._relations_by_name[(schema, table)] = relation
        self.relations_read += 1
        return []

    def _type(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        oid = reader.uint32("type OID")
        namespace = reader.string("type namespace")
        name = reader.string("type name")
        self._type_names[oid] = catalog_type_name(namespace, name)
        return []

    def _type_name(self, type_oid: int, typmod: int) -> str:
        name = builtin_type_name(type_oid, typmod)
        if name is None and self._resolver is not None:
            name = self._resolver(type_oid, typmod)
        if name is None:
            name = self._type_names.get(type_oid)
        return name if name is not None else f"unknown type {type_oid}"  # → kept as text

    # -- changes -------------------------------------------------------------------------

    def _insert(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        relation = self._relation_of(reader)
        self._expect(reader, "N", "new tuple marker")
        columns = self._tuple(reader, relation, keys_only=False)
        return self._change(Kind.INSERT, relation, reader.lsn, columns, [])

    def _update(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        relation = self._relation_of(reader)
        marker = reader.byte("tuple marker")
        identity: list[Column] | None = None
        if marker in ("K", "O"):
            identity = self._tuple(reader, relation, keys_only=marker == "K")
            marker = reader.byte("new tuple marker")
        if marker != "N":
            reader.pos -= 1
            raise reader.error(f"expected tuple marker 'N', 'K' or 'O', found {marker!r}")
        columns = self._tuple(reader, relation, keys_only=False)
        if identity is None:  # the key did not change: the new row's key, as wal2json gives it
            keys = {c.name for c in relation.columns if c.is_key}
            identity = [c for c in columns if c.name in keys]
        return self._change(Kind.UPDATE, relation, reader.lsn, columns, identity)

    def _delete(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        relation = self._relation_of(reader)
        marker = reader.byte("old tuple marker")
        if marker not in ("K", "O"):
            reader.pos -= 1
            raise reader.error(f"expected tuple marker 'K' or 'O', found {marker!r}")
        identity = self._tuple(reader, relation, keys_only=marker == "K")
        return self._change(Kind.DELETE, relation, reader.lsn, [], identity)

    def _truncate(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        count, options = reader.unpack(_TRUNCATE, "relation count, options")
        relations = [self._relation_of(reader) for _ in range(count)]
        transaction = self._current()
        messages = []
        for relation in relations:
            message = ChangeMessage(
                Kind.TRUNCATE,
                reader.lsn,
                xid=transaction.xid,
                timestamp_ms=transaction.timestamp_ms,
                schema=relation.schema,
                table=relation.table,
                truncate_cascade=bool(options & _TRUNCATE_CASCADE),
                truncate_restart_identity=bool(options & _TRUNCATE_RESTART_IDENTITY),
            )
            messages.append(message)
        return messages

    def _message(self, reader: PayloadReader) -> list[ChangeMessage]:
        self._streamed_xid(reader)
        flags, lsn = reader.unpack(_MESSAGE, "flags, LSN")
        prefix = reader.string("prefix")
        content = reader.take(reader.uint32("content length"), "content")
        transactional = bool(flags & _TRANSACTIONAL)
        transaction = self._current() if transactional else _Transaction(None, None)
        message = ChangeMessage(
            Kind.MESSAGE,
            lsn,
            xid=transaction.xid,  # None when not transactional, as wal2json
            timestamp_ms=transaction.timestamp_ms,
            transactional=transactional,
            prefix=prefix,
            content=content,
        )
        return [message]

    def _relation_of(self, reader: PayloadReader) -> Relation:
        oid = reader.uint32("relation OID")
        relation = self._relations.get(oid)
        if relation is None:
            reader.pos -= _UINT32.size
            raise reader.error(f"relation OID {oid} was not described by a Relation message before")
        return relation

    def _expect(self, reader: PayloadReader, marker: str, field_name: str) -> None:
        found = reader.byte(field_name)
        if found != marker:
            reader.pos -= 1
            raise reader.error(f"expected {field_name} {marker!r}, found {found!r}")

    def _tuple(self, reader: PayloadReader, relation: Relation, *, keys_only: bool) -> list[Column]:
        """TupleData → Columns: NULL is None, unchanged TOAST ('u') is left out, text is converted.

        The hot path: reads with local offsets and builds error texts only on error.
        """
        (count,) = reader.unpack(_INT16, "tuple column count")
        described = relation.columns
        if count != len(described):
            reader.pos -= _INT16.size
            raise reader.error(
                f"tuple has {count} columns, the Relation message of "
                f"{relation.schema}.{relation.table} {len(described)}"
            )
        data, pos, size = reader.data, reader.pos, len(reader.data)
        columns = []
        for column in described:
            if pos >= size:
                reader.pos = pos
                raise reader.error(f"truncated: column {column.name!r} kind missing")
            kind = data[pos]  # Byte1 kind
            pos += 1
            if kind == _TEXT:
                if pos + 4 > size:
                    reader.pos = pos
                    raise reader.error(f"truncated: column {column.name!r} length needs 4 bytes")
                end = pos + 4 + int.from_bytes(data[pos : pos + 4])  # Int32 length, then the text output
                if end > size:
                    reader.pos = pos + 4
                    raise reader.error(f"truncated: column {column.name!r} value of {end - pos - 4} bytes")
                raw, pos = data[pos + 4 : end], end
                if keys_only and not column.is_key:
                    continue
                value = self._convert(reader, relation, column, raw)
            elif kind == _NULL:
                value = None
            elif kind == _UNCHANGED_TOAST:
                continue  # absent, exactly as wal2json omits it
            else:
                reader.pos = pos - 1
                problem = "binary mode not supported" if kind == _BINARY else f"unknown tuple column kind {chr(kind)!r}"
                raise reader.error(f"column {column.name!r}: {problem}")
            if keys_only and not column.is_key:
                continue  # a 'K' tuple carries every column, NULL but for the key
            columns.append(Column(column.name, column.type_name, column.type_oid, value))
        reader.pos = pos
        return columns

    def _convert(self, reader: PayloadReader, relation: Relation, column: RelationColumn, raw: bytes) -> Any:
        try:
            return column.convert(raw.decode())
        except UnicodeDecodeError:
            raise reader.error(f"column {column.name!r} is not UTF-8 (the database encoding must be UTF8)") from None
        except (ValueError, TypeError, ArithmeticError) as e:
            raise reader.error(
                f"column {relation.schema}.{relation.table}.{column.name} ({column.type_name}): {e}"
            ) from e

    def _change(
        self,
        kind: Kind,
        relation: Relation,
        lsn: int,
        columns: list[Column],
        identity: list[Column],
    ) -> list[ChangeMessage]:
        transaction = self._current()
        message = ChangeMessage(
            kind,
            lsn,
            transaction.xid,
            transaction.timestamp_ms,
            None,  # next_lsn: B and C only
            relation.schema,
            relation.table,
            columns,
            identity,
            shape=relation.shape,
        )
        return [message]

    # -- streamed transactions (protocol >= 2) ----------------------------------------------

    def _streamed_xid(self, reader: PayloadReader) -> None:
        """Skip the [xid] field: present only in messages of a streamed transaction (replayed at its commit,
        where the subtransaction no longer matters: its aborts were applied to the spill)."""
        if self._replaying is not None:
            reader.uint32("streamed xid")

    def _current(self) -> _Transaction:
        if self._replaying is not None:
            return self._replaying  # the top-level xid and the commit time, from Stream Commit
        return self._transaction if self._transaction is not None else _Transaction(None, None)

    def _stream_start(self, reader: PayloadReader) -> list[ChangeMessage]:
        xid, _first_segment = reader.unpack(_STREAM_START, "xid, first segment")
        if self._stream_xid is not None:
            raise reader.error(f"Stream Start of xid {xid} inside the stream of xid {self._stream_xid}")
        self._stream_xid = xid
        return []

    def _stream_stop(self, reader: PayloadReader) -> list[ChangeMessage]:
        if self._stream_xid is None:
            raise reader.error("Stream Stop without Stream Start")
        self._stream_xid = None
        return []

    def _stream_commit(self, reader: PayloadReader) -> Iterator[ChangeMessage]:
        xid = reader.uint32("xid")
        _flags, commit_lsn, end_lsn, commit_time = reader.unpack(_COMMIT, "flags, commit LSN, end LSN, commit time")
        return self._replay(xid, commit_lsn, end_lsn, _epoch_ms(commit_time))

    def _replay(self, xid: int, commit_lsn: int, end_lsn: int, timestamp_ms: int) -> Iterator[ChangeMessage]:
        """Begin, the transaction's spilled messages decoded in stream order, Commit."""
        spilled = self._spilled.size_of(xid)
        payloads = self._spilled.commit(xid)  # now: it may refuse (StreamedAbortAmbiguous) before anything is given
        if spilled:
            log.info("capture: streamed transaction %d committed: decoding its %.1f MiB spilled", xid, spilled / 2**20)
        return self._replayed(xid, commit_lsn, end_lsn, timestamp_ms, payloads)

    def _replayed(
        self, xid: int, commit_lsn: int, end_lsn: int, timestamp_ms: int, payloads: Iterator[tuple[int, bytes]]
    ) -> Iterator[ChangeMessage]:
        yield ChangeMessage(Kind.BEGIN, commit_lsn, xid=xid, timestamp_ms=timestamp_ms)
        self._replaying = _Transaction(xid, timestamp_ms)
        try:
            for lsn, payload in payloads:
                yield from self._decode(payload, lsn)
        finally:
            self._replaying = None
        yield ChangeMessage(Kind.COMMIT, commit_lsn, xid=xid, timestamp_ms=timestamp_ms, next_lsn=end_lsn)

    def _stream_abort(self, reader: PayloadReader) -> list[ChangeMessage]:
        xid, subxid = reader.unpack(_STREAM_ABORT, "xid, subtransaction xid")
        self._spilled.abort(xid, subxid)
        return []


_HANDLERS: dict[str, Callable[[PgOutputDecoder, PayloadReader], Iterable[ChangeMessage]]] = {
    "B": PgOutputDecoder._begin,
    "C": PgOutputDecoder._commit,
    "O": PgOutputDecoder._origin,
    "R": PgOutputDecoder._relation,
    "Y": PgOutputDecoder._type,
    "I": PgOutputDecoder._insert,
    "U": PgOutputDecoder._update,
    "D": PgOutputDecoder._delete,
    "T": PgOutputDecoder._truncate,
    "M": PgOutputDecoder._message,
    "S": PgOutputDecoder._stream_start,
    "E": PgOutputDecoder._stream_stop,
    "c": PgOutputDecoder._stream_commit,
    "A": PgOutputDecoder._stream_abort,
}


def _epoch_ms(pg_microseconds: int) -> int:
    """Microseconds since 2000-01-01 → Unix epoch milliseconds (floor, as the wal2json decoder)."""
    return pg_microseconds // 1000 + _PG_EPOCH_MS


def _quote_identifier(name: str) -> str:
    """publication_names is a list of SQL identifiers: quote one that is not plain lower case."""
    if name and name.replace("_", "a").isalnum() and name.islower() and not name[0].isdigit() and name.isascii():
        return name
    return '"' + name.replace('"', '""') + '"'
