"""One decoder per logical decoding plugin, behind :class:`capture.messages.Decoder`.

Each plugin has its subpackage (``wal2json/`` today; ``pgoutput/`` is the next), and the
:class:`capture.messages.Plugin` member names its decoder class in its capabilities
(:attr:`Capabilities.decoder`) and builds it (:meth:`Plugin.decoder`); the capabilities
drive the fallbacks elsewhere — nothing outside this seam asks which plugin is in use.
"""

from __future__ import annotations

import importlib
from typing import cast

from capture.messages import Decoder, Plugin


def decoder_for(plugin: Plugin) -> Decoder:
    """A fresh decoder for one replication stream of ``plugin``."""
    path = plugin.capabilities.decoder
    if path is None:
        raise NotImplementedError(f"no decoder for plugin {plugin.value} yet")
    module, _, name = path.partition(":")
    return cast(Decoder, getattr(importlib.import_module(module), name)())
