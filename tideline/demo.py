"""``tideline demo``: capture and the log end to end, verified, with a summary.

Capture (tideline.demo_capture): a private Postgres with wal2json is started, filled,
captured (snapshot), put through a workload, captured again (stream), checked against
the table, and stopped. The log: topics in a fresh directory, keyed records through the
producer API and the CLI's ``produce`` path, read back and checked (count, offsets,
per-partition order, partitioning), then a compacted topic is compacted and the latest
value of every key checked. Each check prints ✓ or ✗; any ✗ makes the exit code 1.
(Commands, projections and Spark join the demo with their issues.)

Record values start with a 10-digit sequence number (``0000000042|…``), assigned in
production order: that is what the order and exactly-once checks read back.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from eventstore.consumer import TABLE_SCHEMA, Consumer, TopicPartition
from eventstore.errors import ConfigError
from eventstore.log import Log
from eventstore.partitioner import partitions_for_keys
from eventstore.producer import Producer
from tideline.cli_common import one_line_errors
from tideline.demo_capture import TOPIC as CAPTURE_TOPIC
from tideline.demo_capture import CaptureResult, run_capture_demo
from tideline.log_cli import PartitionCleaning, compact_topic, produce_lines

ORDERS_TOPIC = "demo.orders"
PROFILES_TOPIC = "demo.customer-profiles"
SEQ_DIGITS = 10
API_CHUNK = 20_000  # records per send_batch call
CUSTOMERS = 20_000
PROFILE_KEYS = 2_000
CONSUMER_POLL_BYTES = 16 << 20


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class DemoResult:
    """Measurements and checks of one demo run."""

    directory: Path
    partitions: int
    api_records: int = 0
    api_seconds: float = 0.0
    cli_records: int = 0
    cli_seconds: float = 0.0
    consumed: int = 0
    consume_seconds: float = 0.0
    profile_records: int = 0
    cleaning: list[PartitionCleaning] = field(default_factory=list)
    profiles_after: int = 0
    capture: CaptureResult | None = None
    bytes_on_disk: int = 0
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


# ---------------------------------------------------------------------------- data


def _order_value(seq: int, order: int) -> bytes:
    return (
        b'%010d|{"order":"order-%08d","items":%d,"amount_cents":%d,"currency":"EUR","status":"placed",'
        b'"note":"demo order written by tideline demo"}' % (seq, order, 1 + order % 7, (order * 7919) % 100_000)
    )


def _customer_key(i: int) -> bytes:
    return b"customer-%05d" % ((i * 7919) % CUSTOMERS)


def _cli_lines(first_seq: int, count: int) -> tuple[bytes, int]:
    """``produce`` input: keyed lines, every 10th keyless, every 25th a tombstone; returns (text, seqs used)."""
    lines = []
    seq = first_seq
    for j in range(count):
        if j % 25 == 24:
            lines.append(_customer_key(j) + b"\t\\N\n")
            continue
        value = _order_value(seq, first_seq + j)
        lines.append(value + b"\n" if j % 10 == 9 else _customer_key(j) + b"\t" + value + b"\n")
        seq += 1
    return b"".join(lines), seq - first_seq


def _sequence_numbers(values: pa.Array) -> np.ndarray:
    """The leading sequence number of every non-null value, as int64."""
    present = pc.drop_null(values)
    digits = pc.cast(pc.binary_slice(present, 0, SEQ_DIGITS), pa.string())
    return np.asarray(pc.cast(digits, pa.int64()).to_numpy(zero_copy_only=False))


# ---------------------------------------------------------------------------- phases


def _prepare_directory(directory: Path | None) -> Path:
    """A fresh, empty log directory; by default ``<data dir>/demo-<timestamp>``."""
    if directory is not None:
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise ConfigError(f"{directory} is not empty: the demo needs a fresh directory")
        return directory
    from tideline.cli import State  # imported late: tideline.cli imports this module

    parent = State.data_dir
    if not parent.exists() or (parent.is_dir() and not any(parent.iterdir())):
        Log(parent, create=True).close()  # keep the data dir a usable log, not a bare folder
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = parent / f"demo-{stamp}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = parent / f"demo-{stamp}-{n}"
    return candidate


def _produce_api(log: Log, result: DemoResult, progress: Progress, task: TaskID) -> None:
    started = time.monotonic()
    with Producer(log) as producer:
        for start in range(0, result.api_records, API_CHUNK):
            stop = min(start + API_CHUNK, result.api_records)
            keys = [_customer_key(i) for i in range(start, stop)]
            values = [_order_value(i, i) for i in range(start, stop)]
            producer.send_batch(ORDERS_TOPIC, values, keys)
            progress.advance(task, stop - start)
    result.api_seconds = time.monotonic() - started


def _produce_cli(log: Log, result: DemoResult, progress: Progress, task: TaskID) -> int:
    """Feed ``produce`` lines through the CLI's code path; returns sequence numbers used."""
    text, seqs = _cli_lines(result.api_records, result.cli_records)
    summary = produce_lines(log, ORDERS_TOPIC, io.BytesIO(text))
    result.cli_seconds = summary.seconds
    progress.advance(task, summary.records)
    result.checks.append(
        Check(
            "CLI produce path wrote every line",
            summary.records == result.cli_records,
            f"{summary.records} records ({summary.keyless} keyless, {summary.tombstones} tombstones)",
        )
    )
    return seqs


