"""The console's state: the latest panels and, in memory, the time series of its charts.

A :class:`Sampler` thread calls :meth:`ConsoleState.refresh` every ``interval_s``: every
panel of :mod:`tideline.console.panels` is computed once (a panel that fails holds its
error instead, the others are unaffected) and one point is appended to the series. HTTP
requests only read the latest refresh, so any number of open pages costs one refresh per
interval.

Series (one point per refresh, at most ``history`` kept; nothing is stored on disk):

- ``events_per_s`` — capture throughput: the rate of the connector's
  ``tideline_capture_events_total`` between two scrapes of its ``--metrics-port`` (the
  connector's own :class:`capture.status.Stats`) when ``--capture-metrics`` is given; else
  the rate of the summed log end offsets of the ``<topic prefix>.*`` topics (the topics
  panel's figures): records appended per second, tombstones and markers included.
- ``latency_ms`` — commit → log: the connector's ``tideline_capture_lag_ms`` (when its
  last position was stored − that transaction's commit time); only with ``--capture-metrics``.
- ``capture_lag_bytes`` — the capture panel's ``lag_bytes``.

Thread-safety: ``refresh`` runs on one thread at a time (the sampler's, or a test's);
readers take a consistent copy under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections import deque
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tideline.console.panels import PANELS, ConsoleSettings, PanelUnavailable, gathered_warnings

log = logging.getLogger("tideline.console")

METRICS_TIMEOUT_S = 2.0
EVENTS_SAMPLE = "tideline_capture_events_total"
LAG_MS_SAMPLE = "tideline_capture_lag_ms"


def scrape_capture_metrics(url: str, *, slot: str, topic_prefix: str) -> dict[str, float]:
    """The samples of one connector (labels ``slot``, ``topic_prefix``) at its Prometheus endpoint ``url``."""
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("slot") == slot and sample.labels.get("topic_prefix") == topic_prefix:
                out[sample.name] = float(sample.value)
    if EVENTS_SAMPLE not in out:
        raise ValueError(f"{url} has no {EVENTS_SAMPLE} of slot {slot!r} and topic prefix {topic_prefix!r}")
    return out


class ConsoleState:
    """The latest panels and the series (see the module docstring)."""

    def __init__(self, settings: ConsoleSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._panels: dict[str, dict[str, Any]] = {}
        self._warnings: list[dict[str, str]] = []
        self._series: deque[dict[str, Any]] = deque(maxlen=settings.history)
        self._refreshed_ms = 0
        self._last_count: tuple[float, float] | None = None  # (monotonic time, events or records) of the last point
        self.refreshes = 0

    def refresh(self) -> None:
        """Compute every panel once and append one point to the series."""
        panels = {name: self._compute(name) for name in PANELS}
        point = self._point(panels)
        warnings = gathered_warnings(self.settings, panels)
        if "error" in point:
            warnings.append({"panel": "series", "message": point["error"]})
        with self._lock:
            self._panels = panels
            self._warnings = warnings
            self._series.append(point)
            self._refreshed_ms = point["t"]
            self.refreshes += 1

    def panel(self, name: str) -> dict[str, Any]:
        """The last refresh's panel ``name`` with ``refreshed_ms`` (``error``: why it could not be read)."""
        with self._lock:
            return {"refreshed_ms": self._refreshed_ms, **self._panels.get(name, {"error": "not read yet"})}

    def warnings(self) -> dict[str, Any]:
        with self._lock:
            return {"refreshed_ms": self._refreshed_ms, "warnings": list(self._warnings)}

    def series(self) -> dict[str, Any]:
        throughput = "connector metrics" if self.settings.capture_metrics else (
            f"records appended to {self.settings.topic_prefix}.* topics")  # fmt: skip
        with self._lock:
            return {"refreshed_ms": self._refreshed_ms, "throughput_source": throughput,
                    "latency_source": "connector metrics" if self.settings.capture_metrics else None,
                    "points": list(self._series)}  # fmt: skip

    def _compute(self, name: str) -> dict[str, Any]:
        try:
            return PANELS[name](self.settings)
        except PanelUnavailable as e:
            return {"error": str(e), "unavailable": True}
        except Exception as e:  # one panel's failure (a database down, a broker gone) is shown, not fatal
            log.debug("console: panel %s failed", name, exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return {"error": first}

    def _point(self, panels: dict[str, dict[str, Any]]) -> dict[str, Any]:
        now = time.monotonic()
        point: dict[str, Any] = {"t": int(time.time() * 1000), "events_per_s": None, "latency_ms": None,
                                 "capture_lag_bytes": panels["capture"].get("lag_bytes")}  # fmt: skip
        count: float | None = None
        if self.settings.capture_metrics is not None:
            try:
                samples = scrape_capture_metrics(self.settings.capture_metrics, slot=self.settings.slot,
                                                 topic_prefix=self.settings.topic_prefix)  # fmt: skip
            except (OSError, ValueError) as e:
                point["error"] = f"capture metrics: {e}"
            else:
                count = samples[EVENTS_SAMPLE]
                point["latency_ms"] = samples.get(LAG_MS_SAMPLE)
        elif "topics" in panels["topics"]:
            prefix = self.settings.topic_prefix + "."
            count = float(sum(p["log_end_offset"] for t in panels["topics"]["topics"] if t["topic"].startswith(prefix)
                              for p in t["partition_info"]))  # fmt: skip
        if count is not None:
            if self._last_count is not None and now > self._last_count[0]:
                point["events_per_s"] = round(max(0.0, count - self._last_count[1]) / (now - self._last_count[0]), 1)
            self._last_count = (now, count)
        return point


class Sampler:
    """A daemon thread refreshing a :class:`ConsoleState` every ``interval_s`` until :meth:`stop`."""

    def __init__(self, state: ConsoleState) -> None:
        self.state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = self.state.settings.interval_s
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.state.refresh()
            except Exception:  # a bug must not freeze the page on old figures unnoticed: log it, try again
                log.exception("console: refresh failed")
            self._stop.wait(max(0.0, interval - (time.monotonic() - began)))
