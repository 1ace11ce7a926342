"""Consumer groups: committed offsets in ``__consumer_offsets``, membership and assignment.

* Offsets: commit/committed round trips, positions resume from commits, commits survive
  compaction of the offsets topic and a reopen; offsets committed in transactions count
  on commit only and hold a new owner back while open (a dead producer's transaction is
  recovered); isolation levels (LSO, aborted data, markers).
* One process: 2 and 3 consumers in a group share a 6-partition topic without overlap,
  a leaving member's partitions move to the others, a new member takes some back, and
  what the group consumed across all of it is every record exactly once.
* Several processes (tests/eventstore/group_worker.py): 2 and 3 workers, one joining
  mid-run, consume every record exactly once; with a worker killed with -9 mid-run, the
  survivors take its partitions over from its last commit, every record is processed at
  least once, and the only duplicates are its records at or after its last commit.

Sizes grow with ``TIDELINE_SOAK=1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from readiness import patience

from eventstore.cleaner import compact_partition
from eventstore.consumer import CommitFailedError, Consumer, OffsetAndMetadata, TopicPartition
from eventstore.errors import ConfigError, TidelineError
from eventstore.group import GROUPS_DIR, MEMBERS_DIR, assign_round_robin, live_members
from eventstore.isolation import IsolationLevel, is_aborted
from eventstore.log import Log
from eventstore.offsets import (
    OFFSETS_PARTITIONS,
    OFFSETS_TOPIC,
    OffsetStore,
    decode_offset_key,
    ensure_offsets_topic,
    offset_commit_records,
    offsets_partition_for,
)
from eventstore.partition_log import AbortedTransaction, FsyncMode, FsyncPolicy
from eventstore.producer import Producer
from eventstore.producer_state import ControlType, control_key
from eventstore.record_batch import build_records, encode_batch, unpack_header

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
FAST = FsyncPolicy(FsyncMode.NONE)
TOPIC = "events"
PARTITIONS = 6
WORKER = Path(__file__).with_name("group_worker.py")
DEADLINE_S = 90.0  # generous: CI runs this on 2 vCPUs


def _deadline(what: str, seconds: float = DEADLINE_S) -> Iterator[None]:
    """Yield until ``seconds`` pass (stretched by the machine's load), then fail naming ``what``."""
    limit = patience(seconds)
    end = time.monotonic() + limit
    while time.monotonic() < end:
        yield
    raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")


def _produce(log: Log, n: int, start: int = 0, *, topic: str = TOPIC) -> None:
    keys = [f"key-{i}".encode() for i in range(start, start + n)]
    values = [f"{i}".encode() for i in range(start, start + n)]
    with Producer(log) as producer:
        producer.send_batch(topic, values, keys)


def _ends(log: Log, topic: str = TOPIC) -> dict[TopicPartition, int]:
    return {
        TopicPartition(topic, p): log.partition(topic, p).log_end_offset() for p in range(log.topic(topic).partitions)
    }


def _everything(log: Log, topic: str = TOPIC) -> set[tuple[int, int]]:
    return {(tp.partition, o) for tp, end in _ends(log, topic).items() for o in range(end)}


@pytest.fixture
def log(tmp_path: Path) -> Iterator[Log]:
    with Log(tmp_path / "log", fsync=FAST) as opened:
        yield opened


# ---------------------------------------------------------------------------- offsets


def test_commit_committed_and_resume(log: Log) -> None:
    log.create_topic(TOPIC, 3)
    _produce(log, 300)
    tps = [TopicPartition(TOPIC, p) for p in range(3)]
    with Consumer(log, group_id="g", enable_auto_commit=False) as first:
        first.assign(tps)
        assert first.committed(tps) == dict.fromkeys(tps)
        assert first.position(tps[0]) == 0  # nothing committed: auto_offset_reset=earliest
        first.poll(0, max_records=10)
        first.commit()  # positions of every assigned partition
        first.commit({tps[2]: OffsetAndMetadata(7, "note")})
        committed = first.committed(tps)
        assert committed[tps[2]] is not None and committed[tps[2]].metadata == "note"
        assert committed[tps[2]].commit_timestamp > 0
        # one poll of 10 records read the first partition only; an unread partition's position
        # comes from the commit (7), or else from auto_offset_reset (0)
        assert [first.position(tp) for tp in tps] == [10, 0, 7]
    with Consumer(log, group_id="g") as again:
        again.assign(tps)
        assert [again.position(tp) for tp in tps] == [10, 0, 7]
        assert sum(again.lag().values()) == 300 - 10 - 7
        while again.poll(0):
            pass
        assert set(again.lag().values()) == {0}
    # close() auto-committed the positions of the manual assignment (group_id set, auto-commit on)
    assert {tp: om.offset for tp, om in OffsetStore(log).group_offsets("g").items() if om} == _ends(log, TOPIC)
    with Consumer(log, group_id="other") as other:
        other.assign(tps)
        assert other.position(tps[0]) == 0  # groups do not share offsets


def test_consumer_argument_errors(log: Log) -> None:
    log.create_topic(TOPIC, 2)
    tp = TopicPartition(TOPIC, 0)
    with pytest.raises(ConfigError, match="read_committed or read_uncommitted"):
        Consumer(log, isolation_level="serializable")
    with pytest.raises(ConfigError, match="illegal group id"):
        Consumer(log, group_id="a/b")
    with Consumer(log) as consumer:
        with pytest.raises(TidelineError, match="needs a group"):
            consumer.subscribe([TOPIC])
        consumer.assign([tp])
        with pytest.raises(TidelineError, match="needs a group"):
            consumer.commit()
        with pytest.raises(TidelineError, match="manual assignment"):
            consumer.subscribe([TOPIC], group="g")
    with Consumer(log, group_id="g") as member:
        member.subscribe([TOPIC])
        assert member.subscription() == [TOPIC]
        with pytest.raises(TidelineError, match="while subscribed"):
            member.assign([tp])
        member.poll(0)
        assert member.assignment() == [TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)]
        with pytest.raises(CommitFailedError, match="not owned"):
            member.commit({TopicPartition("elsewhere", 0): 1})
        member.unsubscribe()
        assert member.assignment() == [] and member.subscription() == []
    assert live_members(log.path, "g") == []


