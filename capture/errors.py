"""Capture's errors, and the one place where a failure is classified as permanent or transient.

Errors are classified where they enter (STYLE.md): :func:`classify` looks at a
database error once and says either "permanent: stop now, and here is what to do" or
"transient: reconnect with backoff". Permanent failures (Debezium stops its task on the
same ones) are:

========================  ====================================================  =========
what                      how it shows                                          SQLSTATE
========================  ====================================================  =========
authentication            password authentication failed / no pg_hba.conf entry 28P01, 28000
missing role              role "…" does not exist                               28000
missing database          database "…" does not exist                           3D000
permission                must be superuser or replication role, permission …   42501
wal_level not logical     logical decoding requires wal_level >= logical        55000
plugin not installed      could not access file "wal2json"                      58P01
plugin not allowed        library "…" may not be used as an output plugin       (15.19+)
slot limit reached        all replication slots are in use                      53400
slot active elsewhere     replication slot "…" is active for PID …              55006
publication missing       publication "…" does not exist (pgoutput, decoding)   (42704)
not the tables' owner     must be owner of table … (a publication is altered)   42501
no CREATE on the database permission denied for database … (publication)       42501
table refused (``fail``)  capture.tables.TableRefusedError                      —
configuration             eventstore.errors.ConfigError (bad options, topics)   —
========================  ====================================================  =========

A busy slot is the one class that waits first: right after a connection of ours died (a
crash, a network cut) its walsender may hold the slot a little longer, so the connector
retries for ``slot_busy_wait_s`` before calling the slot another process's.

Everything else a connection can suffer — refused or reset connections, server restart
(57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now), network errors
(class 08) — is transient *after streaming has started once*. So are the log backend's
transient failures (:func:`is_sink_transient`: a Kafka broker lost, Kafka out of reach):
the batch is aborted, the sink opened again, and capture resumes from the stored position.
A fenced producer (another connector with the same identity took over) is permanent. A first connection that
fails is reported, not retried, unless the connector runs with ``retry_on_start``: a typo
in a DSN should not look like a connector that is "reconnecting" forever.
"""

from __future__ import annotations

import errno
import re
import sqlite3

import psycopg

from eventstore.errors import (
    ConfigError,
    InvalidTxnStateError,
    KafkaUnavailableError,
    LogStorageError,
    RetriableError,
    TidelineError,
)


class CaptureError(TidelineError):
    """Base of capture's own errors."""


class PermanentCaptureError(CaptureError):
    """A failure retrying cannot fix: the connector stops at once; the message says what to do."""


class SlotLostError(PermanentCaptureError):
    """The replication slot is gone, or no longer holds the WAL after our stored position."""


class OffsetMismatchError(PermanentCaptureError):
    """The stored position and the slot's ``confirmed_flush_lsn`` disagree (capture.recovery): choose
    ``--offset-mismatch trust_slot`` or ``trust_offset`` after reading what each means."""


class RetriesExhaustedError(CaptureError):
    """Transient failures went on for longer than ``max_retry_time_s``."""


