"""Fixtures of the capture tests: the decoding plugin the acceptance suites run with, and on which server.

``plugin`` runs a test once per plugin on PostgreSQL 15 (Debian's, the one with wal2json). A suite that must also
run on PostgreSQL 18 asks for it with ``@pytest.mark.parametrize("plugin", ON_BOTH_SERVERS, indirect=True)``: then
its ``server`` fixture (tests/conftest.py) is the version of the plugin's :class:`Source` (18 has pgoutput only).
A source on 18 refuses to run a test that does not take its database from ``server``, so no test claims 18 while
running on 15.
"""

from __future__ import annotations

import pytest
from sources import PLUGINS, Source

from capture.messages import Plugin


@pytest.fixture(params=PLUGINS, ids=str)
def plugin(request: pytest.FixtureRequest) -> Plugin:
    """The logical decoding plugin the connector streams with (pgoutput: publications managed, ``filtered``)."""
    source = request.param
    assert isinstance(source, Source)
    if source.server_version != 15 and "server" not in request.fixturenames:
        raise pytest.UsageError(f"{request.node.nodeid}: runs on PostgreSQL {source.server_version} but takes no "
                                "'server' fixture: its database would be on 15")  # fmt: skip
    return source.plugin
