"""ChangeWaiter (eventstore.notify): a reader sleeps until another process writes.

* Unit: writes, new files and renames into a watched directory wake ``wait``; nothing
  changed means a timeout; unwatch and ``set_watched`` shape what is seen; a vanished
  directory, a kernel queue overflow, ``wakeup`` and ``close`` from another thread, and
  the polling fallback (chosen, or forced by a real ``EMFILE``) all behave.
* Long-poll: a ``ChangeWaiter`` and a ``Consumer.poll`` blocked at the head of a partition
  return when *another process* appends; an idle ``poll`` returns nothing.

The timing acceptance figures (p99 < 50 ms from another process's append to the poll
returning it; an idle waiter under 2 % CPU) are measured by ``python -m bench --only
notify`` (bench/notify_bench.py): tests assert on events, never on time.

Real files, real processes, no mocks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import WakeupError
from eventstore.log import Log
from eventstore.notify import ChangeWaiter

REPO = Path(__file__).resolve().parents[2]
NO_CHANGE_S = 0.05


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return env


def make_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def pwrite(path: Path, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------- unit


def test_pwrite_wakes_and_events_are_drained(tmp_path: Path) -> None:
    d = make_dir(tmp_path / "t-0")
    segment = d / "00000000000000000000.log"
    segment.write_bytes(b"")
    with ChangeWaiter() as waiter:
        assert waiter.inotify, waiter.fallback_reason
        waiter.watch(d)
        assert waiter.wait(NO_CHANGE_S) is False  # nothing changed: timeout
        for i in range(50):  # a burst: one wake-up drains it all
            pwrite(segment, b"batch", i * 5)
        assert waiter.wait(0) is True  # already pending: returns at once
        assert waiter.wait(NO_CHANGE_S) is False


def test_write_from_another_thread_ends_a_blocking_wait(tmp_path: Path) -> None:
    d = make_dir(tmp_path / "t-0")
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        writer = later(0.1, lambda: pwrite(d / "00000000000000000000.log", b"x", 0))
        assert waiter.wait(10) is True  # False only after the 10 s timeout
        writer.join()


def test_new_file_and_rename_into_wake(tmp_path: Path) -> None:
    d = make_dir(tmp_path / "t-0")
    elsewhere = make_dir(tmp_path / "elsewhere")
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        (d / "00000000000000000100.log").touch()  # a roll: IN_CREATE, no write
        assert waiter.wait(NO_CHANGE_S) is True
        assert waiter.wait(NO_CHANGE_S) is False
        staged = elsewhere / "lso.tmp"
        staged.write_bytes(b"offset")  # not watched: no event
        assert waiter.wait(NO_CHANGE_S) is False
        os.replace(staged, d / "lso")  # replace via rename: IN_MOVED_TO only
        assert waiter.wait(NO_CHANGE_S) is True
        assert waiter.wait(NO_CHANGE_S) is False


def test_reads_do_not_wake(tmp_path: Path) -> None:
    """The reader's own reads (IN_ACCESS/IN_OPEN/IN_CLOSE_NOWRITE) must not wake it."""
    d = make_dir(tmp_path / "t-0")
    (d / "00000000000000000000.log").write_bytes(b"data")
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        for _ in range(3):
            assert (d / "00000000000000000000.log").read_bytes() == b"data"
        assert waiter.wait(NO_CHANGE_S) is False


def test_unwatch_and_set_watched(tmp_path: Path) -> None:
    a, b, c = (make_dir(tmp_path / f"t-{n}") for n in range(3))
    with ChangeWaiter() as waiter:
        waiter.watch(a)
        waiter.watch(a)  # idempotent
        waiter.watch(b)
        assert waiter.watched == {a, b}
        waiter.unwatch(a)
        waiter.unwatch(a)  # no-op
        (a / "f").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is False

        (b / "f").write_bytes(b"x")  # queued, then b is unwatched: discarded, not a change
        waiter.set_watched([c])
        assert waiter.watched == {c}
        assert waiter.wait(NO_CHANGE_S) is False
        (b / "f").write_bytes(b"y")
        assert waiter.wait(NO_CHANGE_S) is False
        (c / "f").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is True

        waiter.set_watched([a, c])
        waiter.set_watched([a, c])  # unchanged: nothing to do
        (a / "g").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is True
        waiter.set_watched([])
        assert waiter.watched == frozenset()
        (c / "g").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is False


def test_one_directory_under_two_names(tmp_path: Path) -> None:
    """Two paths of one directory share a kernel watch: unwatching one keeps the other."""
    d = make_dir(tmp_path / "t-0")
    alias = tmp_path / "alias"
    alias.symlink_to(d, target_is_directory=True)
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        waiter.watch(alias)
        waiter.unwatch(alias)
        (d / "f").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is True