def test_offsets_survive_compaction_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "log"
    groups = [f"group-{i}" for i in range(12)]
    tps = [TopicPartition(TOPIC, p) for p in range(4)]
    with Log(path, fsync=FAST) as log:
        log.create_topic(TOPIC, 4)
        store = OffsetStore(log)
        for round_ in range(30):
            for g in groups:
                store.commit(g, {tp: OffsetAndMetadata(round_ * 10 + tp.partition) for tp in tps})
        store.commit("group-0", {tps[3]: None})  # a tombstone deletes one committed offset
        expected = {g: store.group_offsets(g) for g in groups}
        assert tps[3] not in expected["group-0"]
        assert expected["group-5"][tps[2]].offset == 292
        meta = log.topic(OFFSETS_TOPIC)
        assert meta.config.cleanup_policy.compacts and meta.partitions == OFFSETS_PARTITIONS
        kept = read = 0
        for p in range(meta.partitions):
            plog = log.partition(OFFSETS_TOPIC, p)
            plog.roll()  # close the active segment: compaction cleans closed ones only
            stats = compact_partition(plog)
            kept, read = kept + stats.records_kept, read + stats.records_read
        assert 0 < kept < read  # old commits were removed
        assert {g: OffsetStore(log).group_offsets(g) for g in groups} == expected  # a fresh replay
        assert {g: store.group_offsets(g) for g in groups} == expected  # the incremental cache
        assert OffsetStore(log).groups() == sorted(groups)
    with Log(path, create=False) as reopened:
        assert {g: OffsetStore(reopened).group_offsets(g) for g in groups} == expected


def test_offsets_encoding() -> None:
    tp = TopicPartition("orders-eu", 11)
    partition, keys, values = offset_commit_records("billing", {tp: None})
    assert partition == offsets_partition_for("billing", OFFSETS_PARTITIONS)
    assert decode_offset_key(keys[0]) == ("billing", tp)
    assert values == [None]
    # deterministic keys: compaction compares them byte for byte
    assert offset_commit_records("billing", {tp: OffsetAndMetadata(1)})[1] == keys
    with pytest.raises(ConfigError, match="negative"):
        offset_commit_records("billing", {tp: OffsetAndMetadata(-1)})


