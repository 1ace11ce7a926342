"""One decoder per logical decoding plugin, behind :class:`capture.messages.Decoder`.

Each plugin has its subpackage (``wal2json/`` today; ``pgoutput/`` is the next), and the
:class:`capture.messages.Plugin` member builds its decoder (:meth:`Plugin.decoder`) and
carries its capabilities, which drive the fallbacks elsewhere — nothing outside this
package asks which plugin is in use.
"""

from __future__ import annotations

from capture.messages import Decoder, Plugin


def decoder_for(plugin: Plugin) -> Decoder:
    """A fresh decoder for one replication stream of ``plugin``."""
    if not plugin.capabilities.implemented:
        raise NotImplementedError(f"no decoder for plugin {plugin.value} yet")
    if plugin is Plugin.WAL2JSON:
        from capture.decoders.wal2json import Wal2JsonDecoder

        return Wal2JsonDecoder()
    raise NotImplementedError(f"no decoder for plugin {plugin.value} yet")
