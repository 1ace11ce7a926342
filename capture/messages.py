"""The plugin-neutral seam between a logical decoding plugin and the rest of capture.

A decoder (:class:`Decoder`) turns one payload of the replication stream into zero or
more :class:`ChangeMessage` values; everything after it (envelopes, TOAST filling,
transactions, the log) only sees those. A plugin is a decoder and a :class:`Plugin`
member whose :class:`Capabilities` say what its stream can and cannot tell, and whether
the native core decodes it; what a decoder needs from the connector comes in
:class:`DecoderSettings` (pgoutput: the publications, the protocol, where streamed
transactions spill). Its decoder is made by ``capture.decoders.decoder_for``: this
module names the decoder's class, it does not import it (the decoders import this module).

Positions: ``lsn`` is the WAL position of the change (``BEGIN`` shares the first
change's LSN; one statement's rows may share one), so an event is identified by
``(commit_lsn, event_index)``: the commit LSN of its transaction and its 0-based index
among the transaction's changes, as docs/capture.md ("Events") states it.

Values in ``columns``/``identity`` are already converted to Python values (see
:mod:`capture.pgtypes` for the mapping table): ``Decimal`` for numeric, parsed JSON for
json/jsonb, lists for arrays, ``bytes`` for bytea, ``datetime``/``date``/``time``/
``Interval`` for temporal types, ``str`` for what Python cannot hold exactly. A column
missing from an UPDATE's ``columns`` (unchanged TOAST: wal2json omits it, the pgoutput
decoder leaves its 'u' columns out the same way) is simply absent (capture.events fills
it). Neither plugin sends UPDATE/DELETE of tables without a replica identity (wal2json
skips them; pgoutput gets such tables through an insert/truncate-only publication,
capture.publications): capture.tables captures them keyless, inserts only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eventstore.errors import TidelineError


class Plugin(enum.Enum):
    """Logical decoding output plugins, with what each can and cannot tell us."""

    WAL2JSON = "wal2json"
    PGOUTPUT = "pgoutput"  # streams the tables of publications (capture.publications)

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES[self]

    @property
    def implemented(self) -> bool:
        return self.capabilities.decoder is not None


@dataclass(frozen=True, slots=True)
class DecoderSettings:
    """What a connector tells the decoder of its stream; each plugin takes what applies to it."""

    dsn: str | None = None  # the source database (pgoutput names non-built-in types with its format_type)
    publications: tuple[str, ...] = ()  # pgoutput: publication_names
    proto_version: int = 2  # pgoutput: 1-3 (2 and 3 can stream in-progress transactions)
    streaming: bool = True  # pgoutput, protocol >= 2: big transactions arrive before their commit, spilled to disk
    spill_dir: Path | None = None  # where streamed transactions wait for their commit (None: the system's temp dir)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a plugin's stream carries (drives fallbacks in the rest of capture)."""

    decoder: str | None  # "module:Class" of its decoder in capture.decoders (None: not implemented yet)
    marks_unchanged_toast: bool  # pgoutput marks them 'u' (its decoder omits them too); wal2json omits the column
    numeric_nan_distinct: bool  # wal2json renders numeric/real/double NaN and ±Infinity as JSON null
    needs_publication: bool  # pgoutput streams only tables of a publication
    emits_type_oids: bool
    emits_primary_key: bool
    emits_generated_columns: bool  # stored generated columns in row images (pgoutput 15 leaves them out)
    # A partition's changes come under the partition's name (wal2json), not its partitioned table's (pgoutput's
    # publication publishes them as the root's with publish_via_partition_root)
    names_partitions: bool
    # The native core (capture.native) decodes its row changes in compiled code: native/src has a reader for its
    # payloads, and capture.native.handle maps this member to the extension's tideline_native.Plugin (a plugin
    # without one takes the Python path; --core native refuses it)
    native_core: bool