def test_ensure_offsets_topic_is_idempotent(log: Log, tmp_path: Path) -> None:
    first = ensure_offsets_topic(log)
    with Log(log.path) as other:  # another process's view
        assert ensure_offsets_topic(other) == first


def _txn_batch(values: list[bytes], seq: int) -> bytearray:
    return encode_batch(
        build_records([b"k"] * len(values), values),
        first_timestamp=1,
        max_timestamp=1,
        producer_id=7,
        producer_epoch=0,
        base_sequence=seq,
        transactional=True,
    )


def _marker(kind: ControlType) -> bytearray:
    return encode_batch(
        build_records([control_key(kind)], [b""]),
        first_timestamp=1,
        max_timestamp=1,
        producer_id=7,
        producer_epoch=0,
        transactional=True,
        control=True,
    )


def _read(log: Log, level: IsolationLevel, start: int = 0) -> tuple[list[bytes], int, int]:
    """Values a fresh consumer at ``level`` reads from ``start``; its position and lag after."""
    tp = TopicPartition(TOPIC, 0)
    with Consumer(log, isolation_level=level) as consumer:
        consumer.assign([tp])
        consumer.seek(tp, start)
        values = []
        while records := consumer.poll(0, max_records=2):
            values += [r.value or b"" for r in records]
        return values, consumer.position(tp), consumer.lag()[tp]


def test_isolation_levels(log: Log) -> None:
    """read_committed stops at the last stable offset and skips aborted data; markers are never returned."""
    log.create_topic(TOPIC, 1)
    plain = lambda *vs: encode_batch(build_records([b"k"] * len(vs), list(vs)), first_timestamp=1, max_timestamp=1)  # noqa: E731
    log.append(TOPIC, 0, plain(b"p0", b"p1", b"p2"))  # offsets 0-2
    log.append(TOPIC, 0, _txn_batch([b"a3", b"a4"], 0))  # 3-4: opens a transaction
    assert _read(log, IsolationLevel.READ_COMMITTED) == ([b"p0", b"p1", b"p2"], 3, 0)
    assert _read(log, IsolationLevel.READ_UNCOMMITTED) == ([b"p0", b"p1", b"p2", b"a3", b"a4"], 5, 0)
    log.append(TOPIC, 0, _marker(ControlType.ABORT))  # 5
    log.append(TOPIC, 0, _txn_batch([b"c6", b"c7"], 2))  # 6-7
    log.append(TOPIC, 0, _marker(ControlType.COMMIT))  # 8
    log.append(TOPIC, 0, plain(b"p9"))  # 9
    committed = [b"p0", b"p1", b"p2", b"c6", b"c7", b"p9"]
    assert _read(log, IsolationLevel.READ_COMMITTED) == (committed, 10, 0)
    assert _read(log, IsolationLevel.READ_UNCOMMITTED) == ([*committed[:3], b"a3", b"a4", *committed[3:]], 10, 0)
    assert _read(log, IsolationLevel.READ_COMMITTED, start=5) == ([b"c6", b"c7", b"p9"], 10, 0)  # at a marker
    assert _read(log, IsolationLevel.READ_UNCOMMITTED, start=8) == ([b"p9"], 10, 0)


def test_aborted_transaction_rule() -> None:
    """A transactional batch is aborted iff its producer has an aborted range covering its base offset."""
    batch = encode_batch(
        build_records([b"k"], [b"v"]), first_timestamp=1, max_timestamp=1, producer_id=7, transactional=True
    )
    header = unpack_header(batch)  # base offset 0
    assert is_aborted(header, [AbortedTransaction(7, 0, 3)])
    assert not is_aborted(header, [AbortedTransaction(8, 0, 3)])  # another producer
    assert not is_aborted(header, [AbortedTransaction(7, 1, 3)])  # a later transaction
    plain = unpack_header(encode_batch(build_records([b"k"], [b"v"]), first_timestamp=1, max_timestamp=1))
    assert not is_aborted(plain, [AbortedTransaction(-1, 0, 3)])


