"""The reservations example's read views, declared for :mod:`projections` (``VIEWS``).

==================  ==============================  =============================================
projection          source                          view
==================  ==============================  =============================================
``users``           ``events.user`` (fold)          ``users``: one row per registered user
``seats``           ``events.reservation`` (fold)   ``seats``: the active reservation per seat
``show_occupancy``  ``events.reservation`` (frame)  ``show_occupancy``: per show and hour of
                                                    ``recorded_at``: seats reserved, cancelled
``snapshots``       both (fold)                     the commands' ``snapshots``: latest state
                                                    of every stream
``orders``          ``demo.shop.orders`` (CDC)      ``cdc_mirror``: the demo's plain table
==================  ==============================  =============================================

Any other CDC topic can be mirrored as ``mirror:<topic>`` (``tideline project rebuild
mirror:cdc.public.accounts``).

The folds are the domain's own ``apply`` (``USER``, ``RESERVATION``); the functions below
only say which rows a state stands for. They are module-level: Spark workers import them.

Run them::

    tideline project rebuild users --dsn "$DSN"
    tideline project follow seats --dsn "$DSN"
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, timedelta

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from commands.schema import snapshots
from examples.reservations import models
from examples.reservations.domain import RESERVATION, USER, Reservation, Status, User
from projections.views import (
    CountView,
    FoldView,
    MirrorView,
    Row,
    StoredEvent,
    Stream,
    ViewCatalog,
    snapshot_rows,
)

HOUR = timedelta(hours=1)


def user_rows(stream: Stream) -> Sequence[Row]:
    state: User = stream.state
    if not state.registered:
        return []
    return [(state.user_id, state.username, state.display_name, stream.version, stream.commit_lsn)]


def seat_rows(stream: Stream) -> Sequence[Row]:
    state: Reservation = stream.state
    if state.status is not Status.ACTIVE:
        return []
    return [(state.show_id, state.seat, state.reservation_id, state.customer_id, stream.version, stream.commit_lsn)]


RESERVED, CANCELLED = "SeatReserved", "ReservationCancelled"


def occupancy_frame(events: DataFrame) -> DataFrame:
    """Hourly tumbling windows of ``recorded_at`` per show: SeatReserved and ReservationCancelled counts."""
    counted = events.where(F.col("event_type").isin(RESERVED, CANCELLED)).select(
        F.get_json_object("payload", "$.show_id").alias("show_id"),
        F.window("recorded_at", "1 hour").alias("w"),
        "event_type",
    )
    return counted.groupBy("show_id", F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end")).agg(
        F.sum(F.when(F.col("event_type") == RESERVED, 1).otherwise(0)).cast("int").alias("reserved"),
        F.sum(F.when(F.col("event_type") == CANCELLED, 1).otherwise(0)).cast("int").alias("cancelled"),
    )


def occupancy_contributions(event: StoredEvent) -> Sequence[tuple[Row, Row]]:
    """What one event adds to ``show_occupancy``: ``[((show_id, window_start), (reserved, cancelled))]``."""
    if event.event_type not in (RESERVED, CANCELLED):
        return []
    when = event.recorded_at.astimezone(UTC)
    start = when.replace(minute=0, second=0, microsecond=0)
    counts = (1, 0) if event.event_type == RESERVED else (0, 1)
    return [((str(event.payload["show_id"]), start), counts)]


def occupancy_window_end(key: Row) -> Row:
    return (key[1] + HOUR,)


VIEWS = ViewCatalog(
    module=__name__,
    views={
        "users": FoldView("users", (USER,), models.users, user_rows),
        "seats": FoldView("seats", (RESERVATION,), models.seats, seat_rows),
        "show_occupancy": CountView(
            "show_occupancy",
            ("events.reservation",),
            models.show_occupancy,
            key_columns=("show_id", "window_start"),
            count_columns=("reserved", "cancelled"),
            frame=occupancy_frame,
            contributions=occupancy_contributions,
            extra_columns=("window_end",),
            extra=occupancy_window_end,
        ),
        "snapshots": FoldView("snapshots", (USER, RESERVATION), snapshots, snapshot_rows, snapshots=True),
        "orders": MirrorView("orders", "demo.shop.orders"),
    },
)
