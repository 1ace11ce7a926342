"""Schema change events, in band (``--schema-changes``): each DDL on a captured table as an event.

PostgreSQL does not decode DDL: logical decoding streams row changes, and a table's new
shape shows only in the rows that follow it. With ``--schema-changes`` the connector installs
(at start, idempotently) an **event trigger** in the source database that writes one
transactional logical message per table a DDL command created, altered or dropped::

    pg_logical_emit_message(true, 'tideline.ddl', '{"ddl": …, "command_tag": …, "schema": …,
                                                   "table": …, "columns": [...], "key": [...]}')

With ``"partitions"`` (a partitioned table: its leaf partitions after the command, ``[schema, name, OID,
partition constraint]`` each) and ``"partition_root"`` (a partition: ``[root schema, root name, its OID, its
constraint]``), null otherwise: what capture.partitions follows partitioned tables by
(``--publish-via-partition-root``). Messages of an older function lack both keys; the connector replaces the
function at start (:data:`FUNCTION_VERSION` in its body).

The message is part of the DDL's own transaction and sits in the WAL right after the DDL's
catalog changes, so it is decoded at the DDL's position: after every row written before it,
before the first row of the new shape (also when DML and DDL share a transaction). The
connector turns each message about a captured table into one event on
``<prefix>.schema_changes`` (one partition, never compacted, kept forever: a history, like
Debezium's schema history topic), keyed ``{"table": "<schema>.<table>"}``, with Debezium's
schema change value (its MySQL and SQL Server connectors' ``SchemaChangeValue``)::

    {"source": {…, "schema": …, "table": …, "commit_lsn": …, "lsn": …, "event_index": …},
     "ts_ms": …, "databaseName": …, "schemaName": …, "ddl": "<the statement's text>",
     "tableChanges": [{"type": "CREATE" | "ALTER" | "DROP", "id": "\\"public\\".\\"orders\\"",
                       "table": {"primaryKeyColumnNames": [...],
                                 "columns": [{"name", "typeName", "position", "optional",
                                              "defaultValueExpression"}, …]} | null}]}

``ddl`` is ``current_query()``: the text the client sent (all of it, when it sent several
statements at once). The columns are the table's after the command, excluded columns
(``--exclude-columns``) left out. A ``DROP TABLE`` has ``"table": null``. Each event takes an
index among its transaction's events, as a row change does, so a restart skips the ones it
stored (no duplicates) and re-reads the others.

What is installed (in the connector's database, as the connecting role, which must be allowed
to create event triggers — a superuser on PostgreSQL 15 to 18; see docs/capture.md for what
managed services offer): the function ``public.tideline_ddl_event()`` (``SECURITY DEFINER``,
``search_path`` pinned: a DDL by any role emits the message with its owner's rights; it
does nothing where ``wal_level`` is not ``logical``, or in a session that set
``tideline.skip_ddl_events = on``) and the
event triggers ``tideline_ddl`` (``ddl_command_end``, CREATE/ALTER TABLE) and
``tideline_ddl_drop`` (``sql_drop``, DROP TABLE). :func:`install_sql` is the same SQL, for a
DBA to run by hand (``tideline capture schema-changes-sql``). Without ``--schema-changes`` the
connector ignores these messages (they never reach ``<prefix>.message``).

Thread-safety: the functions open their own connections; nothing is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import psycopg

from eventstore.errors import ConfigError

DDL_PREFIX = "tideline.ddl"
FUNCTION = "public.tideline_ddl_event"
TRIGGERS = ("tideline_ddl", "tideline_ddl_drop")
# In the function's body: an installed function without it is an older one, replaced at start (its messages lack
# the partition fields capture.partitions needs).
FUNCTION_VERSION = "tideline ddl event v2"

_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
-- {FUNCTION_VERSION}
DECLARE
  r record;
BEGIN
  IF current_setting('wal_level') <> 'logical' OR coalesce(current_setting('tideline.skip_ddl_events', true), '') = 'on'
  THEN
    RETURN;  -- no logical decoding to read it, or a session that asked not to be recorded
  END IF;
  IF TG_EVENT = 'sql_drop' THEN
    FOR r IN SELECT schema_name, object_name FROM pg_event_trigger_dropped_objects()
             WHERE object_type = 'table' AND original LOOP
      PERFORM pg_logical_emit_message(true, '{DDL_PREFIX}', jsonb_build_object(
        'ddl', current_query(), 'command_tag', 'DROP TABLE', 'schema', r.schema_name,
        'table', r.object_name, 'columns', NULL, 'key', NULL)::text);
    END LOOP;
    RETURN;
  END IF;
  FOR r IN SELECT c.oid, n.nspname, c.relname, c.relkind, c.relispartition, max(d.command_tag) AS command_tag
           FROM pg_event_trigger_ddl_commands() d
           JOIN pg_class c ON c.oid = d.objid AND d.classid = 'pg_class'::regclass
           JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relkind IN ('r', 'p') AND d.command_tag IN ('CREATE TABLE', 'ALTER TABLE', 'CREATE TABLE AS',
                                                               'SELECT INTO')
           GROUP BY c.oid, n.nspname, c.relname, c.relkind, c.relispartition LOOP
    PERFORM pg_logical_emit_message(true, '{DDL_PREFIX}', jsonb_build_object(
      'ddl', current_query(), 'command_tag', r.command_tag, 'schema', r.nspname, 'table', r.relname,
      'columns', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                    'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod), 'position', a.attnum,
                    'optional', NOT a.attnotnull, 'default', pg_get_expr(ad.adbin, ad.adrelid),
                    'generated', a.attgenerated <> '') ORDER BY a.attnum),
                    '[]'::jsonb)
                  FROM pg_attribute a LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
                  WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped),
      'key', (SELECT coalesce(jsonb_agg(a.attname ORDER BY array_position(i.indkey::int2[], a.attnum)), '[]'::jsonb)
              FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey::int2[])
              WHERE i.indrelid = r.oid AND i.indisprimary),
      'partitions', CASE WHEN r.relkind = 'p' THEN
                      (SELECT coalesce(jsonb_agg(jsonb_build_array(ln.nspname, l.relname, l.oid::bigint,
                                                                   pg_get_partition_constraintdef(l.oid))
                                                 ORDER BY l.oid), '[]'::jsonb)
                       FROM pg_partition_tree(r.oid) t JOIN pg_class l ON l.oid = t.relid
                       JOIN pg_namespace ln ON ln.oid = l.relnamespace WHERE t.isleaf) END,
      'partition_root', CASE WHEN r.relispartition THEN
                          (SELECT jsonb_build_array(rn.nspname, rc.relname, r.oid::bigint,
                                                    pg_get_partition_constraintdef(r.oid)) FROM pg_class rc
                           JOIN pg_namespace rn ON rn.oid = rc.relnamespace
                           WHERE rc.oid = pg_partition_root(r.oid)) END)::text);
  END LOOP;
END
$fn$
"""


