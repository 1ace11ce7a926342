"""Where a projection's records come from: the embedded log or Apache Kafka, behind one seam.

Rebuild, both follow engines, read-your-writes, status and the reference fold ask a
:class:`LogSource` and nothing else about the log, so the same view declarations and
the same Postgres protocol (view rows and checkpoints in one transaction) run on either
backend:

- **a Spark batch or stream**: the ``tideline`` data source on the embedded log
  (:mod:`.embedded_source`); Spark's own ``format("kafka")`` with
  ``kafka.isolation.level=read_committed`` on Kafka (:mod:`.kafka_source`);
- **last stable and end offsets**: the partitions' files; Kafka's ``ListOffsets`` at
  read_committed / read_uncommitted;
- **capture's stored position**: ``__tideline_capture_offsets`` read_committed, with a
  ``Consumer`` or a ``KafkaReader``;
- **the live engine's reads**: a ``Consumer`` woken by inotify; a librdkafka consumer
  (``assign`` + seek to the checkpoints, read_committed, nothing committed to Kafka).

Every frame a source builds has the ``tideline`` source's columns
(:data:`projections.range_reader.SPARK_SCHEMA`: ``topic, partition, offset, timestamp,
key, value, headers, is_tombstone``), so view code cannot tell the backends apart.
Offsets are ``{topic: {partition: next offset}}`` (:data:`projections.store.Offsets`);
only partitions of topics that exist appear (a view's aggregate may have no events yet).

>>> with open_source(log_dir=Path("tideline-data"), kafka=None) as source:   # doctest: +SKIP
...     source.stable_offsets(["events.user"])
{'events.user': {0: 120, 1: 98}}

Thread-safety: a source may be shared by the threads of one job (the Spark engine's
``foreachBatch`` thread and its driver); a :class:`LiveReader` belongs to one thread,
except :meth:`LiveReader.wakeup`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self

from projections.apply import LogRecord
from projections.planning import OffsetRange
from projections.store import Offsets

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["CapturePositionReader", "LiveReader", "LogSource", "as_source", "open_source", "source_for"]

CONSISTENT_CUT_ATTEMPTS = 50
CONSISTENT_CUT_PAUSE_S = 0.005


class CapturePositionReader(Protocol):
    """Capture's stored position, read incrementally (``__tideline_capture_offsets``, read_committed)."""

    def lsn(self) -> int:
        """The end of the last wholly stored source transaction (0: capture stored none yet)."""
        ...

    def close(self) -> None: ...


class LiveReader(Protocol):
    """What the ``live`` follow engine reads with (one thread; see :mod:`projections.live`)."""

    def assign(self, offsets: Offsets) -> None:
        """Read every partition of the view's existing topics from ``offsets`` (its earliest
        offset where ``offsets`` has none), forgetting earlier positions."""
        ...

    def refresh(self) -> None:
        """Before a cycle: partitions of topics that appeared since are read from their earliest
        offset (positions of the others kept); what :meth:`wait` watches is brought up to date."""
        ...

    def positions(self) -> Offsets:
        """The next offset of every assigned partition: past every record :meth:`read` returned
        and past the control records and aborted transactions behind them."""
        ...

    def end_offsets(self) -> Offsets:
        """Where a read_committed reader of the assigned partitions stops now."""
        ...

    def read(self, max_records: int) -> list[LogRecord]:
        """What is readable now, at most ``max_records``, in offset order per partition, keys and
        values as capture's JSON; never blocks."""
        ...

    def wait(self, timeout: float) -> None:
        """Until a view partition or capture's stored position may have changed, :meth:`wakeup`,
        or ``timeout`` seconds."""
        ...

    def wakeup(self) -> None:
        """End the current :meth:`wait` soon (any thread)."""
        ...

    def close(self) -> None: ...


