"""The addresses of libpq functions in the libpq psycopg uses in this process, for the native core.

The native core (``tideline_native``) reads a COPY's lines (capture.snapshot_readers) and the replication
stream's messages (capture.replication) with libpq's own calls on psycopg's connection, so that no Python
object is made per line or message. It is given the connection (``PGconn.pgconn_ptr``) and the addresses of
the functions below, which must be those of the libpq that owns the connection:

* psycopg's ``python`` implementation loads libpq with ctypes: that library;
* the ``binary`` one links the libpq it ships (``psycopg_binary.libs/libpq-….so``), the ``c`` one the
  system's: the one such library mapped into this process (Linux's ``/proc/self/maps``), opened again with
  ctypes (the same copy: ``dlopen`` of a loaded library returns it).

Where that cannot be told for sure, :func:`functions` returns None and the callers read through psycopg.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from psycopg import pq

log = logging.getLogger("capture.libpq")

COPY = ("PQgetCopyData", "PQfreemem")  # a COPY's lines (capture.snapshot_readers.read_copy)
STREAM = ("PQgetCopyData", "PQfreemem", "PQconsumeInput")  # the replication stream (capture.replication)


@functools.cache
def functions(names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The addresses of ``names`` in psycopg's libpq, in that order; None where they cannot be told for sure."""
    try:
        if pq.__impl__ == "python":
            from psycopg.pq import _pq_ctypes

            lib = _pq_ctypes.pq  # type: ignore[attr-defined]  # the module's CDLL, not in its stub
        else:
            lib = ctypes.CDLL(_mapped_libpq(pq.__impl__))
        addresses = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
    except (OSError, AttributeError, ImportError, LookupError) as e:
        log.info("capture: libpq's %s not found, reading through psycopg: %s", ", ".join(names), e)
        return None
    found = tuple(a for a in addresses if a)
    return found if len(found) == len(names) else None


def _mapped_libpq(impl: str) -> str:
    """The path of the libpq psycopg's ``binary`` or ``c`` implementation uses, among the files mapped here."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = {parts[5] for parts in (line.split(maxsplit=5) for line in maps) if len(parts) == 6}
    libs = {p.strip() for p in paths if os.path.basename(p.strip()).startswith("libpq")}
    ours = {p for p in libs if ("psycopg_binary" in p) == (impl == "binary")}
    if len(ours) != 1:
        raise LookupError(f"{len(ours)} libpq libraries of psycopg's {impl} implementation are mapped: {sorted(ours)}")
    return ours.pop()
