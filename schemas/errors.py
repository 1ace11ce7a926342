"""The error hierarchy of the schemas package: every error raised here is a :class:`SchemaError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.compat import Incompatibility


class SchemaError(Exception):
    """Root of every error of the schemas package."""


class SchemaParseError(SchemaError):
    """A schema text is not valid JSON or not a valid Avro schema."""


class UnknownSchemaError(SchemaError, LookupError):
    """No schema with that id, subject or version is registered."""


class IncompatibleSchemaError(SchemaError):
    """A registration was refused by the subject's compatibility level.

    ``incompatibilities`` lists every broken rule; ``str()`` names each field path and rule.
    """

    def __init__(self, subject: str, level: str, incompatibilities: Sequence[Incompatibility]) -> None:
        self.subject = subject
        self.level = level
        self.incompatibilities = list(incompatibilities)
        lines = "; ".join(str(i) for i in self.incompatibilities)
        super().__init__(f"schema is not {level} compatible with subject {subject!r}: {lines}")


class SchemaStoreConflictError(SchemaError):
    """Another registry writer took the store over during a write: nothing was written, redo the write.

    Raised by a :class:`~schemas.registry.SchemaStore` whose exclusion is optimistic (the
    Kafka store: a newer writer fences the older); :class:`~schemas.registry.SchemaRegistry`
    retries the whole refresh → check → append a few times before letting it through.
    """


class WireFormatError(SchemaError, ValueError):
    """A framed value is malformed: wrong magic byte, truncated, or undecodable by its schema."""


class ValueConversionError(SchemaError, ValueError):
    """A Python value cannot be represented in a column's Avro type (named in the message)."""
