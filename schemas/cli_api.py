"""What ``tideline schemas list | show SUBJECT [VERSION] | versions SUBJECT | check SUBJECT FILE`` prints.

Each function takes a :class:`~schemas.registry.SchemaRegistry` and returns data (for
``--json``) and a ``render_*`` companion returns the text for a terminal. Nothing here
registers or changes anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.errors import SchemaParseError
from schemas.pgavro import envelope_row_columns
from schemas.position import format_lsn
from schemas.registry import SchemaRegistry
from schemas.starts import SchemaStart


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
    start = shown.get("started")
    if start is not None:
        head += f"\nstarted at {_described(start)}"
    return head + "\n" + json.dumps(shown["schema"], indent=2)


def start_json(start: SchemaStart | None) -> dict[str, Any] | None:
    """A version's start (schemas.starts) for ``--json``: None when no event of the connector recorded one."""
    if start is None:
        return None
    return {"topic": start.topic, "commit_lsn": start.commit_lsn, "commit_lsn_text": format_lsn(start.commit_lsn),
            "event_index": start.event_index, "lsn": start.lsn, "snapshot": start.snapshot}  # fmt: skip


def subject_versions(
    registry: SchemaRegistry, subject: str, starts: dict[tuple[str, int], SchemaStart]
) -> list[dict[str, Any]]:
    """Every version of ``subject``: its schema id, its field names (a record's) and where its first event is in
    the source (``started``: the capture position, schemas.starts; None when nothing recorded one)."""
    out = []
    for version in registry.versions(subject):
        found = registry.get_version(subject, version)
        schema = json.loads(found.schema)
        out.append({"subject": subject, "version": version, "id": found.id, "fields": _fields(schema),
                    "started": start_json(starts.get((subject, version)))})  # fmt: skip
    return out


def render_versions(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no versions"
    lines = ["VERSION  ID  STARTED AT (commit LSN #event)  FIELDS"]
    for r in rows:
        started = "-" if r["started"] is None else _described(r["started"])
        fields = ", ".join(r["fields"]) if r["fields"] is not None else ""
        lines.append(f"{r['version']:>7}  {r['id']:>2}  {started:<30}  {fields}")
    return "\n".join(lines)


def _fields(schema: Any) -> list[str] | None:
    """A change envelope's row columns, else a record's own fields (None: not a record)."""
    columns = envelope_row_columns(schema)
    if columns is not None:
        return [name for name, _ in columns]
    if isinstance(schema, dict) and schema.get("type") == "record":
        return [str(f.get("name")) for f in schema.get("fields", []) if isinstance(f, dict)]
    return None


def _described(start: dict[str, Any]) -> str:
    if start["snapshot"]:
        return f"snapshot at {start['commit_lsn_text']}"
    return f"{start['commit_lsn_text']} #{start['event_index']}"


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
