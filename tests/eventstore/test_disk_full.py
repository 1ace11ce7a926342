"""Disk full: ENOSPC in the log's write path, on a real (small tmpfs) file system.

The log lives on a 16 MiB tmpfs (tideline.faults); a ballast file leaves little space.
Producers append until writes fail, and go on trying; then the ballast is deleted and
they continue. Checked:

* the producer gets a clear error (:class:`LogStorageError`, ENOSPC, naming the segment);
* no segment is left damaged: every segment validates from byte 0 with no torn tail
  (the failed write was cut), while the disk is still full;
* nothing acknowledged is lost, nothing is stored twice, nothing unacknowledged is read;
* once space is back, appends succeed again, in this process and after a reopen;
* a compaction pass that runs out of space keeps the old segments and removes its partial output;
* a transaction whose commit meets the full disk is committed in every partition or in none (a short
  write of the coordinator's decision used to pass for a stored one).

Time to recover (reported to RELIABILITY.md) = from freeing the space to the first
successful append. Sizes grow with ``TIDELINE_SOAK=1``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import time
from pathlib import Path

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import LogStorageError
from eventstore.log import Log
from eventstore.producer import Producer
from eventstore.segment import list_segment_bases, log_path, scan_batches
from eventstore.topic import TopicConfig
from tideline.faults import SmallFilesystem
from tideline.reliability import record_fault_result

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
Acked = dict[tuple[int, int], tuple[bytes, bytes]]  # (partition, offset) → (key, value)


def read_everything(path: Path, topic: str, partitions: int) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of ``topic`` from offset 0, through a fresh Log (as another process would)."""
    out = []
    with Log(path, create=False) as log:
        consumer = Consumer(log, enable_auto_commit=False)
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        ends = {tp: log.partition(topic, tp.partition).log_end_offset() for tp in tps}
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            out.extend((r.partition, r.offset, r.key, r.value) for r in consumer.poll(0))
        consumer.close()
    return out


def check_segments_whole(path: Path, topic: str, partitions: int) -> int:
    """Every segment validates from byte 0 with no torn tail; returns how many there are."""
    count = 0
    for p in range(partitions):
        pdir = path / f"{topic}-{p}"
        for base in list_segment_bases(pdir):
            seg = log_path(pdir, base)
            fd = os.open(seg, os.O_RDONLY)
            try:
                result = scan_batches(fd, seg, 0, min_base_offset=base)  # raises on damage
            finally:
                os.close(fd)
            assert not result.torn, f"{seg} has a torn tail at byte {result.valid_end}: {result.torn_reason}"
            count += 1
    return count


def check_exactly(read: list[tuple[int, int, bytes | None, bytes | None]], acked: Acked, what: str) -> None:
    seen: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
    for p, off, key, value in read:
        assert (p, off) not in seen, f"{what}: offset {off} of partition {p} read twice"
        seen[(p, off)] = (key, value)
    lost = sorted(set(acked) - set(seen))
    extra = sorted(set(seen) - set(acked))
    wrong = sorted(k for k in set(seen) & set(acked) if seen[k] != acked[k])
    assert not lost, f"{what}: {len(lost)} acknowledged records lost, e.g. {lost[:5]}"
    assert not extra, f"{what}: {len(extra)} records stored that were never acknowledged, e.g. {extra[:5]}"
    assert not wrong, f"{what}: {len(wrong)} records differ from what was acknowledged, e.g. {wrong[:5]}"
    values = [v for _, _, _, v in read]
    assert len(values) == len(set(values)), f"{what}: a record was stored twice"


def send_round(producer: Producer, rng: random.Random, serial: list[int], acked: Acked) -> BaseException | None:
    """One batch of 1-40 records; acknowledged ones go into ``acked``; returns the error, if any."""
    pending = []
    for _ in range(rng.randint(1, 40)):
        serial[0] += 1
        key, value = b"k%03d" % rng.randrange(200), b"v%d:" % serial[0] + os.urandom(rng.randrange(50, 1500))
        pending.append((key, value, producer.send("t", value, key=key)))
    producer.flush()
    error = None
    for key, value, future in pending:
        try:
            md = future.result()
        except Exception as e:
            error = error or e
            continue
        acked[(md.partition, md.offset)] = (key, value)
    return error


