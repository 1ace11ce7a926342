"""The pgoutput decoder (logical replication protocol 1 to 3): see :mod:`capture.decoders.pgoutput.decoder`."""

from capture.decoders.pgoutput.decoder import DEFAULT_PUBLICATION, PgOutputDecoder, Relation, RelationColumn
from capture.decoders.pgoutput.types import CatalogTypeResolver, TypeResolver, builtin_type_name

__all__ = [
    "DEFAULT_PUBLICATION",
    "CatalogTypeResolver",
    "PgOutputDecoder",
    "Relation",
    "RelationColumn",
    "TypeResolver",
    "builtin_type_name",
]
