"""An aggregate type: a state, a pure fold over its events, and the decision function.

The domain is plain typed Python with no I/O::

    apply(state, event) -> state          # the fold: total, pure, never raises on stored events
    decide(state, command) -> [events]    # raises a DomainError subclass to refuse the command

``fold`` is the one definition of how a stream becomes a state: the command handler uses
it to rebuild an aggregate before deciding, and projections run the same function on
Spark. States, events and commands are frozen dataclasses (see :mod:`commands.codec`),
so a state can be stored as a snapshot and shipped to a Spark worker as JSON.

Cross-aggregate uniqueness (a username, a seat) is not a property of any one stream:
an event can *acquire* or *release* a claim ``(claim_type, value)``, and the handler
writes the claims in the same transaction as the events. ``claims(event)`` derives
them from the events, so ``decide`` stays the only place where rules live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from commands.events import Event, EventRegistry

S = TypeVar("S")
C = TypeVar("C")


@dataclass(frozen=True, slots=True, order=True)
class Claim:
    """A unique value held by one stream, e.g. ``Claim("username", "alice")``."""

    claim_type: str
    value: str


@dataclass(frozen=True, slots=True)
class ClaimChanges:
    """Claims an event takes and gives back."""

    acquire: tuple[Claim, ...] = ()
    release: tuple[Claim, ...] = ()


NO_CLAIMS = ClaimChanges()


def _no_claims(event: Event) -> ClaimChanges:
    return NO_CLAIMS


@dataclass(frozen=True)
class AggregateType(Generic[S, C]):
    """Everything the handler needs to know about one kind of aggregate.

    ``name`` is the ``stream_type`` of its rows (and, downstream, the topic
    ``events.<name>``); ``stream_id(command)`` names the stream a command targets.
    ``state_version`` is the schema version of the state as stored in a snapshot:
    raise it when the state's shape changes, and older snapshots are ignored (the
    stream is folded from its first event instead).
    """

    name: str
    state_type: type[S]
    initial: S
    apply: Callable[[S, Event], S]
    decide: Callable[[S, C], Sequence[Event]]
    stream_id: Callable[[C], str]
    events: EventRegistry
    claims: Callable[[Event], ClaimChanges] = _no_claims
    state_version: int = 1

    def fold(self, events: Iterable[Event], state: S | None = None) -> S:
        """The state after ``events``, starting from ``state`` (default: the initial state)."""
        current = self.initial if state is None else state
        for event in events:
            current = self.apply(current, event)
        return current


def claim_changes(aggregate: AggregateType[S, C], events: Sequence[Event]) -> ClaimChanges:
    """The net claims of ``events`` in order (a claim taken then given back is neither)."""
    acquire: dict[Claim, None] = {}
    release: dict[Claim, None] = {}
    for event in events:
        changes = aggregate.claims(event)
        for claim in changes.acquire:
            release.pop(claim, None)
            acquire[claim] = None
        for claim in changes.release:
            if acquire.pop(claim, "absent") == "absent":
                release[claim] = None
    return ClaimChanges(tuple(sorted(acquire)), tuple(sorted(release)))