def test_disk_full_refuses_appends_keeps_segments_whole_and_resumes(small_disk: SmallFilesystem) -> None:
    rounds = 5 if SOAK else 1
    rng = random.Random(19)
    path = small_disk.path / "log"
    acked: Acked = {}
    serial = [0]
    errors = 0
    recoveries: list[float] = []
    with Log(path) as log:
        log.create_topic("t", 2, TopicConfig(segment_bytes=64 << 10, segment_ms=10**15))
        producer = Producer(log, linger_ms=3_600_000)
        for round_ in range(rounds):
            small_disk.fill(leave_bytes=rng.randrange(100 << 10, 600 << 10))
            first_error = None
            failures = 0
            while failures < 25:
                error = send_round(producer, rng, serial, acked)
                if error is not None:
                    first_error = first_error or error
                    failures += 1
            errors += failures
            assert isinstance(first_error, LogStorageError), f"not a clear error: {first_error!r}"
            assert first_error.errno == errno.ENOSPC and "free space" in str(first_error), str(first_error)
            assert str(path) in str(first_error)
            # while the disk is still full: every segment whole, every acknowledged record readable
            check_segments_whole(path, "t", 2)
            check_exactly(read_everything(path, "t", 2), acked, f"round {round_}, disk full")

            small_disk.free()
            freed = time.monotonic()
            while (error := send_round(producer, rng, serial, acked)) is not None:
                assert isinstance(error, LogStorageError), repr(error)
                assert time.monotonic() - freed < 60, f"appends still fail 60 s after space returned: {error}"
            recoveries.append(time.monotonic() - freed)
            for _ in range(20):
                assert send_round(producer, rng, serial, acked) is None, "an append failed with space available"
            check_exactly(read_everything(path, "t", 2), acked, f"round {round_}, space back")
        producer.close()
    segments = check_segments_whole(path, "t", 2)
    with Log(path, create=False) as log, Producer(log, linger_ms=0) as producer:
        assert send_round(producer, rng, serial, acked) is None
    check_exactly(read_everything(path, "t", 2), acked, "after a reopen")
    assert segments > 4, "too few segments: rolls did not happen under the fault"
    record_fault_result(
        "disk full (log)",
        "ENOSPC in the log's write path: a full 16 MiB tmpfs under 2 partitions, appends retried while full, "
        "then space returns",
        injected=errors,
        survived=errors,
        records_lost=0,
        duplicates=0,
        recover_seconds=recoveries,
        detail=f"{rounds} fill/free rounds, {len(acked)} records acknowledged, {segments} segments, all whole",
    )


def test_compaction_on_a_full_disk_leaves_the_old_segments_and_no_leftovers(small_disk: SmallFilesystem) -> None:
    """A compaction pass that hits ENOSPC writing its output keeps the old segments, removes its
    partial output (the space goes back), and succeeds once space is back."""
    from eventstore.cleaner import compact_partition
    from eventstore.topic import CleanupPolicy

    rng = random.Random(7)
    path = small_disk.path / "log"
    acked: Acked = {}
    serial = [0]
    with Log(path) as log:
        log.create_topic("t", 1, TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=64 << 10))
        with Producer(log, linger_ms=3_600_000) as producer:
            for _ in range(60):
                assert send_round(producer, rng, serial, acked) is None
        plog = log.partition("t", 0)
        plog.roll()
        before = {n: (plog.directory / n).read_bytes() for n in os.listdir(plog.directory) if n.endswith(".log")}
        small_disk.fill(leave_bytes=8 << 10)
        failed = 0
        for _ in range(3):
            try:
                compact_partition(plog)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                failed += 1
            assert not [n for n in os.listdir(plog.directory) if n.endswith(".cleaned")], "partial output left"
        assert failed == 3, "compaction found room on a full disk: fill more"
        after = {n: (plog.directory / n).read_bytes() for n in os.listdir(plog.directory) if n.endswith(".log")}
        assert after == before, "a failed pass changed the segments"
        check_exactly(read_everything(path, "t", 1), acked, "after failed passes")
        small_disk.free()
        stats = compact_partition(plog)
        assert stats.records_kept < stats.records_read
    latest: dict[bytes, bytes] = {}
    for (_, _), (key, value) in sorted(acked.items()):
        latest[key] = value
    got: dict[bytes | None, bytes | None] = {}
    for _, _, key, value in read_everything(path, "t", 1):
        got[key] = value
    assert got == latest, "after compaction the latest value of some key is not the one acknowledged last"


