"""The errors of the write side, one hierarchy rooted in :class:`CommandsError`.

Driver errors are translated at the boundary (``raise ConcurrencyError(...) from e``);
every message names the stream, command or claim involved so that an API can return it
as is.
"""

from __future__ import annotations

from eventstore.errors import TidelineError


class CommandsError(TidelineError):
    """Root of every error the write side raises on purpose."""


class DomainError(CommandsError):
    """The command was refused by the domain's rules: nothing was written.

    ``decide`` raises it when the command is invalid for the aggregate's current state
    (domains subclass it: ``SeatNotAvailable``, ``ReservationNotActive`` …); the handler
    raises its subclass :class:`DuplicateClaimError` when a uniqueness claim is held by
    another stream. Retrying the same command gives the same answer until the state (or
    the claim's holder) changes, so ``except DomainError`` is "refused, do not retry".
    """


class ValidationError(DomainError):
    """The command itself is malformed (an empty name, a seat that does not exist …)."""


class ConcurrencyError(CommandsError):
    """The stream kept changing under the command: every attempt lost the race.

    Raised after ``attempts`` fresh loads each ended in a version conflict on
    ``(stream_id, version)``; nothing was written. Retry later or raise
    ``HandlerConfig.max_attempts``.
    """

    def __init__(self, stream_id: str, expected_version: int, attempts: int) -> None:
        super().__init__(
            f"stream {stream_id!r} changed concurrently: version {expected_version + 1} was taken "
            f"by another writer on each of {attempts} attempt(s)"
        )
        self.stream_id = stream_id
        self.expected_version = expected_version
        self.attempts = attempts


class WrongExpectedVersionError(CommandsError):
    """The caller decided on a version of the stream that is no longer current (KurrentDB's
    WrongExpectedVersion): nothing was written; reload, decide again, resend."""

    def __init__(self, stream_id: str, expected_version: int, actual_version: int | None) -> None:
        where = f"is at version {actual_version}" if actual_version is not None else "moved on while appending"
        super().__init__(
            f"stream {stream_id!r} {where}, not at the expected version {expected_version}: reload it and decide again"
        )
        self.stream_id = stream_id
        self.expected_version = expected_version
        self.actual_version = actual_version


class DuplicateClaimError(DomainError):
    """A uniqueness claim (a username, a seat) is held by another stream; nothing was written.

    A :class:`DomainError` (the domain's uniqueness rule refused the command), raised by the
    append rather than by ``decide``: ``except DomainError`` catches a taken handle too.
    """

    def __init__(self, claim_type: str, value: str, holder: str) -> None:
        super().__init__(f"{claim_type} {value!r} is already claimed by {holder!r}")
        self.claim_type = claim_type
        self.value = value
        self.holder = holder


class CommandIdReusedError(CommandsError):
    """A command id already recorded for a different stream: command ids must be unique."""

    def __init__(self, command_id: str, stream_id: str, recorded_stream_id: str) -> None:
        super().__init__(
            f"command id {command_id!r} was already used for stream {recorded_stream_id!r}, "
            f"not {stream_id!r}: give every command a fresh id"
        )
        self.command_id = command_id


class UnknownEventError(CommandsError):
    """A stored event type or schema version that the registry cannot decode (no class or upcaster)."""


class CodecError(CommandsError):
    """A JSON value does not fit the dataclass field it is decoded into."""
