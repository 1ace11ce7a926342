"""Consumer-group membership and partition assignment among processes on one machine.

There is no broker and no coordinator: the members of a group meet in the log
directory, and the kernel's ``flock`` locks are the source of truth for who is alive
and who owns which partition. Layout::

    _groups/<group>/members/<member_id>.lock   flock LOCK_EX held by the member for its whole life
    _groups/<group>/members/<member_id>.json   what the member says about itself (below)
    _groups/<group>/owners/<topic>-<n>.lock    flock LOCK_EX held by the member consuming partition n

Member file (JSON, replaced atomically by write-to-temporary + rename, not fsynced:
membership does not outlive the processes)::

    {"format_version": 1, "member_id": "tideline-1f2e3d4c5b6a", "client_id": "tideline",
     "pid": 4242, "host": "box", "topics": ["orders"],            # the subscription
     "assignment": [["orders", 0], ["orders", 3]],                 # owner locks it holds now
     "joined_ms": 1700000000000, "heartbeat_ms": 1700000004000}

Member ids are ``<client_id>-<12 hex digits>`` (random), never reused.

**Liveness** is the kernel's: a member is alive while some process holds the flock of its
``.lock`` file. A member killed with ``-9`` loses its locks at once, member and owner
locks alike. Whoever lists the members tries ``LOCK_SH | LOCK_NB`` on each ``.lock``
through its own descriptor: if that succeeds nobody holds it, the member is dead, and
the lister deletes its files (holding the lock: the id is never reused, so nothing new
can appear under that name). A new member creates its lock file under a temporary name,
locks it, then renames it into place, so a listed lock file is never unlocked by a live
member. The ``heartbeat_ms`` field is refreshed about every second for people reading the
directory; nothing decides liveness from it.

Known difference from Kafka: a member that stops polling but whose process stays alive
keeps its membership and partitions for as long as it lives (Kafka evicts it after
``max.poll.interval.ms`` / ``session.timeout.ms``).

**Assignment** (:func:`assign_round_robin`, Kafka's RoundRobinAssignor): every member
computes the same target from the same inputs: the live members sorted by id and their
subscriptions; all partitions of the subscribed topics, sorted, are dealt in turn to
the members, each partition to the next member (cyclically) subscribed to its topic.
A member then releases partitions outside its target (after committing their positions)
and tries ``LOCK_NB`` on the owner locks of partitions newly in it; a lock still held by
the previous owner is retried on the next refresh. Because ownership is a kernel lock,
two members never consume one partition at the same time, even while they briefly
disagree about who is in the group. A new owner reads the group's committed offset only
after taking the lock, and the previous owner committed before releasing it, so a clean
hand-over loses and repeats nothing.

flock locks conflict between separate ``open`` calls of the same process too, so several
members in one process coordinate exactly as members in several processes do. A process
that ``fork``s shares its locks with the child (same open file description): use
``spawn`` to start workers from a process holding memberships.

Thread-safety: :class:`GroupMember` is not thread-safe; it belongs to one consumer.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from eventstore.errors import ConfigError
from eventstore.offsets import TopicPartition
from eventstore.topic import now_ms

GROUPS_DIR = "_groups"
MEMBERS_DIR = "members"
OWNERS_DIR = "owners"
MEMBER_FORMAT_VERSION = 1
LOCK_SUFFIX = ".lock"
JSON_SUFFIX = ".json"
TMP_SUFFIX = ".tmp"
HEARTBEAT_WRITE_MS = 1000
_LEGAL_GROUP = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def validate_group_id(group: str) -> None:
    """Group ids name directories: the characters of topic names, 1-249 of them."""
    if not isinstance(group, str) or not _LEGAL_GROUP.match(group) or group in (".", ".."):
        raise ConfigError(f"illegal group id {group!r}: use 1-249 characters from [A-Za-z0-9._-]")


def group_dir(log_dir: Path, group: str) -> Path:
    return log_dir / GROUPS_DIR / group


def group_names(log_dir: Path) -> list[str]:
    """Groups that have (or had) members in ``log_dir``."""
    root = log_dir / GROUPS_DIR
    if not root.is_dir():
        return []
    return sorted(n for n in os.listdir(root) if (root / n / MEMBERS_DIR).is_dir())


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What a live member says about itself (its member file)."""

    member_id: str
    client_id: str
    pid: int
    host: str
    topics: tuple[str, ...]  # subscription
    assignment: tuple[TopicPartition, ...]  # partitions it owns now
    joined_ms: int
    heartbeat_ms: int

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> MemberInfo:
        return cls(
            str(body["member_id"]),
            str(body["client_id"]),
            int(body["pid"]),
            str(body["host"]),
            tuple(sorted(str(t) for t in body["topics"])),
            tuple(sorted(TopicPartition(str(t), int(p)) for t, p in body["assignment"])),
            int(body["joined_ms"]),
            int(body["heartbeat_ms"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": MEMBER_FORMAT_VERSION,
            "member_id": self.member_id,
            "client_id": self.client_id,
            "pid": self.pid,
            "host": self.host,
            "topics": list(self.topics),
            "assignment": [[tp.topic, tp.partition] for tp in self.assignment],
            "joined_ms": self.joined_ms,
            "heartbeat_ms": self.heartbeat_ms,
        }


def _remove_member_files(members: Path, member_id: str) -> None:
    """Delete a member's files, its lock file last (the caller holds that lock, or is the member)."""
    for suffix in (JSON_SUFFIX, JSON_SUFFIX + TMP_SUFFIX, LOCK_SUFFIX + TMP_SUFFIX, LOCK_SUFFIX):
        with suppress(FileNotFoundError):
            (members / (member_id + suffix)).unlink()


def _is_alive(members: Path, member_id: str) -> bool:
    """Whether the member's lock is held; a dead member's files are deleted on the way."""
    try:
        fd = os.open(members / (member_id + LOCK_SUFFIX), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        _remove_member_files(members, member_id)
        return False
    finally:
        os.close(fd)


def live_members(log_dir: Path, group: str) -> list[MemberInfo]:
    """The live members of ``group``, sorted by id; removes the files of dead ones.

    A live member whose member file is not written yet (it is joining) is left out.
    """
    members = group_dir(log_dir, group) / MEMBERS_DIR
    try:
        names = os.listdir(members)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        if not name.endswith(LOCK_SUFFIX):
            continue
        member_id = name[: -len(LOCK_SUFFIX)]
        if not _is_alive(members, member_id):
            continue
        try:
            out.append(MemberInfo.from_json(orjson.loads((members / (member_id + JSON_SUFFIX)).read_bytes())))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue  # joining (no file yet); a torn file cannot happen (rename), but never fail the caller
    return out


def assign_round_robin(
    members: Iterable[MemberInfo], partition_count: Callable[[str], int | None]
) -> dict[str, list[TopicPartition]]:
    """Kafka's round-robin assignment: member id → its partitions (see the module docstring).

    ``partition_count(topic)``: the topic's partition count, None for a topic that does
    not exist (its subscribers get nothing of it).
    """
    ordered = sorted(members, key=lambda m: m.member_id)
    out: dict[str, list[TopicPartition]] = {m.member_id: [] for m in ordered}
    counts = {t: partition_count(t) for t in sorted({t for m in ordered for t in m.topics})}
    everything = sorted(TopicPartition(t, p) for t, n in counts.items() if n for p in range(n))
    cycle = itertools.cycle(ordered)
    for tp in everything:
        member = next(cycle)
        while tp.topic not in member.topics:  # some member subscribes to tp.topic: it is in ``everything``
            member = next(cycle)
        out[member.member_id].append(tp)
    return out


class GroupMember:
    """This process's membership in one group: its member file and its owner locks.

    Joining happens in the constructor; :meth:`leave` ends it. The caller drives the
    rest: :meth:`target` (who should own what now), :meth:`release`,
    :meth:`try_acquire`, :meth:`heartbeat`.
    """

    def __init__(self, log_dir: Path, group: str, *, client_id: str, topics: Iterable[str]) -> None:
        validate_group_id(group)
        self.log_dir = log_dir
        self.group = group
        self.client_id = client_id
        self.member_id = f"{client_id}-{uuid.uuid4().hex[:12]}"
        self.topics = tuple(sorted(set(topics)))
        self.joined_ms = now_ms()
        self._members = group_dir(log_dir, group) / MEMBERS_DIR
        self._owners = group_dir(log_dir, group) / OWNERS_DIR
        self._owned: dict[TopicPartition, int] = {}  # partition → fd holding its owner lock
        self._written: MemberInfo | None = None
        self._written_ms = 0
        self._members.mkdir(parents=True, exist_ok=True)
        self._owners.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = self._join()
        self.heartbeat(force=True)

    def _join(self) -> int:
        tmp = self._members / (self.member_id + LOCK_SUFFIX + TMP_SUFFIX)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(tmp, self._members / (self.member_id + LOCK_SUFFIX))  # appears already locked
        except BaseException:
            os.close(fd)
            with suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return fd

    @property
    def owned(self) -> frozenset[TopicPartition]:
        return frozenset(self._owned)

    def subscribe(self, topics: Iterable[str]) -> None:
        self.topics = tuple(sorted(set(topics)))
        self.heartbeat(force=True)

    def target(self, partition_count: Callable[[str], int | None]) -> set[TopicPartition]:
        """The partitions this member should own, given the live members now."""
        members = [m for m in live_members(self.log_dir, self.group) if m.member_id != self.member_id]
        members.append(self._info())  # ourselves as we are now, even if our file is being rewritten
        return set(assign_round_robin(members, partition_count).get(self.member_id, []))

    def release(self, partitions: Iterable[TopicPartition]) -> None:
        """Give up ownership (the caller committed their positions first)."""
        for tp in partitions:
            fd = self._owned.pop(tp, None)
            if fd is not None:
                os.close(fd)  # closing the only descriptor releases the flock

    def try_acquire(self, partitions: Iterable[TopicPartition]) -> list[TopicPartition]:
        """Take the owner locks that are free now; return the partitions taken."""
        taken = []
        for tp in sorted(partitions):
            if tp in self._owned:
                continue
            fd = os.open(self._owners / f"{tp.topic}-{tp.partition}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # still held by its previous owner: retried on the next refresh
                continue
            self._owned[tp] = fd
            taken.append(tp)
        return taken

    def _info(self) -> MemberInfo:
        return MemberInfo(
            self.member_id,
            self.client_id,
            os.getpid(),
            socket.gethostname(),
            self.topics,
            tuple(sorted(self._owned)),
            self.joined_ms,
            now_ms(),
        )

    def heartbeat(self, *, force: bool = False) -> None:
        """Rewrite the member file if what it says changed, or about every second."""
        info = self._info()
        written = self._written
        changed = written is None or (written.topics, written.assignment) != (info.topics, info.assignment)
        if not (force or changed or info.heartbeat_ms - self._written_ms >= HEARTBEAT_WRITE_MS):
            return
        path = self._members / (self.member_id + JSON_SUFFIX)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        tmp.write_bytes(orjson.dumps(info.to_json()))
        os.replace(tmp, path)
        self._written = info
        self._written_ms = info.heartbeat_ms

    def leave(self) -> None:
        """Release every partition and delete the member files (idempotent)."""
        self.release(list(self._owned))
        if self._lock_fd is None:
            return
        _remove_member_files(self._members, self.member_id)
        os.close(self._lock_fd)
        self._lock_fd = None