def test_a_transaction_whose_commit_meets_a_full_disk_is_committed_everywhere_or_nowhere(
    small_disk: SmallFilesystem,
) -> None:
    """A full disk lets a write through only as far as the last free page: the commit decision written into the
    transaction's state file short (torn, so not there at all), then a commit marker written to one partition and
    refused by the next, must not leave the first committed and the second aborted by the abort that follows.

    Set up so that exactly that happens: the state file ends a few bytes before a page boundary, partition ``b``'s
    segment ends on one (its marker needs a new page) and ``a``'s does not; the disk is then filled."""
    import struct

    import crc32c

    from eventstore.consumer import IsolationLevel

    page = os.statvfs(small_disk.path).f_frsize
    path = small_disk.path / "log"
    with Log(path) as log:
        for topic in ("a", "b"):
            log.create_topic(topic, 1)
        producer = Producer(log, transactional_id="tx", linger_ms=0)
        producer.init_transactions()
        producer.begin_transaction()
        producer.send_batch("a", [b"one"], [b"k"], partition=0)
        segment_b = log_path(path / "b-0", 0)
        producer.send_batch("b", [b"x" * 1000], [b"k"], partition=0)  # measures a one-record batch's overhead
        overhead = os.path.getsize(segment_b) - 1000
        room = page - os.path.getsize(segment_b) % page
        producer.send_batch("b", [b"y" * (room - overhead)], [b"k"], partition=0)
        assert os.path.getsize(segment_b) % page == 0, "b's segment does not end on a page boundary"

        # The state file (length + CRC32C + JSON, see eventstore.transactions) rewritten to end 40 bytes before a
        # page boundary: its last record, the open transaction's, padded with a key the reader ignores.
        state = path / "_transactions" / "tx.state"
        raw = state.read_bytes()
        pos, last = 0, b""
        while pos < len(raw):
            length = struct.unpack_from("<I", raw, pos)[0]
            last, pos = raw[pos + 8 : pos + 8 + length], pos + 8 + length
        body = json.loads(last)
        body["pad"] = ""
        size = len(json.dumps(body).encode()) + 8
        body["pad"] = "p" * (page - 40 - size)
        encoded = json.dumps(body).encode()
        state.write_bytes(struct.pack("<II", len(encoded), crc32c.crc32c(encoded)) + encoded)
        assert os.path.getsize(state) == page - 40

        small_disk.fill(leave_bytes=0)
        try:
            producer.commit_transaction()
            committed = True
        except LogStorageError as e:
            assert e.errno == errno.ENOSPC, e
            committed = False
        small_disk.free()
        if not committed:
            producer.abort_transaction()  # what a caller does after a failed commit (capture does)
        producer.close()

    with Log(path, create=False) as log, Producer(log, transactional_id="tx") as successor:
        successor.init_transactions()  # completes or aborts whatever is left
        visible = {}
        for topic in ("a", "b"):
            with Consumer(log, enable_auto_commit=False, isolation_level=IsolationLevel.READ_COMMITTED) as c:
                c.assign([TopicPartition(topic, 0)])
                c.seek_to_beginning()
                visible[topic] = 0
                while batch := c.poll(timeout_ms=0):
                    visible[topic] += len(batch)
    assert (visible["a"] > 0) == (visible["b"] > 0), f"one transaction, half of it committed: {visible}"
    assert (visible["a"] > 0) == committed, f"commit {'returned' if committed else 'failed'}, but {visible}"
