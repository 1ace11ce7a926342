"""A cursor over one pgoutput payload whose errors say where: message, byte offset, LSN, excerpt.

Thread safety: one reader per payload, used by one thread.
"""

from __future__ import annotations

import struct
from typing import Any

from capture.messages import DecodeError

_UINT32 = struct.Struct("!I")
_EXCERPT_BYTES = 48  # of the payload, in hex, in an error


class PayloadReader:
    """Reads one payload in order; every error names the field, the byte offset and the payload."""

    __slots__ = ("data", "lsn", "pos", "what")

    def __init__(self, data: bytes, lsn: int) -> None:
        self.data, self.pos, self.what, self.lsn = data, 0, "message", lsn

    def unpack(self, layout: struct.Struct, field_name: str) -> tuple[Any, ...]:
        if self.pos + layout.size > len(self.data):
            raise self.error(f"truncated: {field_name} needs {layout.size} bytes")
        values = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return values

    def uint32(self, field_name: str) -> int:
        return int(self.unpack(_UINT32, field_name)[0])

    def byte(self, field_name: str) -> str:
        if self.pos >= len(self.data):
            raise self.error(f"truncated: {field_name} missing")
        self.pos += 1
        return chr(self.data[self.pos - 1])

    def string(self, field_name: str) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise self.error(f"truncated: {field_name} has no terminating NUL")
        raw, self.pos = self.data[self.pos : end], end + 1
        return self.text(raw, field_name)

    def take(self, length: int, field_name: str) -> bytes:
        if self.pos + length > len(self.data):
            raise self.error(f"truncated: {field_name} of {length} bytes")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw

    def text(self, raw: bytes, field_name: str) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise self.error(f"{field_name} is not UTF-8 (the database encoding must be UTF8)") from None

    def end(self) -> None:
        if self.pos != len(self.data):
            raise self.error(f"{len(self.data) - self.pos} bytes left over after the message")

    def error(self, problem: str) -> DecodeError:
        head = self.data[:_EXCERPT_BYTES].hex()
        more = "…" if len(self.data) > _EXCERPT_BYTES else ""
        return DecodeError(
            f"pgoutput {self.what} at byte {self.pos} of {len(self.data)} (payload at LSN {format_lsn(self.lsn)}): "
            f"{problem}; payload {head}{more}"
        )


def format_lsn(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