class LogSource(abc.ABC):
    """A log backend as projections see it (see the module docstring)."""

    description: str  # for messages: "the log at DIR", "Kafka at HOST:PORT"

    # -- partitions and offsets ------------------------------------------------------------

    @abc.abstractmethod
    def partition_counts(self, topics: Iterable[str]) -> dict[str, int]:
        """The partition count of each of ``topics`` that exists."""

    @abc.abstractmethod
    def stable_offsets(self, topics: Iterable[str]) -> Offsets:
        """The last stable offset of every partition of ``topics`` that exist: what a
        read_committed reader reaches now."""

    @abc.abstractmethod
    def appended_offsets(self, topics: Iterable[str]) -> Offsets:
        """The log end (high watermark, read_uncommitted) of every partition of ``topics`` that exist."""

    @abc.abstractmethod
    def start_offsets(self, topics: Iterable[str]) -> Offsets:
        """The first offset (log start: retention and compaction may have moved it) of every partition
        of ``topics`` that exist."""

    def record_count(self, topics: Iterable[str]) -> int:
        """How many records ``topics`` hold at most, from the offsets alone (no scan): the last stable
        offset minus the log start, summed over their partitions. An upper bound: offsets that compaction
        emptied and transaction markers count too."""
        topics = list(topics)
        starts = self.start_offsets(topics)
        return sum(
            max(0, end - starts.get(topic, {}).get(p, 0))
            for topic, per in self.stable_offsets(topics).items()
            for p, end in per.items()
        )

    def consistent_offsets(self, topics: Iterable[str], attempts: int = CONSISTENT_CUT_ATTEMPTS) -> Offsets:
        """Last stable offsets that form a cut of the log's transactions: read until two reads in a
        row agree (a transaction committed between the reads of two partitions would otherwise be
        half inside)."""
        topics = list(topics)
        previous = self.stable_offsets(topics)
        for _ in range(attempts):
            current = self.stable_offsets(topics)
            if current == previous:
                return current
            previous = current
            time.sleep(CONSISTENT_CUT_PAUSE_S)
        return previous

    # -- records ---------------------------------------------------------------------------

    @abc.abstractmethod
    def capture_positions(self) -> CapturePositionReader:
        """A reader of capture's stored position (the caller closes it)."""

    @abc.abstractmethod
    def records(self, topic: str, partition: int, until: int | None = None) -> Iterator[LogRecord]:
        """The committed records of one partition from its start (below ``until`` if given), in
        offset order, keys and values as capture's JSON."""

    @abc.abstractmethod
    def appended_at(self, topic: str, partition: int, offset: int) -> datetime | None:
        """When the first committed record at or after ``offset`` was appended (None: none readable)."""

    # -- Spark -----------------------------------------------------------------------------

    def task_ranges(self, ends: Offsets) -> tuple[str, list[OffsetRange]] | None:
        """Where Spark tasks may read this log themselves (the embedded log: its path) and one range
        per partition of ``ends``, from the partition's start; None: only through :meth:`batch_frame`."""
        return None

    @abc.abstractmethod
    def batch_frame(self, spark: SparkSession, ends: Offsets, *, whole_partitions: bool = False) -> DataFrame:
        """The committed records of the partitions in ``ends``, from their start up to those
        offsets (``whole_partitions``: one Spark partition per log partition, offset order)."""

    @abc.abstractmethod
    def stream_frame(
        self, spark: SparkSession, topics: Iterable[str], starting: Offsets, max_records: int | None
    ) -> DataFrame:
        """A streaming read of ``topics`` (read_committed) from ``starting`` (``-2``: earliest;
        every partition of every existing topic must be named; topics that appear later are
        read from their earliest offset), at most ``max_records`` records per micro-batch.
        Its offsets in Spark's checkpoint have the layout ``{"topic": {"0": next offset}}``."""

    # -- the live engine --------------------------------------------------------------------

    @abc.abstractmethod
    def live_reader(self, topics: tuple[str, ...]) -> LiveReader:
        """A reader of ``topics`` for the live engine (the caller closes it)."""

    # -- lifetime --------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether there is a log to read (an embedded log's directory may not be created yet)."""
        return True

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the source holds open (files, clients); it may be used again after."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_source(*, log_dir: Path | None = None, kafka: str | None = None, create: bool = False) -> LogSource:
    """The source for ``kafka`` bootstrap servers when given, else the embedded log at ``log_dir``
    (``create``: a log that does not exist yet is created, as a follow job does)."""
    if kafka is not None:
        from projections.kafka_source import KafkaSource

        return KafkaSource(kafka)
    if log_dir is None:
        raise ValueError("a log source needs the embedded log's directory or Kafka's bootstrap servers")
    from projections.embedded_source import EmbeddedSource

    return EmbeddedSource(log_dir, create=create)


def as_source(log: Path | LogSource, *, create: bool = False) -> LogSource:
    """``log`` itself, or the embedded log at that directory."""
    return log if isinstance(log, LogSource) else open_source(log_dir=log, create=create)


@contextmanager
def source_for(log_dir: Path | None, source: LogSource | None, *, create: bool = False) -> Iterator[LogSource]:
    """``source``, or the embedded log at ``log_dir`` (opened here, and closed on leaving): what
    the jobs' ``log_dir=`` / ``source=`` keyword pair means (exactly one of them)."""
    if (log_dir is None) == (source is None):
        raise ValueError("give exactly one of log_dir (the embedded log) and source")
    if source is not None:
        yield source
        return
    with open_source(log_dir=log_dir, create=create) as opened:
        yield opened
