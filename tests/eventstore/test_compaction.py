"""Log compaction against a reference model, under injected crashes, kill -9 and concurrent appends.

The reference model is every acknowledged record by offset (from the producer's
RecordMetadata). After compacting every closed segment, the exact record set a consumer
must see from offset 0 is known: below the active segment, the last record of each key
(tombstones until their delete horizon), and the active segment as it was.

Crash tests: (a) a pass is stopped before each of its file-system steps in turn (writes
of ``.cleaned`` files, renames, deletions), and the directory must afterwards hold, per
group of segments, either the old segments or the new one, never a mix; (b) a process
running compaction passes in a loop is killed with SIGKILL at random moments.

Sizes grow with ``TIDELINE_SOAK=1``.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logutil import (
    BIG_MS,
    FAST,
    Model,
    Rec,
    check_exact,
    check_segments,
    check_view,
    consume_all,
    digest,
    expected_after_compaction,
    produce,
    read_fresh,
    send_one,
    snapshot,
)

import eventstore.cleaner as cleaner
from eventstore.cleaner import compact_partition, resolve_overlaps
from eventstore.log import Log
from eventstore.segment import list_segment_bases, log_path
from eventstore.topic import DAY_MS, CleanupPolicy, TopicConfig, now_ms

SOAK = os.environ.get("TIDELINE_SOAK") == "1"
REPO = Path(__file__).resolve().parents[2]
HOUR_MS = 3600 * 1000


def compact_config(segment_bytes: int, **kw: int) -> TopicConfig:
    return TopicConfig(cleanup_policy=CleanupPolicy.COMPACT, segment_bytes=segment_bytes, segment_ms=BIG_MS, **kw)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return env


# ---------------------------------------------------------------------------- reference model


@settings(
    max_examples=80 if SOAK else 20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    segment_bytes=st.sampled_from([4096, 8192, 16384, 65536]),
    partitions=st.integers(1, 3),
    n_keys=st.integers(1, 80),
    n_records=st.integers(50, 1200),
    tombstone_rate=st.sampled_from([0.0, 0.1, 0.35]),
    roll_rate=st.sampled_from([0.0, 0.05, 0.3]),
    delete_retention_ms=st.sampled_from([0, DAY_MS]),
    seed=st.integers(0, 2**32 - 1),
)
def test_compaction_matches_reference_model(
    segment_bytes: int,
    partitions: int,
    n_keys: int,
    n_records: int,
    tombstone_rate: float,
    roll_rate: float,
    delete_retention_ms: int,
    seed: int,
) -> None:
    rng = random.Random(seed)
    model = Model()
    with tempfile.TemporaryDirectory(prefix="tideline-compact-") as tmp:
        path = Path(tmp) / "log"
        cfg = compact_config(segment_bytes, delete_retention_ms=delete_retention_ms)
        with Log(path, fsync=FAST) as log:
            log.create_topic("t", partitions, cfg)
            produce(log, "t", model, rng, n_records, n_keys=n_keys, tombstone_rate=tombstone_rate, roll_rate=roll_rate)
            for p in range(partitions):
                log.partition("t", p).roll()
            # some data in the active segments: compaction must not touch it
            produce(log, "t", model, rng, rng.randrange(0, 40), n_keys=n_keys, tombstone_rate=tombstone_rate)

            now = now_ms()
            clean_end: dict[int, int] = {}
            active: dict[int, tuple[Path, str]] = {}
            for p in range(partitions):
                plog = log.partition("t", p)
                bases = list_segment_bases(plog.directory)
                clean_end[p] = bases[-1]
                active[p] = (log_path(plog.directory, bases[-1]), digest(log_path(plog.directory, bases[-1])))

            def check(drop_tombstones: bool, what: str) -> None:
                for p in range(partitions):
                    produced = model.part(p)
                    view = read_fresh(path, "t", p)
                    check_view(view, produced, tombstones_may_be_gone=drop_tombstones, what=f"{what} p{p}")
                    expected = expected_after_compaction(produced, clean_end[p], drop_tombstones=drop_tombstones)
                    check_exact(view, expected, what=f"{what} p{p}")
                    directory = log.partition("t", p).directory
                    check_segments(directory)
                    active_path, active_digest = active[p]
                    assert list_segment_bases(directory)[-1] == clean_end[p], "the active segment changed"
                    assert digest(active_path) == active_digest, f"{what}: the active segment of p{p} was modified"

            # pass 1: every closed segment is cleaned; latest tombstones are kept (horizon set)
            for p in range(partitions):
                produced = model.part(p)
                below = [o for o in produced if o < clean_end[p]]
                kept = expected_after_compaction({o: produced[o] for o in below}, clean_end[p])
                stats = compact_partition(log.partition("t", p), now=now)
                assert stats.records_read == len(below)
                assert stats.records_kept == len(kept)
                assert stats.tombstones_dropped == 0
            check(False, "after pass 1")

            # pass 2 at the same time: idempotent, except tombstones whose horizon (now + 0) has come
            for p in range(partitions):
                produced = model.part(p)
                kept = expected_after_compaction(produced, clean_end[p])
                tombs = sum(1 for o, r in kept.items() if o < clean_end[p] and r.value is None)
                stats = compact_partition(log.partition("t", p), now=now)
                assert stats.tombstones_dropped == (tombs if delete_retention_ms == 0 else 0)
                assert stats.records_kept == stats.records_read - stats.tombstones_dropped
            check(delete_retention_ms == 0, "after pass 2")

            # past the horizon: every tombstone in the cleaned part goes (with all earlier values)
            for p in range(partitions):
                compact_partition(log.partition("t", p), now=now + delete_retention_ms + 1)
            check(True, "after the delete horizon")

            # and once more: nothing left to do
            for p in range(partitions):
                stats = compact_partition(log.partition("t", p), now=now + delete_retention_ms + 2)
                assert stats.records_kept == stats.records_read
                assert stats.tombstones_dropped == 0
            check(True, "after the last pass")


def _scenario_log(path: Path, delete_retention_ms: int) -> tuple[Model, dict[str, int]]:
    """a=1 b=1 a=∅ c=1 b=2 d=1 d=∅ d=2 | roll | c=2 (active)."""
    model = Model()
    offsets: dict[str, int] = {}
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, compact_config(4096, delete_retention_ms=delete_retention_ms))
        for name, key, value in [
            ("a1", b"a", b"a1"),
            ("b1", b"b", b"b1"),
            ("a_tomb", b"a", None),
            ("c1", b"c", b"c1"),
            ("b2", b"b", b"b2"),
            ("d1", b"d", b"d1"),
            ("d_tomb", b"d", None),
            ("d2", b"d", b"d2"),
        ]:
            offsets[name] = send_one(log, "t", model, key, value)
        log.partition("t", 0).roll()
        offsets["c2"] = send_one(log, "t", model, b"c", b"c2")
    return model, offsets


def _values(view: list[tuple[int, Rec]]) -> list[tuple[bytes | None, bytes | None]]:
    return [(r.key, r.value) for _, r in view]


@pytest.mark.parametrize("delete_retention_ms", [0, DAY_MS])
def test_tombstones_kept_until_the_delete_horizon(tmp_path: Path, delete_retention_ms: int) -> None:
    path = tmp_path / "log"
    model, offsets = _scenario_log(path, delete_retention_ms)
    now = now_ms()
    with Log(path, create=False, fsync=FAST) as log:
        plog = log.partition("t", 0)
        compact_partition(plog, now=now)
        view = read_fresh(path, "t", 0)
        # the superseded tombstone of d and every earlier value are gone; a's tombstone stays
        assert _values(view) == [(b"a", None), (b"c", b"c1"), (b"b", b"b2"), (b"d", b"d2"), (b"c", b"c2")]
        assert [o for o, _ in view] == [offsets[n] for n in ("a_tomb", "c1", "b2", "d2", "c2")]

        if delete_retention_ms:
            for later in (now + 1, now + delete_retention_ms - 1):
                compact_partition(plog, now=later)
                assert _values(read_fresh(path, "t", 0))[0] == (b"a", None), "tombstone dropped before its horizon"
        stats = compact_partition(plog, now=now + delete_retention_ms)
        assert stats.tombstones_dropped == 1
        view = read_fresh(path, "t", 0)
        assert _values(view) == [(b"c", b"c1"), (b"b", b"b2"), (b"d", b"d2"), (b"c", b"c2")]
        assert all(r.key != b"a" for _, r in view), "a value of the deleted key came back"
        check_view(view, model.part(0), tombstones_may_be_gone=True)
        # the active segment's later value of c is untouched, the cleaned c1 stays (latest in the cleaned part)
        assert stats.records_kept == stats.records_read - 1


def test_min_compaction_lag_keeps_recent_segments(tmp_path: Path) -> None:
    path = tmp_path / "log"
    model = Model()
    rng = random.Random(7)
    t0 = now_ms() - 10 * HOUR_MS
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, compact_config(1 << 20, min_compaction_lag_ms=3 * HOUR_MS))
        plog = log.partition("t", 0)
        # segments stamped 10 h, 8 h, 1 h (recent), 9 h (old again) before "now", then the active one
        for age in (10, 8, 1, 9):
            produce(log, "t", model, rng, 80, n_keys=10, timestamp=t0 + (10 - age) * HOUR_MS)
            plog.roll()
        produce(log, "t", model, rng, 5, n_keys=10, timestamp=t0 + 10 * HOUR_MS)
        bases = list_segment_bases(plog.directory)
        assert len(bases) == 5
        before = snapshot(plog.directory)
        now = t0 + 10 * HOUR_MS

        compact_partition(plog, now=now)
        after = snapshot(plog.directory)
        # only the prefix of closed segments older than the lag is cleaned: 10 h and 8 h
        for base in bases[2:]:
            assert after[log_path(plog.directory, base).name] == before[log_path(plog.directory, base).name], (
                f"segment {base} (recent, or after a recent one) was compacted"
            )
        assert bases[1] not in list_segment_bases(plog.directory), "the two old segments were not merged"
        view = read_fresh(path, "t", 0)
        check_exact(view, expected_after_compaction(model.part(0), bases[2]), what="lag 3h")
        check_view(view, model.part(0))

        compact_partition(plog, now=now + 2 * HOUR_MS)  # the 1 h segment is now 3 h old
        view = read_fresh(path, "t", 0)
        check_exact(view, expected_after_compaction(model.part(0), bases[4]), what="lag passed")
        check_segments(plog.directory)


def test_keyless_records_survive_compaction(tmp_path: Path) -> None:
    """Records written before the topic became compacted have no key: they are kept."""
    path = tmp_path / "log"
    model = Model()
    rng = random.Random(3)
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, TopicConfig(segment_bytes=4096, segment_ms=BIG_MS))
        for i in range(20):
            if i % 3 == 0:
                send_one(log, "t", model, None, b"keyless-%d" % i)
            else:
                send_one(log, "t", model, b"k%d" % (i % 4), b"v%d" % i)
        log.alter_topic_config("t", {"cleanup_policy": "compact"})
        produce(log, "t", model, rng, 200, n_keys=4)
        plog = log.partition("t", 0)
        plog.roll()
        end = list_segment_bases(plog.directory)[-1]
        compact_partition(plog)
        view = read_fresh(path, "t", 0)
        check_exact(view, expected_after_compaction(model.part(0), end), what="keyless")
        assert sum(1 for _, r in view if r.key is None) == 7


# ---------------------------------------------------------------------------- injected crashes


class Crash(BaseException):
    """The simulated death of the process (BaseException: nothing may catch it)."""


class StepFaults:
    """Counts the file-system steps of a compaction pass and stops the pass before step ``crash_at``.

    Steps: each write of a ``.cleaned`` file (a crash there leaves half of it written),
    each ``os.replace`` and each unlink done by eventstore.cleaner in ``directory``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path, crash_at: int | None) -> None:
        self.directory = directory
        self.crash_at = crash_at
        self.steps: list[str] = []
        self.armed = True
        real_write = cleaner.write_fsynced
        real_unlink = pathlib.Path.unlink
        faults = self

        def write(path: Path, chunks: list[bytes | bytearray]) -> int:
            if faults._crash_now(f"write {path.name}"):
                data = b"".join(bytes(c) for c in chunks)
                path.write_bytes(data[: len(data) // 2])
                raise Crash(faults.steps[-1])
            return real_write(path, chunks)

        class Os:
            def __getattr__(self, name: str) -> object:
                return getattr(os, name)

            @staticmethod
            def replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
                if faults._crash_now(f"replace {Path(src).name} -> {Path(dst).name}"):
                    raise Crash(faults.steps[-1])
                os.replace(src, dst)

        def unlink(self: pathlib.Path, missing_ok: bool = False) -> None:
            if self.parent == faults.directory and faults._crash_now(f"unlink {self.name}"):
                raise Crash(faults.steps[-1])
            real_unlink(self, missing_ok=missing_ok)

        monkeypatch.setattr(cleaner, "write_fsynced", write)
        monkeypatch.setattr(cleaner, "os", Os())
        monkeypatch.setattr(pathlib.Path, "unlink", unlink)

    def _crash_now(self, what: str) -> bool:
        if not self.armed:
            return False
        self.steps.append(what)
        return len(self.steps) - 1 == self.crash_at


def _groups(pre: list[int], post: list[int]) -> list[list[int]]:
    """The groups of a pass: each surviving closed base with the bases merged into it."""
    groups: list[list[int]] = []
    for base in pre:
        if base in post or not groups:
            groups.append([base])
        else:
            groups[-1].append(base)
    return groups


def _group_states(directory: Path, groups: list[list[int]], old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """Per group, 'old' (every old segment, as it was) or 'new' (only the compacted one); else fail."""
    now = snapshot(directory)
    present = set(list_segment_bases(directory))
    states = []
    for group in groups:
        names = [
            name for base in group for name in (f"{base:020d}.log", f"{base:020d}.index", f"{base:020d}.timeindex")
        ]
        first = names[:3]
        if present.issuperset(group) and all(now.get(n) == old.get(n) for n in names):
            states.append("old")
        elif present & set(group) == {group[0]} and all(now.get(n) == new.get(n) for n in first):
            states.append("new")
        else:

            def state(n: str) -> str:
                if n not in now:
                    return "missing"
                return "old" if now[n] == old.get(n) else "new" if now[n] == new.get(n) else "other"

            detail = ", ".join(f"{int(n[:20])}{n[20:]}={state(n)}" for n in names if n.endswith(".log"))
            raise AssertionError(f"group {group} is neither old nor new: {detail}")
    return "".join("o" if s == "old" else "N" for s in states)


def _check_crash_point(
    work: Path, model: Model, groups: list[list[int]], old: dict[str, bytes], new: dict[str, bytes], now: int
) -> list[str]:
    """Every check after one simulated crash; returns the failing ones."""
    pdir = work / "t-0"
    problems: list[str] = []

    def attempt(check: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # every check of every crash point is reported
            problems.append(f"{check}: {type(e).__name__}: {str(e).splitlines()[0]}")

    def settle() -> None:
        with Log(work, create=False, fsync=FAST) as log:  # a fresh process's first write settles leftovers
            send_one(log, "t", model, b"settle", b"x")

    def next_pass() -> None:
        with Log(work, create=False, fsync=FAST) as log:
            compact_partition(log.partition("t", 0), now=now)
        end = list_segment_bases(pdir)[-1]
        check_exact(read_fresh(work, "t", 0), expected_after_compaction(model.part(0), end))
        check_segments(pdir)

    # a reader that settles nothing already sees a correct log
    attempt("view before settling", lambda: check_view(read_fresh(work, "t", 0), model.part(0)))
    attempt("settle", settle)
    attempt("segments", lambda: check_segments(pdir))
    attempt("old-or-new", lambda: _group_states(pdir, groups, old, new))
    attempt("view after settling", lambda: check_view(read_fresh(work, "t", 0), model.part(0)))
    attempt("next pass", next_pass)
    return problems


@pytest.fixture(scope="module")
def crash_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Model]]:
    """A compacted topic with small closed segments (so groups merge several) and an active tail."""
    path = tmp_path_factory.mktemp("crash-template") / "log"
    model = Model()
    rng = random.Random(20240611)
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, compact_config(8192, delete_retention_ms=DAY_MS))
        produce(log, "t", model, rng, 260, n_keys=16, tombstone_rate=0.15, max_batch=6, roll_rate=0.25)
        log.partition("t", 0).roll()
        produce(log, "t", model, rng, 6, n_keys=16)
    yield path, model


def test_crash_at_every_step_of_a_pass(
    crash_template: tuple[Path, Model], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template, template_model = crash_template
    now = now_ms()

    # the uninterrupted pass: how many steps, and what it leaves
    dry = tmp_path / "dry"
    shutil.copytree(template, dry)
    pdir_dry = dry / "t-0"
    old = snapshot(pdir_dry)
    pre = list_segment_bases(pdir_dry)
    with monkeypatch.context() as m, Log(dry, create=False, fsync=FAST) as log:
        faults = StepFaults(m, pdir_dry, None)
        compact_partition(log.partition("t", 0), now=now)
        steps = list(faults.steps)
    new = snapshot(pdir_dry)
    post = list_segment_bases(pdir_dry)
    groups = _groups(pre[:-1], post[:-1])
    assert any(len(g) > 1 for g in groups), "the workload must make groups of several segments"
    assert len(steps) > 10, steps

    failures: list[str] = []
    for k in range(len(steps)):
        work = tmp_path / f"crash-{k}"
        shutil.copytree(template, work)
        pdir = work / "t-0"
        model = Model(records={0: dict(template_model.part(0))}, serial=template_model.serial)
        with monkeypatch.context() as m, Log(work, create=False, fsync=FAST) as log:
            StepFaults(m, pdir, k)
            with pytest.raises(Crash):
                compact_partition(log.partition("t", 0), now=now)
        where = f"crash before step {k} ({steps[k]})"
        problems = _check_crash_point(work, model, groups, old, new, now)
        if problems:
            failures.append(f"{where}:\n    " + "\n    ".join(problems))
        shutil.rmtree(work)
    assert not failures, f"{len(failures)} of {len(steps)} crash points fail:\n" + "\n".join(failures)


def test_resolve_overlaps_is_idempotent_on_a_clean_log(crash_template: tuple[Path, Model], tmp_path: Path) -> None:
    work = tmp_path / "log"
    shutil.copytree(crash_template[0], work)
    before = snapshot(work / "t-0")
    resolve_overlaps(work / "t-0")
    assert snapshot(work / "t-0") == before
    with Log(work, create=False, fsync=FAST) as log:
        compact_partition(log.partition("t", 0))
    after = snapshot(work / "t-0")
    resolve_overlaps(work / "t-0")
    assert snapshot(work / "t-0") == after


# ---------------------------------------------------------------------------- kill -9

CLEANER_LOOP = r"""
import sys
from pathlib import Path
from eventstore.log import Log
from eventstore.cleaner import compact_partition
path, topic, stop = sys.argv[1], sys.argv[2], Path(sys.argv[3])
log = Log(path, create=False)
plogs = [log.partition(topic, p) for p in range(log.topic(topic).partitions)]
print("ready", flush=True)
passes = 0
while not stop.exists():
    for plog in plogs:
        compact_partition(plog)
    passes += 1
print(passes, flush=True)
"""


def _start_cleaner(path: Path, topic: str, stop: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLEANER_LOOP, str(path), topic, str(stop)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"cleaner process failed to start: {line!r}"
    return proc


def test_kill_9_during_compaction(tmp_path: Path) -> None:
    iterations = 300 if SOAK else 20
    rng = random.Random(99)
    path = tmp_path / "log"
    model = Model()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, compact_config(8192, delete_retention_ms=DAY_MS))
        produce(log, "t", model, rng, 300, n_keys=24, tombstone_rate=0.15, roll_rate=0.25)
        log.partition("t", 0).roll()
    pdir = path / "t-0"

    # how long does a pass take here? kills land within a few passes' time
    probe = tmp_path / "probe"
    shutil.copytree(path, probe)
    with Log(probe, create=False, fsync=FAST) as log:
        started = time.monotonic()
        compact_partition(log.partition("t", 0))
        compact_partition(log.partition("t", 0))
        window = 2 * (time.monotonic() - started)
    shutil.rmtree(probe)

    stop = tmp_path / "never"
    for i in range(iterations):
        proc = _start_cleaner(path, "t", stop)
        time.sleep(rng.uniform(0, window))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        where = f"kill {i}"
        check_view(read_fresh(path, "t", 0), model.part(0), what=f"{where}, before settling")
        with Log(path, create=False, fsync=FAST) as log:
            # the first write settles leftovers; then new work for the next cleaner
            send_one(log, "t", model, b"k0000", b"after-kill-%d" % i)
            check_segments(pdir, what=where)
            check_view(read_fresh(path, "t", 0), model.part(0), what=f"{where}, after settling")
            produce(log, "t", model, rng, rng.randrange(10, 60), n_keys=24, tombstone_rate=0.15, roll_rate=0.3)
            log.partition("t", 0).roll()

    with Log(path, create=False, fsync=FAST) as log:
        compact_partition(log.partition("t", 0))
        end = list_segment_bases(pdir)[-1]
    view = read_fresh(path, "t", 0)
    check_exact(view, expected_after_compaction(model.part(0), end), what="after the kills")
    check_segments(pdir)


# ---------------------------------------------------------------------------- concurrent appends

PRODUCER = r"""
import json, random, sys
from eventstore.log import Log
from eventstore.producer import Producer
path, topic, seed, count, ack_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = random.Random(seed)
log = Log(path, create=False)
acks = []
with Producer(log, linger_ms=3_600_000) as producer:
    pending = []
    for i in range(count):
        key = b"k%03d" % rng.randrange(40)
        value = None if rng.random() < 0.1 else b"child-%d" % i + b"x" * rng.randrange(80)
        pending.append((key, value, producer.send(topic, value, key=key)))
        if rng.random() < 0.2:
            producer.flush()
            for k, v, f in pending:
                md = f.result()
                acks.append([md.partition, md.offset, k.hex(), None if v is None else v.hex()])
            pending.clear()
    producer.flush()
    for k, v, f in pending:
        md = f.result()
        acks.append([md.partition, md.offset, k.hex(), None if v is None else v.hex()])
with open(ack_path + ".tmp", "w") as f:
    json.dump(acks, f)
import os
os.replace(ack_path + ".tmp", ack_path)
"""


def test_compaction_while_another_process_appends(tmp_path: Path) -> None:
    """A producer process appends (and rolls small segments) while this process compacts in a loop."""
    import json

    path = tmp_path / "log"
    partitions = 2
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", partitions, compact_config(4096, delete_retention_ms=DAY_MS))
    count = 20000 if SOAK else 2500
    acks = tmp_path / "acks.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(path), "t", "5", str(count), str(acks)], env=child_env(), cwd=REPO
    )
    views: list[tuple[int, list[tuple[int, Rec]]]] = []
    passes = 0
    with Log(path, create=False, fsync=FAST) as log:
        while proc.poll() is None:
            for p in range(partitions):
                compact_partition(log.partition("t", p))
                views.append((p, read_fresh(path, "t", p)))
            passes += 1
    assert proc.wait() == 0
    model = Model()
    for p, off, k, v in json.loads(acks.read_text()):
        model.add(p, off, Rec(bytes.fromhex(k), None if v is None else bytes.fromhex(v), 0))
    assert sum(len(model.part(p)) for p in range(partitions)) == count
    assert passes >= 3, "the producer finished before compaction could overlap it"

    # what readers saw meanwhile: offsets increase, every record is the acknowledged one
    for p, view in views:
        offsets = [o for o, _ in view]
        assert offsets == sorted(set(offsets)), f"a concurrent read of p{p} saw offsets twice or out of order"
        for off, rec in view:
            want = model.part(p).get(off)
            assert want is not None and (want.key, want.value) == (rec.key, rec.value), f"p{p} offset {off}"

    with Log(path, create=False, fsync=FAST) as log:
        for p in range(partitions):
            check_view(read_fresh(path, "t", p), model.part(p), what=f"after appends p{p}")
            plog = log.partition("t", p)
            compact_partition(plog)
            end = list_segment_bases(plog.directory)[-1]
            view = read_fresh(path, "t", p)
            check_exact(view, expected_after_compaction(model.part(p), end), what=f"final p{p}")
            check_segments(plog.directory)


def test_append_while_another_process_compacts(tmp_path: Path) -> None:
    """This process appends (with rolls) while a cleaner process runs passes in a loop."""
    rng = random.Random(11)
    path = tmp_path / "log"
    model = Model()
    with Log(path, fsync=FAST) as log:
        log.create_topic("t", 1, compact_config(4096, delete_retention_ms=DAY_MS))
    stop = tmp_path / "stop"
    proc = _start_cleaner(path, "t", stop)
    try:
        with Log(path, create=False, fsync=FAST) as log:
            for _ in range(40 if SOAK else 8):
                produce(log, "t", model, rng, 150, n_keys=30, tombstone_rate=0.1, roll_rate=0.1)
                check_view(consume_all(log, "t", 0), model.part(0), what="while compacting")
    finally:
        stop.touch()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert int(out.split()[-1]) >= 1
    pdir = path / "t-0"
    check_segments(pdir)
    check_view(read_fresh(path, "t", 0), model.part(0), what="after the cleaner stopped")
    with Log(path, create=False, fsync=FAST) as log:
        plog = log.partition("t", 0)
        plog.roll()
        compact_partition(plog)
        end = list_segment_bases(pdir)[-1]
    check_exact(read_fresh(path, "t", 0), expected_after_compaction(model.part(0), end), what="final")
