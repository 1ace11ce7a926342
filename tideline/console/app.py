"""The console's HTTP face: the page (static files in ``static/``, no build step) and one JSON endpoint per panel.

::

    GET /                  the page (index.html, console.js, console.css under /static/)
    GET /api/config        what the console watches (backend, slot, topic prefix, refresh interval)
    GET /api/topics        topics and partitions: offsets, sizes (``log describe --json`` of each)
    GET /api/capture       the slot (confirmed LSN, retained WAL), stored position, lag, the core per table
                           (``capture status --json``)
    GET /api/groups        consumer groups and their lag (``log groups --json``)
    GET /api/projections   projections: checkpoints, lag, stalled (``project status --json``)
    GET /api/schemas       subjects and versions (``schemas list --json``)
    GET /api/warnings      stalled views, slot retention above the threshold, keyless tables, tables on capture's
                           Python core, unreadable panels
    GET /api/series        throughput and commit → log latency over time (sampled in memory)

Every answer carries ``refreshed_ms``, when its figures were read; a panel that could not
be read has ``error`` (and answers 200: the page shows it in the panel).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from tideline.console.panels import PANELS
from tideline.console.state import ConsoleState

STATIC_DIR = Path(__file__).parent / "static"


def create_app(state: ConsoleState) -> FastAPI:
    """The console's app over ``state`` (refreshed by a :class:`tideline.console.state.Sampler`)."""
    app = FastAPI(title="Tideline console", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/config")
    def config() -> dict[str, Any]:
        return state.settings.to_json()

    @app.get("/api/warnings")
    def warnings() -> dict[str, Any]:
        return state.warnings()

    @app.get("/api/series")
    def series() -> dict[str, Any]:
        return state.series()

    @app.get("/api/{panel}")
    def panel(panel: str) -> dict[str, Any]:
        if panel not in PANELS:
            raise HTTPException(404, f"no panel {panel!r}: there are {', '.join(sorted(PANELS))}")
        return state.panel(panel)

    return app