def install_sql() -> list[str]:
    """The statements that install the event triggers (idempotent; one transaction)."""
    statements = [_FUNCTION_SQL.strip()]
    for name, event, tags in (
        (TRIGGERS[0], "ddl_command_end", "'CREATE TABLE', 'ALTER TABLE', 'CREATE TABLE AS', 'SELECT INTO'"),
        (TRIGGERS[1], "sql_drop", "'DROP TABLE'"),
    ):
        statements.append(
            f"DO $do$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = '{name}') THEN "
            f"CREATE EVENT TRIGGER {name} ON {event} WHEN TAG IN ({tags}) EXECUTE FUNCTION {FUNCTION}(); "
            "END IF; END $do$"
        )
    return statements


def install(dsn: str) -> bool:
    """Install the event triggers (:func:`install_sql`) unless they are there; True when they were created.

    ConfigError naming the role and what to do when it may not create event triggers."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_event_trigger WHERE evtname = ANY(%s) AND evtenabled <> 'D'", [list(TRIGGERS)]
        ).fetchone()
        role = conn.execute("SELECT current_user, current_setting('server_version_num')::int / 10000").fetchone()
        current = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE oid = to_regproc(%s) AND prosrc LIKE %s",
            (FUNCTION, f"%{FUNCTION_VERSION}%"),
        ).fetchone()
        assert found is not None and role is not None and current is not None
        if found[0] == len(TRIGGERS) and current[0]:
            conn.rollback()
            return False
        try:
            for statement in install_sql():  # an older function is replaced, triggers that exist are kept
                conn.execute(statement.encode())
            conn.commit()
        except psycopg.errors.InsufficientPrivilege as e:
            raise ConfigError(
                f"--schema-changes needs the event triggers {', '.join(TRIGGERS)}, and role {role[0]} may not "
                f"create them on PostgreSQL {role[1]} ({str(e).strip().splitlines()[0]}): only a superuser may "
                "(on managed services, their admin role where it is allowed: docs/capture.md, Schema change "
                "events). Have one run the SQL of `tideline capture schema-changes-sql`, or capture without "
                "--schema-changes"
            ) from e
    return True


def triggers_enabled(dsn: str) -> bool:
    """Whether both event triggers exist and are enabled in the database of ``dsn``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_event_trigger WHERE evtname = ANY(%s) AND evtenabled <> 'D'", [list(TRIGGERS)]
        ).fetchone()
    return row is not None and row[0] == len(TRIGGERS)


