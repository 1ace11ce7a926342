"""Type names for pgoutput's type OIDs and typmods: what ``format_type(oid, typmod)`` prints.

pgoutput names a column's type by OID and typmod only; capture's converters
(:func:`capture.pgtypes.text_converter`) and :class:`capture.messages.Column` want the
name the server prints (``numeric(12,2)``, ``character varying(20)[]``, ``mood``), as
wal2json and the snapshot give it. Three sources, in this order:

1. **Built-in types** (OID < 10000, ``FirstGenbkiObjectId``: fixed for a major version):
   :data:`BUILTIN_TYPES` and :data:`BUILTIN_ARRAYS`, generated from PostgreSQL 15's
   ``pg_type`` with ``format_type(oid, NULL)``, plus the typmod rendering of
   ``format_type`` for the types that have one (:func:`builtin_type_name`).
2. A **resolver** given to the decoder, ``(type_oid, typmod) -> name`` (the connector
   passes a :class:`CatalogTypeResolver`, which asks the catalog's ``format_type``): exact
   for every other type. It answers None for a type the catalog no longer has (dropped
   since the change was written), and the Type message names it.
3. Without a resolver, pgoutput's own **Type message** ('Y'), which it sends before the
   Relation message of a table that has a column of a type with OID ≥ 10000: namespace
   and name from ``pg_type``. Its name is turned into what ``format_type`` would print
   under a search path holding ``public`` (``public.mood`` → ``mood``, ``s.mood`` →
   ``s.mood``, quoting left out); an array type's name ``_mood`` becomes ``mood[]``
   (a heuristic: Postgres names array types ``_<element>``, but a user may also name
   an ordinary type so). A **domain**'s Type message names its *base* type: a domain
   over a built-in type arrives as ``int4`` in ``pg_catalog`` (an empty namespace), named here ``domain over int4``
   (an unknown name: its values stay text, as wal2json and the snapshot give a domain's
   values); a domain over a user type is named like that type. The resolver has none
   of these blind spots.

Thread safety: pure functions and constant tables; a :class:`CatalogTypeResolver` belongs to one decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

TypeResolver = Callable[[int, int], "str | None"]  # (type OID, typmod) -> format_type(oid, typmod), None: unknown

FIRST_NON_BUILTIN_OID = 10000  # FirstGenbkiObjectId: pgoutput sends a Type message for OIDs from here on

# format_type(oid, NULL) of PostgreSQL 15's built-in non-array, non-pseudo types.
BUILTIN_TYPES: dict[int, str] = {
    16: 'boolean', 17: 'bytea', 18: '"char"', 19: 'name', 20: 'bigint', 21: 'smallint', 22: 'int2vector',
    23: 'integer', 24: 'regproc', 25: 'text', 26: 'oid', 27: 'tid', 28: 'xid', 29: 'cid', 30: 'oidvector',
    71: 'pg_type', 75: 'pg_attribute', 81: 'pg_proc', 83: 'pg_class', 114: 'json', 142: 'xml', 194: 'pg_node_tree',
    600: 'point', 601: 'lseg', 602: 'path', 603: 'box', 604: 'polygon', 628: 'line', 650: 'cidr', 700: 'real',
    701: 'double precision', 718: 'circle', 774: 'macaddr8', 790: 'money', 829: 'macaddr', 869: 'inet',
    1033: 'aclitem', 1042: 'character', 1043: 'character varying', 1082: 'date', 1083: 'time without time zone',
    1114: 'timestamp without time zone', 1184: 'timestamp with time zone', 1186: 'interval', 1248: 'pg_database',
    1266: 'time with time zone', 1560: 'bit', 1562: 'bit varying', 1700: 'numeric', 1790: 'refcursor',
    2202: 'regprocedure', 2203: 'regoper', 2204: 'regoperator', 2205: 'regclass', 2206: 'regtype',
    2842: 'pg_authid', 2843: 'pg_auth_members', 2950: 'uuid', 2970: 'txid_snapshot', 3220: 'pg_lsn',
    3361: 'pg_ndistinct', 3402: 'pg_dependencies', 3614: 'tsvector', 3615: 'tsquery', 3642: 'gtsvector',
    3734: 'regconfig', 3769: 'regdictionary', 3802: 'jsonb', 3904: 'int4range', 3906: 'numrange', 3908: 'tsrange',
    3910: 'tstzrange', 3912: 'daterange', 3926: 'int8range', 4066: 'pg_shseclabel', 4072: 'jsonpath',
    4089: 'regnamespace', 4096: 'regrole', 4191: 'regcollation', 4451: 'int4multirange', 4532: 'nummultirange',
    4533: 'tsmultirange', 4534: 'tstzmultirange', 4535: 'datemultirange', 4536: 'int8multirange',
    4600: 'pg_brin_bloom_summary', 4601: 'pg_brin_minmax_multi_summary', 5017: 'pg_mcv_list', 5038: 'pg_snapshot',
    5069: 'xid8', 6101: 'pg_subscription',
}  # fmt: skip

# Built-in array type OID → its element type OID (format_type prints "<element with typmod>[]").
BUILTIN_ARRAYS: dict[int, int] = {
    143: 142, 199: 114, 210: 71, 270: 75, 271: 5069, 272: 81, 273: 83, 629: 628, 651: 650, 719: 718, 775: 774,
    791: 790, 1000: 16, 1001: 17, 1002: 18, 1003: 19, 1005: 21, 1006: 22, 1007: 23, 1008: 24, 1009: 25, 1010: 27,
    1011: 28, 1012: 29, 1013: 30, 1014: 1042, 1015: 1043, 1016: 20, 1017: 600, 1018: 601, 1019: 602, 1020: 603,
    1021: 700, 1022: 701, 1027: 604, 1028: 26, 1034: 1033, 1040: 829, 1041: 869, 1115: 1114, 1182: 1082,
    1183: 1083, 1185: 1184, 1187: 1186, 1231: 1700, 1270: 1266, 1561: 1560, 1563: 1562, 2201: 1790, 2207: 2202,
    2208: 2203, 2209: 2204, 2210: 2205, 2211: 2206, 2949: 2970, 2951: 2950, 3221: 3220, 3643: 3614, 3644: 3642,
    3645: 3615, 3735: 3734, 3770: 3769, 3807: 3802, 3905: 3904, 3907: 3906, 3909: 3908, 3911: 3910, 3913: 3912,
    3927: 3926, 4073: 4072, 4090: 4089, 4097: 4096, 4192: 4191, 5039: 5038, 6150: 4451, 6151: 4532, 6152: 4533,
    6153: 4534, 6155: 4535, 6157: 4536,
}  # fmt: skip

_VARHDRSZ = 4  # character(n) and character varying(n) store n + 4 as their typmod
_INTERVAL_FULL_RANGE = 0x7FFF
_INTERVAL_FULL_PRECISION = 0xFFFF
_MONTH, _YEAR, _DAY, _HOUR, _MINUTE, _SECOND = 1 << 1, 1 << 2, 1 << 3, 1 << 10, 1 << 11, 1 << 12
_INTERVAL_FIELDS = {
    _YEAR: " year", _MONTH: " month", _DAY: " day", _HOUR: " hour", _MINUTE: " minute", _SECOND: " second",
    _YEAR | _MONTH: " year to month", _DAY | _HOUR: " day to hour", _DAY | _HOUR | _MINUTE: " day to minute",
    _DAY | _HOUR | _MINUTE | _SECOND: " day to second", _HOUR | _MINUTE: " hour to minute",
    _HOUR | _MINUTE | _SECOND: " hour to second", _MINUTE | _SECOND: " minute to second",
    _INTERVAL_FULL_RANGE: "",
}  # fmt: skip


def builtin_type_name(type_oid: int, typmod: int) -> str | None:
    """``format_type(type_oid, typmod)`` for a built-in type; None for any other OID.

    >>> builtin_type_name(1700, (12 << 16 | 2) + 4), builtin_type_name(1015, 9), builtin_type_name(1186, -1)
    ('numeric(12,2)', 'character varying(5)[]', 'interval')
    """
    element = BUILTIN_ARRAYS.get(type_oid)
    if element is not None:
        name = _with_typmod(element, typmod)
        return None if name is None else name + "[]"
    return _with_typmod(type_oid, typmod)


def _with_typmod(type_oid: int, typmod: int) -> str | None:
    name = BUILTIN_TYPES.get(type_oid)
    if name is None or typmod < 0:
        # bpchar and bit without a typmod are "bpchar" and '"bit"': plain "character" and
        # "bit" would mean character(1) and bit(1).
        return {1042: "bpchar", 1560: '"bit"'}.get(type_oid, name)
    if type_oid == 1042 or type_oid == 1043:  # character(n), character varying(n)
        return f"{name}({typmod - _VARHDRSZ})"
    if type_oid == 1700:  # numeric(precision, scale): both packed into typmod - 4; the scale may be negative
        packed = typmod - _VARHDRSZ
        scale = ((packed & 0x7FF) ^ 1024) - 1024
        return f"numeric({packed >> 16 & 0xFFFF},{scale})"
    if type_oid == 1560 or type_oid == 1562:  # bit(n), bit varying(n)
        return f"{name}({typmod})"
    if type_oid in (1083, 1114, 1184, 1266):  # time(p) / timestamp(p) [with|without time zone]
        head, _, zone = name.partition(" ")
        return f"{head}({typmod}) {zone}"
    if type_oid == 1186:  # interval [fields] [(precision)]
        fields = _INTERVAL_FIELDS.get(typmod >> 16 & _INTERVAL_FULL_RANGE, "")
        precision = typmod & 0xFFFF
        return f"interval{fields}" if precision == _INTERVAL_FULL_PRECISION else f"interval{fields}({precision})"
    return name  # no other built-in type takes a typmod


def catalog_type_name(namespace: str, name: str) -> str:
    """A Type message's (namespace, name) → the name ``format_type`` prints (see the module docstring).

    >>> catalog_type_name("public", "mood"), catalog_type_name("public", "_mood"), catalog_type_name("s", "t")
    ('mood', 'mood[]', 's.t')
    >>> catalog_type_name("", "int4"), catalog_type_name("pg_catalog", "_int4")
    ('domain over int4', 'domain over _int4')
    """
    if namespace in ("", "pg_catalog"):  # "" is pgoutput's pg_catalog, where only built-in types live
        return f"domain over {name}"  # (see the module docstring)
    if name.startswith("_") and len(name) > 1:
        return catalog_type_name(namespace, name[1:]) + "[]"
    return name if namespace == "public" else f"{namespace}.{name}"


class CatalogTypeResolver:
    """``format_type(oid, typmod)`` from the source database, one query per type and typmod, cached.

    The connection opens on the first question (most streams hold built-in types only)
    and stays open until :meth:`close`. Connection errors propagate (the connector retries).
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None
        self._names: dict[tuple[int, int], str | None] = {}

    def __call__(self, type_oid: int, typmod: int) -> str | None:
        key = (type_oid, typmod)
        if key not in self._names:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.dsn, autocommit=True)
            row = self._conn.execute(
                "SELECT format_type(t.oid, %s) FROM pg_type t WHERE t.oid = %s", (typmod, type_oid)
            ).fetchone()
            self._names[key] = None if row is None else str(row[0])
        return self._names[key]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
