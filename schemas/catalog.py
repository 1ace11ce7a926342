"""Tideline's own Avro schemas: the ``.avsc`` files in ``schemas/avsc/``, loaded by file name.

========================  ====================================================================
file (``load(name)``)     what it types
========================  ====================================================================
consumer_offset_key       key of a committed group offset (``__consumer_offsets``)
consumer_offset_value     value of a committed group offset
connector_position        the connector's position (capture.connector.Position)
transaction_key           key of a BEGIN/END record on ``<prefix>.transaction``
transaction_value         BEGIN/END record, END with per-table event counts
snapshot                  an aggregate snapshot (stream_id, version, state JSON, schema_version)
source                    the change-event envelope's ``source`` block
transaction_block         the change-event envelope's ``transaction`` block
envelope                  the change-event envelope, rows as JSON text (the generic form)
========================  ====================================================================

A file may name a type defined in another file (``envelope`` names ``Source``): the
loader inlines the definition at its first use, so every loaded schema is standalone.

>>> load("connector_position")["name"]
'io.tideline.capture.ConnectorPosition'

Thread-safety: the caches are ``functools.lru_cache`` (thread-safe); returned JSON is a
fresh copy per call of :func:`load_json`.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from schemas.canonical import PRIMITIVES, parse
from schemas.errors import SchemaParseError, UnknownSchemaError

AVSC_DIR = Path(__file__).resolve().parent / "avsc"


def names() -> list[str]:
    """Every schema name :func:`load` accepts, sorted."""
    return sorted(p.stem for p in AVSC_DIR.glob("*.avsc"))


def load(name: str) -> Any:
    """The parsed (fastavro) schema of ``schemas/avsc/<name>.avsc``; cached."""
    return _parsed(name)


def load_json(name: str) -> dict[str, Any]:
    """The JSON of ``<name>.avsc`` with referenced types inlined (a fresh copy, safe to edit)."""
    return copy.deepcopy(_standalone(name))


@cache
def _parsed(name: str) -> Any:
    return parse(_standalone(name))


@cache
def _raw(name: str) -> dict[str, Any]:
    path = AVSC_DIR / f"{name}.avsc"
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnknownSchemaError(f"no schema {name!r} in {AVSC_DIR} (known: {', '.join(names())})") from None
    except ValueError as e:
        raise SchemaParseError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SchemaParseError(f"{path}: a catalog schema must be a named type (a JSON object)")
    return value


def _full_name(node: dict[str, Any], namespace: str) -> tuple[str, str]:
    name = str(node["name"])
    ns = str(node.get("namespace", namespace))
    return (name, name.rpartition(".")[0]) if "." in name else (f"{ns}.{name}" if ns else name, ns)


@cache
def _named_types() -> dict[str, str]:
    """Full name of every named type defined at the top of a file → that file's name."""
    out: dict[str, str] = {}
    for file in names():
        out[_full_name(_raw(file), "")[0]] = file
    return out


@cache
def _standalone(name: str) -> dict[str, Any]:
    root = copy.deepcopy(_raw(name))
    defined: set[str] = set()
    result = _inline(root, "", defined)
    assert isinstance(result, dict)
    return result


def _inline(node: Any, namespace: str, defined: set[str]) -> Any:
    """Replace the first reference to a type of another file by its definition."""
    if isinstance(node, list):
        return [_inline(n, namespace, defined) for n in node]
    if isinstance(node, str):
        if node in PRIMITIVES:
            return node
        full = node if "." in node else f"{namespace}.{node}" if namespace else node
        if full in defined or full not in _named_types():
            return node
        return _inline(copy.deepcopy(_raw(_named_types()[full])), namespace, defined)
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind in ("record", "error", "enum", "fixed"):
        full, namespace = _full_name(node, namespace)
        defined.add(full)
    if kind in ("record", "error"):
        for f in node.get("fields", []):
            f["type"] = _inline(f["type"], namespace, defined)
    elif kind == "array":
        node["items"] = _inline(node["items"], namespace, defined)
    elif kind == "map":
        node["values"] = _inline(node["values"], namespace, defined)
    elif isinstance(kind, (dict, list)):
        node["type"] = _inline(kind, namespace, defined)
    return node
