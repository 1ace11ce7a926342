"""What ``tideline schemas list | show SUBJECT [VERSION] | check SUBJECT FILE`` prints, as plain functions.

Each function takes a :class:`~schemas.registry.SchemaRegistry` and returns data (for
``--json``) and a ``render_*`` companion returns the text for a terminal. Nothing here
registers or changes anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.errors import SchemaParseError
from schemas.registry import SchemaRegistry


def list_subjects(registry: SchemaRegistry) -> list[dict[str, Any]]:
    """Every subject with its latest version, id and compatibility level."""
    out = []
    for subject in registry.subjects():
        latest = registry.latest(subject)
        level = registry.compatibility(subject).value
        out.append({"subject": subject, "latest_version": latest.version, "id": latest.id,
                    "versions": registry.versions(subject), "compatibility": level})  # fmt: skip
    return out


def render_subjects(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no subjects"
    width = max(len(r["subject"]) for r in rows)
    lines = [f"{'SUBJECT':<{width}}  VERSION  ID  COMPATIBILITY"]
    lines += [f"{r['subject']:<{width}}  {r['latest_version']:>7}  {r['id']:>2}  {r['compatibility']}" for r in rows]
    return "\n".join(lines)


def show_subject(registry: SchemaRegistry, subject: str, version: int | None = None) -> dict[str, Any]:
    """One version of a subject (default: the latest) with its schema as JSON; UnknownSchemaError if absent."""
    found = registry.latest(subject) if version is None else registry.get_version(subject, version)
    return {"subject": found.subject, "version": found.version, "id": found.id,
            "compatibility": registry.compatibility(subject).value, "schema": json.loads(found.schema)}  # fmt: skip


def render_show(shown: dict[str, Any]) -> str:
    head = f"{shown['subject']} version {shown['version']} (id {shown['id']}, compatibility {shown['compatibility']})"
    return head + "\n" + json.dumps(shown["schema"], indent=2)


def check_file(registry: SchemaRegistry, subject: str, path: Path | str) -> dict[str, Any]:
    """Would the schema in ``path`` be accepted as the next version of ``subject``? Registers nothing."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SchemaParseError(f"cannot read {path}: {e.strerror}") from None
    report = registry.check(subject, text)
    return {"subject": subject, "compatibility": report.level.value, "compatible": report.compatible,
            "existing_version": report.existing_version,
            "incompatibilities": [{"path": i.path, "rule": i.rule.value, "message": i.message}
                                  for i in report.incompatibilities]}  # fmt: skip


def render_check(result: dict[str, Any]) -> str:
    if result["existing_version"] is not None:
        return f"{result['subject']}: already registered as version {result['existing_version']}"
    if result["compatible"]:
        return f"{result['subject']}: compatible ({result['compatibility']})"
    lines = [f"{result['subject']}: NOT compatible ({result['compatibility']})"]
    lines += [f"  - {i['message']}" for i in result["incompatibilities"]]
    return "\n".join(lines)
