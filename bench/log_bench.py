"""Log (eventstore) benchmarks: append, read and compaction against raw file I/O.

Every figure is measured in the same run as its peer, on the same filesystem, and the
two are interleaved run by run (engine, raw, engine, raw, …) so that drift in the disk
hits both; each reports the medians of both sides' runs and the median of the per-pair
ratios (best run ÷ best run as an extra column). Data is generated before timing starts,
and ``os.sync()`` runs before every timed step so that no earlier dirty page is flushed
on its clock.

1. Append: 200-byte values through ``Producer.send_batch`` (about 1 MiB per batch, fsync
   per batch: the default policy) into a 1-partition topic, keyless and keyed; peer: a
   raw sequential write of the same bytes with the same write sizes (``os.write`` +
   ``os.fdatasync`` per batch-sized chunk). Informational: the per-record ``send()``
   API, and 1-record batches (stored size, and durable appends/s against a raw 200-byte
   ``write`` + ``fdatasync``).
2. Read: a consumer from offset 0 over the keyless data (``poll()`` counting rows, and
   ``to_table()``), page cache warm; peer: ``os.read`` of the segment files in 4 MiB
   chunks. Informational: iterating ``ConsumerRecord`` objects.
3. Transactions: records/s with one transaction per 1,000 records (``begin`` →
   ``send_batch`` → ``commit``: coordinator state fsynced on the first partition and at
   the decision, data batch, commit marker per partition); peer: the same 1,000-record
   ``send_batch`` calls without transactions (idempotent producer), same run,
   interleaved. Once into 1 partition, once keyed over 4 partitions.
4. Compaction: ``compact_partition`` over the closed 8 MiB segments of a compacted topic
   (1M records over 100k random keys); peer: a raw copy (read + write + fsync per file)
   of the same segment files. MB/s count the input (closed segment) bytes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa

from bench.report import Paired, Section, measured, measured_paired
from eventstore.cleaner import CleanStats, compact_partition
from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from eventstore.record_batch import HEADER_SIZE, build_records, encode_batch
from eventstore.segment import list_segment_bases, log_path, scan_batches
from eventstore.topic import CleanupPolicy, TopicConfig

if TYPE_CHECKING:
    from bench.__main__ import Context

T = TypeVar("T")

KEY = "log"
TITLE = "Log (eventstore): append, read, compaction"

MB = 1e6
RECORD_BYTES = 200
READ_CHUNK = 4 << 20  # raw read size; equal to the consumer's default max_poll_bytes
COPY_CHUNK = 8 << 20
TOPIC = "bench"


@dataclass(frozen=True, slots=True)
class Sizes:
    append_records: int
    append_runs: int  # fsync-bound and noisy on a virtual disk: more runs than the others
    read_runs: int  # cheap: more runs against page-cache noise
    runs: int
    send_records: int
    single_appends: int
    compact_records: int
    compact_keys: int
    compact_segment_bytes: int
    txn_records: int


FULL = Sizes(
    append_records=1_000_000,
    append_runs=7,
    read_runs=5,
    runs=3,
    send_records=100_000,
    single_appends=300,
    compact_records=1_000_000,
    compact_keys=100_000,
    compact_segment_bytes=8 << 20,
    txn_records=200_000,
)
QUICK = Sizes(
    append_records=100_000,
    append_runs=2,
    read_runs=2,
    runs=2,
    send_records=10_000,
    single_appends=30,
    compact_records=100_000,
    compact_keys=10_000,
    compact_segment_bytes=1 << 20,
    txn_records=20_000,
)


# ---------------------------------------------------------------------------- data


def make_values(n: int, size: int, seed: int) -> pa.Array:
    """``n`` random binary values of ``size`` bytes, built without a per-record loop."""
    data = np.random.default_rng(seed).bytes(n * size)
    offsets = np.arange(0, (n + 1) * size, size, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def make_keys(ids: Any) -> pa.Array:
    return pa.array([b"key-%d" % i for i in ids], pa.binary())


def timed_call(fn: Callable[[], T]) -> tuple[float, T]:
    """``os.sync()`` (no earlier dirty page is flushed on the clock), then time ``fn()``."""
    os.sync()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def timed(fn: Callable[[], object]) -> float:
    return timed_call(fn)[0]


def batch_sizes(directory: Path) -> list[int]:
    """Stored size of every batch in the partition directory, in log order."""
    sizes: list[int] = []
    for base in list_segment_bases(directory):
        path = log_path(directory, base)
        fd = os.open(path, os.O_RDONLY)
        try:
            sizes += [b.header.size for b in scan_batches(fd, path, 0, verify_crc=False).batches]
        finally:
            os.close(fd)
    return sizes


def segment_files(directory: Path) -> list[Path]:
    return [log_path(directory, b) for b in list_segment_bases(directory)]


# ---------------------------------------------------------------------------- raw peers


def raw_write(path: Path, sizes: list[int], chunk: bytes) -> float:
    """Seconds to append ``sizes`` bytes per call to a new file, fdatasync after each call."""
    view = memoryview(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def go() -> None:
            for size in sizes:
                written = 0
                while written < size:
                    written += os.write(fd, view[written:size])
                os.fdatasync(fd)

        return timed(go)
    finally:
        os.close(fd)
        path.unlink()


def raw_read(files: list[Path]) -> int:
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, READ_CHUNK):
                total += len(chunk)
        finally:
            os.close(fd)
    return total


def raw_copy(files: list[Path], dest: Path) -> None:
    """Copy each file to ``dest`` (read, write, fsync per file), then fsync ``dest``."""
    for path in files:
        fin = os.open(path, os.O_RDONLY)
        fout = os.open(dest / path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while chunk := os.read(fin, COPY_CHUNK):
                view = memoryview(chunk)
                written = 0
                while written < len(chunk):
                    written += os.write(fout, view[written:])
            os.fsync(fout)
        finally:
            os.close(fin)
            os.close(fout)
    dfd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------- append


@dataclass(frozen=True, slots=True)
class AppendRun:
    seconds: float
    directory: Path  # the partition directory
    sizes: list[int]  # stored batch sizes

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes)


def append_once(root: Path, values: pa.Array, keys: pa.Array | None) -> AppendRun:
    root.mkdir(parents=True)
    with Log(root / "log") as log:
        log.create_topic(TOPIC, 1)
        with Producer(log) as producer:
            seconds = timed(lambda: producer.send_batch(TOPIC, values, keys))
    pdir = root / "log" / f"{TOPIC}-0"
    return AppendRun(seconds, pdir, batch_sizes(pdir))


def bench_append(ctx: Context, section: Section, sizes: Sizes, values: pa.Array, keys: pa.Array) -> Path:
    """Append keyless and keyed; returns the partition directory of a keyless run (for reads)."""
    n = len(values)
    root = ctx.workdir / "append"
    chunk = np.random.default_rng(7).bytes(max(8 << 20, 2 * sizes.append_records))

    # warm-up: imports, Arrow kernels, partitioner, the filesystem's allocation paths
    warm = append_once(root / "warm", values.slice(0, 20_000), keys.slice(0, 20_000))
    raw_write(root / "warm.raw", warm.sizes, chunk)
    shutil.rmtree(root / "warm")

    runs: dict[str, list[AppendRun]] = {"keyless": [], "keyed": []}
    raws: dict[str, list[float]] = {"keyless": [], "keyed": []}
    keep: Path | None = None
    for i in range(sizes.append_runs):
        for variant, k in (("keyless", None), ("keyed", keys)):
            run = append_once(root / f"{variant}-{i}", values, k)
            raw = raw_write(root / f"{variant}-{i}.raw", run.sizes, chunk)
            runs[variant].append(run)
            raws[variant].append(raw)
            ctx.say(
                f"append {variant} run {i + 1}: {n / run.seconds:,.0f} records/s, "
                f"{run.stored_bytes / run.seconds / MB:,.0f} MB/s; raw write {run.stored_bytes / raw / MB:,.0f} MB/s"
            )
            if variant == "keyless" and keep is None:
                keep = run.directory
            else:
                shutil.rmtree(run.directory.parent.parent)
    assert keep is not None

    rates: dict[str, float] = {}
    for variant in ("keyless", "keyed"):
        first = runs[variant][0]
        stored = first.stored_bytes
        # each raw run wrote its engine run's bytes, with the same write sizes
        mbps = Paired([r.stored_bytes / r.seconds / MB for r in runs[variant]],
                      [r.stored_bytes / s / MB for r, s in zip(runs[variant], raws[variant], strict=True)])  # fmt: skip
        records = Paired([n / r.seconds for r in runs[variant]], [n / s for s in raws[variant]])
        rates[variant] = records.value
        section.results.append(
            measured_paired(
                f"append {variant}, 1 MiB batches, fsync/batch",
                mbps,
                "MB/s",
                baseline_name="raw write+fdatasync",
                min_ratio=0.5,
                note=(
                    f"{len(first.sizes)} batches of ≈{stored / len(first.sizes) / (1 << 20):.2f} MiB, "
                    f"{stored / n:.1f} stored B/record for {RECORD_BYTES} B values"
                    + (" + 'key-N' keys" if variant == "keyed" else "")
                    + f"; MB/s {mbps.spread()}"
                ),
            )
        )
        section.results.append(
            measured_paired(
                f"append {variant}, records/s",
                records,
                "records/s",
                baseline_name="raw write, per record",
                min_value=500_000,
            )
        )

    # per-record send(): informational
    m = sizes.send_records
    py_values: list[bytes] = values.slice(0, m).to_pylist()
    send_root = ctx.workdir / "send"
    send_root.mkdir()
    with Log(send_root / "log") as log:
        log.create_topic(TOPIC, 1)
        with Producer(log) as producer:

            def send_all() -> None:
                futures = [producer.send(TOPIC, v) for v in py_values]
                producer.flush()
                for f in futures:
                    f.result()

            send_s = timed(send_all)
    shutil.rmtree(send_root)
    section.results.append(
        measured(
            "append via per-record send() (keyless)",
            m / send_s,
            "records/s",
            baseline_name="send_batch keyless (median run)",
            baseline_value=rates["keyless"],
            note=f"{m:,} records, default linger_ms=5 / batch_size=1 MiB, then flush() and every future's result()",
        )
    )
    ctx.say(f"send() per record: {m / send_s:,.0f} records/s")

    bench_single_appends(ctx, section, sizes, values, keys, chunk)
    return keep


def bench_single_appends(
    ctx: Context, section: Section, sizes: Sizes, values: pa.Array, keys: pa.Array, chunk: bytes
) -> None:
    """1-record batches: stored bytes, and durable appends/s vs a raw 200-byte write + fdatasync.

    Two engine paths: ``Producer.send_batch`` with one keyed record (partitioner, encoding,
    append), and ``Log.append`` of an already encoded 1-record batch (the storage alone).
    """
    m = sizes.single_appends
    root = ctx.workdir / "single"
    root.mkdir()
    one_values = [values.slice(j, 1) for j in range(m)]
    one_keys = [keys.slice(j, 1) for j in range(m)]
    encoded = encode_batch(build_records(one_keys[0], one_values[0]), first_timestamp=0, max_timestamp=0)
    producer_s: list[float] = []
    append_s: list[float] = []
    raw_s: list[float] = []
    stored: list[int] = []
    for i in range(sizes.runs):
        with Log(root / f"producer-{i}") as log:
            log.create_topic(TOPIC, 1)
            with Producer(log) as producer:
                for j in range(10):  # warm-up
                    producer.send_batch(TOPIC, one_values[j], one_keys[j])

                def send_each(p: Producer = producer) -> None:
                    for v, k in zip(one_values, one_keys, strict=True):
                        p.send_batch(TOPIC, v, k)

                producer_s.append(timed(send_each))
        stored = batch_sizes(root / f"producer-{i}" / f"{TOPIC}-0")[10:]
        shutil.rmtree(root / f"producer-{i}")
        with Log(root / f"append-{i}") as log:
            log.create_topic(TOPIC, 1)
            for _ in range(10):
                log.append(TOPIC, 0, bytearray(encoded))
            copies = [bytearray(encoded) for _ in range(m)]

            def append_each(lg: Log = log, batches: list[bytearray] = copies) -> None:
                for batch in batches:
                    lg.append(TOPIC, 0, batch)

            append_s.append(timed(append_each))
        shutil.rmtree(root / f"append-{i}")
        raw_s.append(raw_write(root / f"raw-{i}", [RECORD_BYTES] * m, chunk))
    per_batch = statistics.mean(stored)
    key_bytes = statistics.mean(len(k) for k in keys.slice(0, m).to_pylist())
    via_producer = Paired([m / s for s in producer_s], [m / s for s in raw_s])
    via_append = Paired([m / s for s in append_s], [m / s for s in raw_s])
    section.results.append(
        measured(
            "1-record batch, stored bytes",
            per_batch,
            "B",
            baseline_name=f"{RECORD_BYTES} B value",
            baseline_value=RECORD_BYTES,
            note=(
                f"{HEADER_SIZE} B batch header + {per_batch - HEADER_SIZE:.0f} B Arrow IPC message for a "
                f"{RECORD_BYTES} B value and a {key_bytes:.0f} B key: "
                f"{per_batch - RECORD_BYTES - key_bytes:.0f} B of overhead per 1-record batch"
            ),
        )
    )
    section.results.append(
        measured_paired(
            "1-record batches via send_batch, durable appends/s",
            via_producer,
            "appends/s",
            baseline_name=f"raw {RECORD_BYTES} B write+fdatasync",
            note=f"{m} keyed `send_batch` calls of one record each, fsync per batch; {via_producer.spread()}",
        )
    )
    section.results.append(
        measured_paired(
            "1-record batches via Log.append (pre-encoded), durable appends/s",
            via_append,
            "appends/s",
            baseline_name=f"raw {RECORD_BYTES} B write+fdatasync",
            note=f"the storage path alone: no partitioner, no encoding; {via_append.spread()}",
        )
    )
    ctx.say(
        f"1-record batches: {per_batch:.0f} B each; send_batch {via_producer.value:,.0f}/s, "
        f"Log.append {via_append.value:,.0f}/s, raw {via_producer.peer:,.0f}/s (medians)"
    )


# ---------------------------------------------------------------------------- read


def consume(log_dir: Path, mode: str) -> tuple[float, int]:
    """Seconds and record count to read the topic from offset 0 (``count``, ``table``, ``objects``)."""
    with Log(log_dir, create=False) as log:
        tp = TopicPartition(TOPIC, 0)
        count = 0

        def go() -> None:
            nonlocal count
            consumer = Consumer(log)
            consumer.assign([tp])
            consumer.seek_to_beginning()
            while records := consumer.poll():
                if mode == "count":
                    count += len(records)
                elif mode == "table":
                    count += records.to_table().num_rows
                else:
                    for _ in records:
                        count += 1

        return timed(go), count


def bench_read(ctx: Context, section: Section, sizes: Sizes, pdir: Path, expected: int) -> None:
    files = segment_files(pdir)
    log_dir = pdir.parent
    total = raw_read(files)  # warm the page cache
    consume(log_dir, "count")  # and the consumer's code paths
    raw_s: list[float] = []
    got: dict[str, list[float]] = {"count": [], "table": []}
    for _ in range(sizes.read_runs):
        raw_s.append(timed(lambda: raw_read(files)))
        for mode in got:
            seconds, count = consume(log_dir, mode)
            if count != expected:
                raise AssertionError(f"consumer read {count} records, expected {expected}")
            got[mode].append(seconds)
    obj_s, count = consume(log_dir, "objects")
    if count != expected:
        raise AssertionError(f"consumer read {count} records as objects, expected {expected}")
    labels = {"count": "read Arrow, poll + count rows", "table": "read Arrow, poll + to_table()"}
    count_rate = 0.0
    for mode, secs in got.items():
        mbps = Paired([total / s / MB for s in secs], [total / s / MB for s in raw_s])
        records = Paired([expected / s for s in secs], [expected / s for s in raw_s])
        count_rate = count_rate or records.value
        section.results.append(
            measured_paired(
                labels[mode],
                mbps,
                "MB/s",
                baseline_name="raw read",
                min_ratio=0.5,
                note=f"{expected:,} records, {total / MB:,.0f} MB of segments, page cache warm; MB/s {mbps.spread()}",
            )
        )
        section.results.append(
            measured_paired(
                f"{labels[mode]}, records/s",
                records,
                "records/s",
                baseline_name="raw read, per record",
                min_value=1_000_000,
            )
        )
        ctx.say(f"read {mode}: {records.value:,.0f} records/s, {mbps.value:,.0f} MB/s (raw {mbps.peer:,.0f}; medians)")
    section.results.append(
        measured(
            "read as ConsumerRecord objects, records/s",
            expected / obj_s,
            "records/s",
            baseline_name="Arrow poll + count (median run)",
            baseline_value=count_rate,
            note="iterating ConsumerRecords (one run)",
        )
    )
    ctx.say(f"read objects: {expected / obj_s:,.0f} records/s")


# ---------------------------------------------------------------------------- compaction


def bench_compaction(ctx: Context, section: Section, sizes: Sizes, values: pa.Array) -> None:
    n, k = sizes.compact_records, sizes.compact_keys
    root = ctx.workdir / "compact"
    source = root / "source"
    ids = np.random.default_rng(11).integers(0, k, n)
    keys = make_keys(ids)
    config = TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=sizes.compact_segment_bytes)
    with Log(source, fsync=FsyncPolicy(FsyncMode.NONE)) as log:  # setup, not timed
        log.create_topic(TOPIC, 1, config)
        with Producer(log) as producer:
            producer.send_batch(TOPIC, values.slice(0, n), keys)
    os.sync()
    pdir = source / f"{TOPIC}-0"
    closed = segment_files(pdir)[:-1]
    closed_bytes = sum(p.stat().st_size for p in closed)
    raw_read(closed)  # warm

    comp_s: list[float] = []
    copy_s: list[float] = []
    stats: CleanStats | None = None
    for i in range(sizes.runs):
        work = root / f"run-{i}"
        shutil.copytree(source, work)
        with Log(work, create=False) as log:
            seconds, stats = timed_call(partial(compact_partition, log.partition(TOPIC, 0)))
            comp_s.append(seconds)
        shutil.rmtree(work)
        dest = root / f"copy-{i}"
        dest.mkdir()
        copy_s.append(timed(partial(raw_copy, closed, dest)))
        shutil.rmtree(dest)
        ctx.say(
            f"compaction run {i + 1}: {closed_bytes / comp_s[-1] / MB:,.0f} MB/s; "
            f"raw copy {closed_bytes / copy_s[-1] / MB:,.0f} MB/s"
        )
    assert stats is not None
    if stats.bytes_read != closed_bytes:
        raise AssertionError(f"compaction read {stats.bytes_read} bytes, the closed segments hold {closed_bytes}")
    mbps = Paired([closed_bytes / s / MB for s in comp_s], [closed_bytes / s / MB for s in copy_s])
    section.results.append(
        measured_paired(
            "compaction (compact_partition)",
            mbps,
            "MB/s",
            baseline_name="raw copy",
            min_ratio=0.3,
            note=(
                f"{len(closed)} closed segments of {sizes.compact_segment_bytes >> 20} MiB "
                f"({closed_bytes / MB:,.0f} MB, {stats.records_read:,} records over {k:,} random keys) → "
                f"{stats.bytes_written / MB:,.1f} MB, {stats.records_kept:,} records kept; "
                f"{stats.records_read / statistics.median(comp_s):,.0f} records/s (median run); MB/s {mbps.spread()}"
            ),
        )
    )


# ---------------------------------------------------------------------------- transactions

TXN_SIZE = 1_000


def txn_append_once(root: Path, values: pa.Array, keys: pa.Array | None, partitions: int, txn: bool) -> float:
    """Seconds to append ``values`` in 1,000-record ``send_batch`` calls, each its own transaction if ``txn``."""
    root.mkdir(parents=True)
    with Log(root / "log") as log:
        log.create_topic(TOPIC, partitions)
        producer = Producer(log, transactional_id="bench" if txn else None)
        if txn:
            producer.init_transactions()
        chunks = [
            (values.slice(i, TXN_SIZE), keys.slice(i, TXN_SIZE) if keys is not None else None)
            for i in range(0, len(values), TXN_SIZE)
        ]

        def go() -> None:
            for v, k in chunks:
                if txn:
                    producer.begin_transaction()
                producer.send_batch(TOPIC, v, k, partition=0 if k is None else None)
                if txn:
                    producer.commit_transaction()

        seconds = timed(go)
        producer.close()
    shutil.rmtree(root)
    return seconds


def bench_transactions(ctx: Context, section: Section, sizes: Sizes, values: pa.Array, keys: pa.Array) -> None:
    n = sizes.txn_records
    root = ctx.workdir / "txn"
    txn_append_once(root / "warm", values.slice(0, 5 * TXN_SIZE), None, 1, True)
    for label, k, parts in (("1 partition", None, 1), ("keyed, 4 partitions", keys.slice(0, n), 4)):
        txn_s: list[float] = []
        plain_s: list[float] = []
        for i in range(sizes.runs):
            txn_s.append(txn_append_once(root / f"t{i}", values.slice(0, n), k, parts, True))
            plain_s.append(txn_append_once(root / f"p{i}", values.slice(0, n), k, parts, False))
            ctx.say(f"transactions {label} run {i + 1}: {n / txn_s[-1]:,.0f} vs plain {n / plain_s[-1]:,.0f} records/s")
        rates = Paired([n / s for s in txn_s], [n / s for s in plain_s])
        section.results.append(
            measured_paired(
                f"transactional append, 1 txn per {TXN_SIZE:,} records, {label}",
                rates,
                "records/s",
                baseline_name=f"same {TXN_SIZE:,}-record send_batch calls, no transaction",
                note=f"{n:,} records of {RECORD_BYTES} B; records/s {rates.spread()}",
            )
        )


# ---------------------------------------------------------------------------- entry point


def run(ctx: Context, section: Section) -> None:
    sizes = QUICK if ctx.quick else FULL
    n = max(sizes.append_records, sizes.compact_records)
    values = make_values(n, RECORD_BYTES, seed=1)
    keys = make_keys(range(n))
    section.notes += [
        f"Records: {RECORD_BYTES}-byte random values; keys `b'key-%d'` where keyed; codec none; "
        f"{sizes.runs} runs ({sizes.append_runs} for batched appends, {sizes.read_runs} for reads), engine and raw "
        "peer back to back run by run: values are the medians of each side's runs, the ratio the median of the "
        "per-pair ratios; `os.sync()` before every timed step.",
        f"Append: {sizes.append_records:,} records per run through `Producer.send_batch` (batch_size 1 MiB) into a "
        "1-partition topic, fsync policy every_batch (default); the raw peer writes the same total bytes with "
        "the same per-call sizes (the stored batch sizes) to a new file, `os.write` + `os.fdatasync` per call.",
        "Read: a fresh Log and Consumer per run reading the keyless append data from offset 0 (default "
        "max_poll_bytes 4 MiB); the raw peer `os.read`s the same segment files in 4 MiB chunks; page cache warm "
        "for both.",
        f"Transactions: {sizes.txn_records:,} records in {TXN_SIZE:,}-record `send_batch` calls, each in its own "
        "transaction (begin, send_batch, commit) vs the same calls by an idempotent producer without transactions; "
        "fsync every_batch; a fresh log per run.",
        f"Compaction: {sizes.compact_records:,} records over {sizes.compact_keys:,} uniformly random keys, "
        f"segment_bytes {sizes.compact_segment_bytes >> 20} MiB; each run compacts a fresh copy of the "
        "partition; the raw peer copies the same closed segment files (read, write, fsync per file, fsync dir).",
    ]
    ctx.say(f"generated {n:,} values")
    m = sizes.append_records
    pdir = bench_append(ctx, section, sizes, values.slice(0, m), keys.slice(0, m))
    bench_read(ctx, section, sizes, pdir, sizes.append_records)
    shutil.rmtree(pdir.parent.parent)
    bench_transactions(ctx, section, sizes, values, keys)
    bench_compaction(ctx, section, sizes, values)
