"""Helpers for the write-side tests: per-test databases and raw SQL."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import psycopg
from psycopg import sql

from tideline.pgharness import LocalPostgres

_counter = itertools.count()


def clone_database(postgres: LocalPostgres, template: str) -> str:
    name = f"cmd_{next(_counter)}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    return postgres.dsn_for(name)


def rows(dsn: str, query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query.encode(), params).fetchall()
