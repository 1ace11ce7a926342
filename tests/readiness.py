"""Waiting for a process to do real work before a test kills, stops or interrupts it, also on a loaded machine.

A test that kills a process at a random moment picks the moment only after the process has shown
that it works: its first acknowledgement, its first stored position, its first committed batch. On a
machine under load, the start of an interpreter alone can take seconds, and a kill "0.3 to 1.2 s after
the spawn" then lands before anything happened (the test loses its power, or fails on an ``x > 0``).
So: wait for the signal (polling, never a fixed sleep), then kill at a random moment of the window in
which work is in flight.

The waits' deadlines are safety nets, never the expected path: :func:`patience` stretches them by the
machine's load, and a process (or thread) that ends before the signal fails the wait at once, saying
so, instead of letting it run to its deadline.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Alive = subprocess.Popen[Any] | threading.Thread | None
MAX_LOAD_FACTOR = 6.0


def load_factor() -> float:
    """How many times slower than a quiet one this machine is now: the 1-minute load average per CPU,
    at least 1 and at most :data:`MAX_LOAD_FACTOR`."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available here: assume a quiet machine
        return 1.0
    return min(MAX_LOAD_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def patience(seconds: float) -> float:
    """A deadline of ``seconds`` on a quiet machine, stretched by the current :func:`load_factor`."""
    return seconds * load_factor()


def _failure(message: str, details: Callable[[], str] | None) -> AssertionError:
    return AssertionError(message + (f":\n{details()}" if details else ""))


def _ended(alive: Alive) -> str | None:
    if isinstance(alive, subprocess.Popen):
        code = alive.poll()
        return None if code is None else f"the process (PID {alive.pid}) exited ({code})"
    if isinstance(alive, threading.Thread) and not alive.is_alive():
        return f"the thread {alive.name} ended"
    return None


def wait_until(
    ready: Callable[[], T],
    what: str,
    *,
    timeout: float = 120.0,
    every: float = 0.05,
    alive: Alive = None,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll ``ready()`` until it returns something true, and return that.

    Fails (``AssertionError`` naming ``what``, with ``details()`` when given, e.g. a stderr tail) as soon
    as ``alive`` (the process or thread expected to get there) has ended without getting there, or after
    ``patience(timeout)`` seconds.
    """
    limit = patience(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = ready()
        if value:
            return value
        gone = _ended(alive)
        if gone is not None:
            value = ready()  # it may have got there just before it ended
            if value:
                return value
            raise _failure(f"{gone} before {what}", details)
        if time.monotonic() > deadline:
            raise _failure(f"timed out after {limit:.0f} s waiting for {what}", details)
        time.sleep(every)


def wait_for_progress(
    measure: Callable[[], int],
    target: int,
    what: str,
    *,
    stall: float = 120.0,
    every: float = 0.1,
    alive: Alive = None,
    details: Callable[[], str] | None = None,
) -> int:
    """Poll ``measure()`` until it reaches ``target``; return its last value. A slow machine only makes
    this take longer: it fails only when the measure stops growing for ``patience(stall)`` seconds (or
    ``alive`` ended first)."""
    best = measure()
    moved = time.monotonic()
    while best < target:
        if (gone := _ended(alive)) is not None and (best := max(best, measure())) < target:
            raise _failure(f"{gone} at {best} of {target}: {what}", details)
        limit = patience(stall)
        if time.monotonic() - moved > limit:
            raise _failure(f"no progress for {limit:.0f} s at {best} of {target}: {what}", details)
        time.sleep(every)
        now = measure()
        if now > best:
            best, moved = now, time.monotonic()
    return best


def file_size(path: Path) -> int:
    """The size of ``path`` in bytes; 0 if it does not exist (yet)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wait_for_growth(path: Path, size: int, what: str, **kw: Any) -> int:
    """Until ``path`` is bigger than ``size`` bytes (something new was written to it); its new size."""
    return wait_until(lambda: file_size(path) > size and file_size(path), what, **kw)


def wait_for_text(path: Path, text: str, what: str | None = None, **kw: Any) -> str:
    """Until a line containing ``text`` appears in the file ``path`` (e.g. a process's stderr); that line."""

    def line() -> str | None:
        try:
            content = path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        return next((x for x in content.splitlines() if text in x), None)

    if "details" not in kw:
        kw["details"] = lambda: path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path})"
    return wait_until(line, what or f"{text!r} in {path.name}", **kw)
