"""SQLAlchemy engines over psycopg 3 from the DSNs Tideline passes around.

A DSN may be a URL (``postgresql://user@host:port/db``, as the harness prints) or a
libpq keyword string (``host=… dbname=…``); both become a ``postgresql+psycopg``
engine.
"""

from __future__ import annotations

from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine

DRIVER = "postgresql+psycopg"


def sqlalchemy_url(dsn: str) -> str | None:
    """``postgresql+psycopg://…`` for a URL DSN; None for a libpq keyword string."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return DRIVER + "://" + dsn[len(prefix) :]
    return None


def make_engine(dsn: str, **options: Any) -> Engine:
    """An engine for ``dsn``; ``options`` go to :func:`sqlalchemy.create_engine`."""
    url = sqlalchemy_url(dsn)
    if url is not None:
        return create_engine(url, **options)
    return create_engine(f"{DRIVER}://", creator=lambda: psycopg.connect(dsn), **options)
