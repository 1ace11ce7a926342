"""The application's views (``VIEWS``) and the DDL of their tables (:data:`DDL`, run by the tests).

The tables follow an alembic naming convention (``pk_<table>``, ``uq_<table>_<column>``,
``ix_<table>_<column>``, ``ck_<table>_<name>``): a rebuild must keep those names."""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from sqlalchemy import BigInteger, CheckConstraint, Column, Index, Integer, MetaData, Table, Text

from commands.schema import snapshots
from projections.views import CountView, FoldView, Row, StoredEvent, Stream, ViewCatalog, snapshot_rows

from .domain import ACCOUNT, Account

NAMING = {
    "pk": "pk_%(table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}
metadata = MetaData(naming_convention=NAMING)

accounts = Table(
    "ua_accounts",
    metadata,
    Column("account_id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("handle", Text, nullable=False, unique=True),
    Column("balance", BigInteger, nullable=False),
    Column("version", Integer, nullable=False),
    Column("commit_lsn", BigInteger, nullable=False),
    CheckConstraint("balance >= 0", name="balance_nonnegative"),
    Index(None, "owner"),
)

deposits = Table(
    "ua_deposits",
    metadata,
    Column("account_id", Text, primary_key=True),
    Column("deposits", Integer, nullable=False),
    Column("amount", BigInteger, nullable=False),
)

# What the application's migration would create (the names alembic gives under NAMING).
DDL = """
CREATE TABLE ua_accounts (
    account_id text NOT NULL,
    owner text NOT NULL,
    handle text NOT NULL,
    balance bigint NOT NULL,
    version integer NOT NULL,
    commit_lsn bigint NOT NULL,
    CONSTRAINT pk_ua_accounts PRIMARY KEY (account_id),
    CONSTRAINT uq_ua_accounts_handle UNIQUE (handle),
    CONSTRAINT ck_ua_accounts_balance_nonnegative CHECK (balance >= 0)
);
CREATE INDEX ix_ua_accounts_owner ON ua_accounts (owner);
CREATE TABLE ua_deposits (
    account_id text NOT NULL,
    deposits integer NOT NULL,
    amount bigint NOT NULL,
    CONSTRAINT pk_ua_deposits PRIMARY KEY (account_id)
);
"""


def account_rows(stream: Stream) -> Sequence[Row]:
    state: Account = stream.state
    if not state.opened:
        return []
    return [(state.account_id, state.owner, state.handle, state.balance, stream.version, stream.commit_lsn)]


def deposits_frame(events: DataFrame) -> DataFrame:
    deposited = events.where(F.col("event_type") == "Deposited").select(
        F.get_json_object("payload", "$.account_id").alias("account_id"),
        F.get_json_object("payload", "$.amount").cast("long").alias("amount"),
    )
    return deposited.groupBy("account_id").agg(
        F.count(F.lit(1)).cast("int").alias("deposits"), F.sum("amount").cast("long").alias("amount")
    )


def deposit_contributions(event: StoredEvent) -> Sequence[tuple[Row, Row]]:
    if event.event_type != "Deposited":
        return []
    return [((str(event.payload["account_id"]),), (1, int(event.payload["amount"])))]


VIEWS = ViewCatalog(
    module=__name__,
    views={
        "ua_accounts": FoldView("ua_accounts", (ACCOUNT,), accounts, account_rows),
        "ua_deposits": CountView(
            "ua_deposits",
            ("events.ua_account",),
            deposits,
            key_columns=("account_id",),
            count_columns=("deposits", "amount"),
            frame=deposits_frame,
            contributions=deposit_contributions,
        ),
        "ua_snapshots": FoldView("ua_snapshots", (ACCOUNT,), snapshots, snapshot_rows, snapshots=True),
    },
)
