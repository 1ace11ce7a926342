"""Avro schema compatibility: can a reader schema read data written with a writer schema?

The rules are the Avro specification's *schema resolution* (reader vs writer), checked
structurally so a rejection can say which field breaks which rule:

* **primitives** match themselves; **promotions** int → long, float, double; long →
  float, double; float → double; string ↔ bytes.
* **records** match by unqualified name (or a reader alias equal to the writer's full
  name, as Java's checker does); fields match by name (or reader field alias). A reader
  field the writer lacks needs a ``default``; a writer field the reader lacks is skipped.
* **enums** match by name; a writer symbol the reader lacks needs the reader's enum
  ``default``.
* **fixed** match by name and ``size``.
* **arrays** and **maps** match when their items / values do.
* **unions**: a writer union matches when *every* branch matches the reader; a
  non-union writer matches a reader union when *some* branch matches.
* **logical types** resolve by their underlying type, with one Tideline rule on top: two
  ``decimal`` types must have the same ``scale`` and the reader's ``precision`` must be
  at least the writer's (otherwise the reader would mis-scale or overflow the value).

Compatibility levels (Confluent's): ``BACKWARD`` — the new schema reads data written
with the previous version; ``FORWARD`` — the previous version reads data written with the
new one; ``FULL`` — both; ``*_TRANSITIVE`` — against every earlier version, not just the
latest; ``NONE`` — no check.

>>> check_resolution({"type": "record", "name": "R", "fields": [{"name": "x", "type": "int"}]},
...                  {"type": "record", "name": "R", "fields": []})[0].message
"field 'x' added without a default"
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.canonical import PRIMITIVES, parse

PROMOTIONS: dict[str, frozenset[str]] = {  # writer type → reader types that can read it
    "int": frozenset({"long", "float", "double"}),
    "long": frozenset({"float", "double"}),
    "float": frozenset({"double"}),
    "string": frozenset({"bytes"}),
    "bytes": frozenset({"string"}),
}
NAMED_KINDS = frozenset({"record", "error", "enum", "fixed"})


class Rule(enum.Enum):
    """Which resolution rule a pair of schemas breaks."""

    TYPE_MISMATCH = "type mismatch"
    MISSING_DEFAULT = "reader field without default"
    NAME_MISMATCH = "name mismatch"
    MISSING_ENUM_SYMBOL = "enum symbol missing"
    FIXED_SIZE_MISMATCH = "fixed size mismatch"
    MISSING_UNION_BRANCH = "union branch missing"
    DECIMAL_MISMATCH = "decimal precision/scale mismatch"


@dataclass(frozen=True, slots=True)
class Incompatibility:
    """One broken rule: ``path`` is the dotted field path from the top record ('' at the top)."""

    path: str
    rule: Rule
    message: str

    def __str__(self) -> str:
        return self.message


class CompatibilityLevel(enum.Enum):
    """A subject's compatibility level (Confluent's names)."""

    BACKWARD = "BACKWARD"
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"
    FORWARD = "FORWARD"
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL = "FULL"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"
    NONE = "NONE"

    @classmethod
    def parse(cls, text: str) -> CompatibilityLevel:
        try:
            return cls(text.strip().upper())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown compatibility level {text!r} (choose {known})") from None

    @property
    def transitive(self) -> bool:
        return self.value.endswith("_TRANSITIVE")

    @property
    def backward(self) -> bool:
        return self.value.startswith(("BACKWARD", "FULL"))

    @property
    def forward(self) -> bool:
        return self.value.startswith(("FORWARD", "FULL"))


def check_resolution(reader: Any, writer: Any) -> list[Incompatibility]:
    """Every reason ``reader`` cannot read data written with ``writer`` (empty: it can).

    Both are schema texts, JSON values or fastavro parsed schemas.
    """
    r, w = parse(reader), parse(writer)
    checker = _Checker(_named(r), _named(w))
    return checker.check(r, w, "")


def check_compatibility(
    level: CompatibilityLevel, new: Any, previous: Sequence[Any], *, first_version: int = 1
) -> list[Incompatibility]:
    """Why ``new`` may not follow ``previous`` (oldest first) under ``level``; empty: it may.

    Messages are prefixed with the direction and the version they fail against, e.g.
    ``"BACKWARD (new reads version 2): field 'x' added without a default"``; ``previous[0]``
    is version ``first_version``.
    """
    if level is CompatibilityLevel.NONE or not previous:
        return []
    first = 0 if level.transitive else len(previous) - 1
    out: list[Incompatibility] = []
    for index in range(len(previous) - 1, first - 1, -1):
        old, version = previous[index], index + first_version
        if level.backward:
            out += _prefixed(check_resolution(new, old), f"BACKWARD (new schema reads data of version {version})")
        if level.forward:
            out += _prefixed(check_resolution(old, new), f"FORWARD (version {version} reads data of the new schema)")
    return out


def _prefixed(found: list[Incompatibility], prefix: str) -> list[Incompatibility]:
    return [Incompatibility(i.path, i.rule, f"{prefix}: {i.message}") for i in found]


def _named(schema: Any) -> dict[str, dict[str, Any]]:
    """Every named type of a parsed schema by full name (fastavro keeps them in ``__named_schemas``)."""
    named: dict[str, dict[str, Any]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for n in node:
                walk(n)
        elif isinstance(node, dict):
            if node.get("type") in NAMED_KINDS:
                named[str(node["name"])] = node
            for f in node.get("fields", []):
                walk(f["type"])
            for key in ("items", "values"):
                if key in node:
                    walk(node[key])
            if isinstance(node.get("type"), (dict, list)):
                walk(node["type"])

    walk(schema)
    return named


def _short(full_name: str) -> str:
    return full_name.rpartition(".")[2]


class _Checker:
    """One reader/writer pair; ``seen`` breaks recursion through named types (assumed compatible on revisit)."""

    def __init__(self, reader_names: dict[str, dict[str, Any]], writer_names: dict[str, dict[str, Any]]) -> None:
        self.reader_names = reader_names
        self.writer_names = writer_names
        self.seen: set[tuple[str, str]] = set()

    def _resolve(self, node: Any, names: dict[str, dict[str, Any]]) -> Any:
        if isinstance(node, str) and node not in PRIMITIVES:
            return names.get(node, node)
        if isinstance(node, dict) and node.get("type") in PRIMITIVES and "logicalType" not in node:
            return node["type"]
        return node

    def check(self, reader: Any, writer: Any, path: str) -> list[Incompatibility]:
        r = self._resolve(reader, self.reader_names)
        w = self._resolve(writer, self.writer_names)
        if isinstance(w, list):
            out: list[Incompatibility] = []
            for branch in w:
                out += self.check(r, branch, path)  # every writer branch must resolve
            return out
        if isinstance(r, list):
            return self._check_reader_union(r, w, path)
        return self._check_single(r, w, path)

    def _check_reader_union(self, r: list[Any], w: Any, path: str) -> list[Incompatibility]:
        """Some branch of the reader union must read ``w``; else the closest branch's reasons."""
        w_kind, w_name = _kind(w), _short(str(w["name"])) if isinstance(w, dict) and "name" in w else None
        closest: list[Incompatibility] | None = None
        for branch in r:
            found = self.check(branch, w, path)
            if not found:
                return []
            rb = self._resolve(branch, self.reader_names)
            rb_name = _short(str(rb["name"])) if isinstance(rb, dict) and "name" in rb else None
            if closest is None and _kind(rb) == w_kind and rb_name == w_name:
                closest = found
        if closest is not None:
            return closest
        detail = f"reader union {describe(r)} has no branch that can read writer type {describe(w)}"
        return [self._issue(path, Rule.MISSING_UNION_BRANCH, detail)]

    def _check_single(self, r: Any, w: Any, path: str) -> list[Incompatibility]:
        rk, wk = _kind(r), _kind(w)
        if rk != wk:
            if wk in PROMOTIONS and rk in PROMOTIONS[wk]:
                return []
            hint = f" (no promotion {wk}→{rk})" if wk in PRIMITIVES and rk in PRIMITIVES else ""
            return [self._issue(path, Rule.TYPE_MISMATCH,
                                f"reader type {describe(r)} cannot read writer type {describe(w)}{hint}")]  # fmt: skip
        if rk in PRIMITIVES:
            return self._check_logical(r, w, path)
        if rk in NAMED_KINDS:
            if not self._names_match(r, w):
                detail = f"reader {rk} {r['name']!r} cannot read writer {wk} {w['name']!r} (names differ)"
                return [self._issue(path, Rule.NAME_MISMATCH, detail)]
            pair = (str(r["name"]), str(w["name"]))
            if pair in self.seen:
                return []
            self.seen.add(pair)
            found = self._check_named(rk, r, w, path)
            if found:
                self.seen.discard(pair)  # only a pair proven compatible may short-cut a later visit
            return found
        if rk == "array":
            return self.check(r["items"], w["items"], f"{path}[]")
        return self.check(r["values"], w["values"], f"{path}{{}}")  # map

    def _check_named(self, kind: str, r: dict[str, Any], w: dict[str, Any], path: str) -> list[Incompatibility]:
        if kind == "enum":
            return self._check_enum(r, w, path)
        if kind == "fixed":
            if r["size"] != w["size"]:
                detail = f"fixed {r['name']!r}: reader size {r['size']} ≠ writer size {w['size']}"
                return [self._issue(path, Rule.FIXED_SIZE_MISMATCH, detail)]
            return self._check_logical(r, w, path)
        return self._check_record(r, w, path)

    def _names_match(self, r: dict[str, Any], w: dict[str, Any]) -> bool:
        if _short(str(r["name"])) == _short(str(w["name"])):
            return True
        return str(w["name"]) in [str(a) for a in r.get("aliases", [])]

    def _check_record(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[Incompatibility]:
        writer_fields = {f["name"]: f for f in w["fields"]}
        out: list[Incompatibility] = []
        for field in r["fields"]:
            name = field["name"]
            field_path = f"{path}.{name}" if path else name
            match = writer_fields.get(name)
            if match is None:
                match = next((writer_fields[a] for a in field.get("aliases", []) if a in writer_fields), None)
            if match is not None:
                out += self.check(field["type"], match["type"], field_path)
            elif "default" not in field:
                detail = f"field {field_path!r} added without a default"
                out.append(self._issue(field_path, Rule.MISSING_DEFAULT, detail))
        return out

    def _check_enum(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[Incompatibility]:
        if "default" in r:
            return []
        missing = [s for s in w["symbols"] if s not in r["symbols"]]
        if not missing:
            return []
        return [self._issue(path, Rule.MISSING_ENUM_SYMBOL,
                            f"enum {r['name']!r}: writer symbol(s) {', '.join(map(repr, missing))} missing from "
                            "the reader, which has no default")]  # fmt: skip

    def _check_logical(self, r: Any, w: Any, path: str) -> list[Incompatibility]:
        if not (isinstance(r, dict) and isinstance(w, dict)):
            return []
        if r.get("logicalType") != "decimal" or w.get("logicalType") != "decimal":
            return []  # other logical types resolve by their underlying type
        rs, ws = int(r.get("scale", 0)), int(w.get("scale", 0))
        rp, wp = int(r["precision"]), int(w["precision"])
        if rs != ws or rp < wp:
            return [self._issue(path, Rule.DECIMAL_MISMATCH,
                                f"reader decimal({rp},{rs}) cannot read writer decimal({wp},{ws}) "
                                "(scales must be equal and reader precision ≥ writer precision)")]  # fmt: skip
        return []

    @staticmethod
    def _issue(path: str, rule: Rule, detail: str) -> Incompatibility:
        if path and not detail.startswith("field "):
            detail = f"field {path!r}: {detail}"
        return Incompatibility(path, rule, detail)


def _kind(node: Any) -> str:
    if isinstance(node, str):
        return node
    kind = node.get("type")
    return str(kind) if isinstance(kind, str) else "union"


def describe(node: Any) -> str:
    """A short name of a schema node for messages: 'int', 'record Foo', "['null', 'long']"."""
    if isinstance(node, list):
        return "[" + ", ".join(describe(n) for n in node) + "]"
    if isinstance(node, str):
        return repr(_short(node) if node not in PRIMITIVES else node)
    kind = str(node.get("type"))
    if kind in NAMED_KINDS:
        return f"{kind} {_short(str(node['name']))!r}"
    if "logicalType" in node:
        return f"{kind!r} ({node['logicalType']})"
    if kind == "array":
        return f"array of {describe(node['items'])}"
    if kind == "map":
        return f"map of {describe(node['values'])}"
    return repr(kind)
