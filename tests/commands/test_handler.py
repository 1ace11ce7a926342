"""The command handler against a real Postgres: accept, refuse, claims, idempotency, upcasting, snapshots."""

from __future__ import annotations

import pytest
from commands_util import rows

from commands import store as store_module
from commands.errors import (
    CommandIdReusedError,
    ConcurrencyError,
    DuplicateClaimError,
    ValidationError,
    WrongExpectedVersionError,
)
from commands.handler import CommandHandler, HandlerConfig
from examples.reservations.domain import (
    RESERVATION,
    USER,
    CancelReservation,
    ChangeSeat,
    RegisterUser,
    Reservation,
    ReservationExists,
    ReservationNotActive,
    ReserveSeat,
    Status,
    User,
)


def lsn_value(lsn: str) -> int:
    high, low = lsn.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def test_accepted_command_appends_its_event_with_metadata_and_returns_a_position(
    handler: CommandHandler, dsn: str
) -> None:
    before = rows(dsn, "SELECT CAST(pg_current_wal_insert_lsn() AS text)")[0][0]
    result = handler.handle(
        RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"), command_id="c1", correlation_id="req-9"
    )
    assert (result.stream_id, result.stream_type, result.version, result.events) == (
        "reservation-r1", "reservation", 1, ("SeatReserved",)
    )  # fmt: skip
    assert not result.replayed and result.attempts == 1
    assert lsn_value(result.commit_lsn) > lsn_value(before)
    [(stream_id, stream_type, version, event_type, schema_version, payload, metadata)] = rows(
        dsn, "SELECT stream_id, stream_type, version, event_type, schema_version, payload, metadata FROM events"
    )
    assert (stream_id, stream_type, version, event_type, schema_version) == (
        "reservation-r1", "reservation", 1, "SeatReserved", 1
    )  # fmt: skip
    assert payload == {"reservation_id": "r1", "show_id": "hamlet", "seat": "A1", "customer_id": "alice"}
    assert metadata == {
        "command_id": "c1",
        "command_type": "ReserveSeat",
        "correlation_id": "req-9",
        "causation_id": "c1",
    }
    assert rows(dsn, "SELECT claim_type, value, stream_id FROM claims") == [("seat", "hamlet/A1", "reservation-r1")]
    loaded = handler.load(RESERVATION, "reservation-r1")
    assert loaded.version == 1
    assert loaded.state == Reservation(Status.ACTIVE, "r1", "hamlet", "A1", "alice")


def test_domain_errors_write_nothing(handler: CommandHandler, dsn: str) -> None:
    with pytest.raises(ValidationError, match="invalid seat 'a1'"):
        handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "a1", "alice"))
    with pytest.raises(ReservationNotActive, match="is none, not active"):
        handler.handle(RESERVATION, CancelReservation("r1"))
    handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
    with pytest.raises(ReservationExists):
        handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A2", "alice"))
    with pytest.raises(ValidationError, match="already holds seat A1"):
        handler.handle(RESERVATION, ChangeSeat("r1", "A1"))
    assert rows(dsn, "SELECT count(*) FROM events")[0][0] == 1
    assert rows(dsn, "SELECT count(*) FROM commands")[0][0] == 1


def test_a_seat_has_one_holder_until_released(handler: CommandHandler, dsn: str) -> None:
    handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
    with pytest.raises(DuplicateClaimError, match="seat 'hamlet/A1' is already claimed by 'reservation-r1'"):
        handler.handle(RESERVATION, ReserveSeat("r2", "hamlet", "A1", "bob"))
    assert handler.load(RESERVATION, "reservation-r2").version == 0  # nothing written for r2
    handler.handle(RESERVATION, ReserveSeat("r2", "macbeth", "A1", "bob"))  # another show: free
    handler.handle(RESERVATION, ChangeSeat("r1", "B7"))  # claims B7, releases A1
    handler.handle(RESERVATION, ReserveSeat("r3", "hamlet", "A1", "carol"))
    with pytest.raises(DuplicateClaimError):
        handler.handle(RESERVATION, ChangeSeat("r3", "B7"))
    handler.handle(RESERVATION, CancelReservation("r1"))  # releases B7
    handler.handle(RESERVATION, ChangeSeat("r3", "B7"))
    assert sorted(rows(dsn, "SELECT value, stream_id FROM claims")) == [
        ("hamlet/B7", "reservation-r3"),
        ("macbeth/A1", "reservation-r2"),
    ]
    assert handler.load(RESERVATION, "reservation-r1").state.status is Status.CANCELLED


def test_usernames_are_unique(handler: CommandHandler) -> None:
    handler.handle(USER, RegisterUser("u1", "alice"))
    with pytest.raises(DuplicateClaimError, match="username 'alice' is already claimed by 'user-u1'"):
        handler.handle(USER, RegisterUser("u2", "alice"))
    assert handler.handle(USER, RegisterUser("u2", "alice_b")).version == 1