def test_offsets_committed_in_transactions(log: Log) -> None:
    """Offsets sent in a transaction count on commit, never on abort, and hold readers while open."""
    log.create_topic(TOPIC, 2)
    _produce(log, 40)
    tp0, tp1 = TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)
    store = OffsetStore(log)
    producer = Producer(log, transactional_id="txn-offsets", linger_ms=1)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send_offsets_to_transaction({tp0: 5}, "g")
        assert store.pending("g") == {tp0} and store.committed("g", [tp0]) == {tp0: None}
        with Consumer(log, group_id="g", enable_auto_commit=False) as consumer:
            consumer.assign([tp0, tp1])
            assert {r.partition for r in consumer.poll(0)} == {1}  # tp0 waits for the transaction
            assert list(consumer.lag()) == [tp1]
            producer.commit_transaction()
            assert store.pending("g") == set()
            assert consumer.position(tp0) == 5  # resolved now
            first = next(iter(consumer.poll(0)))
            assert (first.partition, first.offset) == (0, 5)

        producer.begin_transaction()
        producer.send_offsets_to_transaction({tp0: 9, tp1: 3}, "g")
        store.commit("g", {tp1: OffsetAndMetadata(7)})  # a plain commit after the transactional one...
        assert store.pending("g") == {tp0, tp1}
        producer.abort_transaction()
        assert {tp: om.offset for tp, om in store.group_offsets("g").items()} == {tp0: 5, tp1: 7}  # abort: never

        producer.begin_transaction()
        producer.send_offsets_to_transaction({tp1: 4}, "g")
        store.commit("g", {tp1: OffsetAndMetadata(8)})
        producer.commit_transaction()
        assert store.committed("g", [tp1])[tp1] == OffsetStore(log).committed("g", [tp1])[tp1]
        assert store.group_offsets("g")[tp1].offset == 8  # the later record wins, as in Kafka
    finally:
        producer.close()


ABANDON = r"""
import os, sys
from eventstore.consumer import TopicPartition
from eventstore.log import Log
from eventstore.producer import Producer
log = Log(sys.argv[1])
producer = Producer(log, transactional_id="abandoned", linger_ms=1)
producer.init_transactions()
producer.begin_transaction()
producer.send_offsets_to_transaction({TopicPartition(sys.argv[2], 0): 30}, "g")
print("open", flush=True)
sys.stdin.read()
"""


