"""Parsing and identity of Avro schemas: one parse per distinct text, one identity form per schema.

Identity: two schema texts are "the same schema" iff their **identity forms** are equal.
The identity form starts from the Avro *Parsing Canonical Form* (PCF: full names, no
``namespace``, no ``doc``, primitives written as bare names, no whitespace) but keeps
what PCF strips and what changes meaning for a registry: ``logicalType``, ``precision``,
``scale``, field ``default`` values, ``aliases``, enum ``default`` and custom properties
such as ``connect.name``. Plain PCF would make ``decimal(12,2)`` and ``decimal(10,4)``
one schema (both PCF ``"bytes"``), and a new field default invisible — Confluent's
registry compares schema text for the same reason. Keys are sorted, so attribute order
does not matter. :func:`fingerprint` is the PCF's SHA-256, for readers that want the
spec's fingerprint.

Thread-safety: the parse cache is a bounded ``functools.lru_cache`` (thread-safe).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any

from schemas.errors import SchemaParseError

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_DROPPED = frozenset({"doc", "namespace"})  # namespace is folded into the full name


def schema_json(schema: str | dict[str, Any] | list[Any]) -> Any:
    """The JSON value of a schema given as text or as JSON; SchemaParseError on bad JSON."""
    if isinstance(schema, str):
        if schema.strip() in PRIMITIVES:
            return schema.strip()  # a bare primitive name, as in a field's "type"
        try:
            return json.loads(schema)
        except ValueError as e:
            raise SchemaParseError(f"schema is not valid JSON: {e}") from None
    return schema


def parse(schema: str | dict[str, Any] | list[Any]) -> Any:
    """A fastavro parsed schema (validated: names, defaults, logical types); SchemaParseError if invalid."""
    if isinstance(schema, dict) and "__fastavro_parsed" in schema:
        return schema
    text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    return _parse_text(text)


@lru_cache(maxsize=4096)
def _parse_text(text: str) -> Any:
    from fastavro.schema import SchemaParseException, UnknownType, parse_schema  # not at import: `tideline --help`

    value = schema_json(text)
    try:
        return parse_schema(value)
    except (SchemaParseException, UnknownType, ValueError, TypeError, KeyError, AttributeError) as e:
        raise SchemaParseError(f"invalid Avro schema: {e}") from None


def identity_form(schema: str | dict[str, Any] | list[Any]) -> str:
    """The canonical text that decides schema identity (see the module docstring)."""
    return json.dumps(_strip(parse(schema)), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _strip(node: Any) -> Any:
    if isinstance(node, list):
        return [_strip(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_strip(v) if k in ("type", "fields", "items", "values") else v)
           for k, v in node.items() if not k.startswith("__") and k not in _DROPPED}  # fmt: skip
    if "fields" in out:
        out["fields"] = [
            {k: (_strip(v) if k == "type" else v) for k, v in f.items() if k != "doc"} for f in node["fields"]
        ]
    if set(out) == {"type"} and isinstance(out["type"], str) and out["type"] in PRIMITIVES:
        return out["type"]
    return out


def fingerprint(schema: str | dict[str, Any] | list[Any]) -> str:
    """SHA-256 (hex) of the schema's Parsing Canonical Form, as the Avro specification defines it."""
    from fastavro.schema import to_parsing_canonical_form

    return hashlib.sha256(to_parsing_canonical_form(parse(schema)).encode()).hexdigest()


def strip_logical_types(node: Any) -> Any:
    """A copy of a schema JSON without ``logicalType``: decoding it yields the underlying values
    (days, microseconds, unscaled decimal bytes) with no conversion to Python objects."""
    if isinstance(node, list):
        return [strip_logical_types(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (strip_logical_types(v) if k in ("type", "items", "values") else v)
           for k, v in node.items() if k != "logicalType" and not k.startswith("__")}  # fmt: skip
    if "fields" in node:
        out["fields"] = [{**f, "type": strip_logical_types(f["type"])} for f in node["fields"]]
    return out
