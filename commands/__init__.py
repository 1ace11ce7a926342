"""The write side of event-sourced apps: validate commands, append events to Postgres.

An aggregate type (:class:`AggregateType`) is plain typed Python: a frozen-dataclass
state, a pure ``apply(state, event) -> state`` fold and ``decide(state, command) ->
[events]``, which raises a :class:`DomainError` to refuse a command. A
:class:`CommandHandler` loads the stream (latest snapshot + later events), decides, and
appends with optimistic concurrency, command-id idempotency and uniqueness claims in one
Postgres transaction (tables: :mod:`commands.schema`, created by ``tideline db upgrade``).

See docs/commands.md; examples/reservations is a complete domain.

Inside Tideline (and in its tests) import from the submodules (``commands.handler`` …):
the test tree has a ``tests/commands`` directory, which pytest can make shadow this
``__init__`` as a namespace package.
"""

from commands.aggregate import AggregateType, Claim, ClaimChanges
from commands.errors import (
    CommandIdReusedError,
    CommandsError,
    ConcurrencyError,
    DomainError,
    DuplicateClaimError,
    UnknownEventError,
    ValidationError,
)
from commands.events import EncodedEvent, Event, EventRegistry
from commands.handler import CommandHandler, CommandResult, HandlerConfig, Loaded

__all__ = [
    "AggregateType",
    "Claim",
    "ClaimChanges",
    "CommandHandler",
    "CommandIdReusedError",
    "CommandResult",
    "CommandsError",
    "ConcurrencyError",
    "DomainError",
    "DuplicateClaimError",
    "EncodedEvent",
    "Event",
    "EventRegistry",
    "HandlerConfig",
    "Loaded",
    "UnknownEventError",
    "ValidationError",
]