def test_offsets_of_an_abandoned_transaction_are_recovered(log: Log) -> None:
    """A member waiting on offsets in the open transaction of a killed producer gets it aborted."""
    log.create_topic(TOPIC, 1)
    _produce(log, 40)
    tp = TopicPartition(TOPIC, 0)
    OffsetStore(log).commit("g", {tp: OffsetAndMetadata(12)})
    proc = subprocess.Popen(
        [sys.executable, "-c", ABANDON, str(log.path), TOPIC], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"open"
        assert OffsetStore(log).pending("g") == {tp}
        proc.kill()
        proc.wait()
        with Consumer(log, group_id="g", heartbeat_interval_ms=0) as member:
            member.subscribe([TOPIC])
            member.poll(0)
            assert member.assignment() == [tp]
            assert member.position(tp) == 12  # waited, recovered the dead producer's transaction (aborted)
        assert OffsetStore(log).pending("g") == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


ABANDON_DATA = r"""
import sys
from eventstore.log import Log
from eventstore.producer import Producer
log = Log(sys.argv[1])
producer = Producer(log, transactional_id="abandoned-data", linger_ms=1)
producer.init_transactions()
producer.begin_transaction()
producer.send(sys.argv[2], b"lost", key=b"k")
producer.flush()
print("open", flush=True)
sys.stdin.read()
"""


def test_short_lived_readers_get_an_abandoned_transaction_aborted(log: Log) -> None:
    """read_committed readers that each poll once (no long wait of their own) still unblock the partition."""
    log.create_topic(TOPIC, 1)
    _produce(log, 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", ABANDON_DATA, str(log.path), TOPIC], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"open"
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _produce(log, 1, 1)  # after the dead producer's open transaction: invisible until it is aborted
    for _ in _deadline("a read_committed reader to see past the abandoned transaction", 30):
        values, _, _ = _read(log, IsolationLevel.READ_COMMITTED)
        if len(values) == 2:
            break
        time.sleep(0.05)
    assert values == [b"0", b"1"]
    assert _read(log, IsolationLevel.READ_UNCOMMITTED)[0] == [b"0", b"lost", b"1"]


# ---------------------------------------------------------------------------- assignment


def test_round_robin_is_deterministic_and_respects_subscriptions() -> None:
    from eventstore.group import MemberInfo

    def member(mid: str, *topics: str) -> MemberInfo:
        return MemberInfo(mid, "c", 1, "h", tuple(sorted(topics)), (), 0, 0)

    counts = {"a": 4, "b": 2, "gone": None}
    members = [member("m2", "a"), member("m1", "a", "b"), member("m3", "b", "gone")]
    out = assign_round_robin(members, counts.get)
    assert out == assign_round_robin(list(reversed(members)), counts.get)
    assert out == {
        "m1": [TopicPartition("a", 0), TopicPartition("a", 2), TopicPartition("b", 1)],
        "m2": [TopicPartition("a", 1), TopicPartition("a", 3)],
        "m3": [TopicPartition("b", 0)],  # the next in turn after m2 took a3; "gone" does not exist
    }


def _poll_all(consumers: list[Consumer], seen: Counter[tuple[int, int]]) -> None:
    for c in consumers:
        for r in c.poll(0, max_records=7):
            seen[(r.partition, r.offset)] += 1


def _settle(consumers: list[Consumer], seen: Counter[tuple[int, int]]) -> list[set[TopicPartition]]:
    """Poll every consumer until each owns its share of the 6 partitions, disjointly."""
    for _ in _deadline(f"{len(consumers)} consumers to share {PARTITIONS} partitions"):
        _poll_all(consumers, seen)
        owned = [set(c.assignment()) for c in consumers]
        assert sum(map(len, owned)) == len(set().union(*owned)), f"overlapping assignments {owned}"
        if all(len(o) == PARTITIONS // len(consumers) for o in owned):
            return owned
    raise AssertionError("unreachable")


@pytest.mark.parametrize("members", [2, 3])
def test_members_in_one_process_share_partitions(log: Log, members: int) -> None:
    log.create_topic(TOPIC, PARTITIONS)
    _produce(log, 3000)
    seen: Counter[tuple[int, int]] = Counter()
    make = lambda: Consumer(log, group_id="g", heartbeat_interval_ms=0, auto_commit_interval_ms=10)  # noqa: E731
    consumers = [make() for _ in range(members)]
    for c in consumers:
        c.subscribe([TOPIC])
    owned = _settle(consumers, seen)
    assert set().union(*owned) == set(_ends(log))

    leaving = consumers.pop(0)
    leaving.close()  # commits its positions and releases its partitions
    assert leaving.assignment() == []
    if consumers:
        owned_after = _settle(consumers, seen)
        assert set().union(*owned_after) == set(_ends(log))  # round-robin is not sticky: shares may move

    rejoined = make()
    rejoined.subscribe([TOPIC])
    consumers.append(rejoined)
    _settle(consumers, seen)
    assert {m.member_id for m in live_members(log.path, "g")} == {c.member_id for c in consumers}

    _produce(log, 600, 3000)
    everything = _everything(log)
    for _ in _deadline("the group to consume everything"):
        _poll_all(consumers, seen)
        if set(seen) >= everything:
            break
    assert set(seen) == everything
    assert max(seen.values()) == 1, "a record was delivered twice without any failure"
    for c in consumers:
        c.close()
    assert live_members(log.path, "g") == []
    committed = OffsetStore(log).group_offsets("g")
    assert {tp: om.offset for tp, om in committed.items()} == _ends(log)


# ---------------------------------------------------------------------------- processes


@dataclass
class WorkerLog:
    """What one worker process wrote (see group_worker.py)."""

    member_id: str = ""
    records: list[tuple[int, int]] = field(default_factory=list)
    commits: list[tuple[int, int]] = field(default_factory=list)
    acquired: list[tuple[int, int, int]] = field(default_factory=list)  # partition, position, t_ns
    revoked: list[tuple[int, int]] = field(default_factory=list)  # partition, t_ns
    closed: bool = False

    @classmethod
    def read(cls, path: Path) -> WorkerLog:
        out = cls()
        text = path.read_text() if path.exists() else ""
        for line in text.split("\n")[:-1]:  # the last element is "" or a line cut by a kill
            kind, *rest = line.split(" ")
            if kind == "M":
                out.member_id = rest[0]
            elif kind == "R":
                out.records.append((int(rest[0]), int(rest[1])))
            elif kind == "C":
                out.commits.append((int(rest[0]), int(rest[1])))
            elif kind == "A":
                out.acquired.append((int(rest[0]), int(rest[1]), int(rest[2])))
            elif kind == "V":
                out.revoked.append((int(rest[0]), int(rest[1])))
            elif kind == "CLOSED":
                out.closed = True
        return out


class Workers:
    """Worker processes of one group; always killed at the end."""

    def __init__(self, path: Path, group: str) -> None:
        self.path = path
        self.group = group
        self.stop_file = path.parent / f"stop-{group}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.outs: list[Path] = []

    def start(self, max_records: int = 25, pause_ms: int = 2) -> int:
        out = self.path.parent / f"{self.group}-worker-{len(self.procs)}.txt"
        args = [str(self.path), TOPIC, self.group, str(out), str(self.stop_file), str(max_records), str(pause_ms)]
        self.procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], stderr=subprocess.PIPE))
        self.outs.append(out)
        return len(self.procs) - 1

    def logs(self) -> list[WorkerLog]:
        return [WorkerLog.read(out) for out in self.outs]

    def stop(self) -> None:
        self.stop_file.touch()
        for proc in self.procs:
            try:
                _, err = proc.communicate(timeout=patience(DEADLINE_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            assert proc.returncode in (0, -signal.SIGKILL), err.decode()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Workers]]:
    made: list[Workers] = []
    yield made
    for w in made:
        w.kill_all()


