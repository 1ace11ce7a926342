"""Decoder input fuzzing (issue 19): mutated wal2json JSON and pgoutput messages.

The payloads are real: a workload of every op and many types runs against the session's
Postgres 15 and both plugins' output is read from slots (``pg_logical_slot_get_*changes``).
Hypothesis then mutates them — byte flips, truncations, insertions, duplicated and dropped
spans, and for wal2json also JSON-level edits (a field removed, a value of another type) —
and feeds each to its decoder, in stream order (pgoutput's decoder keeps relation state).
Every mutated payload either decodes or raises :class:`capture.messages.DecodeError`
naming what is wrong; no other exception (a ``KeyError`` deep in a builder would take
the connector down with a message that names nothing) and no hang.

What the connector does with such an error — stop, confirm nothing past the last stored
transaction, store nothing of the broken transaction — is ``test_decode_error_mid_transaction``
(a real stream whose Nth payload is corrupted on its way to the decoder).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from backends import Backend
from capture_util import drop_slots, fresh_database, sql
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from workload import soak

import capture.connector
from capture.config import CaptureConfig, CoreChoice
from capture.connector import Connector
from capture.decoders.pgoutput import PgOutputDecoder
from capture.decoders.wal2json import Wal2JsonDecoder
from capture.messages import ChangeMessage, DecodeError, Plugin
from tideline.pgharness import LocalPostgres
from tideline.reliability import RESULTS_ENV, record_fault_result

EXAMPLES = 2_000 if soak() else 300
PUBLICATION = "fuzz_all"
WORKLOAD = (
    "CREATE TABLE f (id int PRIMARY KEY, n numeric, r real, d double precision, t text, j jsonb, b bytea, "
    "a int[], ts timestamptz, u uuid, big text)",
    "ALTER TABLE f ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE TABLE nokey (v text)",
    "INSERT INTO f VALUES (1, 12.5, 'NaN', '-Infinity', 'x''y', '{\"k\": [1, 2.50]}', '\\x00ff', '{1,NULL}', "
    "'2024-02-29 12:00+02', gen_random_uuid(), repeat('z', 5000))",
    "INSERT INTO f (id, n) VALUES (2, 1e30), (3, NULL)",
    "UPDATE f SET t = 'changed' WHERE id = 1",  # big (TOASTed) unchanged
    "UPDATE f SET id = 20 WHERE id = 2",
    "DELETE FROM f WHERE id = 3",
    "INSERT INTO nokey VALUES ('a')",
    "SELECT pg_logical_emit_message(true, 'fuzz', 'hello')",
    "SELECT pg_logical_emit_message(false, 'fuzz', '\\x00'::bytea)",
    "TRUNCATE f",
)


@pytest.fixture(scope="module")
def payloads(postgres: LocalPostgres) -> Iterator[dict[str, list[tuple[int, bytes]]]]:
    """Real output of both plugins for the workload: ``{"wal2json": [(lsn, payload)], "pgoutput": [...]}``."""
    dsn = fresh_database(postgres, "fuzz")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
        c.execute("SELECT pg_create_logical_replication_slot('fuzz_w2j', 'wal2json')")
        c.execute("SELECT pg_create_logical_replication_slot('fuzz_pgo', 'pgoutput')")
        for statement in WORKLOAD:
            c.execute(statement.encode())
        out: dict[str, list[tuple[int, bytes]]] = {}
        for plugin, slot, decoder in (("wal2json", "fuzz_w2j", Wal2JsonDecoder()),
                                      ("pgoutput", "fuzz_pgo", PgOutputDecoder(PUBLICATION))):  # fmt: skip
            options = [item for pair in decoder.slot_options().items() for item in pair]
            rows = c.execute(
                "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, VARIADIC %s::text[])",
                (slot, options),
            ).fetchall()
            out[plugin] = [(parse(lsn), bytes(data)) for lsn, data in rows]
    assert len(out["wal2json"]) > 20 and len(out["pgoutput"]) > 10, {k: len(v) for k, v in out.items()}
    yield out
    drop_slots(dsn)


def parse(lsn: str) -> int:
    high, low = lsn.split("/")
    return int(high, 16) << 32 | int(low, 16)


@st.composite
def mutated(draw: st.DrawFn, payload: bytes) -> bytes:
    """One of: flip bytes, truncate, insert bytes, duplicate or drop a span."""
    data = bytearray(payload)
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "drop"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, max(0, len(data) - 1)))
            if data:
                data[i] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del data[at:]
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        end = draw(st.integers(at, min(len(data), at + 16)))
        data[at:at] = data[at:end] if kind == "duplicate" else b""
        if kind == "drop":
            del data[at:end]
    return bytes(data)


def json_edit(record: Any, draw: st.DrawFn) -> Any:
    """A wal2json record with one field removed, or given a value of another JSON type."""
    fields = [k for k in record if isinstance(record, dict)] if isinstance(record, dict) else []
    if not fields:
        return record
    field = draw(st.sampled_from(fields))
    edited = dict(record)
    if draw(st.booleans()):
        del edited[field]
    else:
        edited[field] = draw(st.sampled_from([None, 0, -1, 1.5, "", "x", [], {}, [None], {"a": 1}, True]))
    return edited


def decode_all(decoder: Any, stream: list[tuple[int, bytes]], plugin: str) -> None:
    for lsn, payload in stream:
        try:
            list(decoder.decode(payload, lsn))  # a streamed transaction's replay decodes as it is iterated
        except DecodeError as e:
            assert str(e).strip(), "a DecodeError with no message"


def fuzz(check: Callable[[st.DataObject], None], **overrides: Any) -> int:
    """``check`` over :data:`EXAMPLES` Hypothesis examples; returns how many examples ran through it, counted as
    each completes (the examples Hypothesis actually ran: it may stop short of ``max_examples``). A failing
    example raises out of here, after Hypothesis has shrunk it, so nothing after a call runs for a failed fuzz."""
    ran = 0

    @settings(max_examples=EXAMPLES, deadline=None, **overrides)
    @given(data=st.data())
    def examples(data: st.DataObject) -> None:
        nonlocal ran
        check(data)
        ran += 1

    examples()
    return ran


def wal2json_mutations(stream: list[tuple[int, bytes]], decoder: Callable[[], Any]) -> Callable[[st.DataObject], None]:
    """One example: a payload of the stream byte-mutated or JSON-edited, the stream decoded in order."""

    def check(data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(stream) - 1))
        lsn, payload = stream[i]
        if data.draw(st.booleans()):
            bad = data.draw(mutated(payload))
        else:
            bad = json.dumps(json_edit(json.loads(payload), data.draw)).encode()
        decode_all(decoder(), [*stream[:i], (lsn, bad), *stream[i + 1 :]], "wal2json")

    return check


def pgoutput_mutations(stream: list[tuple[int, bytes]]) -> Callable[[st.DataObject], None]:
    """One example: a message of the stream byte-mutated, the stream decoded in order by one decoder (it keeps
    relation state)."""

    def check(data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(stream) - 1))
        lsn, payload = stream[i]
        decode_all(PgOutputDecoder(PUBLICATION), [*stream[:i], (lsn, data.draw(mutated(payload))), *stream[i + 1 :]],
                   "pgoutput")  # fmt: skip

    return check


def record_fuzz_row(plugin: str, what: str, ran: int, stream: list[tuple[int, bytes]]) -> None:
    """The RELIABILITY.md row of one fuzz run that passed: every example it ran survived."""
    record_fault_result("decoder input", f"mutated {plugin} {what} (hypothesis)", injected=ran, survived=ran,
                        records_lost=0, duplicates=0,
                        detail=f"{plugin}: {ran:,} examples, each a mutated payload among {len(stream)} payloads of a "
                        "real workload, decoded in stream order")  # fmt: skip


def test_mutated_wal2json_payloads_decode_or_raise_decode_error(payloads: dict[str, list[tuple[int, bytes]]]) -> None:
    stream = payloads["wal2json"]
    ran = fuzz(wal2json_mutations(stream, Wal2JsonDecoder))
    assert ran > 0
    record_fuzz_row("wal2json", "JSON", ran, stream)  # after every example passed: a failed run records nothing


def test_mutated_pgoutput_messages_decode_or_raise_decode_error(payloads: dict[str, list[tuple[int, bytes]]]) -> None:
    stream = payloads["pgoutput"]
    ran = fuzz(pgoutput_mutations(stream))
    assert ran > 0
    record_fuzz_row("pgoutput", "messages", ran, stream)


class LeakyWal2JsonDecoder(Wal2JsonDecoder):
    """The real wal2json decoder with the bug the fuzz test exists to find: a payload that is not JSON escapes
    as a ValueError instead of a DecodeError naming what is wrong."""

    def decode(self, payload: bytes, lsn: int = 0) -> list[ChangeMessage]:
        try:
            json.loads(payload)
        except ValueError as e:
            raise ValueError(f"leaked: {e}") from None
        return super().decode(payload, lsn)


def test_a_failing_fuzz_run_records_no_row(
    payloads: dict[str, list[tuple[int, bytes]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fuzz run that finds an escaping exception fails before its row is recorded: the result directory stays
    empty (and the examples before the failing one are not reported as survived)."""
    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    stream = payloads["wal2json"]
    with pytest.raises(ValueError, match="leaked"):
        # the row is recorded as in the real test, after fuzz() returns; no example database (this failure is
        # the test's own, not one to replay elsewhere), no shrinking (the first failure is enough)
        ran = fuzz(wal2json_mutations(stream, LeakyWal2JsonDecoder), database=None, phases=(Phase.generate,))
        record_fuzz_row("wal2json", "JSON", ran, stream)
    assert not results.exists() or list(results.iterdir()) == []


