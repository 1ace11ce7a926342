"""The wal2json (format-version 2) decoder: see :mod:`capture.decoders.wal2json.decoder`."""

from capture.decoders.wal2json.decoder import SLOT_OPTIONS, Wal2JsonDecoder

__all__ = ["SLOT_OPTIONS", "Wal2JsonDecoder"]
