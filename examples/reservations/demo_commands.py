"""The commands part of the reservations demo (``make demo``): the reservations app's commands, some refused on purpose.

Users register (a few with usernames already taken), customers reserve seats of a few
shows (a few seats already held), change seats and cancel; a few commands are sent with
the stream version the client saw earlier, after someone else changed it (stale:
:class:`~commands.errors.WrongExpectedVersionError`). Every refusal writes nothing; the
tally says how many of each kind there were, and the demo later checks that the log's
``events.*`` topics hold exactly the accepted events (capture's outbox routing).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commands.errors import DomainError, DuplicateClaimError, WrongExpectedVersionError
from commands.handler import CommandHandler
from examples.reservations.domain import RESERVATION, USER, CancelReservation, ChangeSeat, RegisterUser, ReserveSeat

SHOWS = ("hamlet", "macbeth", "tempest", "lear")
SEATS = tuple(f"{row}{n}" for row in "ABCDEFGHJK" for n in range(1, 21))  # 200 seats per show


@dataclass(slots=True)
class CommandsResult:
    accepted: Counter[str] = field(default_factory=Counter)  # by command type
    refused: Counter[str] = field(default_factory=Counter)  # by reason
    last_commit_lsn: str = "0/0"

    @property
    def total(self) -> int:
        return sum(self.accepted.values()) + sum(self.refused.values())


def run_commands(
    dsn: str,
    *,
    users: int,
    reservations: int,
    seed: int,
    on_command: Callable[[], None] = lambda: None,
    stop: threading.Event | None = None,
) -> CommandsResult:
    """Issue the workload through the command handler; ``on_command`` after each command;
    ``stop`` ends it early (between commands)."""
    rng = random.Random(seed)
    result = CommandsResult()
    with CommandHandler(dsn) as handler:

        def send(aggregate: Any, command: Any, **kw: Any) -> bool:
            try:
                r = handler.handle(aggregate, command, **kw)
            except DuplicateClaimError as e:
                result.refused[f"{e.claim_type} taken"] += 1
                return False
            except WrongExpectedVersionError:
                result.refused["stale version"] += 1
                return False
            except DomainError as e:
                result.refused[type(e).__name__] += 1
                return False
            finally:
                on_command()
            result.accepted[type(command).__name__] += 1
            result.last_commit_lsn = r.commit_lsn
            return True

        for i in range(users):
            if stop is not None and stop.is_set():
                return result
            taken = i > 10 and rng.random() < 0.1  # a username someone already has
            name = f"user_{rng.randrange(i)}" if taken else f"user_{i}"
            send(USER, RegisterUser(f"u{i}", name, f"User {i}"))
        active: list[str] = []
        for i in range(reservations):
            if stop is not None and stop.is_set():
                return result
            roll = rng.random()
            if roll < 0.55 or not active:
                rid, customer = f"r{i}", f"u{rng.randrange(users)}"
                if send(RESERVATION, ReserveSeat(rid, rng.choice(SHOWS), rng.choice(SEATS), customer)):
                    active.append(rid)
            elif roll < 0.75:
                send(RESERVATION, ChangeSeat(rng.choice(active), rng.choice(SEATS)))
            elif roll < 0.9:
                rid = active.pop(rng.randrange(len(active)))
                send(RESERVATION, CancelReservation(rid))
            else:  # a client acting on the version it read before someone else changed the stream
                rid = rng.choice(active)
                seen = handler.load(RESERVATION, f"reservation-{rid}").version
                if send(RESERVATION, ChangeSeat(rid, rng.choice(SEATS)), expected_version=seen):
                    send(RESERVATION, ChangeSeat(rid, rng.choice(SEATS)), expected_version=seen)  # now stale
    return result