def test_watch_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with ChangeWaiter() as waiter:
        with pytest.raises(FileNotFoundError):
            waiter.watch(tmp_path / "missing")
        with pytest.raises(NotADirectoryError):
            waiter.watch(tmp_path / "file")
        good = make_dir(tmp_path / "t-0")
        with pytest.raises(FileNotFoundError):
            waiter.set_watched([good, tmp_path / "missing"])
        assert waiter.watched == {good}  # the others are still watched


def test_removed_directory_does_not_break_the_waiter(tmp_path: Path) -> None:
    gone = make_dir(tmp_path / "t-0")
    (gone / "00000000000000000000.log").write_bytes(b"x")
    kept = make_dir(tmp_path / "t-1")
    with ChangeWaiter() as waiter:
        waiter.set_watched([gone, kept])
        shutil.rmtree(gone)
        assert waiter.wait(NO_CHANGE_S) is True  # deletions, then IN_IGNORED: a change
        assert waiter.wait(NO_CHANGE_S) is False
        assert waiter.watched == {kept}  # the vanished directory was dropped
        (kept / "f").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is True
        with pytest.raises(FileNotFoundError):
            waiter.watch(gone)
        make_dir(gone)  # recreated: watching the path again watches the new directory
        waiter.watch(gone)
        (gone / "f").write_bytes(b"x")
        assert waiter.wait(NO_CHANGE_S) is True


def test_moved_away_directory_is_dropped(tmp_path: Path) -> None:
    d = make_dir(tmp_path / "t-0")
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        d.rename(tmp_path / "t-0.deleted")
        assert waiter.wait(NO_CHANGE_S) is True
        assert waiter.watched == frozenset()
        (tmp_path / "t-0.deleted" / "f").write_bytes(b"x")  # not what was asked for any more
        assert waiter.wait(NO_CHANGE_S) is False


def test_queue_overflow_counts_as_a_change(tmp_path: Path) -> None:
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 100_000:
        pytest.skip(f"max_queued_events is {limit}: too many files to overflow it")
    d = make_dir(tmp_path / "t-0")
    with ChangeWaiter() as waiter:
        waiter.watch(d)
        fds = [os.open(d / name, os.O_WRONLY | os.O_CREAT, 0o644) for name in ("a", "b")]
        try:
            for i in range(limit + 10):  # alternate files: consecutive events differ, none coalesce
                os.pwrite(fds[i % 2], b"x", i)
        finally:
            for fd in fds:
                os.close(fd)
        assert waiter.wait(0) is True
        assert waiter.overflows == 1
        assert waiter.wait(NO_CHANGE_S) is False
        (d / "c").write_bytes(b"x")  # still watching after the overflow
        assert waiter.wait(NO_CHANGE_S) is True


def test_wakeup_from_another_thread(tmp_path: Path) -> None:
    with ChangeWaiter() as waiter:
        waiter.watch(make_dir(tmp_path / "t-0"))
        waker = later(0.1, waiter.wakeup)
        assert waiter.wait(10) is True  # False only after the 10 s timeout
        waker.join()
        assert waiter.wait(NO_CHANGE_S) is False
        waiter.wakeup()  # before a wait: the next wait returns at once, once
        waiter.wakeup()
        assert waiter.wait(10) is True
        assert waiter.wait(NO_CHANGE_S) is False


def test_close_from_another_thread_ends_a_wait() -> None:
    waiter = ChangeWaiter()
    closer = later(0.1, waiter.close)
    assert waiter.wait(10) is True
    closer.join()
    with pytest.raises(ValueError):
        waiter.wait(0)
    with pytest.raises(ValueError):
        waiter.watch(Path("."))
    waiter.wakeup()  # harmless after close
    waiter.close()  # idempotent


def test_one_waiting_thread_at_a_time() -> None:
    with ChangeWaiter() as waiter:
        first = threading.Thread(target=waiter.wait, args=(10,))
        first.start()
        deadline = time.monotonic() + 10
        while not waiter._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError):
            waiter.wait(0)
        waiter.wakeup()
        first.join()


def test_fallback_mode(tmp_path: Path) -> None:
    d = make_dir(tmp_path / "t-0")
    with ChangeWaiter(use_inotify=False) as waiter:
        assert not waiter.inotify
        assert waiter.fallback_reason is not None
        waiter.watch(d)
        assert waiter.watched == {d}
        with pytest.raises(FileNotFoundError):
            waiter.watch(tmp_path / "missing")
        # "Maybe changed" after at most one short step, whatever the timeout: the caller re-checks.
        assert waiter.wait(10) is True
        assert waiter.wait(0) is True
        waker = later(0.1, waiter.wakeup)
        waker.join()
        assert waiter.wait(10) is True
        waiter.unwatch(d)
        assert waiter.watched == frozenset()


EMFILE_CHILD = r"""
import logging, os, resource, sys
from pathlib import Path
from eventstore.notify import ChangeWaiter
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
os.close(fds.pop())  # room for the wakeup eventfd, none for the inotify instance
waiter = ChangeWaiter()
print(waiter.inotify, waiter.fallback_reason)
waiter.watch(Path(sys.argv[1]))
print(waiter.wait(10))
waiter.close()
"""


