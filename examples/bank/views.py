"""The bank's projections (``VIEWS``), found by Tideline through ``--views examples.bank.views`` (or the project
file's ``views``).

============  ===========================  ==========================================================
projection    source                       view
============  ===========================  ==========================================================
``accounts``  ``events.account`` (fold)    ``accounts``: one row per open account, with its balance
``activity``  ``events.account`` (count)   ``account_activity``: deposits, withdrawals per account/day
``branches``  ``bank.public.branches``     ``cdc_mirror``: the latest row of each branch office (CDC
              (CDC mirror)                 of a plain table, ``capture run --topic-prefix bank``)
============  ===========================  ==========================================================

Every function a view calls is module-level: Spark's Python workers import this module (Tideline ships its
package to them).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from projections.views import CountView, FoldView, MirrorView, Row, StoredEvent, Stream, ViewCatalog

from . import models
from .domain import ACCOUNT, Account, Status

DEPOSITED, WITHDRAWN = "MoneyDeposited", "MoneyWithdrawn"


def account_rows(stream: Stream) -> Sequence[Row]:
    """The ``accounts`` row of an open account, in the table's column order; none once it is closed."""
    state: Account = stream.state
    if state.status is not Status.OPEN:
        return []
    return [(state.account_id, state.handle, state.owner, state.balance, stream.version, stream.commit_lsn)]


def activity_frame(events: DataFrame) -> DataFrame:
    """Deposits and withdrawals per account and UTC day of ``recorded_at`` (Spark)."""
    moves = events.where(F.col("event_type").isin(DEPOSITED, WITHDRAWN)).select(
        F.get_json_object("payload", "$.account_id").alias("account_id"),
        F.to_date("recorded_at").alias("day"),
        "event_type",
    )
    return moves.groupBy("account_id", "day").agg(
        F.sum(F.when(F.col("event_type") == DEPOSITED, 1).otherwise(0)).cast("int").alias("deposits"),
        F.sum(F.when(F.col("event_type") == WITHDRAWN, 1).otherwise(0)).cast("int").alias("withdrawals"),
    )


def activity_contributions(event: StoredEvent) -> Sequence[tuple[Row, Row]]:
    """What one event adds to ``account_activity`` (the same computation in plain Python)."""
    if event.event_type not in (DEPOSITED, WITHDRAWN):
        return []
    day = event.recorded_at.astimezone(UTC).date()
    return [((str(event.payload["account_id"]), day), (1, 0) if event.event_type == DEPOSITED else (0, 1))]


VIEWS = ViewCatalog(
    module=__name__,
    views={
        "accounts": FoldView("accounts", (ACCOUNT,), models.accounts, account_rows),
        "activity": CountView(
            "activity",
            ("events.account",),
            models.account_activity,
            key_columns=("account_id", "day"),
            count_columns=("deposits", "withdrawals"),
            frame=activity_frame,
            contributions=activity_contributions,
        ),
        "branches": MirrorView("branches", "bank.public.branches"),
    },
)
