"""The plugin × server combinations the capture suites run on (the ``plugin`` fixture's parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from capture.messages import Plugin


@dataclass(frozen=True)
class Source:
    """A plugin on a server version."""

    plugin: Plugin
    server_version: int = 15

    def __str__(self) -> str:
        return self.plugin.value if self.server_version == 15 else f"{self.plugin.value}-pg{self.server_version}"


# wal2json (the default) and pgoutput on 15: every acceptance suite that asks for ``plugin`` runs once per plugin.
PLUGINS = [Source(Plugin.WAL2JSON), Source(Plugin.PGOUTPUT)]
# ... and pgoutput on 18 too, for the suites that run on both servers.
ON_BOTH_SERVERS = [*PLUGINS, Source(Plugin.PGOUTPUT, 18)]
