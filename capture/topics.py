"""Topic names of captured tables: the mapping rule, overrides, and collisions refused.

Rule (Debezium's): a table's topic is ``<prefix>.<schema>.<table>`` with every character
outside ``[A-Za-z0-9._-]`` replaced by ``_`` — one ``_`` per character, so ``filter
table_6`` → ``filter_table_6`` and ``ünï`` → ``___``. The mapping is deterministic (it
depends on the names only), so a restart, another connector or a reader computes the
same topic. Names longer than a topic may be (249 characters) are refused.

Two captured tables that map to one topic (``public."a b"`` and ``public.a_b``) are
refused, naming both, before anything of either is written; give one of them its own
topic with an override (``--table-topic 'public.a b=cdc.public.a_b_2'``). Overrides
take precedence over the rule and must be legal topic names themselves.

Thread-safety: none; owned by the connector thread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from eventstore.errors import ConfigError
from eventstore.topic import validate_topic_name

_ILLEGAL = re.compile(r"[^A-Za-z0-9._-]")
MAX_TOPIC_CHARS = 249


class TopicCollisionError(ConfigError):
    """Two captured tables map to the same topic name."""


def topic_name_part(name: str) -> str:
    """A schema or table name as it appears in a topic: illegal characters → ``_``."""
    return _ILLEGAL.sub("_", name)


def table_topic(prefix: str, schema: str, table: str) -> str:
    """``<prefix>.<schema>.<table>`` with illegal characters mapped (see the module docstring)."""
    return f"{prefix}.{topic_name_part(schema)}.{topic_name_part(table)}"


class TopicRouter:
    """Assigns every captured table its topic (rule or override) and refuses collisions."""

    def __init__(self, prefix: str, overrides: dict[str, str] | None = None) -> None:
        self.prefix = prefix
        self.overrides = dict(overrides or {})
        self._topics: dict[tuple[str, str], str] = {}
        self._owners: dict[str, tuple[str, str]] = {}

    def topic(self, schema: str, table: str) -> str:
        """The table's topic (assigned on first call; raises TopicCollisionError if it is taken)."""
        found = self._topics.get((schema, table))
        if found is not None:
            return found
        name = self.overrides.get(f"{schema}.{table}") or table_topic(self.prefix, schema, table)
        if len(name) > MAX_TOPIC_CHARS:
            raise ConfigError(
                f"table {schema}.{table} maps to a topic name of {len(name)} characters (at most {MAX_TOPIC_CHARS}): "
                f"give it a shorter one with --table-topic '{schema}.{table}=<topic>'"
            )
        validate_topic_name(name)
        owner = self._owners.get(name)
        if owner is not None and owner != (schema, table):
            raise TopicCollisionError(
                f"tables {owner[0]}.{owner[1]} and {schema}.{table} both map to topic {name!r} (characters outside "
                f"[A-Za-z0-9._-] become _): give one of them its own topic with "
                f"--table-topic '{schema}.{table}=<topic>', or exclude one"
            )
        self._owners[name] = (schema, table)
        self._topics[(schema, table)] = name
        return name

    def check(self, tables: Iterable[tuple[str, str]], reserved: Iterable[str] = ()) -> None:
        """Assign every table up front, so that a collision stops the connector before it writes anything.

        ``reserved``: topics the connector writes for itself (``<prefix>.transaction``, …);
        a table mapping to one of those is a collision too.
        """
        for name in reserved:
            self._owners.setdefault(name, ("(connector)", name))
        for schema, table in tables:
            self.topic(schema, table)
