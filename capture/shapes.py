"""Each captured table's shape at the stream's position: the columns a change's row images have.

A change event carries exactly the columns its table had when the change was written (issue 32),
never those of the connector's catalog of today, which is *ahead* of the stream after a restart or
while a backlog is caught up (columns added or renamed since), and *behind* it while capture runs
and DDL happens (columns dropped since). The row images themselves come from the stream; what needs
the shape is an UPDATE whose unchanged TOASTed values the plugin left out: those columns, and only
those, are filled (capture.events). Which ones were left out:

* **pgoutput**: the Relation message in force (the server sends one before the first change of a
  table after each DDL, and at the start of each session): ``ChangeMessage.shape``. Exact: the
  columns marked 'u' are those the Relation message has and the tuple lacks.
* **wal2json** marks nothing: an UPDATE just omits an unchanged TOASTed column. Its shape is tracked
  from the stream. An INSERT carries every column, and so does the old row of an UPDATE or DELETE
  under REPLICA IDENTITY FULL: such a change *confirms* the shape. Between two of them a DDL shows in
  the stream only as a transaction without row changes (wal2json sends the B and C of a transaction
  that changed the catalog only) or as an UPDATE with a column the shape lacks:
  :meth:`ShapeTracker.possible_ddl`. An UPDATE after such a sign that would be filled first checks the
  shape against the catalog (read again when it is older than the sign): a column the catalog no longer
  has was dropped (not filled); one it has under a new name, where the gone one was, with the same
  type, was renamed.
* **the snapshot**: the catalog it read with (:meth:`ShapeTracker.snapshot_read`).

Renamed columns keep their earlier names (``Shape.aliases``): the TOAST cache and the key state keep a
row's values under the names they had when it was stored, and a fill of ``body`` (renamed from
``big``) takes the value kept under ``big``.

The shapes are kept in the key state (capture.keystate, ``shapes``: written in the SQLite transaction
that follows the log transaction storing the position), so a restart starts from the shapes at the
stored position, not from the catalog of the day. A table first seen without one (a key state from
before, or lost) starts from the catalog.

What the stream cannot tell, with wal2json (pgoutput has none of these):

* a DDL and an UPDATE leaving a TOASTed value unchanged in one transaction, with no confirming change
  of the table between them: the transaction is not empty, and the UPDATE's columns may all be known;
* a column dropped after the change, when a DDL sign came between the shape's confirmation and the
  change, and the catalog was read after both: the catalog says it is gone, and the UPDATE lacks its
  value (filled before, left out now);
* renames the catalog cannot tell from a drop and an add (several at once with other types).

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capture.messages import ChangeMessage, Column, Kind, RowShape
from capture.tables import toastable_type

if TYPE_CHECKING:
    from capture.keystate import KeyState
    from capture.tables import TableCatalog, TableInfo

SIGN_META = "shape_sign"  # the key state's meta row: the last position where a table may have changed unseen
UNCONFIRMED = -1  # a shape no change has confirmed (from the catalog, or caught up from the log)


@dataclass(frozen=True, slots=True)
class Shape:
    """A table's columns at a position of the stream."""

    names: tuple[str, ...]
    types: tuple[str, ...]  # format_type's names, as the stream and the catalog write them
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # column → its earlier names, newest first
    toastable: frozenset[str] = frozenset()  # the columns outside the key whose values may be TOASTed
    name_set: frozenset[str] = frozenset()
    types_by_name: dict[str, str] = field(default_factory=dict)
    # each column's pg_attribute.attnum when the shape is known exactly (the snapshot's catalog, a DDL message of
    # capture.schema_changes, and each DDL message since): () when it was inferred from the stream
    attnums: tuple[int, ...] = ()

    @classmethod
    def of(cls, names: tuple[str, ...], types: tuple[str, ...], key: tuple[str, ...],
           aliases: dict[str, tuple[str, ...]] | None = None, attnums: tuple[int, ...] = ()) -> Shape:  # fmt: skip
        toastable = frozenset(n for n, t in zip(names, types, strict=True) if toastable_type(t) and n not in key)
        return cls(names, types, aliases or {}, toastable, frozenset(names), dict(zip(names, types, strict=True)),
                   attnums if len(attnums) == len(names) else ())  # fmt: skip

    def to_json(self, confirmed: int) -> str:
        out: dict[str, Any] = {"names": self.names, "types": self.types, "aliases": self.aliases,
                               "confirmed": confirmed}  # fmt: skip
        if self.attnums:
            out["attnums"] = self.attnums
        return json.dumps(out)


