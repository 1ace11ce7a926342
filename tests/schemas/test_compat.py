"""Compatibility rules, table-driven from the Avro specification's schema resolution rules."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.compat import CompatibilityLevel, Rule, check_compatibility, check_resolution


def rec(*fields: dict[str, Any], name: str = "R", **extra: Any) -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": list(fields), **extra}


def f(name: str, type_: Any, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": type_, **extra}


def enum(*symbols: str, **extra: Any) -> dict[str, Any]:
    return {"type": "enum", "name": "E", "symbols": list(symbols), **extra}


DEC = {"type": "bytes", "logicalType": "decimal"}

# (case id, reader, writer, expected reason substring or None when the reader can read the writer)
CASES: list[tuple[str, Any, Any, str | None]] = [
    ("same primitive", "int", "int", None),
    ("promote int→long", "long", "int", None),
    ("promote int→float", "float", "int", None),
    ("promote int→double", "double", "int", None),
    ("promote long→float", "float", "long", None),
    ("promote long→double", "double", "long", None),
    ("promote float→double", "double", "float", None),
    ("string→bytes", "bytes", "string", None),
    ("bytes→string", "string", "bytes", None),
    ("no long→int", "int", "long", "reader type 'int' cannot read writer type 'long' (no promotion long→int)"),
    ("no double→float", "float", "double", "no promotion double→float"),
    ("no string→int", "int", "string", "no promotion string→int"),
    ("boolean vs int", "boolean", "int", "reader type 'boolean' cannot read writer type 'int'"),
    ("record: added field with default", rec(f("a", "int"), f("b", "string", default="")), rec(f("a", "int")), None),
    (
        "record: added field without default",
        rec(f("a", "int"), f("b", "string")),
        rec(f("a", "int")),
        "field 'b' added without a default",
    ),
    ("record: removed field", rec(f("a", "int")), rec(f("a", "int"), f("b", "string")), None),
    ("record: field type promoted", rec(f("a", "long")), rec(f("a", "int")), None),
    (
        "record: nested path named",
        rec(f("after", ["null", rec(f("amount", "int"), name="Row")])),
        rec(f("after", ["null", rec(f("amount", "long"), name="Row")])),
        "field 'after.amount': reader type 'int' cannot read writer type 'long' (no promotion long→int)",
    ),
    ("record: name differs", rec(f("a", "int"), name="A"), rec(f("a", "int"), name="B"), "names differ"),
    ("record: namespace differs only", rec(f("a", "int"), name="x.R"), rec(f("a", "int"), name="y.R"), None),
    (
        "record: reader alias for writer name",
        rec(f("a", "int"), name="New", aliases=["Old"]),
        rec(f("a", "int"), name="Old"),
        None,
    ),
    ("record: reader field alias", rec(f("b", "int", aliases=["a"])), rec(f("a", "int")), None),
    ("enum: reader superset", enum("A", "B", "C"), enum("A", "B"), None),
    ("enum: writer symbol missing", enum("A"), enum("A", "B"), "writer symbol(s) 'B' missing from the reader"),
    ("enum: missing symbol with reader default", enum("A", "U", default="U"), enum("A", "B"), None),
    ("fixed: same size", {"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 4}, None),
    (
        "fixed: size differs",
        {"type": "fixed", "name": "F", "size": 8},
        {"type": "fixed", "name": "F", "size": 4},
        "reader size 8 ≠ writer size 4",
    ),
    ("array items promoted", {"type": "array", "items": "long"}, {"type": "array", "items": "int"}, None),
    (
        "array items incompatible",
        rec(f("xs", {"type": "array", "items": "int"})),
        rec(f("xs", {"type": "array", "items": "string"})),
        "field 'xs[]': reader type 'int' cannot read writer type",
    ),
    ("map values", {"type": "map", "values": "double"}, {"type": "map", "values": "float"}, None),
    (
        "map values incompatible",
        {"type": "map", "values": "int"},
        {"type": "map", "values": "boolean"},
        "reader type 'int' cannot read writer type 'boolean'",
    ),
    ("reader union has the writer type", ["null", "string"], "string", None),
    ("reader union via promotion", ["null", "long"], "int", None),
    (
        "reader union lacks writer type",
        rec(f("x", ["null", "int"])),
        rec(f("x", ["null", "string"])),
        "field 'x': reader union ['null', 'int'] has no branch that can read writer type 'string'",
    ),
    ("writer union, every branch resolves", ["null", "long", "string"], ["null", "int"], None),
    ("writer union branch unresolvable", "long", ["null", "int"], "reader type 'long' cannot read writer type 'null'"),
    ("writer union into non-union reader", "double", ["int", "float"], None),
    ("logical type by underlying type", {"type": "long", "logicalType": "timestamp-micros"}, "long", None),
    ("decimal same", {**DEC, "precision": 12, "scale": 2}, {**DEC, "precision": 12, "scale": 2}, None),
    ("decimal wider precision", {**DEC, "precision": 14, "scale": 2}, {**DEC, "precision": 12, "scale": 2}, None),
    (
        "decimal scale differs",
        {**DEC, "precision": 12, "scale": 4},
        {**DEC, "precision": 12, "scale": 2},
        "reader decimal(12,4) cannot read writer decimal(12,2)",
    ),
    (
        "recursive record",
        rec(f("next", ["null", "R"], default=None), f("v", "long")),
        rec(f("next", ["null", "R"]), f("v", "int")),
        None,
    ),
]


@pytest.mark.parametrize(("reader", "writer", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolution_rule(reader: Any, writer: Any, reason: str | None) -> None:
    found = check_resolution(reader, writer)
    if reason is None:
        assert found == []
    else:
        assert found, "expected a rejection"
        assert any(reason in i.message for i in found), [i.message for i in found]


def test_rule_and_path_are_reported() -> None:
    (issue,) = check_resolution(rec(f("a", rec(f("b", "int"), name="In"))), rec(f("a", rec(name="In"))))
    assert issue.rule is Rule.MISSING_DEFAULT
    assert issue.path == "a.b"


V1 = rec(f("a", "int"))
V2_ADD_DEFAULT = rec(f("a", "int"), f("b", "string", default="x"))
V2_ADD_REQUIRED = rec(f("a", "int"), f("b", "string"))
V2_DROP = rec()


@pytest.mark.parametrize(
    ("level", "new", "ok"),
    [
        (CompatibilityLevel.BACKWARD, V2_ADD_DEFAULT, True),
        (CompatibilityLevel.BACKWARD, V2_ADD_REQUIRED, False),
        (CompatibilityLevel.BACKWARD, V2_DROP, True),
        (CompatibilityLevel.FORWARD, V2_ADD_REQUIRED, True),  # old readers ignore the new field
        (CompatibilityLevel.FORWARD, V2_DROP, False),  # old readers need 'a', which has no default
        (CompatibilityLevel.FULL, V2_ADD_DEFAULT, True),
        (CompatibilityLevel.FULL, V2_ADD_REQUIRED, False),
        (CompatibilityLevel.NONE, rec(f("a", "string")), True),
    ],
)
def test_levels(level: CompatibilityLevel, new: Any, ok: bool) -> None:
    assert (check_compatibility(level, new, [V1]) == []) is ok


def test_transitive_checks_every_version() -> None:
    v1 = rec(f("a", "int"))
    v2 = rec(f("a", "int"), f("b", "int", default=0))
    v3 = rec(f("b", "int", default=0))  # reads v2 (drops 'a'); FORWARD from v1 fails: v1 needs 'a'
    assert check_compatibility(CompatibilityLevel.FORWARD, v3, [v2]) != []
    v3b = rec(f("a", "int", default=0), f("b", "int", default=0))
    assert check_compatibility(CompatibilityLevel.BACKWARD, v3b, [v1, v2]) == []
    narrow = rec(f("a", "int"), f("b", "int"))  # reads v2 (has b) but not v1 (no b)
    assert check_compatibility(CompatibilityLevel.BACKWARD, narrow, [v1, v2]) == []
    found = check_compatibility(CompatibilityLevel.BACKWARD_TRANSITIVE, narrow, [v1, v2])
    assert [i.message for i in found] == [
        "BACKWARD (new schema reads data of version 1): field 'b' added without a default"
    ]
