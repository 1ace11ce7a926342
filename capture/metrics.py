"""Prometheus metrics of a running connector (``tideline capture run --metrics-port P``).

Read from :class:`capture.status.Stats` at scrape time::

  tideline_capture_events_total             counter  events appended (committed or in the open batch)
  tideline_capture_transactions_total       counter  source transactions seen
  tideline_capture_batches_total            counter  log transactions committed
  tideline_capture_snapshot_rows_total      counter  rows read by snapshots
  tideline_capture_outbox_violations_total  counter  updates/deletes of outbox rows (flagged, not routed)
  tideline_capture_schema_changes_total  counter  schema change events written (--schema-changes)
  tideline_capture_reconnects_total         counter  transient failures recovered from (capture.errors)
  tideline_capture_lag_ms                   gauge    when the last position was stored − its commit time
  tideline_capture_lag_bytes                gauge    server WAL end − last stored commit LSN
  tideline_capture_last_stored_lsn          gauge    commit LSN of the last stored position
  tideline_capture_slot_retained_wal_bytes  gauge    WAL the slot holds back (checked every 30 s; -1 unknown)
  tideline_capture_core_info                info     the per-change core: labels core (native, python), requested
                                                     (--core), reason (why python; "" when native)
  tideline_capture_table_core_info          info     per captured table (label table): core, reason
  tideline_capture_python_core_tables       gauge    captured tables on the Python path
  tideline_capture_kafka_producer_info      info     into Kafka: producer (native, python), requested
                                                     (--kafka-producer), reason (why python)

Every metric carries the labels ``slot`` and ``topic_prefix``. The core's are there once the connector has
read its tables (capture.status.CoreReport).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from capture.connector import Connector

PREFIX = "tideline_capture_"


class CaptureCollector(Collector):
    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    def collect(self) -> Iterator[Metric]:
        stats = self.connector.stats
        labels = ["slot", "topic_prefix"]
        values = [self.connector.config.slot, self.connector.config.topic_prefix]

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        yield counter("events", "Events appended to the log.", stats.events)
        yield counter("transactions", "Source transactions seen.", stats.transactions)
        yield counter("batches", "Log transactions committed.", stats.batches)
        yield counter("snapshot_rows", "Rows read by snapshots.", stats.snapshot_rows)
        yield counter("outbox_violations", "Updates/deletes of outbox rows (not routed).", stats.outbox_violations)
        yield counter("schema_changes", "Schema change events written (--schema-changes).", stats.schema_changes)
        yield counter("reconnects", "Transient failures recovered from.", stats.reconnects)
        yield gauge("lag_ms", "When the last position was stored minus its commit time.", stats.lag_ms())
        yield gauge("lag_bytes", "Server WAL end minus the last stored commit LSN.", stats.lag_bytes())
        yield gauge("last_stored_lsn", "Commit LSN of the last stored position.", stats.last_stored_lsn)
        yield gauge("slot_retained_wal_bytes", "WAL the slot holds back (-1: unknown).", stats.retained_wal_bytes)
        core = stats.core
        if core is not None:
            info = InfoMetricFamily(PREFIX + "core", "The per-change core (native or python) and why python.",
                                    labels=labels)  # fmt: skip
            info.add_metric(values, {"core": core.core, "requested": core.requested, "reason": core.core_reason or ""})
            yield info
            tables = core.tables
            per_table = InfoMetricFamily(PREFIX + "table_core", "The core of a captured table's changes, and why "
                                         "python.", labels=[*labels, "table"])  # fmt: skip
            for name, table in sorted(tables.items()):
                per_table.add_metric([*values, name], {"core": table.core, "reason": table.reason or ""})
            yield per_table
            if core.producer is not None:
                producer = InfoMetricFamily(PREFIX + "kafka_producer", "The Kafka sink's producer (native or python) "
                                            "and why python.", labels=labels)  # fmt: skip
                producer.add_metric(values, {"producer": str(core.producer["kafka_producer"]),
                                             "requested": str(core.producer["kafka_producer_requested"]),
                                             "reason": str(core.producer["kafka_producer_reason"] or "")})  # fmt: skip
                yield producer
            python = sum(1 for t in tables.values() if t.core == "python")
            yield gauge("python_core_tables", "Captured tables whose changes take the Python path.", python)