@dataclass(slots=True)
class _Tracked:
    shape: Shape
    confirmed: int  # the commit LSN of the change that last showed the whole shape (UNCONFIRMED: none)
    stored: int  # ``confirmed`` as last written to the key state (UNCONFIRMED: never written)
    source: RowShape | None = None  # pgoutput: the Relation message's shape it was last seen as


class ShapeTracker:
    """The shapes of the captured tables as the stream goes (see the module docstring)."""

    def __init__(self, keystate: KeyState) -> None:
        self.keystate = keystate
        self.sign = 0  # the last position where a table may have changed without a change showing it
        self._tracked: dict[str, _Tracked] = {}  # topic → its shape (read from the key state at first sight)
        self.reconciled = 0  # shapes checked against the catalog (tests, logs)
        # DDL messages flow (capture.schema_changes: ``--schema-changes`` installed the event triggers): a shape read
        # with its attnums stays exact, each DDL telling how it changed; without them, attnums say nothing of the
        # DDL to come and a shape is checked against the catalog after a sign like any other
        self.exact = False

    def load(self) -> None:
        """The shapes at the stored position (a stream starts there): what the key state holds (read as each
        table is first seen: a topic tracked later has its key state caught up from the log first)."""
        self._tracked.clear()
        self.sign = int(self.keystate.meta(SIGN_META) or 0)

    def _stored(self, topic: str) -> dict[str, Any] | None:
        text = self.keystate.shape(topic)
        return None if text is None else dict(json.loads(text))

    def possible_ddl(self, lsn: int) -> None:
        """The stream showed, at ``lsn``, that a table may have changed without a change of it saying how."""
        if lsn > self.sign:
            self.sign = lsn
            self.keystate.put_meta(SIGN_META, str(lsn))

    def snapshot_read(self, table: TableInfo, topic: str, lsn: int) -> None:
        """The snapshot read ``table`` with the catalog's columns, at ``lsn``."""
        names = tuple(c.name for c in table.columns)
        types = tuple(c.type_name for c in table.columns)
        attnums = tuple(c.attnum for c in table.columns) if self.exact and all(c.attnum for c in table.columns) else ()
        self._set(table, topic, Shape.of(names, types, table.key, attnums=attnums), lsn)

    def ddl(self, table: TableInfo, topic: str, columns: list[tuple[str, str, int]], lsn: int) -> None:
        """A DDL message (capture.schema_changes) at ``lsn``: the table's columns (name, type, attnum) after it,
        exactly. A column whose attnum the shape had under another name was renamed (its earlier names kept as
        aliases, for the TOAST fill); without the attnums of the shape before (a shape inferred from the stream),
        the renames are paired as :meth:`_successor` pairs them."""
        tracked = self._of(table, topic)
        previous = tracked.shape
        names = tuple(name for name, _, _ in columns)
        types = tuple(type_name for _, type_name, _ in columns)
        attnums = tuple(attnum for _, _, attnum in columns)
        if not previous.attnums:
            shape = self._successor(previous, names, types, table.key)
            self._set(table, topic, Shape.of(names, types, table.key, shape.aliases, attnums), lsn)
            return
        before = dict(zip(previous.attnums, previous.names, strict=True))
        aliases: dict[str, tuple[str, ...]] = {}
        for name, attnum in zip(names, attnums, strict=True):
            old = before.get(attnum)
            if old is not None and old != name:
                aliases[name] = (old, *previous.aliases.get(old, ()))
            elif old == name and name in previous.aliases:
                aliases[name] = previous.aliases[name]
        self._set(table, topic, Shape.of(names, types, table.key, aliases, attnums), lsn)

    def is_catalog_shape(self, table: TableInfo, topic: str, *, types: bool = False) -> bool:
        """Whether the table's shape at the stream's position has the catalog's columns (the native core, which
        checks a change against the catalog, may then handle its changes; capture.native); ``types``: with the
        catalog's types too."""
        tracked = self._tracked.get(topic)
        if tracked is not None:
            names, type_names = tracked.shape.names, tracked.shape.types
        else:
            stored = self._stored(topic)
            if stored is None:
                return True
            names, type_names = tuple(stored["names"]), tuple(stored["types"])
        if set(names) != table.column_names:
            return False
        catalog = {c.name: c.type_name for c in table.columns}
        return not types or all(catalog[n] == t for n, t in zip(names, type_names, strict=True))

    def at(self, m: ChangeMessage, table: TableInfo, topic: str, lsn: int, catalog: TableCatalog) -> Shape:
        """The shape of ``table`` at the change ``m`` of the transaction committed at ``lsn`` (what its row
        images hold, unchanged TOASTed values included); the tracked shape follows it."""
        tracked = self._of(table, topic)
        if m.shape is not None:  # pgoutput: the Relation message in force
            if tracked.source is not m.shape:
                if m.shape.names != tracked.shape.names or m.shape.types != tracked.shape.types:
                    tracked = self._set(table, topic, self._successor(tracked.shape, m.shape.names, m.shape.types,
                                                                      table.key), lsn)  # fmt: skip
                tracked.source = m.shape
            return tracked.shape
        whole = self._whole_row(m, table)
        if whole is not None:
            if len(whole) != len(tracked.shape.names) or any(tracked.shape.types_by_name.get(c.name) != c.type_name
                                                             for c in whole):  # fmt: skip
                names, types = tuple(c.name for c in whole), tuple(c.type_name for c in whole)
                return self._set(table, topic, self._successor(tracked.shape, names, types, table.key), lsn).shape
            self._confirm(topic, tracked, lsn)
            return tracked.shape
        if m.kind is not Kind.UPDATE:
            return tracked.shape  # a DELETE's old key: it shows nothing of the shape
        shape = tracked.shape
        new = [c for c in m.columns if c.name not in shape.name_set]
        # a column the change carries under another type than the shape's: ALTER COLUMN … TYPE since
        retyped = {c.name: c.type_name for c in m.columns if c.name in shape.name_set and c.type_name
                   and shape.types_by_name.get(c.name) != c.type_name}  # fmt: skip
        if new or retyped:
            self.possible_ddl(lsn)  # columns added, renamed or retyped since the shape was confirmed
        present = {c.name for c in m.columns}
        # a fill ahead, and the shape unsure: a sign since it was confirmed, or in this very transaction (a DDL
        # in it: the shapes of its changes are only as sure as the catalog after its commit)
        # (a shape known exactly, kept so by DDL messages, is never unsure)
        unsure = not (shape.attnums and self.exact) and (tracked.confirmed < self.sign or self.sign == lsn)
        if unsure and any(n not in present for n in shape.names):
            tracked = self._reconcile(table, topic, tracked, lsn, catalog)
            shape = tracked.shape
        # every column the change carries exists at the change (the catalog may have dropped it since), with the
        # type the change carries it under
        more = [c for c in m.columns if c.name not in shape.name_set]
        if more or any(shape.types_by_name.get(n) != t for n, t in retyped.items()):
            types = tuple(retyped.get(n, t) for n, t in zip(shape.names, shape.types, strict=True))
            shape = Shape.of(shape.names + tuple(c.name for c in more), types + tuple(c.type_name for c in more),
                             table.key, shape.aliases)  # fmt: skip
            tracked = self._set(table, topic, shape, lsn)
        elif present == shape.name_set:
            self._confirm(topic, tracked, lsn)
        return shape

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _whole_row(m: ChangeMessage, table: TableInfo) -> list[Column] | None:
        """The change's columns when they are the whole row: an INSERT's, the old row under REPLICA IDENTITY FULL
        (wal2json writes every column of it, NULLs included; the server detoasts it)."""
        if m.kind is Kind.INSERT:
            return m.columns
        if m.kind in (Kind.UPDATE, Kind.DELETE) and table.replica_identity == "f" and m.identity:
            return m.identity
        return None

    def _of(self, table: TableInfo, topic: str) -> _Tracked:
        tracked = self._tracked.get(topic)
        if tracked is not None:
            return tracked
        stored = self._stored(topic)
        if stored is not None:
            aliases = {k: tuple(v) for k, v in stored.get("aliases", {}).items()}
            shape = Shape.of(tuple(stored["names"]), tuple(stored["types"]), table.key, aliases,
                             tuple(int(a) for a in stored.get("attnums", ())))  # fmt: skip
            confirmed = int(stored.get("confirmed", UNCONFIRMED))
            tracked = _Tracked(shape, confirmed, confirmed)
        else:  # nothing stored: the catalog's (a table new to the key state)
            names = tuple(c.name for c in table.columns)
            shape = Shape.of(names, tuple(c.type_name for c in table.columns), table.key)
            tracked = _Tracked(shape, UNCONFIRMED, UNCONFIRMED)
        self._tracked[topic] = tracked
        return tracked

    def _set(self, table: TableInfo, topic: str, shape: Shape, lsn: int) -> _Tracked:
        tracked = self._tracked[topic] = _Tracked(shape, lsn, lsn)
        if self.keystate.is_tracked(topic):
            self.keystate.put_shape(topic, shape.to_json(lsn))
        return tracked

    def _confirm(self, topic: str, tracked: _Tracked, lsn: int) -> None:
        """A change showed the whole shape again; stored when the stored one was unconfirmed since a sign."""
        tracked.confirmed = max(tracked.confirmed, lsn)
        if tracked.stored < self.sign <= lsn and self.keystate.is_tracked(topic):
            tracked.stored = tracked.confirmed
            self.keystate.put_shape(topic, tracked.shape.to_json(tracked.confirmed))

    def _reconcile(self, table: TableInfo, topic: str, tracked: _Tracked, lsn: int, catalog: TableCatalog) -> _Tracked:
        """The tracked shape against the catalog read after the last sign: dropped columns go, renamed ones
        take their new names (the catalog is read again when it is older than the sign)."""
        current = catalog.current(table.schema, table.name)
        if current is None or catalog.read_lsn < self.sign:
            current = catalog.refresh(table.schema, table.name)
        if current is None:
            return tracked
        self.reconciled += 1
        shape = _aligned(tracked.shape, tuple(c.name for c in current.columns),
                         tuple(c.type_name for c in current.columns), table.key)  # fmt: skip
        if shape.names == tracked.shape.names and shape.aliases == tracked.shape.aliases:
            self._confirm(topic, tracked, lsn)
            return tracked
        return self._set(table, topic, shape, lsn)

    @staticmethod
    def _successor(previous: Shape, names: tuple[str, ...], types: tuple[str, ...], key: tuple[str, ...]) -> Shape:
        """The shape the stream shows next (whole), with the earlier names of the columns renamed since
        ``previous``: the gone columns and the new ones pair up in order when they are as many, with the same
        types (a column dropped and another added in its place, of its type, passes for a rename: its value
        can be an unchanged TOASTed one only after a table rewrite)."""
        renamed = _renames(previous, names, types)
        aliases: dict[str, tuple[str, ...]] = {}
        for name in names:
            old = renamed.get(name)
            if old is not None:
                aliases[name] = (old, *previous.aliases.get(old, ()))
            elif name in previous.aliases and name in previous.name_set:
                aliases[name] = previous.aliases[name]
        return Shape.of(names, types, key, aliases)