def _shared(path: Path, group: str, members: int) -> bool:
    """Whether ``members`` live members own all partitions, an equal share each."""
    live = live_members(path, group)
    owned = [tp for m in live for tp in m.assignment]
    even = all(len(m.assignment) == PARTITIONS // members for m in live)
    return len(live) == members and len(set(owned)) == len(owned) == PARTITIONS and even


def _wait_shared(path: Path, group: str, members: int) -> None:
    for _ in _deadline(f"{members} members of {group} to share the partitions"):
        if _shared(path, group, members):
            return
        time.sleep(0.05)


def _wait_committed_to_end(log: Log, group: str) -> None:
    store = OffsetStore(log)
    ends = _ends(log)
    for _ in _deadline(f"group {group} to commit every partition to its end"):
        committed = store.group_offsets(group)
        if all(tp in committed and committed[tp].offset == end for tp, end in ends.items()):
            return
        time.sleep(0.05)


def _produce_slowly(log: Log, total: int, start: int, chunks: int = 20) -> None:
    """``total`` records in ``chunks`` appends, a little apart, so consumers run meanwhile."""
    per = max(1, total // chunks)
    for first in range(start, start + total, per):
        _produce(log, min(per, start + total - first), first)
        time.sleep(0.01)


@pytest.mark.parametrize(("initial", "joining"), [(2, 0), (3, 0), (2, 1)], ids=["2", "3", "2+1"])
def test_worker_processes_share_partitions_exactly_once(
    tmp_path: Path, workers: list[Workers], initial: int, joining: int
) -> None:
    """No kill: every record is processed exactly once, so no two members ever read one partition at once."""
    path = tmp_path / "log"
    total = 30_000 if SOAK else 3000
    with Log(path, fsync=FAST) as log:
        log.create_topic(TOPIC, PARTITIONS)
        group = Workers(path, "g")
        workers.append(group)
        for _ in range(initial):
            group.start()
        _wait_shared(path, "g", initial)
        _produce_slowly(log, total // 2, 0)
        produced = total // 2
        for _ in range(joining):
            group.start()
        if joining:  # records keep flowing until the joiner has its share: a rebalance mid-stream
            for _ in _deadline("the new member to get its share"):
                if _shared(path, "g", initial + joining):
                    break
                _produce(log, 20, produced)
                produced += 20
                time.sleep(0.02)
        _produce_slowly(log, total - total // 2, produced)
        _wait_committed_to_end(log, "g")
        group.stop()
        everything = _everything(log)
    logs = group.logs()
    assert all(w.closed for w in logs)
    processed = Counter(rec for w in logs for rec in w.records)
    assert set(processed) == everything
    twice = sorted(rec for rec, n in processed.items() if n > 1)
    assert not twice, f"{len(twice)} records processed twice without a failure, e.g. {twice[:5]}"
    assert all(w.records for w in logs), "a member processed nothing: partitions were not shared"
    assert live_members(path, "g") == []


def test_killed_worker_is_taken_over_from_its_last_commit(tmp_path: Path, workers: list[Workers]) -> None:
    path = tmp_path / "log"
    total = 40_000 if SOAK else 4000
    with Log(path, fsync=FAST) as log:
        log.create_topic(TOPIC, PARTITIONS)
        group = Workers(path, "g")
        workers.append(group)
        for _ in range(3):
            group.start(max_records=10, pause_ms=3)
        _wait_shared(path, "g", 3)
        victim = 1
        _produce_slowly(log, total // 2, 0)
        for _ in _deadline("the victim to process and commit records"):
            mine = group.logs()[victim]
            if len(mine.records) >= 20 and mine.commits:
                break
            time.sleep(0.02)
        killed_ns = time.monotonic_ns()  # before the kill: any later acquisition of its partitions is a takeover
        group.procs[victim].send_signal(signal.SIGKILL)
        group.procs[victim].wait()
        _produce_slowly(log, total - total // 2, total // 2)
        _wait_shared(path, "g", 2)  # the survivors reaped it and hold all partitions
        _wait_committed_to_end(log, "g")
        group.stop()
        everything = _everything(log)
        members_dir = path / GROUPS_DIR / "g" / MEMBERS_DIR
        assert not [n for n in os.listdir(members_dir) if n.startswith(group.logs()[victim].member_id)]

    logs = group.logs()
    dead, survivors = logs[victim], [w for i, w in enumerate(logs) if i != victim]
    assert not dead.closed and all(w.closed for w in survivors)
    processed = Counter(rec for w in logs for rec in w.records)
    assert set(processed) == everything, "a record was never processed"
    by_survivors = Counter(rec for w in survivors for rec in w.records)
    assert max(by_survivors.values()) == 1, "two survivors processed one record"
    assert max(Counter(dead.records).values()) == 1

    # The dead member's partitions at the kill, and its last commit of each.
    owned_at_kill = {p for p in range(PARTITIONS) if _owned_at_end(dead, p)}
    assert owned_at_kill, "the victim owned nothing when killed"
    last_commit = {p: o for p, o in dead.commits}  # the last line of each partition wins
    for rec, n in processed.items():
        if n > 1:
            p, o = rec
            assert n == 2 and rec in dead.records and rec in by_survivors
            assert p in owned_at_kill, f"duplicate {rec} in a partition the victim did not own at the kill"
            assert o >= last_commit.get(p, 0), f"duplicate {rec} below the victim's last commit {last_commit[p]}"
    # Each of its partitions was taken over at its committed offset: not before its last logged
    # commit (it committed at least that), not after the records it processed (nothing skipped).
    for p in owned_at_kill:
        takeovers = sorted((t, pos) for w in survivors for a_p, pos, t in w.acquired if a_p == p and t > killed_ns)
        assert takeovers, f"partition {p} of the killed member was never taken over"
        position = takeovers[0][1]
        started = max((t, pos) for a_p, pos, t in dead.acquired if a_p == p)[1]  # its last acquisition
        processed_to = max([o + 1 for q, o in dead.records if q == p], default=started)
        assert last_commit.get(p, started) <= position <= processed_to


def _owned_at_end(w: WorkerLog, p: int) -> bool:
    """Whether ``w``'s last ownership event for partition ``p`` is an acquisition."""
    events = [(t, "A") for q, _, t in w.acquired if q == p] + [(t, "V") for q, t in w.revoked if q == p]
    return bool(events) and max(events)[1] == "A"
