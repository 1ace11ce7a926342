"""The console's panels: each one is what a ``tideline`` status command computes, called the same way.

- topics: ``log describe --json`` of every topic (``log_cli.describe_topics``,
  ``log_kafka.describe_topics``);
- capture: ``capture status --json`` (:func:`capture.report.capture_status`);
- groups: ``log groups --json`` (``log_cli.describe_groups``, ``log_kafka.describe_groups``);
- projections: ``project status --json`` (:func:`projections.status.projection_status`);
- schemas: ``schemas list --json`` (:func:`schemas.cli_api.list_subjects`).

Nothing here computes a figure of its own: the warnings panel only gathers the warnings
and flags those functions return (keyless tables, the slot's retained WAL above the
threshold, a lost or missing slot, tables on capture's Python core, stalled projections).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from projections.status import DEFAULT_STALL_AFTER_S

if TYPE_CHECKING:
    from tideline.backend import Backend

DSN_ENV = "TIDELINE_DSN"
NO_DSN = f"no database: give --dsn or set {DSN_ENV}"


@dataclass(frozen=True, slots=True)
class ConsoleSettings:
    """What the console watches: the log (embedded at ``data_dir``, or Kafka at ``kafka``), the
    source database of one connector (``dsn``, ``slot``, ``topic_prefix``) and the views database."""

    data_dir: Path
    kafka: str | None = None  # bootstrap servers: Kafka is the log
    dsn: str | None = None  # capture's source database (None: the capture panel says so)
    views_dsn: str | None = None  # projections' database (None: ``dsn``)
    slot: str = "tideline"
    topic_prefix: str = "tideline"
    tables: tuple[str, ...] = ()  # capture's --tables patterns (which tables' warnings count)
    exclude_tables: tuple[str, ...] = ()
    capture_metrics: str | None = None  # a connector's --metrics-port URL: throughput and latency
    state_dir: Path | None = None  # the connector's --state-dir, where it reports its core (None: its default)
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    retained_wal_warn_bytes: int | None = None  # None: the connector's threshold
    interval_s: float = 1.0  # between two refreshes (and two points of the charts)
    history: int = 600  # points kept per chart

    @property
    def log_backend(self) -> Backend:
        """The backend every panel reads (tideline.backend)."""
        from tideline.backend import choose

        return choose(self.data_dir, self.kafka)

    @property
    def backend(self) -> str:
        return self.log_backend.kind

    @property
    def where(self) -> str:
        return self.log_backend.description

    @property
    def projections_dsn(self) -> str | None:
        return self.views_dsn or self.dsn

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "where": self.where,
            "slot": self.slot,
            "topic_prefix": self.topic_prefix,
            "capture_metrics": self.capture_metrics,
            "stall_after_s": self.stall_after_s,
            "interval_s": self.interval_s,
            "history": self.history,
        }


class PanelUnavailable(Exception):
    """A panel cannot be computed with these settings (e.g. no database given)."""


def topics_panel(settings: ConsoleSettings) -> dict[str, Any]:
    """Every topic with its partitions' offsets (and sizes and segments on the embedded log)."""
    described = settings.log_backend.describe_topics()
    return {"count": len(described), "topics": described}


def capture_panel(settings: ConsoleSettings) -> dict[str, Any]:
    """``capture status --json`` of the connector ``(topic_prefix, slot)``."""
    if settings.dsn is None:
        raise PanelUnavailable(NO_DSN)
    from capture.report import capture_status
    from capture.tables import TableFilter

    table_filter = TableFilter(include=list(settings.tables), exclude=list(settings.exclude_tables))
    with settings.log_backend.capture_log(settings.state_dir, create=False) as (log, sink):
        return capture_status(settings.dsn, slot=settings.slot, topic_prefix=settings.topic_prefix, log=log,
                              sink=sink, table_filter=table_filter, state_dir=settings.state_dir,
                              retained_wal_warn_bytes=settings.retained_wal_warn_bytes)  # fmt: skip


def groups_panel(settings: ConsoleSettings) -> dict[str, Any]:
    """``log groups --json``: members, committed offsets, lag per partition."""
    return {"groups": settings.log_backend.describe_groups()}


def projections_panel(settings: ConsoleSettings) -> dict[str, Any]:
    """``project status --json``: checkpoints, lag, stalled, last run of every projection."""
    dsn = settings.projections_dsn
    if dsn is None:
        raise PanelUnavailable(NO_DSN)
    from projections.status import projection_status

    with settings.log_backend.source() as source:
        rows = projection_status(dsn, source, stall_after=settings.stall_after_s)
    return {"projections": rows}


def schemas_panel(settings: ConsoleSettings) -> dict[str, Any]:
    """``schemas list --json``: subjects, versions, latest id, compatibility level."""
    from schemas.cli_api import list_subjects

    with settings.log_backend.registry() as registry:
        return {"subjects": list_subjects(registry)}


PANELS: dict[str, Callable[[ConsoleSettings], dict[str, Any]]] = {
    "topics": topics_panel,
    "capture": capture_panel,
    "groups": groups_panel,
    "projections": projections_panel,
    "schemas": schemas_panel,
}


def gathered_warnings(settings: ConsoleSettings, panels: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The warnings of computed ``panels``: each ``{"panel", "message"}``; a panel that failed is one too."""
    out: list[dict[str, str]] = []
    capture = panels.get("capture", {})
    if "error" not in capture:
        if capture.get("slot") is None:
            out.append({"panel": "capture", "message": f"slot {settings.slot} is missing: capture has not "
                        "started, or the slot was dropped"})  # fmt: skip
        out += [{"panel": "capture", "message": w} for w in capture.get("warnings", [])]
    for row in panels.get("projections", {}).get("projections", []):
        if row["stalled"]:
            out.append({
                "panel": "projections",
                "message": f"projection {row['projection']} is stalled: lag {row['lag']}, its oldest waiting record "
                f"appended at {row['waiting_since']}, last progress {row['last_progress_at'] or 'never'}",
            })  # fmt: skip
    for name, panel in panels.items():
        if "error" in panel and not panel.get("unavailable"):
            out.append({"panel": name, "message": f"cannot read {name}: {panel['error']}"})
    return out
