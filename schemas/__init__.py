"""Avro schemas, the schema registry, the wire format and Postgres → Avro mapping (see docs/schemas.md).

Front door: :func:`load` (Tideline's own ``.avsc`` schemas), :class:`SchemaRegistry`,
:class:`AvroWire`, :class:`TableSchemas`. This package imports nothing from the rest of
Tideline (the log-backed store is ``eventstore.schema_store``).

The names above are imported on first use (PEP 562): importing one light module of the package
(``schemas.jsontext``, which capture's snapshot reader processes need) does not load fastavro and
numpy behind the others (80 ms of a reader's start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.catalog import load
    from schemas.compat import CompatibilityLevel
    from schemas.registry import MemorySchemaStore, RegisteredSchema, SchemaRegistry, SchemaStore
    from schemas.tables import TableSchemas
    from schemas.wire import AvroWire

_HOMES = {
    "AvroWire": "schemas.wire",
    "CompatibilityLevel": "schemas.compat",
    "MemorySchemaStore": "schemas.registry",
    "RegisteredSchema": "schemas.registry",
    "SchemaRegistry": "schemas.registry",
    "SchemaStore": "schemas.registry",
    "TableSchemas": "schemas.tables",
    "load": "schemas.catalog",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
