"""Avro schemas, the schema registry, the wire format and Postgres → Avro mapping (see docs/schemas.md).

Front door: :func:`load` (Tideline's own ``.avsc`` schemas), :class:`SchemaRegistry`,
:class:`AvroWire`, :class:`TableSchemas`. This package imports nothing from the rest of
Tideline (the log-backed store is ``eventstore.schema_store``).
"""

from schemas.catalog import load
from schemas.compat import CompatibilityLevel
from schemas.registry import MemorySchemaStore, RegisteredSchema, SchemaRegistry, SchemaStore
from schemas.tables import TableSchemas
from schemas.wire import AvroWire

__all__ = [
    "AvroWire",
    "CompatibilityLevel",
    "MemorySchemaStore",
    "RegisteredSchema",
    "SchemaRegistry",
    "SchemaStore",
    "TableSchemas",
    "load",
]
