"""Fixtures of the capture tests: the decoding plugin the acceptance suites run with."""

from __future__ import annotations

import pytest

from capture.messages import Plugin

# wal2json (the default) and pgoutput: every acceptance suite that asks for ``plugin`` runs once per plugin.
PLUGINS = [Plugin.WAL2JSON, Plugin.PGOUTPUT]


@pytest.fixture(params=PLUGINS, ids=[p.value for p in PLUGINS])
def plugin(request: pytest.FixtureRequest) -> Plugin:
    """The logical decoding plugin the connector streams with (pgoutput: publications managed, ``filtered``)."""
    assert isinstance(request.param, Plugin)
    return request.param
