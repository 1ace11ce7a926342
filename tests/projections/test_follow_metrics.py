"""The follow job's Prometheus endpoint reads its counters and the log's lag at scrape time."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eventstore.log import Log
from eventstore.metrics import serve_metrics
from eventstore.producer import Producer
from projections.embedded_source import EmbeddedSource
from projections.follow import FollowStats
from projections.metrics import FollowCollector


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tideline_projection_")
    }


def test_metrics_show_progress_and_lag(tmp_path: Path) -> None:
    with Log(tmp_path / "log", create=True) as log:
        log.create_topic("events.user", partitions=1)
        with Producer(log) as producer:
            producer.send_batch("events.user", [b"{}"] * 5, [b"user-1"] * 5)
    stats = FollowStats("users", batches=2, events=3, last_batch_seconds=0.5, reached_lsn=1234)
    stats.applied = {"events.user": {0: 3}}
    view = SimpleNamespace(topics=("events.user",))
    source = EmbeddedSource(tmp_path / "log")
    follower: Any = SimpleNamespace(stats=stats, source=source, view=view)  # what the collector reads
    server = serve_metrics(FollowCollector(follower), 0)
    try:
        metrics = scrape(server.port)
        assert metrics["tideline_projection_events_total"] == 3
        assert metrics["tideline_projection_batches_total"] == 2
        assert metrics["tideline_projection_reached_lsn"] == 1234
        assert metrics["tideline_projection_lag_records"] == 2  # 5 in the log, 3 applied
        stats.events, stats.applied = 5, {"events.user": {0: 5}}
        assert scrape(server.port)["tideline_projection_lag_records"] == 0  # read at scrape time
    finally:
        server.stop()
        source.close()