def test_repeated_command_id_returns_the_original_result(handler: CommandHandler, dsn: str) -> None:
    first = handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"), command_id="same")
    again = handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"), command_id="same")
    assert again.replayed and not first.replayed
    assert (again.stream_id, again.version, again.events) == (first.stream_id, first.version, first.events)
    assert lsn_value(again.commit_lsn) >= lsn_value(first.commit_lsn)
    assert rows(dsn, "SELECT count(*) FROM events")[0][0] == 1
    with pytest.raises(CommandIdReusedError, match="already used for stream 'reservation-r1'"):
        handler.handle(RESERVATION, ReserveSeat("r2", "hamlet", "A2", "bob"), command_id="same")


def test_events_stored_at_schema_v1_are_read_as_v2(handler: CommandHandler, dsn: str) -> None:
    rows(
        dsn,
        "INSERT INTO events (stream_id, stream_type, version, event_type, schema_version, payload) "
        """VALUES ('user-u1', 'user', 1, 'UserRegistered', 1, '{"user_id": "u1", "name": "alice"}') RETURNING id""",
    )
    loaded = handler.load(USER, "user-u1")
    assert loaded == type(loaded)(User(True, "u1", "alice", "alice"), 1)
    decoded = USER.events.decode("UserRegistered", 1, {"user_id": "u1", "name": "alice"})
    assert USER.events.encode(decoded).schema_version == 2


def test_snapshot_plus_later_events_equals_the_full_fold(dsn: str) -> None:
    config = HandlerConfig(snapshot_every=5)
    seats = [f"A{n}" for n in range(1, 14)]
    with CommandHandler(dsn, config) as h:
        h.handle(RESERVATION, ReserveSeat("r1", "hamlet", seats[0], "alice"))
        for seat in seats[1:]:
            h.handle(RESERVATION, ChangeSeat("r1", seat))
    with CommandHandler(dsn, config) as fresh:  # nothing cached: the snapshot + the events after it
        with_snapshot = fresh.load(RESERVATION, "reservation-r1")
        assert fresh.cache_info().misses == 1
    assert rows(dsn, "SELECT version, state FROM snapshots WHERE stream_id = 'reservation-r1'") == [
        (10, {"status": "active", "reservation_id": "r1", "show_id": "hamlet", "seat": "A10",
              "customer_id": "alice", "seat_changes": 9})
    ]  # fmt: skip
    with CommandHandler(dsn, HandlerConfig(use_snapshots=False)) as full:
        folded = full.load(RESERVATION, "reservation-r1")
    assert with_snapshot == folded
    assert folded.version == 13 and folded.state.seat == "A13" and folded.state.seat_changes == 12


def test_snapshot_of_an_older_state_version_is_ignored(dsn: str) -> None:
    from dataclasses import replace

    with CommandHandler(dsn, HandlerConfig(snapshot_every=1)) as h:
        h.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
    rows(dsn, """UPDATE snapshots SET state = '{"bogus": true}' RETURNING version""")
    newer = replace(RESERVATION, state_version=2)
    with CommandHandler(dsn) as h:
        assert h.load(newer, "reservation-r1").state.seat == "A1"  # v1 snapshot skipped: full fold


