"""Shared CLI plumbing: one-line errors and the data directory option."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` on one line to stderr; return the Exit to raise."""
    err_console.print(f"error: {message}", markup=False)
    return typer.Exit(code)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn Tideline, OS and database (psycopg) errors raised inside the block into a one-line message + exit 1."""
    from eventstore.errors import TidelineError

    try:
        yield
    except TidelineError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e)) from None
    except Exception as e:
        if not type(e).__module__.startswith("psycopg"):  # database errors (not imported here: startup time)
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise fail(f"database: {first}") from None