@dataclass(frozen=True, slots=True)
class DdlMessage:
    """What the event trigger wrote about one table."""

    ddl: str
    command_tag: str
    schema: str
    table: str
    columns: list[dict[str, Any]] | None  # None: dropped
    key: list[str] | None
    # a partitioned table's leaf partitions after the command: (schema, name, OID, partition constraint), the
    # constraint as pg_get_partition_constraintdef prints it (None: not a partitioned table, or an older trigger)
    partitions: list[tuple[str, str, int, str]] | None = None
    # a partition's root table after the command: (root schema, root name, the partition's OID and constraint)
    partition_root: tuple[str, str, int, str] | None = None

    @property
    def change_type(self) -> str:
        if self.columns is None:
            return "DROP"
        return "ALTER" if self.command_tag == "ALTER TABLE" else "CREATE"

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"


class DdlMessageError(ValueError):
    """A ``tideline.ddl`` message that is not what the trigger writes."""


def parse(content: bytes | None) -> DdlMessage:
    """The message's content; :class:`DdlMessageError` naming what is wrong."""
    try:
        raw = orjson.loads(content or b"")
        columns = raw["columns"]
        if columns is not None and not isinstance(columns, list):
            raise TypeError("columns is not a list")
        parts, root = raw.get("partitions"), raw.get("partition_root")  # absent: an older trigger's message
        leaves = None if parts is None else [(str(s), str(n), int(o), str(c or "")) for s, n, o, c in parts]
        above = None if root is None else (str(root[0]), str(root[1]), int(root[2]), str(root[3] or ""))
        return DdlMessage(str(raw["ddl"]), str(raw["command_tag"]), str(raw["schema"]), str(raw["table"]),
                          columns, None if raw["key"] is None else [str(k) for k in raw["key"]],
                          leaves, above)  # fmt: skip
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DdlMessageError(f"not a schema change message of {DDL_PREFIX}: {e}") from None


def table_change(ddl: DdlMessage, keep_column: Any) -> dict[str, Any]:
    """One entry of ``tableChanges`` (Debezium's), the columns ``keep_column(name)`` refuses left out."""
    table: dict[str, Any] | None = None
    if ddl.columns is not None:
        table = {
            "primaryKeyColumnNames": ddl.key or [],
            "columns": [
                {
                    "name": c["name"],
                    "typeName": c["type"],
                    "position": c["position"],
                    "optional": c["optional"],
                    "defaultValueExpression": c["default"],
                }
                for c in ddl.columns
                if keep_column(c["name"])
            ],
        }
    return {"type": ddl.change_type, "id": f'"{ddl.schema}"."{ddl.table}"', "table": table}