# (pattern in the server's message, SQLSTATE or None, what is wrong, what to do)
_PERMANENT: tuple[tuple[re.Pattern[str], str | None, str, str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), sqlstate, what, todo)
    for pattern, sqlstate, what, todo in (
        (r"logical decoding cannot be used while in recovery", None,
         "the server is a standby, and PostgreSQL 15 cannot decode on one (16 and later can)",
         "point --dsn at the primary (a DSN naming both hosts with target_session_attrs=read-write follows it)"),
        (r"recovery is in progress", None,
         "the server is a standby and this needs a primary", "point --dsn at the primary"),
        (r"password authentication failed|authentication failed|no password supplied", "28P01",
         "authentication failed", "check the user and password in --dsn (or ~/.pgpass / PGPASSWORD)"),
        (r"no pg_hba\.conf entry", "28000",
         "the server refuses this host/user", "add a pg_hba.conf line for this user (replication connections "
         "need one that matches database 'replication' or the database name), then reload the server"),
        (r'role "[^"]*" does not exist', "28000",
         "the role does not exist", "create it (CREATE ROLE … LOGIN REPLICATION) or fix the user in --dsn"),
        (r'database "[^"]*" does not exist', "3D000",
         "the database does not exist", "fix the database name in --dsn"),
        (r"must be owner of (table|relation|publication)", None,
         "only the owner of a table can add it to a publication", "run the connector as the captured tables' "
         "owner, or create the publication yourself (CREATE PUBLICATION … FOR TABLE …) and pass "
         "--publication-autocreate disabled --publication NAME"),
        (r"permission denied for database", None,
         "creating a publication needs CREATE on the database", "GRANT CREATE ON DATABASE … TO the connector's "
         "role, or create the publication yourself and pass --publication-autocreate disabled --publication NAME"),
        (r'publication "[^"]*" does not exist', None,
         "the slot's changes predate the publication (or it was dropped)", "PostgreSQL 15 decodes each change with "
         "the publications as they were when it was written: create the publication before the slot (drop the "
         "slot, restart with --snapshot when_needed) or check --publication"),
        (r"must be superuser or replication role|permission denied|must have REPLICATION|insufficient privilege",
         "42501", "permission denied", "grant the role REPLICATION (ALTER ROLE … REPLICATION) and SELECT on the "
         "captured tables"),
        (r"logical decoding requires wal_level|wal_level >= logical|wal_level must be", "55000",
         "the server's wal_level is not logical", "set wal_level = logical in postgresql.conf and restart the server"),
        (r'could not access file "[^"]*"|could not load library', "58P01",
         "the output plugin is not installed on the server", "install it (Debian: apt-get install "
         "postgresql-15-wal2json) or choose another --plugin"),
        (r"may not be used as an output plugin", None,
         "the server does not allow this output plugin", "add it to output_plugin_libraries in postgresql.conf "
         "(e.g. 'wal2json, pgoutput, test_decoding') and reload the server"),
        (r"all replication slots are in use", "53400",
         "the server's replication slots are all in use", "drop an unused slot (SELECT pg_drop_replication_slot(…) "
         "FROM pg_replication_slots WHERE NOT active) or raise max_replication_slots and restart the server"),
        (r'replication slot "[^"]*" is active', "55006",
         "the replication slot is in use by another process", "stop the other connector using it, or give this "
         "one another --slot"),
    )
)  # fmt: skip


def permanent_reason(error: BaseException) -> str | None:
    """``"what is wrong: what to do"`` when ``error`` is permanent, else None (transient)."""
    if isinstance(error, (PermanentCaptureError, ConfigError)):
        return str(error)
    if not isinstance(error, psycopg.Error):
        return None
    text = str(error).strip()
    sqlstate = getattr(error, "sqlstate", None)
    first = _server_message(text.splitlines()[0] if text else type(error).__name__)
    for pattern, _, what, todo in _PERMANENT:  # the message is the more specific of the two
        if pattern.search(text):
            return f"{what} ({first}): {todo}"
    for _, state, what, todo in _PERMANENT:
        if state is not None and sqlstate == state:
            return f"{what} ({first}): {todo}"
    return None


def _server_message(text: str) -> str:
    """libpq's connection errors repeat 'connection to server at … failed: FATAL: …': keep the reason."""
    for marker in ("FATAL:  ", "FATAL: ", "ERROR:  ", "ERROR: "):
        if marker in text:
            return text.split(marker, 1)[1].strip()
    return text


SLOT_BUSY = re.compile(r'replication slot "[^"]*" is active', re.IGNORECASE)


def is_slot_busy(error: BaseException) -> bool:
    """The slot is held by a walsender: another connector, or our own previous connection not yet gone."""
    return isinstance(error, psycopg.Error) and (
        getattr(error, "sqlstate", None) == "55006" or bool(SLOT_BUSY.search(str(error)))
    )


def is_slot_missing(error: BaseException) -> bool:
    """``replication slot "…" does not exist`` from the server (SQLSTATE 42704): the slot went away between the
    start checks, which had seen it, and ``START_REPLICATION``."""
    return isinstance(error, psycopg.errors.UndefinedObject) and "replication slot" in str(error)


def is_sink_transient(error: BaseException) -> bool:
    """The log backend failed in a way a new producer may get past: Kafka out of reach, a broker
    lost mid-transaction (librdkafka's abortable and retriable errors), acknowledgements late,
    the embedded log's (or the key state's) disk full — the batch was not stored, appends work
    again once space is free; the key state still locked by the instance this one fenced.
    The connector aborts the batch, opens the sink again (``init_transactions``) and resumes from
    the stored position, with backoff. Fencing (another instance took over) is not one of them."""
    if isinstance(error, LogStorageError):  # the embedded log's disk is full: retried until space returns
        return error.errno == errno.ENOSPC
    if isinstance(error, sqlite3.OperationalError):  # the key state, beside the log, on the same full disk;
        # or locked by the instance this one just fenced, not yet gone (it stops at its next write)
        return any(m in str(error) for m in ("disk is full", "disk I/O error", "database is locked"))
    return isinstance(error, (RetriableError, InvalidTxnStateError, KafkaUnavailableError))


def is_connection_error(error: BaseException) -> bool:
    """Errors that mean the connection or the server went away (retried once streaming has started)."""
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))
