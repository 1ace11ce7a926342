"""The engines a follow job can run on (``tideline project follow VIEW --engine …``).

Both apply the same view declarations with the same transaction protocol (view changes and
checkpoints in one Postgres transaction, exactly once) and keep the same records
(``projection_checkpoints``, ``projection_state``, ``projection_runs``), so a view can be
followed by one and then the other, or rebuilt in between:

``live`` (default)
    :class:`projections.live.LiveFollower`: no Spark; woken by the log's change
    notifications (on Kafka: by its consumer's fetches), it applies what capture stored
    within milliseconds (read-your-writes: ``POST …?consistent=true`` answers in tens of
    milliseconds on the embedded log). One Python process.
``spark``
    :class:`projections.follow.Follower`: Structured Streaming micro-batches (each costs
    hundreds of milliseconds here); count views and mirrors are computed by Spark, so it
    suits heavy views and long catch-ups on a cluster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventstore.errors import ConfigError
from projections.progress import BatchReport, FollowJob
from projections.sources import LogSource
from projections.views import ViewCatalog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class FollowSettings:
    """What a follow job is given, whichever engine runs it."""

    source: LogSource  # the embedded log or Kafka (projections.sources)
    dsn: str
    checkpoint_dir: Path  # the Spark engine's streaming checkpoints (the live engine keeps none)
    max_records_per_batch: int | None = None
    trigger_seconds: float | None = None  # Spark only: the micro-batch interval (default 1 s)
    on_batch: BatchReport = lambda _: None


class FollowEngine(enum.Enum):
    """``value``: the CLI name; ``needs_spark``: whether the job needs a SparkSession."""

    LIVE = "live"
    SPARK = "spark"

    @property
    def needs_spark(self) -> bool:
        return self is FollowEngine.SPARK

    @classmethod
    def parse(cls, text: str) -> FollowEngine:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ConfigError(f"unknown follow engine {text!r} (known: {', '.join(e.value for e in cls)})") from None

    def job(
        self, catalog: ViewCatalog, name: str, settings: FollowSettings, spark: SparkSession | None = None
    ) -> FollowJob:
        """A follow job of view ``name`` on this engine (``spark``: required by the Spark engine)."""
        if self is FollowEngine.LIVE:
            from projections.live import LiveFollower

            if settings.trigger_seconds is not None:
                raise ConfigError("--trigger-seconds is for --engine spark (live applies as the log changes)")
            return LiveFollower(
                catalog,
                name,
                source=settings.source,
                dsn=settings.dsn,
                max_records_per_batch=settings.max_records_per_batch,
                on_batch=settings.on_batch,
            )
        from projections.follow import Follower

        if spark is None:
            raise ConfigError("the spark follow engine needs a SparkSession")
        options: dict[str, Any] = {}
        if settings.trigger_seconds is not None:
            options["trigger_seconds"] = settings.trigger_seconds
        return Follower(
            spark,
            catalog,
            name,
            source=settings.source,
            dsn=settings.dsn,
            checkpoint_dir=settings.checkpoint_dir,
            max_records_per_trigger=settings.max_records_per_batch,
            on_batch=settings.on_batch,
            **options,
        )
