"""Prometheus metrics of a follow job (``tideline project follow VIEW --metrics-port P``).

Read from :class:`projections.progress.FollowStats` at scrape time (either engine)::

  tideline_projection_events_total       counter  records applied
  tideline_projection_batches_total      counter  batches (micro-batches) committed
  tideline_projection_last_batch_seconds gauge    duration of the last batch
  tideline_projection_reached_lsn        gauge    the source LSN the view has reached
  tideline_projection_lag_records        gauge    log end − applied offset, summed over partitions

Every metric carries the label ``projection``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from projections.progress import FollowJob

PREFIX = "tideline_projection_"


class FollowCollector(Collector):
    def __init__(self, follower: FollowJob) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        stats = self.follower.stats
        labels, values = ["projection"], [stats.projection]

        def metric(kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, doc: str, value: float) -> Metric:
            m = kind(PREFIX + name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        lag = stats.lag(self.follower.source, self.follower.view.topics)
        yield metric(CounterMetricFamily, "events", "Records applied.", stats.events)
        yield metric(CounterMetricFamily, "batches", "Batches committed.", stats.batches)
        yield metric(GaugeMetricFamily, "last_batch_seconds", "Duration of the last batch.", stats.last_batch_seconds)
        yield metric(GaugeMetricFamily, "reached_lsn", "Source LSN the view has reached.", stats.reached_lsn)
        yield metric(
            GaugeMetricFamily,
            "lag_records",
            "Log end minus applied offset.",
            sum(sum(p.values()) for p in lag.values()),
        )
