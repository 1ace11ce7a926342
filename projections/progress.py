"""What a follow job reports while it runs, whichever engine applies its batches.

:class:`FollowStats` are the job's counters (read by the metrics endpoint, the progress
line and the CLI's summary); :class:`FollowJob` is what both engines
(:class:`projections.follow.Follower` on Spark, :class:`projections.live.LiveFollower`
without it) offer; :class:`ProgressReporter` writes **one structured line per interval**
(``key=value`` pairs, logfmt style) so that an operator, or a log shipper, sees what
the job is doing::

    follow view=users engine=live batches=12 events=31 batches_total=407 events_total=1288 lag=0 \
reached_lsn=0/1A2B3C8 last_batch_ms=3.1 last_batch_at=2026-11-24T01:02:03.456Z

``batches``/``events``: committed during the interval; ``*_total``: since the job
started; ``lag``: log end (read_committed) − applied offset, summed over the view's
partitions; ``reached_lsn``: the read-your-writes position (:mod:`projections.consistency`);
``last_batch_ms``/``last_batch_at``: duration and wall-clock end of the last committed
batch (``-`` before the first).

Thread-safety: :class:`FollowStats` is written by the job's thread and read by others
(a torn read shows one counter a batch ahead of another, never a wrong total);
:class:`ProgressReporter` runs its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from eventstore.errors import TidelineError
from projections import store
from projections.views import View

if TYPE_CHECKING:
    from projections.sources import LogSource

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


@dataclass
class FollowStats:
    """Counters of a follow job (read by the metrics endpoint and the progress display)."""

    projection: str
    batches: int = 0
    events: int = 0
    last_batch_seconds: float = 0.0
    last_batch_at: float | None = None  # wall clock (time.time()) when the last batch committed
    reached_lsn: int = 0
    restarts: int = 0
    applied: store.Offsets = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def lag(self, source: LogSource, topics: Iterable[str]) -> dict[str, dict[int, int]]:
        """Log end − applied offset per partition (read_committed)."""
        ends = source.stable_offsets(topics)
        return {
            t: {p: max(0, o - self.applied.get(t, {}).get(p, 0)) for p, o in per.items()} for t, per in ends.items()
        }

    def committed(self, events: int, seconds: float, applied: store.Offsets, reached: int) -> None:
        """Count one committed batch."""
        self.batches += 1
        self.events += events
        self.applied = applied
        self.last_batch_seconds = seconds
        self.last_batch_at = time.time()
        self.reached_lsn = max(self.reached_lsn, reached)


BatchReport = Callable[[FollowStats], None]


class FollowJob(Protocol):
    """A follow job of either engine, as the CLI, the metrics endpoint and the reporter see it."""

    stats: FollowStats
    view: View
    source: LogSource

    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> FollowStats: ...


class FoldFailed(TidelineError):
    """A view's fold raised on one event: the job stops, nothing of the batch is committed.

    Fix the event's handling in the view (or the aggregate's ``apply``/upcasters), then
    run the job again: it resumes at the failed batch."""

    def __init__(self, view: str, topic: str, partition: int, offset: int, error: BaseException) -> None:
        self.view, self.topic, self.partition, self.offset = view, topic, partition, offset
        self.error = f"{type(error).__name__}: {error}"
        super().__init__(
            f"view {view}: the fold raised on {topic}[{partition}] offset {offset}: {self.error} "
            "(nothing of this batch was committed)"
        )


# -- the progress line ---------------------------------------------------------------------------


def _lsn(value: int) -> str:
    from projections.consistency import format_lsn

    return format_lsn(value)


def progress_line(job: FollowJob, engine: str, previous: tuple[int, int]) -> tuple[str, tuple[int, int]]:
    """The structured line for ``job`` now and the (batches, events) it reports; ``previous``:
    those of the last line (the counters are read once: the job's thread moves them meanwhile)."""
    s = job.stats
    batches, events = s.batches, s.events
    try:
        lag: int | str = sum(sum(per.values()) for per in s.lag(job.source, job.view.topics).values())
    except (TidelineError, OSError) as e:  # the log may not exist yet: say so rather than crash the reporter
        lag = f'"{type(e).__name__}"'
    at = (
        "-"
        if s.last_batch_at is None
        else datetime.fromtimestamp(s.last_batch_at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )
    last_ms = "-" if s.last_batch_at is None else f"{s.last_batch_seconds * 1000:.1f}"
    line = (
        f"follow view={s.projection} engine={engine} batches={batches - previous[0]} "
        f"events={events - previous[1]} batches_total={batches} events_total={events} lag={lag} "
        f"reached_lsn={_lsn(s.reached_lsn)} last_batch_ms={last_ms} last_batch_at={at}"
    )
    return line, (batches, events)


class ProgressReporter:
    """Emits :func:`progress_line` every ``interval`` seconds (and once more on :meth:`stop`).

    >>> with ProgressReporter(job, "live", 10.0, print):   # doctest: +SKIP
    ...     job.run(stop=stop)
    """

    def __init__(self, job: FollowJob, engine: str, interval: float, emit: Callable[[str], None] = logger.info) -> None:
        if interval <= 0:
            raise ValueError(f"progress interval must be > 0 seconds, not {interval}")
        self.job, self.engine, self.interval, self.emit = job, engine, interval, emit
        self._previous = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{job.stats.projection}", daemon=True)

    def __enter__(self) -> ProgressReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def line(self) -> None:
        """Emit one line now."""
        line, self._previous = progress_line(self.job, self.engine, self._previous)
        self.emit(line)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.line()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self.line()  # the final state (what the last interval did)
