"""What the native core writes a table's Avro keys and values with (``--value-format avro``).

The core (native/src/avro.rs) writes Avro binary itself, framed as :mod:`schemas.wire` frames
it; it re-derives nothing from schema text. :func:`layout_of` reads what it needs from the
schemas the Python path registered for the table (``AvroEncoder.ids``, so the ids are those
the Python path frames with): the key and value schema ids; per row field, in order, its
name, the catalog's type OID (a change carrying another OID takes the Python path, which reads
the catalog again), its kind as :mod:`schemas.pgavro` / :mod:`schemas.pgvalues` write it
(``Kind``'s value; arrays as ``"array"``, which only NULL is written of natively) and where
``null`` and the value sit in its union; and the envelope's, ``source``'s and ``transaction``'s
fields in order, each with its type and union branches.

A layout the core has no encoding for (an envelope field it does not know, a ``source``
field that is neither a string nor a long, a key field laid out unlike its row field) gives
None: the table's changes keep taking the Python path.

Thread-safety: pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture.tables import TableInfo
from schemas.pgavro import DECIMAL_SPECIAL, Kind, PgColumn
from schemas.tables import TableSchemaIds

NONE = -1  # no such union branch (or not a union)
ENVELOPE_FIELDS = frozenset({"before", "after", "source", "op", "ts_ms", "transaction"})
SOURCE_FIELDS = frozenset(
    {"version", "connector", "name", "ts_ms", "snapshot", "db", "schema", "table", "txId", "commit_lsn", "lsn",
     "event_index"}
)  # fmt: skip
TRANSACTION_FIELDS = frozenset({"id", "total_order", "data_collection_order"})
SCALARS = frozenset({"string", "long"})

# (name, type OID, type name (format_type's, typmod included), kind, precision, scale, null branch, value branch)
ColumnLayout = tuple[str, int, str, str, int, int, int, int]
# (name, "string" | "long", null branch, value branch)
FieldLayout = tuple[str, str, int, int]


@dataclass(frozen=True, slots=True)
class AvroLayout:
    """The arguments of ``tideline_native.Core.register_avro`` for one table (after its ``table_id``; given by
    capture.native.handle.CoreHandle.register)."""

    key_id: int
    value_id: int
    columns: list[ColumnLayout]  # the row record's fields, in order
    envelope: list[tuple[str, int, int]]  # (name, null branch, value branch), in order
    source: list[FieldLayout]
    transaction: list[FieldLayout]


def branches(node: Any) -> tuple[int, int]:
    """Where null and the (first) value branch sit in a field's type: (NONE, NONE) when it is no union."""
    if not isinstance(node, list):
        return NONE, NONE
    null = node.index("null") if "null" in node else NONE
    value = next((i for i, b in enumerate(node) if b != "null"), NONE)
    return null, value


def _value_branches(node: Any) -> list[Any]:
    return [b for b in node if b != "null"] if isinstance(node, list) else [node]


def _is_decimal_union(values: list[Any]) -> bool:
    """``[bytes decimal, DecimalSpecial]``: the branch order the core writes numeric(p,s) with."""
    if len(values) != 2 or not isinstance(values[0], dict) or values[0].get("logicalType") != "decimal":
        return False
    special = values[1]
    return special == DECIMAL_SPECIAL or (isinstance(special, dict) and special.get("name") == DECIMAL_SPECIAL)


def _column(field: dict[str, Any], column: PgColumn) -> ColumnLayout | None:
    ctype = column.column_type
    values = _value_branches(field["type"])
    kind = "array" if ctype.dimensions else ctype.kind.value
    if ctype.dimensions == 0 and ctype.kind is Kind.DECIMAL:
        if not _is_decimal_union(values):
            return None
    elif len(values) != 1:
        return None
    null, value = branches(field["type"])
    precision, scale = ctype.precision or 0, ctype.scale or 0
    return (column.name, column.type_oid, column.type_name, kind, precision, scale, null, value)


def _fields(record: Any, known: frozenset[str]) -> list[FieldLayout] | None:
    """A record of strings and longs (each maybe nullable) whose fields the core knows: their layouts."""
    if not isinstance(record, dict) or record.get("type") != "record":
        return None
    out: list[FieldLayout] = []
    for field in record["fields"]:
        values = _value_branches(field["type"])
        if field["name"] not in known or len(values) != 1 or values[0] not in SCALARS:
            return None
        out.append((field["name"], values[0], *branches(field["type"])))
    return out


def _expected(name: str, row: dict[str, Any]) -> tuple[Any, ...]:
    """The types the core writes an envelope field other than source and transaction as."""
    if name in ("before", "after"):
        return (row, row["name"])  # the row record, defined in before and named in after
    return ("string",) if name == "op" else ("long",)


def layout_of(ids: TableSchemaIds, table: TableInfo) -> AvroLayout | None:
    """The layout of ``table``'s registered schemas ``ids`` (None: one the core cannot write)."""
    row_fields = ids.schemas.value["fields"]
    row_columns = ids.row_codec.columns
    if [f["name"] for f in row_fields] != [c.name for c in row_columns]:
        return None
    columns = [_column(f, c) for f, c in zip(row_fields, row_columns, strict=True)]
    by_name = {f["name"]: f for f in row_fields}
    key_fields = ids.schemas.key["fields"]
    if [f["name"] for f in key_fields] != list(table.key):
        return None
    for field in key_fields:  # the core writes a key field as its row field
        row_type = by_name[field["name"]]["type"]
        if branches(field["type"]) != branches(row_type) or len(_value_branches(field["type"])) != len(
            _value_branches(row_type)
        ):
            return None
    envelope: list[tuple[str, int, int]] = []
    source: list[FieldLayout] | None = None
    transaction: list[FieldLayout] | None = None
    for field in ids.schemas.envelope["fields"]:
        name, node = field["name"], field["type"]
        values = _value_branches(node)
        if name not in ENVELOPE_FIELDS or len(values) != 1:
            return None
        if name == "source":
            source = _fields(values[0], SOURCE_FIELDS)
        elif name == "transaction":
            transaction = _fields(values[0], TRANSACTION_FIELDS)
        elif values[0] not in _expected(name, ids.schemas.value):
            return None
        envelope.append((name, *branches(node)))
    if source is None or transaction is None or any(c is None for c in columns):
        return None
    return AvroLayout(ids.key_id, ids.value_id, [c for c in columns if c is not None], envelope, source, transaction)