_CAPABILITIES = {
    Plugin.WAL2JSON: Capabilities(
        decoder="capture.decoders.wal2json:Wal2JsonDecoder",
        marks_unchanged_toast=False,
        numeric_nan_distinct=False,
        needs_publication=False,
        emits_type_oids=True,
        emits_primary_key=True,
        emits_generated_columns=True,
        names_partitions=True,
        native_core=True,
    ),
    Plugin.PGOUTPUT: Capabilities(
        decoder="capture.decoders.pgoutput:PgOutputDecoder",
        marks_unchanged_toast=True,
        numeric_nan_distinct=True,
        needs_publication=True,
        emits_type_oids=True,
        emits_primary_key=False,
        emits_generated_columns=False,
        names_partitions=False,
        native_core=True,
    ),
}


class Kind(enum.Enum):
    BEGIN = "B"
    COMMIT = "C"
    INSERT = "I"
    UPDATE = "U"
    DELETE = "D"
    TRUNCATE = "T"
    MESSAGE = "M"


@dataclass(slots=True)
class Column:
    """One column's name, type and value in a change (value already converted)."""

    name: str
    type_name: str  # as the server names it, e.g. "numeric(12,2)", "text[]", "timestamp with time zone"
    type_oid: int  # 0 when unknown
    value: Any


@dataclass(frozen=True, slots=True)
class RowShape:
    """The columns a table had at a change, as the stream itself describes them (pgoutput: the Relation message
    in force), in column order: what the change's row images hold, an unchanged TOASTed value included (it is
    left out of ``columns``, then filled: capture.events). wal2json describes no shape of its own: an UPDATE omits
    its unchanged TOASTed columns without a mark, so capture.shapes tracks the shape from the stream for it."""

    names: tuple[str, ...]
    types: tuple[str, ...]  # as the stream names them (format_type's names, typmod included)


@dataclass(slots=True)
class ChangeMessage:
    """One decoded item of the stream: a transaction boundary, a row change, a truncate or a message."""

    kind: Kind
    lsn: int  # WAL position of this item (for B/C: the commit record, as wal2json gives it)
    xid: int | None = None
    timestamp_ms: int | None = None  # commit time of the transaction (wal2json gives it on every record)
    next_lsn: int | None = None  # B/C: end of the commit record (what we confirm)
    schema: str | None = None
    table: str | None = None
    columns: list[Column] = field(default_factory=list)  # new row image (I, U)
    identity: list[Column] = field(default_factory=list)  # old key / old row (U, D) per REPLICA IDENTITY
    primary_key: list[str] = field(default_factory=list)  # primary key column names, in key order
    # logical messages (M)
    transactional: bool = True
    prefix: str | None = None
    content: bytes | None = None
    # truncates (T): what the TRUNCATE statement said (pgoutput tells; wal2json does not: False)
    truncate_cascade: bool = False
    truncate_restart_identity: bool = False
    # I, U, D: the table's columns at the change when the stream says (pgoutput), else None (capture.shapes)
    shape: RowShape | None = None


class Decoder(Protocol):
    """Turns one replication payload into messages. Stateless between payloads or not: its choice."""

    plugin: Plugin

    def slot_options(self) -> dict[str, str]:
        """Options for ``START_REPLICATION … LOGICAL … (options)``."""
        ...

    def decode(self, payload: bytes, lsn: int) -> Iterable[ChangeMessage]:
        """Messages of one payload whose XLogData message starts at WAL position ``lsn``.

        Raises :class:`DecodeError` naming what is wrong. Usually a list; may be an iterator
        when one payload stands for very many messages (pgoutput's Stream Commit replays a
        whole streamed transaction): consume it before the next call.
        """
        ...

    def close(self) -> None:
        """Release what the decoder holds (files of streamed transactions, catalog connections)."""
        ...


class DecodeError(TidelineError):
    """A payload from the plugin that cannot be decoded (the connector stops: nothing is written)."""


class StreamingAmbiguous(TidelineError):
    """A transaction streamed before its commit (``DecoderSettings.streaming``) cannot be decoded exactly from
    the stream: the connector reconnects with streaming off, so the server sends each transaction whole."""
