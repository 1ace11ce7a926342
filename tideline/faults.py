"""Fault injection for tests and soak runs: a small file system that fills up on demand.

:func:`small_filesystem` mounts a private ``tmpfs`` of a fixed size (a real file system:
``write`` fails with ``ENOSPC`` when it is full, exactly as on a full disk) and unmounts
it afterwards. :meth:`SmallFilesystem.fill` takes all but some bytes of the free space
with a ballast file; :meth:`SmallFilesystem.free` gives it back — "space returns".

Mounting needs ``CAP_SYS_ADMIN`` (root here); without it :class:`FaultUnavailable` says
why, and tests skip with that reason. Used by the log's disk-full test
(tests/eventstore/test_disk_full.py) and meant for capture's (a ``Log`` on the mount)::

    with small_filesystem(tmp_path / "disk", 8 << 20) as disk:
        log = Log(disk.path / "log")
        ...
        disk.fill(leave_bytes=64 << 10)   # the next appends hit ENOSPC
        ...
        disk.free()                       # space is back

Thread-safety: none; one test owns a mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BALLAST = ".tideline-ballast"
FILL_CHUNK = 64 << 10


class FaultUnavailable(RuntimeError):
    """The fault cannot be injected on this machine (e.g. no permission to mount)."""


@dataclass
class SmallFilesystem:
    """A mounted tmpfs of ``size_bytes`` at ``path``."""

    path: Path
    size_bytes: int

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, *, leave_bytes: int = 0) -> int:
        """Write a ballast file until at most ``leave_bytes`` are free; return the ballast size."""
        ballast = self.path / BALLAST
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        chunk = bytes(FILL_CHUNK)
        try:
            while (free := self.free_bytes()) > leave_bytes:
                want = min(FILL_CHUNK, free - leave_bytes)
                try:
                    os.write(fd, chunk[:want])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        finally:
            os.close(fd)
        return ballast.stat().st_size

    def free(self) -> None:
        """Delete the ballast: the space it took is free again."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / BALLAST).unlink()


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[SmallFilesystem]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (created) for the block; unmount after."""
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        raise FaultUnavailable("no mount command")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tideline-fault", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise FaultUnavailable(f"cannot mount a tmpfs at {path}: {done.stderr.strip() or done.returncode}")
    try:
        yield SmallFilesystem(path, size_bytes)
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, check=False)
