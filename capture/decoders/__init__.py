"""One decoder per logical decoding plugin, behind :class:`capture.messages.Decoder`.

Each plugin has its subpackage (``wal2json/``, ``pgoutput/``), and the
:class:`capture.messages.Plugin` member names its decoder class in its capabilities
(:attr:`Capabilities.decoder`); :func:`decoder_for` builds it from the connector's
:class:`~capture.messages.DecoderSettings` (the class's ``configured`` constructor takes
what applies to its plugin). Here, not on ``Plugin``: the decoders import capture.messages,
which imports none of them. The capabilities drive the fallbacks elsewhere — nothing
outside this seam asks which plugin is in use.
"""

from __future__ import annotations

import importlib
from typing import cast

from capture.messages import Decoder, DecoderSettings, Plugin


def decoder_for(plugin: Plugin, settings: DecoderSettings | None = None) -> Decoder:
    """A fresh decoder for one replication stream of ``plugin``."""
    path = plugin.capabilities.decoder
    if path is None:
        raise NotImplementedError(f"no decoder for plugin {plugin.value} yet")
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cast(Decoder, cls.configured(settings or DecoderSettings()))