def test_retries_are_bounded_then_concurrency_error(
    handler: CommandHandler, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
    real_load = store_module.load_stream
    loads = []

    def stale_load(*args: object, **kwargs: object) -> store_module.LoadedStream:
        loaded = real_load(*args, **{**kwargs, "after_version": None})  # type: ignore[arg-type]  # a full load
        loads.append(loaded.version)
        return store_module.LoadedStream(None, loaded.events[:1], loaded.recorded)  # always "version 1"

    handler.handle(RESERVATION, ChangeSeat("r1", "A2"))  # now at version 2
    monkeypatch.setattr(store_module, "load_stream", stale_load)
    with pytest.raises(ConcurrencyError, match="version 2 was taken by another writer on each of 10 attempt"):
        handler.handle(RESERVATION, ChangeSeat("r1", "A3"))
    assert loads == [2] * handler.config.max_attempts
    assert rows(dsn, "SELECT count(*) FROM events")[0][0] == 2
    assert rows(dsn, "SELECT value FROM claims") == [("hamlet/A2",)]  # the failed claim was rolled back


def test_expected_version_from_the_caller(handler: CommandHandler, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KurrentDB's expected revision: a caller that decided on an old version is refused, not retried."""
    handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"), expected_version=0)  # new stream
    with pytest.raises(WrongExpectedVersionError, match="is at version 1, not at the expected version 0"):
        handler.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A5", "bob"), expected_version=0)
    result = handler.handle(RESERVATION, ChangeSeat("r1", "A2"), expected_version=1)
    assert result.version == 2
    with pytest.raises(WrongExpectedVersionError, match="is at version 2, not at the expected version 1"):
        handler.handle(RESERVATION, ChangeSeat("r1", "A3"), expected_version=1)

    # Another writer appends between the load and the append: no retry either.
    real_load = store_module.load_stream

    def stale_load(*args: object, **kwargs: object) -> store_module.LoadedStream:
        loaded = real_load(*args, **{**kwargs, "after_version": None})  # type: ignore[arg-type]  # a full load
        return store_module.LoadedStream(None, loaded.events[:1], loaded.recorded)  # "version 1"

    monkeypatch.setattr(store_module, "load_stream", stale_load)
    with pytest.raises(WrongExpectedVersionError, match="moved on while appending"):
        handler.handle(RESERVATION, ChangeSeat("r1", "A4"), expected_version=1)
    assert rows(dsn, "SELECT count(*) FROM events")[0][0] == 2  # nothing written by the refused ones


def test_cached_states_fast_forward_over_other_writers_events(dsn: str) -> None:
    """A cached state is only a starting point: each load reads the events after it, so two
    handlers writing one stream in turn each see the other's events."""
    with CommandHandler(dsn) as a, CommandHandler(dsn) as b:
        a.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
        for n in range(2, 8):
            writer = a if n % 2 else b
            result = writer.handle(RESERVATION, ChangeSeat("r1", f"A{n}"))
            assert result.version == n
        # An event written behind both handlers' backs is folded in as well.
        rows(
            dsn,
            "INSERT INTO events (stream_id, stream_type, version, event_type, schema_version, payload) "
            """VALUES ('reservation-r1', 'reservation', 8, 'SeatChanged', 1,"""
            """ '{"reservation_id": "r1", "show_id": "hamlet", "from_seat": "A7", "to_seat": "B9"}') RETURNING id""",
        )
        for h in (a, b):
            cached = h.load(RESERVATION, "reservation-r1")
            assert cached.version == 8 and cached.state.seat == "B9" and cached.state.seat_changes == 7
            assert h.cache_info().hits >= 3
        with CommandHandler(dsn, HandlerConfig(cache_size=0, use_snapshots=False)) as full:
            assert full.load(RESERVATION, "reservation-r1") == cached
            assert full.cache_info().size == 0


def test_cache_keeps_the_most_recently_used_streams(dsn: str) -> None:
    with CommandHandler(dsn, HandlerConfig(cache_size=2)) as h:
        for n in range(1, 4):
            h.handle(RESERVATION, ReserveSeat(f"r{n}", "hamlet", f"A{n}", "alice"))
        assert h.cache_info().size == 2
        misses = h.cache_info().misses
        h.handle(RESERVATION, ChangeSeat("r1", "C1"))  # r1 was evicted: a full load
        assert h.cache_info().misses == misses + 1
        h.handle(RESERVATION, ChangeSeat("r3", "C3"))  # r3 kept (r2 went when r1 came back)
        assert h.cache_info().misses == misses + 1
        assert h.load(RESERVATION, "reservation-r1").state.seat == "C1"
    with pytest.raises(ValueError, match="cache_size must be"):
        HandlerConfig(cache_size=-1)


def test_awkward_text_round_trips_and_a_lost_prepared_statement_is_prepared_again(dsn: str) -> None:
    """Parameters of the append are bound client-side (quoted by psycopg): quotes,
    backslashes, SQL and non-ASCII text arrive as sent; ``DISCARD ALL`` on the session
    (a pool's reset) makes the handler prepare its statement again."""
    name = "o'brien \\\\ \"x\" ); DROP TABLE events; -- é🎭 $1 %s"
    with CommandHandler(dsn, HandlerConfig(pool_size=1)) as h:
        h.handle(USER, RegisterUser("u1", "obrien", display_name=name))
        with h._connection() as conn:
            conn.execute("DISCARD ALL")
        result = h.handle(RESERVATION, ReserveSeat("r1", "hamlet", "A1", "alice"))
        assert result.version == 1
    assert rows(dsn, "SELECT payload->>'display_name' FROM events WHERE stream_id = 'user-u1'") == [(name,)]
    assert rows(dsn, "SELECT count(*) FROM events") == [(2,)]


def test_generated_command_ids_are_time_ordered_uuid7() -> None:
    import time
    import uuid

    from commands.handler import new_command_id

    first = [new_command_id() for _ in range(1000)]
    time.sleep(0.002)
    later = new_command_id()
    assert len(set(first)) == 1000
    assert all(uuid.UUID(i).version == 7 and uuid.UUID(i).variant == uuid.RFC_4122 for i in first)
    assert max(first) < later  # a later millisecond sorts after (text order = byte order = time order)
    assert abs(int(later[:8] + later[9:13], 16) - time.time_ns() // 1_000_000) < 5_000
