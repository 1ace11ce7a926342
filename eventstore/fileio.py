"""Durable file writes shared by the log's small state files and compaction output.

Every write here is whole or raises: a full disk lets ``write``/``pwrite`` through as far as the
last free page and returns the short count without an error (the *next* call fails with ENOSPC),
so a single unchecked call can leave a record torn while its caller goes on as if it were stored
(:func:`pwrite_all`).

Crash policy of :func:`replace_durably`: the new content is written to
``<name>.<pid>.tmp``, fsynced, renamed over ``<name>`` and the directory is fsynced, so a
crash leaves the old file or the new one, plus at most a stale ``.tmp`` that owners
delete on open.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, or raise :class:`OSError` (ENOSPC when the disk is full).

    The caller decides what a part written before the failure means (cut it, or leave it torn for
    the reader's framing to ignore)."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        n = os.pwrite(fd, view[written:], offset + written)
        if n <= 0:  # not seen in practice (the next call raises), but never loop on it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += n


def write_fsynced(path: Path, chunks: Iterable[bytes | bytearray | memoryview]) -> int:
    """Create or truncate ``path``, write every chunk whole, fsync; return the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = 0
        for chunk in chunks:
            view = memoryview(chunk)
            pwrite_all(fd, view, total)
            total += len(view)
        os.fsync(fd)
        return total
    finally:
        os.close(fd)


def tmp_path_for(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def replace_durably(path: Path, data: bytes) -> None:
    """Atomically and durably replace ``path`` with ``data`` (see the module docstring)."""
    tmp = tmp_path_for(path)
    write_fsynced(tmp, [data])
    os.replace(tmp, path)
    fsync_dir(path.parent)