def read_partitions(log: Log, topic: str, on_records: Callable[[int], None] | None = None) -> dict[int, pa.Table]:
    """Every record of ``topic`` up to the current end offsets, one Arrow table per partition."""
    meta = log.topic(topic)
    tps = [TopicPartition(topic, p) for p in range(meta.partitions)]
    parts: dict[int, list[pa.Table]] = {p: [] for p in range(meta.partitions)}
    with Consumer(log, max_poll_bytes=CONSUMER_POLL_BYTES) as consumer:
        consumer.assign(tps)
        end = consumer.end_offsets(tps)
        consumer.seek_to_beginning()
        while active := [tp for tp in consumer.assignment() if consumer.position(tp) < end[tp]]:
            consumer.assign(active)
            records = consumer.poll(0)
            if not records:
                break
            for batch in records.batches:
                parts[batch.batch.partition].append(batch.to_table())
            if on_records is not None:
                on_records(len(records))
    return {p: pa.concat_tables(ts) if ts else TABLE_SCHEMA.empty_table() for p, ts in parts.items()}


def _check_orders(log: Log, result: DemoResult, seqs_used: int, progress: Progress, task: TaskID) -> None:
    started = time.monotonic()
    tables = read_partitions(log, ORDERS_TOPIC, lambda n: progress.advance(task, n))
    result.consume_seconds = time.monotonic() - started
    result.consumed = sum(t.num_rows for t in tables.values())
    produced = result.api_records + result.cli_records
    checks = result.checks
    checks.append(Check("consumed every record", result.consumed == produced, f"{result.consumed} of {produced}"))
    dense = all(np.array_equal(t["offset"].to_numpy(), np.arange(t.num_rows, dtype=np.int64)) for t in tables.values())
    checks.append(Check("offsets dense and increasing per partition", dense, f"{len(tables)} partitions"))
    seqs = {p: _sequence_numbers(t["value"].combine_chunks()) for p, t in tables.items()}
    ordered = all(bool(np.all(np.diff(s) > 0)) for s in seqs.values())
    checks.append(Check("production order kept per partition", ordered, "sequence numbers increase"))
    everything = np.sort(np.concatenate(list(seqs.values()))) if seqs else np.array([], np.int64)
    exactly_once = np.array_equal(everything, np.arange(result.api_records + seqs_used, dtype=np.int64))
    checks.append(Check("every value exactly once", exactly_once, f"{len(everything)} distinct sequence numbers"))
    misplaced = 0
    for p, t in tables.items():
        keys = pc.drop_null(t["key"].combine_chunks())
        misplaced += int(np.count_nonzero(partitions_for_keys(keys, result.partitions) != p))
    checks.append(Check("keys in their murmur2 partition", misplaced == 0, f"{misplaced} misplaced"))


