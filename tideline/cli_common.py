"""Shared CLI plumbing: one-line errors, and serving HTTP (``schemas serve``, ``console``) until a signal."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

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


def listen(host: str, port: int, *, error_code: int = 1) -> socket.socket:
    """A listening socket, bound now so that a taken port is a one-line error (uvicorn would log a traceback)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}", error_code) from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as e:
        listener.close()
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}", error_code) from None
    return listener


def graceful_server(app: Any) -> Any:
    """A uvicorn server (``schemas serve``, ``console``) that shuts down gracefully on SIGINT/SIGTERM and then returns.

    (uvicorn's own re-raises the signal after its shutdown: SIGTERM would end the process
    before the store is closed, and Ctrl-C would end in a KeyboardInterrupt.)
    """
    import uvicorn

    class Server(uvicorn.Server):
        stopped_by: int | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop without waiting for open requests
            self.stopped_by = sig
            self.should_exit = True

    return Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off"))