def _renames(previous: Shape, names: tuple[str, ...], types: tuple[str, ...]) -> dict[str, str]:
    """New name → old name of the columns ``previous`` has and ``names`` lacks, paired with those it adds."""
    now = set(names)
    gone = [(n, t) for n, t in zip(previous.names, previous.types, strict=True) if n not in now]
    added = [(n, t) for n, t in zip(names, types, strict=True) if n not in previous.name_set]
    if not gone or len(gone) != len(added) or any(g[1] != a[1] for g, a in zip(gone, added, strict=True)):
        return {}
    return {a[0]: g[0] for g, a in zip(gone, added, strict=True)}


def _aligned(tracked: Shape, names: tuple[str, ...], types: tuple[str, ...], key: tuple[str, ...]) -> Shape:
    """The tracked shape, its columns the catalog (``names``, ``types``) no longer has dropped and its renamed
    ones under their new names; columns the catalog added are not taken (they may be later than the change)."""
    renamed = {old: new for new, old in _renames(tracked, names, types).items()}
    now = set(names)
    kept_names: list[str] = []
    kept_types: list[str] = []
    aliases: dict[str, tuple[str, ...]] = {}
    for name, type_name in zip(tracked.names, tracked.types, strict=True):
        if name in now:
            kept_names.append(name)
            if name in tracked.aliases:
                aliases[name] = tracked.aliases[name]
        elif name in renamed:
            kept_names.append(renamed[name])
            aliases[renamed[name]] = (name, *tracked.aliases.get(name, ()))
        else:
            continue  # dropped
        kept_types.append(type_name)
    return Shape.of(tuple(kept_names), tuple(kept_types), key, aliases)
