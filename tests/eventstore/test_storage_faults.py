"""Storage faults: fuzzed copies of a partition open safely or are refused, never read wrong.

One small partition is built once (several segments, idempotent batches, committed and
aborted transactions, a clean close: ``recovery-point``, ``producer-state``, ``lso``,
``aborted-txns``, indexes). Each case copies it and damages one file: random byte flips,
a truncation, or a zeroed range (a "page"), in a segment, an index, the producer /
transaction state, or the topic's metadata (``_topics/t.json``). Then, as an operator would:

1. a fresh process view reads the partition from offset 0 (``read_uncommitted`` and
   ``read_committed``),
2. a producer appends one record (the write side's recovery runs here),
3. a fresh view reads everything again.

The oracle, for every read, against what the undamaged copy returns:

* **never a silent wrong read**: every record returned is the record stored at that
  offset (key and value), offsets strictly increase, ``read_committed`` never returns
  aborted data, and an appended record never reuses an offset an earlier read returned;
* **data before the damage is intact**: every record below the first damaged batch is
  returned (before any error);
* **truncated or refused**: records at or after the damage may be missing only as a
  prefix cut (the damaged segment is the last one: its tail was truncated at the first
  bad batch), or after an error — :class:`CorruptLogError` naming the damaged file and a
  byte position, or :class:`CorruptCheckpointError` naming the damaged state file.
  Anything else (a gap in the middle, another exception type) fails the case.
* Damage to derived files (indexes, ``producer-state``, ``recovery-point``) must be
  invisible: everything is returned, nothing is refused.

``make test`` runs 300 cases; ``TIDELINE_SOAK=1`` runs 1,500. Each case's seed is in the
failure message (``FUZZ_SEED=<n>`` reruns one).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import CorruptCheckpointError, CorruptLogError, TidelineError
from eventstore.isolation import IsolationLevel
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from eventstore.record_batch import HEADER_SIZE, unpack_header
from eventstore.segment import list_segment_bases, log_path
from eventstore.topic import TopicConfig
from tideline.reliability import record_fault_result

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
CASES = 1500 if SOAK else 300
TP = TopicPartition("t", 0)
PAGE = 4096
TOPIC_FILE = "../_topics/t.json"  # the topic's metadata (partition count, config), relative to t-0/
NO_FSYNC = FsyncPolicy(FsyncMode.NONE)  # the cases test damage on disk, not durability
Records = dict[int, tuple[bytes | None, bytes | None]]


# ---------------------------------------------------------------------------- the partition


def build_partition(path: Path) -> list[tuple[int, int]]:
    """Idempotent batches, committed and aborted transactions, several segments; a clean close.

    Returns each transaction's (first data offset, marker offset).
    """
    spans = []
    rng = random.Random(20261124)
    with Log(path, fsync=NO_FSYNC) as log:
        log.create_topic("t", 1, TopicConfig(segment_bytes=6 * 1024, segment_ms=10**15))
        with Producer(log, linger_ms=3_600_000) as producer:
            for i in range(30):
                for j in range(rng.randint(1, 6)):
                    producer.send("t", b"v%d.%d:" % (i, j) + b"x" * rng.randrange(150), key=b"k%d" % rng.randrange(9))
                producer.flush()
        for n in range(6):
            with Producer(log, transactional_id=f"tx-{n % 2}", linger_ms=3_600_000) as txn:
                txn.init_transactions()
                txn.begin_transaction()
                futures = [
                    txn.send("t", b"txn%d.%d:" % (n, j) + b"y" * rng.randrange(100), key=b"t%d" % j)
                    for j in range(rng.randint(1, 4))
                ]
                txn.flush()  # the data reaches the log before the transaction ends
                offsets = [f.result().offset for f in futures]
                spans.append((min(offsets), max(offsets) + 1))  # the marker follows (one partition, one writer)
                if n % 3 == 1:
                    txn.abort_transaction()
                else:
                    txn.commit_transaction()
        with Producer(log, linger_ms=3_600_000) as producer:
            for i in range(5):
                producer.send("t", b"tail-%d" % i, key=b"k%d" % i)
                producer.flush()
    return spans


@dataclass(frozen=True)
class ReadOutcome:
    records: list[tuple[int, bytes | None, bytes | None]]
    error: BaseException | None


def read_all(path: Path, level: IsolationLevel) -> ReadOutcome:
    """Everything a fresh consumer returns from offset 0, and the error that stopped it, if any."""
    out: list[tuple[int, bytes | None, bytes | None]] = []
    try:
        with Log(path, create=False, fsync=NO_FSYNC) as log:
            consumer = Consumer(log, enable_auto_commit=False, isolation_level=level, max_poll_bytes=8192)
            try:
                consumer.assign([TP])
                consumer.seek(TP, 0)
                end = log.partition("t", 0).log_end_offset()
                stalled = 0
                while consumer.position(TP) < end and stalled < 3:
                    before = consumer.position(TP)
                    out.extend((r.offset, r.key, r.value) for r in consumer.poll(0))
                    stalled = stalled + 1 if consumer.position(TP) == before else 0
            finally:
                consumer.close()
    except Exception as e:
        return ReadOutcome(out, e)
    return ReadOutcome(out, None)


def batch_starts(data: bytes) -> list[tuple[int, int, int]]:
    """(position, end, base offset) of every batch of an undamaged segment file."""
    out, pos = [], 0
    while pos + HEADER_SIZE <= len(data):
        header = unpack_header(data, pos)
        out.append((pos, pos + header.size, header.base_offset))
        pos += header.size
    return out


# ---------------------------------------------------------------------------- damage


@dataclass
class Damage:
    file: str
    kind: str
    first_changed: int  # first byte that differs from the original (for a truncation: the new size)
    damaged_offset: float = float("inf")  # base offset of the first damaged batch (segments only)
    last_segment: bool = False
    description: str = ""


@dataclass
class Golden:
    path: Path
    files: dict[str, bytes]
    uncommitted: Records
    committed: Records
    segments: list[str] = field(default_factory=list)
    transactions: list[tuple[int, int]] = field(default_factory=list)  # (first data offset, marker offset)

    def committed_cutoff(self, damaged_offset: float) -> float:
        """Below which offset read_committed must still see everything when the data from
        ``damaged_offset`` on is gone: a transaction whose marker was lost stays open (the LSO)."""
        open_firsts = [f for f, m in self.transactions if f < damaged_offset <= m]
        return min([damaged_offset, *open_firsts])


def damage_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str, int]:
    """A damaged copy of ``data``, what was done, and the first byte changed."""
    kind = rng.choice(["flip", "flip", "truncate", "zero"])
    if kind == "flip" or not data:
        buf = bytearray(data)
        if not buf:
            return b"\x00", "extend empty file by one zero byte", 0
        positions = sorted(rng.sample(range(len(buf)), min(len(buf), rng.randint(1, 8))))
        for p in positions:
            buf[p] ^= rng.randint(1, 255)
        return bytes(buf), f"flip bytes at {positions}", positions[0]
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return data[:cut], f"truncate to {cut} of {len(data)} bytes", cut
    start = rng.randrange(0, len(data), PAGE) if len(data) > PAGE and rng.random() < 0.5 else rng.randrange(len(data))
    length = PAGE if rng.random() < 0.5 else rng.randint(1, 256)
    end = min(len(data), start + length)
    buf = bytearray(data)
    buf[start:end] = bytes(end - start)
    changed = next((i for i in range(start, end) if data[i] != 0), -1)
    return bytes(buf), f"zero bytes [{start}, {end})", changed


def pick_file(golden: Golden, rng: random.Random) -> str:
    roll = rng.random()
    names = sorted(golden.files)
    if roll < 0.55:
        return rng.choice(golden.segments)
    if roll < 0.70:
        return rng.choice([n for n in names if n.endswith((".index", ".timeindex"))])
    if roll < 0.96:
        state = [n for n in names if not n.endswith((".log", ".index", ".timeindex", ".json"))]
        return rng.choice(state)
    return TOPIC_FILE


def apply_damage(golden: Golden, case_dir: Path, rng: random.Random) -> Damage | None:
    """Copy the golden log to ``case_dir`` and damage one file; None when the damage changed nothing."""
    shutil.copytree(golden.path, case_dir)
    name = pick_file(golden, rng)
    original = golden.files[name]
    damaged, what, first = damage_bytes(original, rng)
    if damaged == original or first < 0:
        shutil.rmtree(case_dir)
        return None
    (case_dir / "t-0" / name).write_bytes(damaged)  # TOPIC_FILE is relative to t-0/ too
    damage = Damage(name, what.split()[0], first, description=f"{name}: {what}")
    if name.endswith(".log"):
        damage.last_segment = name == golden.segments[-1]
        for _pos, end, base in batch_starts(original):
            if first < end:
                damage.damaged_offset = base
                break
        else:  # the change is past the last batch (cannot happen: nothing lies there)
            damage.damaged_offset = float("inf")
    return damage


# ---------------------------------------------------------------------------- the oracle


def check_read(
    what: str,
    outcome: ReadOutcome,
    model: Records,
    damage: Damage,
    *,
    may_stall: bool = False,
    probe: int = -1,
    cutoff: float | None = None,
) -> None:
    """The oracle (module docstring). ``cutoff``: records below it must be read (default: the
    damaged offset); a read that stops early without an error is allowed when ``may_stall``."""
    records, error = outcome.records, outcome.error
    offsets = [o for o, _, _ in records]
    assert offsets == sorted(set(offsets)), f"{what}: offsets repeat or go back: {offsets}"
    for off, key, value in records:
        if off == probe:
            continue
        assert off in model, f"{what}: offset {off} returned ({key!r}={value!r}) but not visible in the original"
        assert model[off] == (key, value), f"{what}: offset {off} returned {key!r}={value!r}, stored {model[off]}"
    returned = set(offsets)
    cutoff = damage.damaged_offset if cutoff is None else cutoff
    before_damage = [o for o in model if o < cutoff]
    missing_before = [o for o in before_damage if o not in returned]
    if error is not None:
        assert isinstance(error, CorruptLogError | CorruptCheckpointError), (
            f"{what}: not a clear storage error: {type(error).__name__}: {error}"
        )
        assert Path(damage.file).name in str(error), (
            f"{what}: the error does not name the damaged {damage.file}: {error}"
        )
        if isinstance(error, CorruptLogError):
            assert " at byte " in str(error), f"{what}: the error names no position: {error}"
        assert not missing_before or damage.damaged_offset == float("inf"), (
            f"{what}: refused before the damage (offset {cutoff}): offsets {missing_before[:5]} unread"
        )
        return
    assert not missing_before or may_stall, (
        f"{what}: records before the damage are missing: {missing_before[:10]} (of {len(before_damage)})"
    )
    old = sorted(o for o in model)
    got_old = [o for o in offsets if o != probe]
    prefix = old[: len(got_old)]
    gap = sorted(set(prefix) - returned)[:5]
    assert got_old == prefix, f"{what}: a gap in the middle of what was read (missing {gap})"
    if len(got_old) < len(old) and not may_stall and cutoff == damage.damaged_offset:
        assert damage.last_segment, (
            f"{what}: {len(old) - len(got_old)} records from offset {old[len(got_old)]} on silently missing, "
            f"but {damage.file} is not the last segment (no error was raised)"
        )


def run_case(golden: Golden, seed: int, workdir: Path) -> str | None:
    """One fuzz case; returns its description, or None when the damage was a no-op."""
    rng = random.Random(seed)
    case_dir = workdir / f"case-{seed}"
    damage = apply_damage(golden, case_dir, rng)
    if damage is None:
        return None
    where = f"seed {seed} ({damage.description})"
    lso_damaged = damage.file == "lso"
    derived = damage.file.endswith((".index", ".timeindex")) or damage.file in ("producer-state", "recovery-point")
    views = {IsolationLevel.READ_UNCOMMITTED: golden.uncommitted, IsolationLevel.READ_COMMITTED: golden.committed}
    first_reads = {}
    for level, model in views.items():
        outcome = read_all(case_dir, level)
        if derived:
            assert outcome.error is None, f"{where}: damage to a derived file refused a read: {outcome.error}"
        cutoff = golden.committed_cutoff(damage.damaged_offset) if level is IsolationLevel.READ_COMMITTED else None
        check_read(f"{where}, first {level.value} read", outcome, model, damage, may_stall=lso_damaged, cutoff=cutoff)
        first_reads[level] = outcome
    probe_offset = -1
    try:
        with Log(case_dir, create=False, fsync=NO_FSYNC) as log, Producer(log, linger_ms=0) as producer:
            probe_offset = producer.send("t", b"probe", key=b"probe").result().offset
    except TidelineError as e:
        assert not derived, f"{where}: damage to a derived file refused an append: {e}"
        assert isinstance(e, CorruptLogError | CorruptCheckpointError) and Path(damage.file).name in str(e), (
            f"{where}: the append failed without naming {damage.file}: {type(e).__name__}: {e}"
        )
    for level, model in views.items():
        outcome = read_all(case_dir, level)
        if derived:
            assert outcome.error is None, f"{where}: damage to a derived file refused a read: {outcome.error}"
        cutoff = golden.committed_cutoff(damage.damaged_offset) if level is IsolationLevel.READ_COMMITTED else None
        check_read(
            f"{where}, {level.value} read after an append", outcome, model, damage, probe=probe_offset, cutoff=cutoff
        )
        if probe_offset >= 0:
            earlier = {o for o, _, _ in first_reads[level].records}
            assert probe_offset not in earlier, f"{where}: the appended record reused offset {probe_offset}"
            if outcome.error is None and not (damage.last_segment or lso_damaged):
                assert (probe_offset, b"probe", b"probe") in outcome.records, f"{where}: the appended record is lost"
    shutil.rmtree(case_dir)
    return damage.description


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Golden:
    path = tmp_path_factory.mktemp("golden") / "log"
    spans = build_partition(path)
    pdir = path / "t-0"
    files = {n: (pdir / n).read_bytes() for n in os.listdir(pdir) if not n.startswith(".")}
    files[TOPIC_FILE] = (pdir / TOPIC_FILE).read_bytes()
    segments = [log_path(pdir, b).name for b in list_segment_bases(pdir)]

    def model(level: IsolationLevel) -> Records:
        outcome = read_all(path, level)
        assert outcome.error is None, outcome.error
        return {o: (k, v) for o, k, v in outcome.records}

    golden = Golden(
        path, files, model(IsolationLevel.READ_UNCOMMITTED), model(IsolationLevel.READ_COMMITTED), segments, spans
    )
    assert len(segments) >= 4, segments
    assert {"producer-state", "aborted-txns", "lso", "recovery-point"} <= set(files), sorted(files)
    assert len(golden.committed) < len(golden.uncommitted), "no aborted transaction in the partition"
    return golden


def seeds() -> Iterator[int]:
    one = os.environ.get("FUZZ_SEED")
    if one is not None:
        yield int(one)
        return
    yield from range(CASES)


def test_fuzzed_partitions_open_safely_or_are_refused(golden: Golden, tmp_path: Path) -> None:
    kinds: dict[str, int] = {}
    done = 0
    started = time.monotonic()
    durations = []
    for seed in seeds():
        t0 = time.monotonic()
        description = run_case(golden, seed, tmp_path)
        if description is None:
            continue
        durations.append(time.monotonic() - t0)
        done += 1
        name = description.split(":")[0]
        key = (
            "segment" if name.endswith(".log") else "topic metadata" if name == TOPIC_FILE else name.rsplit(".", 1)[-1]
        )
        kinds[key] = kinds.get(key, 0) + 1
    print(f"\n{done} damaged copies in {time.monotonic() - started:.1f} s: {sorted(kinds.items())}")
    assert done >= min(CASES, 1) * 0.8 or os.environ.get("FUZZ_SEED") is not None
    record_fault_result(
        "log storage",
        "1 damaged file per copy of a partition: byte flips, truncations, zeroed ranges in segments, indexes, "
        "producer-state, aborted-txns, lso, recovery-point, topic metadata",
        injected=done,
        survived=done,
        records_lost=0,
        duplicates=0,
        recover_seconds=durations,
        detail=f"damaged files: {', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}; recovery time = open, "
        "two full reads, an append and two more reads of the damaged copy",
    )


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_damaged_aborted_txns_is_refused_until_rebuilt_from_the_log(
    golden: Golden, tmp_path: Path, damage: str
) -> None:
    """The documented repair: with no writer running, delete aborted-txns and producer-state."""
    path = tmp_path / "log"
    shutil.copytree(golden.path, path)
    aborted = path / "t-0" / "aborted-txns"
    raw = aborted.read_bytes()
    assert len(raw) >= 2 * 28, "the partition should hold two aborted transactions"
    aborted.write_bytes(raw[:5] + bytes([raw[5] ^ 0x10]) + raw[6:] if damage == "flip" else raw[:28])
    for level in IsolationLevel:
        outcome = read_all(path, level)
        if level is IsolationLevel.READ_COMMITTED:
            assert isinstance(outcome.error, CorruptCheckpointError) and "aborted-txns" in str(outcome.error)
        else:
            assert outcome.error is None  # read_uncommitted does not need the index
    with Log(path, create=False, fsync=NO_FSYNC) as log, Producer(log, linger_ms=0) as producer:
        producer.send("t", b"x", key=b"x").result()  # plain appends do not need the index; the close
        log.partition("t", 0).roll()  # and the roll rewrite the snapshot: it keeps the evidence
    assert isinstance(read_all(path, IsolationLevel.READ_COMMITTED).error, CorruptCheckpointError)
    aborted.unlink()
    (path / "t-0" / "producer-state").unlink()
    with Log(path, create=False, fsync=NO_FSYNC) as log, Producer(log, linger_ms=0) as producer:
        probe = producer.send("t", b"probe", key=b"probe").result().offset
    outcome = read_all(path, IsolationLevel.READ_COMMITTED)
    assert outcome.error is None
    extra = {o for o, k, _ in outcome.records if k in (b"x", b"probe")}
    assert {o: (k, v) for o, k, v in outcome.records if o not in extra} == golden.committed and probe in extra
    assert aborted.read_bytes()[: len(raw)] == raw  # rebuilt from the abort markers, entry for entry