class CorruptingDecoder:
    """The real decoder, with the ``nth`` INSERT payload it is given flipped into invalid JSON."""

    def __init__(self, inner: Any, nth: int) -> None:
        self.inner, self.nth, self.seen = inner, nth, 0

    def __getattr__(self, name: str) -> Any:  # the rest of the Decoder protocol: the real decoder's
        return getattr(self.inner, name)

    def decode(self, payload: bytes, lsn: int) -> Any:
        if b'"action":"I"' in payload:
            self.seen += 1
            if self.seen == self.nth:
                payload = payload[: len(payload) // 2]  # cut in the middle: not JSON
        return self.inner.decode(payload, lsn)


def test_decode_error_mid_transaction_stops_and_stores_nothing_of_it(
    postgres: LocalPostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload that does not decode, in the middle of a transaction of a real stream: the connector
    stops with a DecodeError naming the WAL position; the slot is not confirmed past the transactions
    stored before it; nothing of the broken transaction is readable; a restart with an intact decoder
    stores everything exactly once."""
    dsn = fresh_database(postgres, "decodefault")
    try:
        sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)")
        backend = Backend.embedded(tmp_path / "log")
        # The corrupting decoder sits on the Python path: with the native core an intact INSERT never reaches the
        # decoder (a malformed payload does: the core hands it back, tests/capture/test_native_core.py).
        config = CaptureConfig(dsn=dsn, slot="fault", topic_prefix="cdc", exit_when_caught_up=True,
                               core=CoreChoice.PYTHON)  # fmt: skip
        backend.run(config)  # the slot and the (empty) snapshot
        one_transaction = "BEGIN; " + "; ".join(f"INSERT INTO t VALUES ({i}, 0)" for i in (3, 4, 5)) + "; COMMIT"
        sql(dsn, "INSERT INTO t VALUES (1, 0)", "INSERT INTO t VALUES (2, 0)", one_transaction)
        with psycopg.connect(dsn) as c:
            row = c.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        real = capture.connector.decoder_for

        def corrupting(plugin: Plugin, settings: Any = None) -> CorruptingDecoder:
            return CorruptingDecoder(real(plugin, settings), nth=4)  # the INSERT of id 4

        monkeypatch.setattr(capture.connector, "decoder_for", corrupting)  # the connector's decoder
        errors: list[BaseException] = []
        with backend.sink() as (log, _):
            connector = Connector(config, log)
            runner = threading.Thread(target=lambda: errors.append(catch(connector.run)))
            runner.start()
            runner.join(120)
        assert len(errors) == 1 and isinstance(errors[0], DecodeError), errors
        assert "WAL " in str(errors[0]), errors[0]
        ids = [json.loads(v)["after"]["id"] for _, _, v in backend.records("cdc.public.t") if v is not None]
        # whole transactions before it, if their log batch was committed before the error (the open batch
        # is aborted with it); nothing of the broken transaction (3, 4, 5)
        assert ids in ([], [1], [1, 2]), ids
        with psycopg.connect(dsn) as c:
            slot = c.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'fault'")
            confirmed = parse((slot.fetchone() or ("0/0",))[0])
        position = backend.position(dsn, "fault")
        assert position is not None and confirmed <= position.confirm_lsn < parse(row[0])
        monkeypatch.setattr(capture.connector, "decoder_for", real)
        backend.run(config)
        ids = [json.loads(v)["after"]["id"] for _, _, v in backend.records("cdc.public.t") if v is not None]
        assert ids == [1, 2, 3, 4, 5], ids
    finally:
        drop_slots(dsn)
    record_fault_result("decoder input", "a payload cut in half mid-transaction on a real stream", injected=1,
                        survived=1, records_lost=0, duplicates=0, detail=str(errors[0])[:200])  # fmt: skip


def catch(run: Any) -> BaseException | None:
    try:
        run()
    except BaseException as e:
        return e
    return None