def _check_compaction(log: Log, result: DemoResult, progress: Progress, task: TaskID) -> None:
    """Overwrite a few thousand keys many times, delete some, compact, check the survivors."""
    n = result.profile_records
    keys = [b"profile-%05d" % ((i * 31) % PROFILE_KEYS) for i in range(n)]
    values: list[bytes | None] = [b'%010d|{"version":%d}' % (i, i // PROFILE_KEYS) for i in range(n)]
    for i in range(max(0, n - PROFILE_KEYS // 20), n):  # the last writes of some keys delete them
        values[i] = None
    latest = dict(zip(keys, values, strict=True))
    with Producer(log) as producer:
        for start in range(0, n, API_CHUNK):
            producer.send_batch(PROFILES_TOPIC, values[start : start + API_CHUNK], keys[start : start + API_CHUNK])
            progress.advance(task, min(API_CHUNK, n - start))
    for p in range(log.topic(PROFILES_TOPIC).partitions):
        log.partition(PROFILES_TOPIC, p).roll()  # the active segment is never compacted: close it
    result.cleaning = compact_topic(log, PROFILES_TOPIC)
    survivors: dict[bytes, bytes | None] = {}
    tables = read_partitions(log, PROFILES_TOPIC)
    for table in tables.values():
        survivors.update(zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True))
    result.profiles_after = sum(t.num_rows for t in tables.values())
    progress.advance(task, n)
    stats = [c.compaction for c in result.cleaning]
    result.checks.append(
        Check(
            "compaction kept the latest value of every key",
            survivors == latest,
            f"{len(latest)} keys, {sum(v is None for v in latest.values())} deleted (tombstones kept for now)",
        )
    )
    result.checks.append(
        Check(
            "compaction removed every overwritten value",
            result.profiles_after == len(latest),
            f"{sum(s.records_read for s in stats)} → {result.profiles_after} records",
        )
    )


def run_demo(
    directory: Path, *, records: int, partitions: int, console: Console, capture_rows: int = 0, transactions: int = 0
) -> DemoResult:
    """Run every phase in ``directory`` (created; must be fresh) and return what happened.

    ``capture_rows`` > 0 runs the capture phase first (it needs the Postgres 15 binaries).
    """
    result = DemoResult(directory, partitions, api_records=records)
    result.cli_records = max(100, records // 20)
    result.profile_records = max(PROFILE_KEYS * 5, records // 5)
    columns = (
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Log(directory, create=True) as log, Progress(*columns, console=console) as progress:
        if capture_rows > 0:
            result.capture = run_capture_demo(
                directory, log, rows=capture_rows, transactions=transactions, progress=progress
            )
            _check_capture(result)
        log.create_topic(ORDERS_TOPIC, partitions, overrides={"segment_bytes": str(8 << 20)})
        log.create_topic(PROFILES_TOPIC, 2, overrides={"cleanup_policy": "compact", "segment_bytes": str(128 << 10)})
        api = progress.add_task("produce (producer API)", total=result.api_records)
        cli = progress.add_task("produce (CLI produce path)", total=result.cli_records)
        consume = progress.add_task("consume + verify", total=result.api_records + result.cli_records)
        compaction = progress.add_task("compact + verify", total=2 * result.profile_records)
        _produce_api(log, result, progress, api)
        seqs_used = _produce_cli(log, result, progress, cli)
        _check_orders(log, result, seqs_used, progress, consume)
        _check_compaction(log, result, progress, compaction)
    result.bytes_on_disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return result


def _check_capture(result: DemoResult) -> None:
    cap = result.capture
    assert cap is not None and cap.snapshot is not None and cap.stream is not None
    result.checks.append(
        Check(
            "capture: snapshot has every row",
            cap.snapshot.snapshot_rows == cap.rows_initial,
            f"{cap.snapshot.snapshot_rows:,} of {cap.rows_initial:,} rows",
        )
    )
    result.checks.append(
        Check(
            "capture: latest value per key = SELECT * FROM shop.orders",
            cap.mismatches == 0 and cap.table_rows > 0,
            f"{cap.table_rows:,} rows, {cap.mismatches} differing keys",
        )
    )
    result.checks.append(
        Check("capture: no event stored twice", cap.duplicates == 0, f"{cap.events_in_topic:,} change events")
    )


# ---------------------------------------------------------------------------- report


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}/s" if seconds > 0 else "-"


def _print_report(console: Console, result: DemoResult) -> None:
    for check in result.checks:
        mark = "[green]✓[/green]" if check.ok else "[red]✗[/red]"
        console.print(f"{mark} {check.name}: {check.detail}", soft_wrap=True)
    stats = [c.compaction for c in result.cleaning]
    table = Table(title="tideline demo", show_header=False)
    table.add_column("what")
    table.add_column("value")
    produced = result.api_records + result.cli_records
    cap = result.capture
    if cap is not None and cap.stream is not None and cap.snapshot is not None:
        table.add_row(
            "capture",
            f"{cap.snapshot.snapshot_rows:,} snapshot rows in {cap.snapshot_seconds:.1f} s; "
            f"{cap.stream.events:,} streamed events ({cap.statements:,} statements in {cap.transactions:,} "
            f"transactions) in {cap.stream_seconds:.1f} s ({_rate(cap.stream.events, cap.stream_seconds)})",
        )
        table.add_row(
            "capture lag",
            f"last change stored {cap.stream.lag_ms():,} ms after its commit; "
            f"slot retains {cap.retained_wal_bytes:,} B of WAL; {cap.stream.to_json()['lag_bytes']:,} B behind",
        )
        table.add_row("capture topic", f"{CAPTURE_TOPIC} ({cap.events_in_topic:,} change events)")
    table.add_row("records produced", f"{produced:,} ({result.api_records:,} API + {result.cli_records:,} CLI)")
    table.add_row("produce, producer API", _rate(result.api_records, result.api_seconds))
    table.add_row("produce, CLI path", _rate(result.cli_records, result.cli_seconds))
    table.add_row("consume", f"{result.consumed:,} records, {_rate(result.consumed, result.consume_seconds)}")
    table.add_row("partitions", f"{result.partitions} ({ORDERS_TOPIC}) + 2 ({PROFILES_TOPIC})")
    table.add_row(
        "compaction",
        f"{sum(s.records_read for s in stats):,} → {result.profiles_after:,} records, "
        f"{sum(s.bytes_read for s in stats):,} → {sum(s.bytes_written for s in stats):,} bytes",
    )
    table.add_row("bytes on disk", f"{result.bytes_on_disk:,}")
    table.add_row("data", str(result.directory.resolve()))
    console.print(table)
    hint = f"inspect it: tideline --data-dir {result.directory} log describe {ORDERS_TOPIC}"
    console.print(hint, markup=False, soft_wrap=True)
    verdict = "[green]all checks passed[/green]" if result.ok else "[red]some checks failed[/red]"
    console.print(verdict)


def demo_command(
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="Fresh directory for the demo log (default: <data dir>/demo-<timestamp>).",
            show_default=False,
        ),
    ] = None,
    records: Annotated[int, typer.Option("--records", help="Records produced through the producer API.")] = 200_000,
    partitions: Annotated[int, typer.Option("--partitions", help="Partitions of the demo topic.")] = 4,
    capture_rows: Annotated[
        int, typer.Option("--capture-rows", help="Rows in the captured table before the snapshot (0: skip capture).")
    ] = 20_000,
    transactions: Annotated[int, typer.Option("--transactions", help="Workload transactions to capture.")] = 500,
) -> None:
    """Produce, consume, verify and compact on the embedded log; print ✓/✗ per check and a summary.

    Exits 1 if a check fails. The data stays in the directory it names.
    """
    console = Console(highlight=False)
    with one_line_errors():
        if records < 1:
            raise ConfigError(f"--records must be ≥ 1, got {records}")
        if not 1 <= partitions <= 256:
            raise ConfigError(f"--partitions must be within 1 … 256, got {partitions}")
        target = _prepare_directory(directory)
        if capture_rows < 0 or transactions < 0:
            raise ConfigError("--capture-rows and --transactions must be ≥ 0")
        result = run_demo(
            target,
            records=records,
            partitions=partitions,
            console=console,
            capture_rows=capture_rows,
            transactions=transactions,
        )
    _print_report(console, result)
    if not result.ok:
        raise typer.Exit(1)
