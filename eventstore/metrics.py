"""Prometheus metrics over HTTP for long-running services (capture, projection follow jobs).

A service exposes its counters by a :class:`prometheus_client.registry.Collector` that
reads them at scrape time (nothing is counted twice, nothing costs anything between
scrapes); :func:`serve_metrics` starts the standard ``/metrics`` endpoint on a port of
its own registry (not the process-global one, so two services in one process — tests —
do not collide) and returns a handle that stops it.

Thread-safety: the HTTP server runs in a daemon thread; collectors must tolerate being
called from it while the service runs (reading ints and floats is enough).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    registry: CollectorRegistry

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(collector: Collector, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """``GET http://host:port/metrics`` in the Prometheus text format (port 0: a free one)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, registry)
