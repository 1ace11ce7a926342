"""Schemas benchmark: Avro (Confluent framing, fastavro) vs JSON (orjson) for change events.

The events: ``n`` change-event envelopes (op ``c``) of a 6-column table like the capture
benchmark's — ``id bigint``, ``qty integer``, ``price numeric(12,2)``, ``name text``,
``created_at timestamptz``, ``note text`` — built from the Python values capture
produces (int, Decimal, str, aware datetime), with a full ``source`` block.

1. Encode: Python values → bytes. Avro: ``RowCodec.envelope_to_avro`` (value
   conversion) + ``AvroWire.encode_many`` (one schema lookup per batch); JSON:
   ``capture.pgtypes.dumps`` of the same envelope (what the connector writes).
2. Decode: bytes → the JSON form. Avro: ``AvroWire.decode_many`` (logical types off)
   + ``RowCodec.envelope_to_json``; JSON: ``orjson.loads``. Informational: Avro
   ``decode_many`` alone, and the encoded sizes.

No target of docs/targets.md covers schemas: every figure is informational. Avro and JSON
run back to back, ``RUNS`` pairs; the ratio is the median of the per-pair ratios (Avro
events/s ÷ JSON events/s), the best-of-N ratio an extra column.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import orjson

from bench.report import Paired, Section, measured, measured_paired
from capture.pgtypes import dumps as json_dumps
from schemas.pgavro import PgColumn
from schemas.registry import MemorySchemaStore, SchemaRegistry
from schemas.tables import TableSchemas
from schemas.wire import AvroWire

if TYPE_CHECKING:
    from bench.__main__ import Context

KEY = "schemas"
TITLE = "Schemas: Avro encode/decode of change events vs JSON (orjson)"

FULL_EVENTS = 100_000
QUICK_EVENTS = 5_000
RUNS = 5

COLUMNS = [
    PgColumn("id", "bigint", 20, not_null=True),
    PgColumn("qty", "integer", 23),
    PgColumn("price", "numeric(12,2)", 1700),
    PgColumn("name", "text", 25),
    PgColumn("created_at", "timestamp with time zone", 1184),
    PgColumn("note", "text", 25),
]


def make_rows(n: int) -> list[dict[str, Any]]:
    start = datetime(2024, 1, 1, tzinfo=UTC)
    return [
        {
            "id": i,
            "qty": i % 1000,
            "price": Decimal(i % 100_000) / 100 + Decimal("0.00"),
            "name": f"customer-{i % 5000}",
            "created_at": start + timedelta(microseconds=i * 1_013),
            "note": None if i % 3 else f"note {i}",
        }
        for i in range(n)
    ]


def source_of(i: int) -> dict[str, Any]:
    return {"version": "tideline-0.1", "connector": "postgresql", "name": "bench", "ts_ms": 1_700_000_000_000,
            "snapshot": "false", "db": "bench", "schema": "public", "table": "orders", "txId": 1000 + i // 100,
            "commit_lsn": 1 << 24 | i // 100, "lsn": 1 << 24 | i, "event_index": i % 100}  # fmt: skip


def rate(n: int, step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    return n / (time.perf_counter() - t0)


def paired_rates(n: int, runs: int, step: Callable[[], object], peer: Callable[[], object]) -> Paired:
    """``runs`` pairs of ``step`` then ``peer``, back to back: events/s of each."""
    values, peers = [], []
    for _ in range(runs):
        values.append(rate(n, step))
        peers.append(rate(n, peer))
    return Paired(values, peers)


def run(ctx: Context, section: Section) -> None:
    n = QUICK_EVENTS if ctx.quick else FULL_EVENTS
    rows = make_rows(n)
    sources = [source_of(i) for i in range(n)]
    registry = SchemaRegistry(MemorySchemaStore())
    ids = TableSchemas(registry, prefix="bench").for_table("public", "orders", COLUMNS, key_columns=["id"])
    codec, wire = ids.row_codec, AvroWire(registry.schema_by_id, logical_types=False)
    writer = AvroWire(registry.schema_by_id)
    envelopes = [{"before": None, "after": r, "source": s, "op": "c", "ts_ms": 1_700_000_000_001, "transaction": None}
                 for r, s in zip(rows, sources, strict=True)]  # fmt: skip
    ctx.say(f"generated {n:,} events")

    def avro_encode() -> list[bytes]:
        datums = [codec.envelope_to_avro(op="c", before=None, after=r, source=s, ts_ms=1_700_000_000_001)
                  for r, s in zip(rows, sources, strict=True)]  # fmt: skip
        return writer.encode_many(ids.value_id, datums)

    def json_encode() -> list[bytes]:
        return [json_dumps(e) for e in envelopes]

    avro_values, json_values = avro_encode(), json_encode()
    check = codec.envelope_to_json(wire.decode(avro_values[7]))
    assert orjson.dumps(check) == json_values[7], "Avro and JSON disagree on the same event"

    def json_decode() -> object:
        return [orjson.loads(v) for v in json_values]

    encode = paired_rates(n, RUNS, avro_encode, json_encode)
    decode = paired_rates(n, RUNS, lambda: [codec.envelope_to_json(d) for d in wire.decode_many(avro_values)],
                          json_decode)  # fmt: skip
    decode_raw = paired_rates(n, RUNS, lambda: wire.decode_many(avro_values), json_decode)
    avro_bytes = sum(map(len, avro_values)) / n
    json_bytes = sum(map(len, json_values)) / n

    section.results += [
        measured_paired("Avro encode (convert + frame), events/s", encode, "events/s",
                        baseline_name="orjson dumps (capture.pgtypes.dumps)", note=f"events/s {encode.spread()}"),
        measured_paired("Avro decode to JSON form, events/s", decode, "events/s", baseline_name="orjson loads",
                        note=f"events/s {decode.spread()}"),
        measured_paired("Avro decode_many alone (underlying values), events/s", decode_raw, "events/s",
                        baseline_name="orjson loads", note=f"events/s {decode_raw.spread()}"),
        measured("Avro bytes per event", avro_bytes, "bytes", baseline_name="JSON bytes per event",
                 baseline_value=json_bytes),
    ]  # fmt: skip
    section.notes += [
        f"{n:,} `c` envelopes of a 6-column table (bigint, integer, numeric(12,2), text, timestamptz, text; "
        f"a third of `note` NULL) with a full `source` block; {RUNS} pairs of runs (Avro, then JSON, back to "
        "back) per figure, single thread, data in memory.",
        "Encode: Avro = `RowCodec.envelope_to_avro` + `AvroWire.encode_many` (Confluent framing, one schema "
        "lookup per batch); JSON = `capture.pgtypes.dumps` of the same Python envelope.",
        "Decode: Avro = `AvroWire.decode_many(logical_types=False)` + `RowCodec.envelope_to_json` (the dict whose "
        "`orjson.dumps` equals capture's JSON, checked); JSON = `orjson.loads`. No target (docs/targets.md): "
        "informational.",
    ]
