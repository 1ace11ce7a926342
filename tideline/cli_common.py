"""Shared CLI plumbing: one-line errors, groups whose commands are built when used, and serving HTTP
(``schemas serve``, ``console``) until a signal."""

from __future__ import annotations

import functools
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    from rich.console import Console
    from typer import _click as click  # typer's own copy of click


@dataclass(frozen=True, slots=True)
class Lazy:
    """A command of a :class:`LazyGroup`: how to build it, and what the group's ``--help`` lists for it without
    building it (None: it is built to be listed)."""

    build: Callable[[], click.Command]
    listed_help: str | None = None


class LazyGroup(TyperGroup):
    """A typer group some of whose commands (:meth:`lazy_commands`) are built, their modules imported, when they
    are used rather than at start-up: when invoked, when ``--help`` lists one without a ``listed_help``, or when
    :meth:`build_all` runs (what needs every command's options: the project file's sections). Until then a
    placeholder holds its place (the order of ``--help``, "did you mean" suggestions)."""

    def lazy_commands(self) -> dict[str, Lazy]:
        return {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._lazy = self.lazy_commands()
        self._unbuilt = set(self._lazy)
        self._listing = False
        for name, lazy in self._lazy.items():
            self.commands[name] = TyperCommand(name, help=lazy.listed_help, rich_markup_mode=self.rich_markup_mode)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._unbuilt and not (self._listing and self._lazy[cmd_name].listed_help is not None):
            self._build(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True  # the commands' listing may show a placeholder's help instead of building it
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def build_all(self) -> None:
        """Build every command, and those of its lazy groups."""
        for name in list(self._unbuilt):
            self._build(name)
        for command in self.commands.values():
            if isinstance(command, LazyGroup):
                command.build_all()

    def _build(self, name: str) -> None:
        self.commands[name] = self._lazy[name].build()
        self._unbuilt.discard(name)


@functools.cache
def err_console() -> Console:
    """The stderr console of one-line errors (made on the first error: rich is not imported at start-up)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` on one line to stderr; return the Exit to raise."""
    err_console().print(f"error: {message}", markup=False)
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
