"""The log cleaner: compaction and retention that run by themselves (Kafka's ``LogCleaner``).

One worker thread loops:

1. **compaction**: pick the due compacted partition with the highest dirty ratio
   (:mod:`eventstore.cleaner_manager`: ``min_cleanable_dirty_ratio``,
   ``min_compaction_lag_ms``, the last stable offset, tombstones whose
   ``delete_retention_ms`` horizon passed) and run one
   :func:`~eventstore.cleaner.compact_partition` pass over it; repeat while one is due;
2. **retention** and **transaction recovery**, every ``retention_check_interval_ms``
   (Kafka's ``log.retention.check.interval.ms``): abandoned transactions are aborted
   (their open data would hold the LSO, and so compaction, back), and
   :func:`~eventstore.cleaner.apply_retention` runs over every partition of a
   ``delete`` or ``compact,delete`` topic;
3. when nothing was due, sleep ``backoff_ms`` (Kafka's ``log.cleaner.backoff.ms``).

I/O is capped at ``io_max_bytes_per_second`` (Kafka's
``log.cleaner.io.max.bytes.per.second``) by a :class:`~eventstore.throttle.Throttler`
over the bytes compaction reads and writes. Producers and consumers are never blocked:
compaction holds only the partition's ``.clean.lock`` (writers take ``.lock``, readers
no lock) and swaps cleaned segments in by rename (eventstore.cleaner).

A partition whose pass fails (e.g. :class:`~eventstore.errors.CorruptLogError`) is
logged and marked **uncleanable**, as in Kafka; it is skipped until its segment files
change, and the cleaner goes on with the others.

Start/stop (also from a service such as ``capture run``, in its own process)::

    cleaner = LogCleaner(log, CleanerConfig(io_max_bytes_per_second=50e6))
    cleaner.start()          # returns at once; the work runs in a daemon thread
    ...
    cleaner.stop()           # prompt: interrupts a throttled pass or the backoff sleep

or ``with LogCleaner(log) as cleaner: …``. ``run_once()`` does one forced pass over
everything (compaction whatever the dirty ratio, then retention), for tools and tests.

Thread-safety: ``start``/``stop`` from one controlling thread; :meth:`status` from any
thread. The ``Log`` it is given may be shared with producers and consumers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType

from eventstore.cleaner import CleanStats, apply_retention, compact_partition
from eventstore.cleaner_manager import CleanerManager, LogToClean
from eventstore.errors import ConfigError, TidelineError
from eventstore.log import Log
from eventstore.partition_log import PartitionLog
from eventstore.throttle import ThrottleInterrupted, Throttler
from eventstore.topic import now_ms
from eventstore.transactions import TransactionCoordinator

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CleanerConfig:
    """Settings of the cleaner service (Kafka's broker-level ``log.cleaner.*`` names)."""

    backoff_ms: int = 15_000  # sleep when no partition is due
    io_max_bytes_per_second: float = math.inf  # cap on compaction reads + writes
    retention_check_interval_ms: int = 300_000  # how often retention and transaction recovery run

    def validate(self) -> None:
        if self.backoff_ms < 0:
            raise ConfigError(f"backoff_ms must be ≥ 0, got {self.backoff_ms}")
        if not self.io_max_bytes_per_second > 0:
            raise ConfigError(f"io_max_bytes_per_second must be > 0, got {self.io_max_bytes_per_second}")
        if self.retention_check_interval_ms < 0:
            raise ConfigError(f"retention_check_interval_ms must be ≥ 0, got {self.retention_check_interval_ms}")


@dataclass(frozen=True, slots=True)
class CleanedPartition:
    """One compaction pass the service ran: why (the split before it) and what it did."""

    before: LogToClean
    stats: CleanStats
    seconds: float


@dataclass(slots=True)
class CleanerStatus:
    """Counters of a running cleaner (a copy: safe to read from any thread)."""

    passes: int = 0  # compaction passes run
    retention_checks: int = 0
    segments_deleted: int = 0  # by retention
    bytes_read: int = 0
    bytes_written: int = 0
    throttled_seconds: float = 0.0
    uncleanable: dict[str, str] = field(default_factory=dict)  # partition → why its last pass failed
    last: CleanedPartition | None = None
    cleaning: str | None = None  # the partition a pass is running over right now


class LogCleaner:
    """Compaction by dirty ratio, retention and transaction recovery in a background thread.

    See the module docstring. ``on_pass`` (optional) is called in the worker thread after
    each compaction pass the service runs (the CLI prints them).
    """

    def __init__(
        self,
        log: Log,
        config: CleanerConfig | None = None,
        *,
        on_pass: Callable[[CleanedPartition], None] | None = None,
    ) -> None:
        self.log = log
        self.config = config or CleanerConfig()
        self.config.validate()
        self.on_pass = on_pass
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._manager = CleanerManager()
        self._throttler = Throttler(self.config.io_max_bytes_per_second, stop=self._stop)
        self._status = CleanerStatus()
        self._status_lock = threading.Lock()
        self._uncleanable: dict[str, object] = {}  # partition → fingerprint when its pass failed
        self._next_retention = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker thread (once); returns at once."""
        if self._thread is not None:
            raise RuntimeError("the log cleaner was already started")
        self._thread = threading.Thread(target=self._loop, name="tideline-log-cleaner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Ask the worker to stop and wait for it (an interrupted pass leaves every group old or new)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("log cleaner did not stop within %s s", timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> LogCleaner:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def status(self) -> CleanerStatus:
        with self._status_lock:
            return replace(self._status, uncleanable=dict(self._status.uncleanable))

    # ------------------------------------------------------------------ work

    def _partitions(self) -> list[PartitionLog]:
        out: list[PartitionLog] = []
        for topic in self.log.topics():
            try:
                meta = self.log.topic(topic)
            except TidelineError as e:  # a topic being created or with damaged metadata
                log.warning("log cleaner skips topic %r: %s", topic, e)
                continue
            out.extend(self.log.partition(topic, n) for n in range(meta.partitions))
        return out

    def clean_filthiest(self) -> CleanedPartition | None:
        """Run one compaction pass over the dirtiest due partition, if any.

        A partition whose pass fails is marked uncleanable and the next dirtiest is tried.
        """
        while True:
            now = now_ms()
            plogs = [p for p in self._partitions() if not self._is_uncleanable(p)]
            ltc = self._manager.grab_filthiest(plogs, now)
            if ltc is None:
                return None
            done = self._clean(ltc, now)
            if done is not None:
                return done

    def _clean(self, ltc: LogToClean, now: int) -> CleanedPartition | None:
        plog = self.log.partition(ltc.topic, ltc.partition)
        started = time.monotonic()
        slept_before = self._throttler.slept_s
        with self._status_lock:
            self._status.cleaning = ltc.name
        try:
            stats = compact_partition(plog, now=now, throttle=self._throttler)
        except ThrottleInterrupted:
            raise
        except (TidelineError, OSError) as e:
            self._mark_uncleanable(ltc, e)
            return None
        finally:
            with self._status_lock:
                self._status.cleaning = None
        self._manager.record_pass(plog, now)
        done = CleanedPartition(ltc, stats, time.monotonic() - started)
        with self._status_lock:
            s = self._status
            s.passes += 1
            s.bytes_read += stats.bytes_read
            s.bytes_written += stats.bytes_written
            s.throttled_seconds += self._throttler.slept_s - slept_before
            s.last = done
        log.info(
            "cleaned %s (dirty ratio %.2f): %d segments, %d → %d records, %d → %d bytes in %.2f s",
            ltc.name,
            ltc.dirty_ratio,
            stats.segments_cleaned,
            stats.records_read,
            stats.records_kept,
            stats.bytes_read,
            stats.bytes_written,
            done.seconds,
        )
        if self.on_pass is not None:
            self.on_pass(done)
        return done

    def _is_uncleanable(self, plog: PartitionLog) -> bool:
        name = f"{plog.topic}-{plog.partition}"
        marked = self._uncleanable.get(name)
        if marked is None:
            return False
        if self._manager.log_to_clean(plog, now_ms()).fingerprint != marked:
            del self._uncleanable[name]  # its files changed (repaired, or new data): try again
            with self._status_lock:
                self._status.uncleanable.pop(name, None)
            return False
        return True

    def _mark_uncleanable(self, ltc: LogToClean, error: Exception) -> None:
        log.error("log cleaner: %s is uncleanable until its files change: %s", ltc.name, error)
        self._uncleanable[ltc.name] = ltc.fingerprint
        with self._status_lock:
            self._status.uncleanable[ltc.name] = str(error)

    def check_retention(self) -> int:
        """End abandoned transactions, then apply retention everywhere; return segments deleted."""
        for ended in TransactionCoordinator(self.log).recover():
            log.info(
                "ended transaction %r (producer %d): %s", ended.transactional_id, ended.producer_id, ended.state.value
            )
        deleted = 0
        for plog in self._partitions():
            if plog.config.cleanup_policy.deletes:
                try:
                    deleted += apply_retention(plog)
                except (TidelineError, OSError) as e:
                    log.error("log cleaner: retention of %s-%d failed: %s", plog.topic, plog.partition, e)
        with self._status_lock:
            self._status.retention_checks += 1
            self._status.segments_deleted += deleted
        return deleted

    def run_once(self) -> dict[str, CleanStats]:
        """One forced pass: recover transactions, compact every compacted partition (whatever
        its dirty ratio), apply retention everywhere. Returns the compaction stats by partition."""
        for ended in TransactionCoordinator(self.log).recover():
            log.info(
                "ended transaction %r (producer %d): %s", ended.transactional_id, ended.producer_id, ended.state.value
            )
        out: dict[str, CleanStats] = {}
        for plog in self._partitions():
            now = now_ms()
            out[f"{plog.topic}-{plog.partition}"] = compact_partition(plog, now=now)
            self._manager.record_pass(plog, now)
            apply_retention(plog)
        with self._status_lock:
            self._status.passes += 1
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            worked = False
            try:
                if time.monotonic() >= self._next_retention:
                    self.check_retention()
                    self._next_retention = time.monotonic() + self.config.retention_check_interval_ms / 1000
                worked = self.clean_filthiest() is not None
            except ThrottleInterrupted:
                break
            except Exception:  # keep cleaning: the error is logged with its cause
                log.exception("log cleaner pass failed")
            if not worked:
                self._stop.wait(self.config.backoff_ms / 1000)
