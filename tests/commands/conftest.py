"""Fixtures for the write side: a migrated template database, cloned per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from commands_util import clone_database

import migrations
from commands.handler import CommandHandler, HandlerConfig
from tideline.pgharness import LocalPostgres

TEMPLATE = "commands_template"


@pytest.fixture(scope="session")
def migrated_template(postgres: LocalPostgres) -> str:
    """A database migrated to head, used as the template of every test's database."""
    dsn = postgres.create_database(TEMPLATE)
    migrations.upgrade(dsn)
    return TEMPLATE


@pytest.fixture
def dsn(postgres: LocalPostgres, migrated_template: str) -> str:
    """A fresh database with the write model's tables (migrated to head)."""
    return clone_database(postgres, migrated_template)


@pytest.fixture
def handler(dsn: str) -> Iterator[CommandHandler]:
    with CommandHandler(dsn, HandlerConfig(snapshot_every=None)) as h:
        yield h
