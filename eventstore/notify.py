"""Sleep until a file in a watched directory changes: how a reader at the head of a
partition waits for a record appended by another process without busy-spinning.

:class:`ChangeWaiter` watches directories (a consumer: the ``<log>/<topic>-<n>/``
directories of its assigned partitions) and blocks in :meth:`ChangeWaiter.wait` until a
file in one of them changes, a timeout passes, or :meth:`ChangeWaiter.wakeup` is called.
A wake-up means "maybe there is something new": the caller re-reads the log and waits
again if not. It is never a promise that a record is readable (an index write, a
checkpoint rename or half a batch wakes it too), and the caller must check *after*
watching, before waiting: changes made before a directory was watched are not reported.

Mechanism: Linux inotify through ``ctypes`` (``inotify_init1(IN_NONBLOCK | IN_CLOEXEC)``,
one watch per directory), plus an eventfd for :meth:`~ChangeWaiter.wakeup`, both in one
``select.poll`` set; the waiting thread sleeps in the kernel and uses no CPU. What wakes
it (:data:`DEFAULT_MASK`), for the partition layout of :mod:`eventstore.partition_log`:

* ``IN_MODIFY``: a ``pwrite`` or truncation of a file: an append to the active
  ``.log`` segment (and its indexes), a state file rewritten in place;
* ``IN_CREATE``: a new file: a segment created by a roll;
* ``IN_MOVED_TO``: a file renamed into the directory: ``replace_durably`` (checkpoints,
  compacted segments swapped in);
* ``IN_DELETE``: a file removed: segments deleted by retention or compaction;
* ``IN_DELETE_SELF`` / ``IN_MOVE_SELF``: the watched directory itself went away.

``IN_ACCESS``/``IN_OPEN``/``IN_CLOSE_*`` are deliberately not watched: a reader's own
reads (and a writer's open/close of ``.lock``) would wake it for nothing.

Each wake-up drains the inotify fd completely (reads until ``EAGAIN``), so one burst of
writes costs one wake-up. Events for directories no longer watched (queued before
:meth:`~ChangeWaiter.unwatch`) are discarded and do not end a wait.

Overflow: when the kernel's event queue overflows (``IN_Q_OVERFLOW``, more than
``/proc/sys/fs/inotify/max_queued_events`` unread events) events were lost, so the wait
reports a change: the caller re-checks everything, which is always correct.
A watched directory that vanishes (``IN_IGNORED`` after its deletion, or moved away)
is a change too, and is dropped from the watch set; watching the path again after it is
recreated watches the new directory.

Fallback: when inotify is unavailable (no libc through ctypes, ``ENOSYS``, or
``inotify_init1`` failing with ``EMFILE`` because ``/proc/sys/fs/inotify/max_user_instances``
instances per user, 128 by default, are in use, or the process is out of descriptors),
the waiter logs one warning naming the reason and degrades to polling: :meth:`wait`
sleeps at most :data:`FALLBACK_STEP_SECONDS` and returns True ("maybe changed").
A directory that cannot be watched because ``max_user_watches`` is exhausted
(``ENOSPC``) degrades the same way, for that waiter, while it is watched. The fallback
is selectable (``ChangeWaiter(use_inotify=False)``) for tests and odd file systems
(inotify does not see writes made on another host of a network file system).

Thread-safety: one thread at a time may :meth:`~ChangeWaiter.wait` (a second concurrent
``wait`` raises RuntimeError). ``watch``, ``unwatch``, ``set_watched``, ``wakeup`` and
``close`` may be called from any thread, also during a ``wait``: ``wakeup`` makes the
current (or, if none, the next) ``wait`` return True promptly, like Kafka's
``Consumer.wakeup``; ``close`` during a ``wait`` makes it return True, and the waiting
thread releases the descriptors on its way out. After ``close``, ``wait`` raises
ValueError; ``close`` is idempotent.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

DEFAULT_MASK = IN_MODIFY | IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
FALLBACK_STEP_SECONDS = 0.005
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name[len])
_READ_SIZE = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Inotify:
    init1: Callable[[int], int]
    add_watch: Callable[[int, bytes, int], int]
    rm_watch: Callable[[int, int], int]


_libc_lock = threading.Lock()
_libc: _Inotify | str | None = None  # loaded functions, or why they are unavailable


def _load_inotify() -> _Inotify | str:
    """The libc inotify functions, or a string saying why they cannot be had (cached)."""
    global _libc
    with _libc_lock:
        if _libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                init1, add_watch, rm_watch = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
            except (OSError, AttributeError) as exc:
                _libc = f"inotify is not available through ctypes: {exc}"
            else:
                init1.argtypes, init1.restype = [ctypes.c_int], ctypes.c_int
                add_watch.argtypes, add_watch.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
                rm_watch.argtypes, rm_watch.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _libc = _Inotify(init1, add_watch, rm_watch)
        return _libc


def _oserror(code: int, path: Path | None = None) -> OSError:
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), str(path))


class ChangeWaiter:
    """Sleeps until a file in one of the watched directories changes, or a timeout.

    >>> with ChangeWaiter() as waiter:                               # doctest: +SKIP
    ...     waiter.set_watched([partition_dir])
    ...     while not (batches := log.read(topic, 0, offset)):   # check after watching
    ...         waiter.wait(remaining)
    """

    def __init__(self, *, use_inotify: bool = True, mask: int = DEFAULT_MASK) -> None:
        self.mask = mask
        self.overflows = 0  # times the kernel queue overflowed (events lost; reported as a change)
        self.fallback_reason: str | None = None  # why this waiter polls instead of sleeping on inotify
        self._lock = threading.Lock()
        self._closed = False
        self._waiting = False
        self._paths: dict[Path, int] = {}  # watched directory -> watch descriptor
        self._by_wd: dict[int, set[Path]] = {}  # one inode under several names shares a descriptor
        self._unwatchable: set[Path] = set()  # watched by polling (ENOSPC/ENOMEM on add_watch)
        self._wake_r, self._wake_w = self._make_wake_fds()
        self._inotify_fd: int | None = None
        self._lib: _Inotify | None = None
        if use_inotify:
            self._open_inotify()
        else:
            self.fallback_reason = "inotify disabled (use_inotify=False)"
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        if self._inotify_fd is not None:
            self._poller.register(self._inotify_fd, select.POLLIN)

    @staticmethod
    def _make_wake_fds() -> tuple[int, int]:
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return fd, fd
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        return r, w

    def _open_inotify(self) -> None:
        lib = _load_inotify()
        if isinstance(lib, str):
            self._degrade(lib)
            return
        fd = lib.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            hint = {
                errno.EMFILE: " (per-user limit /proc/sys/fs/inotify/max_user_instances, or per-process fd limit)",
                errno.ENFILE: " (system-wide file limit)",
                errno.ENOSYS: " (kernel without inotify)",
            }.get(code, "")
            self._degrade(f"inotify_init1 failed: {errno.errorcode.get(code, code)} {os.strerror(code)}{hint}")
            return
        self._inotify_fd, self._lib = fd, lib

    def _degrade(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning("ChangeWaiter falls back to polling every %.0f ms: %s", FALLBACK_STEP_SECONDS * 1000, reason)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> ChangeWaiter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ watch set

    @property
    def inotify(self) -> bool:
        """True when changes are reported by inotify (not the polling fallback)."""
        return self._inotify_fd is not None

    @property
    def watched(self) -> frozenset[Path]:
        """The directories being watched (absolute; vanished ones are dropped)."""
        with self._lock:
            return frozenset(self._paths) | frozenset(self._unwatchable)

    def watch(self, directory: Path) -> None:
        """Watch ``directory`` (idempotent). Raises OSError (e.g. FileNotFoundError,
        NotADirectoryError, PermissionError) if it cannot be watched; ``ENOSPC``
        (``max_user_watches``) degrades this waiter to polling instead."""
        path = Path(os.path.abspath(directory))
        with self._lock:
            self._check_open()
            self._watch_locked(path)

    def _watch_locked(self, path: Path) -> None:
        if path in self._paths or path in self._unwatchable:
            return
        if self._inotify_fd is None or self._lib is None:
            if not path.is_dir():
                raise _oserror(errno.ENOENT if not path.exists() else errno.ENOTDIR, path)
            self._unwatchable.add(path)
            return
        wd = self._lib.add_watch(self._inotify_fd, os.fsencode(path), self.mask | IN_ONLYDIR)
        if wd < 0:
            code = ctypes.get_errno()
            if code not in (errno.ENOSPC, errno.ENOMEM):
                raise _oserror(code, path)
            log.warning(
                "ChangeWaiter cannot watch %s (%s: /proc/sys/fs/inotify/max_user_watches?): polling every %.0f ms",
                path,
                os.strerror(code),
                FALLBACK_STEP_SECONDS * 1000,
            )
            self._unwatchable.add(path)
            return
        self._paths[path] = wd
        self._by_wd.setdefault(wd, set()).add(path)

    def unwatch(self, directory: Path) -> None:
        """Stop watching ``directory`` (no-op if it is not watched)."""
        path = Path(os.path.abspath(directory))
        with self._lock:
            self._check_open()
            self._unwatch_locked(path)

    def _unwatch_locked(self, path: Path) -> None:
        self._unwatchable.discard(path)
        wd = self._paths.pop(path, None)
        if wd is None:
            return
        names = self._by_wd[wd]
        names.discard(path)
        if names:
            return  # the same directory is still watched under another name
        del self._by_wd[wd]
        if self._inotify_fd is not None and self._lib is not None:
            self._lib.rm_watch(self._inotify_fd, wd)  # EINVAL if it already vanished: nothing to do

    def set_watched(self, directories: Iterable[Path]) -> None:
        """Make the watch set exactly ``directories``: cheap when it is unchanged.

        If some cannot be watched the others still are, and the first error is raised.
        """
        wanted = {Path(os.path.abspath(d)) for d in directories}
        with self._lock:
            self._check_open()
            for path in (set(self._paths) | self._unwatchable) - wanted:
                self._unwatch_locked(path)
            first_error: OSError | None = None
            for path in wanted:
                try:
                    self._watch_locked(path)
                except OSError as exc:
                    first_error = first_error or exc
            if first_error is not None:
                raise first_error

    # ------------------------------------------------------------------ waiting

    def wakeup(self) -> None:
        """Make the current ``wait`` (or, if none is running, the next one) return True promptly.

        Callable from any thread; a no-op once closed.
        """
        with self._lock:
            if not self._closed:
                self._signal_locked()

    def _signal_locked(self) -> None:
        with suppress(BlockingIOError):  # already signalled (pipe full / eventfd at its maximum)
            os.write(self._wake_w, (1).to_bytes(8, "little"))

    def wait(self, timeout_s: float) -> bool:
        """Block until a change in a watched directory, ``wakeup()``, or ``timeout_s`` seconds.

        Returns True if something changed or a wakeup came (all pending events are
        drained), at once if that already happened since the last ``wait``; False on
        timeout. In the polling fallback, sleeps at most ``FALLBACK_STEP_SECONDS`` and
        returns True. ``timeout_s <= 0`` only looks.
        """
        with self._lock:
            self._check_open()
            if self._waiting:
                raise RuntimeError("ChangeWaiter.wait is already running in another thread")
            self._waiting = True
        changed = True
        try:
            changed = self._wait(max(0.0, timeout_s))
        finally:
            with self._lock:
                self._waiting = False
                release = self._closed
            if release:  # closed by another thread while we waited
                self._release()
        return changed or release

    def _wait(self, timeout_s: float) -> bool:
        polling = self._inotify_fd is None or bool(self._unwatchable)
        if polling:
            timeout_s = min(timeout_s, FALLBACK_STEP_SECONDS)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            ready = self._poller.poll(math.ceil(remaining * 1000))
            changed = False
            for fd, _ in ready:
                if fd == self._wake_r:
                    self._drain_wake()
                    changed = True
                elif fd == self._inotify_fd:
                    changed = self._drain_inotify() or changed
            if changed:
                return True
            with self._lock:
                if self._closed:
                    return True
            if not ready and time.monotonic() >= deadline:
                return polling  # polling: "maybe changed", the caller re-checks
            # only events of directories no longer watched (or an early return of poll): wait on

    def _drain_wake(self) -> None:
        with suppress(BlockingIOError):
            while os.read(self._wake_r, 8) and self._wake_r != self._wake_w:
                pass  # a pipe: read to the end (one eventfd read resets its counter)

    def _drain_inotify(self) -> bool:
        """Read every pending event; True if any concerns a watched directory (or some were lost)."""
        assert self._inotify_fd is not None
        changed = False
        while True:
            try:
                buf = os.read(self._inotify_fd, _READ_SIZE)
            except BlockingIOError:
                return changed
            except InterruptedError:
                continue
            if not buf:
                return changed
            pos = 0
            with self._lock:
                while pos + _EVENT.size <= len(buf):
                    wd, mask, _cookie, name_len = _EVENT.unpack_from(buf, pos)
                    pos += _EVENT.size + name_len
                    if mask & IN_Q_OVERFLOW:
                        self.overflows += 1
                        changed = True
                    elif wd in self._by_wd:
                        changed = True
                        if mask & (IN_IGNORED | IN_MOVE_SELF):
                            self._forget_wd(wd, removed_by_kernel=bool(mask & IN_IGNORED))

    def _forget_wd(self, wd: int, *, removed_by_kernel: bool) -> None:
        """The directory of ``wd`` was deleted (the kernel dropped the watch) or moved away
        (its path no longer names it: drop the watch ourselves)."""
        for path in self._by_wd.pop(wd):
            del self._paths[path]
        if not removed_by_kernel and self._inotify_fd is not None and self._lib is not None:
            self._lib.rm_watch(self._inotify_fd, wd)

    # ------------------------------------------------------------------ closing

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ChangeWaiter is closed")

    def close(self) -> None:
        """Release the descriptors; a ``wait`` running in another thread returns True."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._waiting:
                # Signalled under the lock: the waiting thread cannot release the descriptors
                # (it takes the lock first) before this write is done.
                self._signal_locked()
                return
        self._release()

    def __del__(self) -> None:
        # An unclosed waiter must not keep its inotify instance (128 per user) until exit.
        try:
            if not self._closed and not self._waiting:
                self.close()
        except Exception:
            pass

    def _release(self) -> None:
        fds = {self._wake_r, self._wake_w}
        if self._inotify_fd is not None:
            fds.add(self._inotify_fd)  # closing it removes every watch
        for fd in fds:
            with suppress(KeyError):
                self._poller.unregister(fd)
            os.close(fd)
        with self._lock:
            self._paths.clear()
            self._by_wd.clear()
            self._unwatchable.clear()