def test_fallback_when_inotify_init_fails_with_emfile(tmp_path: Path) -> None:
    """A real EMFILE (out of descriptors in a child process) degrades to polling with a warning."""
    out = subprocess.run(
        [sys.executable, "-c", EMFILE_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=60,
        check=True,
    )
    first, second = out.stdout.splitlines()
    assert first.startswith("False ") and "EMFILE" in first
    assert second == "True"  # after one fallback step, not the 10 s timeout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING eventstore.notify")]
    assert len(warnings) == 1 and "EMFILE" in warnings[0], out.stderr


# ---------------------------------------------------------------------------- another process appends

WRITER = r"""
import sys
from eventstore.log import Log
from eventstore.producer import Producer
path, topic = sys.argv[1], sys.argv[2]
log = Log(path)
producer = Producer(log)
producer.send_batch(topic, [b"warm-up"], partition=0)  # process start and recovery are not part of the test
print("ready", flush=True)
for line in sys.stdin:
    producer.send_batch(topic, [line.strip().encode()], partition=0)
    print("sent", flush=True)
producer.close()
log.close()
"""

WAIT_S = 60.0  # generous: each wait ends on the event it checks, long before this


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _start_writer(log: Log) -> subprocess.Popen[str]:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(log.path), "t"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
    return writer


def test_another_process_append_ends_a_blocking_wait(tmp_path: Path) -> None:
    """The waiter, blocked in the kernel, returns True (a change) when another process appends."""
    log = Log(tmp_path / "log")
    log.create_topic("t", partitions=1)
    writer = _start_writer(log)
    assert writer.stdin is not None and writer.stdout is not None
    try:
        with ChangeWaiter() as waiter:
            assert waiter.inotify, waiter.fallback_reason
            waiter.watch(log.partition("t", 0).directory)
            for i in range(20):
                woke: list[bool] = []
                thread = threading.Thread(target=lambda out=woke: out.append(waiter.wait(WAIT_S)))
                thread.start()
                _wait_until(lambda: waiter._waiting, "the waiter to block")
                writer.stdin.write(f"record-{i}\n")
                writer.stdin.flush()
                thread.join(WAIT_S + 10)
                assert woke == [True], "the wait timed out: the other process's append did not wake it"
                assert writer.stdout.readline() == "sent\n"
                while waiter.wait(0):  # drain the rest of this append's events (index, fsync)
                    pass
    finally:
        writer.stdin.close()
        writer.wait(timeout=60)
        log.close()
    assert writer.returncode == 0


def test_long_poll_returns_a_record_another_process_appends(tmp_path: Path) -> None:
    """Consumer.poll blocked at the head returns each record another process appends, in order."""
    log = Log(tmp_path / "log")
    log.create_topic("t", partitions=1)
    writer = _start_writer(log)
    assert writer.stdin is not None and writer.stdout is not None
    consumer = Consumer(log, enable_auto_commit=False)
    consumer.assign([TopicPartition("t", 0)])
    consumer.seek(TopicPartition("t", 0), 1)  # after the writer's warm-up record
    try:
        assert not consumer.poll(timeout_ms=10)  # set up and watching
        for i in range(20):
            got: list[list[bytes | None]] = []
            thread = threading.Thread(
                target=lambda out=got: out.append([r.value for r in consumer.poll(timeout_ms=60_000)])
            )
            thread.start()
            _wait_until(lambda: consumer._waiter is not None and consumer._waiter._waiting, "the poll to block")
            writer.stdin.write(f"record-{i}\n")
            writer.stdin.flush()
            thread.join(WAIT_S + 10)
            assert got == [[f"record-{i}".encode()]], got
            assert writer.stdout.readline() == "sent\n"
    finally:
        writer.stdin.close()
        writer.wait(timeout=60)
        consumer.close()
        log.close()
    assert writer.returncode == 0


def test_idle_group_member_poll_returns_nothing(tmp_path: Path) -> None:
    """Consumer.poll(2 s) on quiet partitions (read_committed, a group member) returns no records."""
    with Log(tmp_path / "log") as log:
        log.create_topic("t", partitions=2)
        with Consumer(log, group_id="idle") as consumer:
            consumer.subscribe(["t"])
            assert not consumer.poll(timeout_ms=200)  # joined, partitions taken, watching
            assert not consumer.poll(timeout_ms=2000)
            assert len(consumer.assignment()) == 2


def test_wakeup_ends_a_blocking_poll(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        log.create_topic("t", partitions=1)
        consumer = Consumer(log)
        consumer.assign([TopicPartition("t", 0)])
        later(0.2, consumer.wakeup)
        with pytest.raises(WakeupError):  # without the wakeup: no records after 60 s, no raise
            consumer.poll(timeout_ms=60_000)
        assert not consumer.poll(timeout_ms=0)  # one wakeup, one raise
        consumer.close()
