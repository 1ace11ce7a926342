"""The wal2json format-version 2 decoder: one JSON object per payload → one ChangeMessage.

Records, as wal2json 2.5 writes them with :meth:`Wal2JsonDecoder.slot_options`::

  B, C  {"action", "xid", "timestamp", "lsn": commit record, "nextlsn": end of the commit}
  I     {"action", "xid", "timestamp", "lsn", "schema", "table", "columns"} (and "pk" with include-pk)
  U     … "columns": new row without unchanged TOASTed columns, "identity": old key
        (the new row's key when it did not change) or, under REPLICA IDENTITY FULL, the old row
  D     … "identity" instead of "columns"
  T     {"action", "xid", "timestamp", "lsn", "schema", "table"}: one per truncated table
  M     {"action", "xid", "timestamp", "lsn", "transactional", "prefix", "content"};
        non-transactional messages come before their transaction's B, xid and timestamp null
  column {"name", "type": with typmod, "typeoid", "value"}; pk item {"name", "type", "typeoid"}

LSNs are "X/Y" hex strings (→ int), timestamps "2024-03-31 01:30:00.123456+00" in the
walsender's TimeZone and DateStyle (→ epoch milliseconds; every record of a transaction
carries its commit time). Tables without a primary key under REPLICA IDENTITY DEFAULT
get no U or D records at all: wal2json skips them with a server-log warning.

JSON parsing is ``orjson.loads`` (≈ 2 µs a record), which would turn numeric values (bare
JSON numbers) into binary floats. So a record carrying a numeric column first has each
numeric value quoted: the bytes ``"typeoid":1700,"value":`` occur only as JSON structure
(inside a string every quote is escaped) and ``value`` is a column's last key, so the
number runs to the next ``}``. The converter then reads the string into a Decimal with
every digit (≈ 1 µs more than plain orjson; ``json.loads(parse_float=Decimal)`` costs
≈ 5 µs more). As a safety net, a numeric value that still arrives as a float (a payload
without type OIDs, an integer beyond 64 bits) raises
:class:`~capture.pgtypes.InexactValueError` during conversion and the payload is parsed
again with ``json.loads(parse_float=Decimal)``; so is a payload orjson rejects (the raw,
non-UTF-8 bytes of a binary logical message).

Logical message content: wal2json copies it as a C string and escapes it as JSON, so
content is exact up to its first NUL byte and cut there (a wal2json limitation); other
bytes, valid UTF-8 or not, come back unchanged (decoded with ``surrogateescape``).

Thread safety: see :class:`Wal2JsonDecoder`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import orjson

from capture.messages import ChangeMessage, Column, DecodeError, DecoderSettings, Kind, Plugin
from capture.pgtypes import InexactValueError, converter

# Options for START_REPLICATION / pg_logical_slot_get_changes (wal2json 2.5 names).
SLOT_OPTIONS: dict[str, str] = {
    "format-version": "2",
    "include-transaction": "1",  # B and C records (wal2json's default, said explicitly)
    "include-xids": "1",
    "include-timestamp": "1",
    "include-lsn": "1",  # "lsn" on every record, "nextlsn" on B and C
    "include-type-oids": "1",  # dispatch by OID, and the cheap numeric detection below
    "include-types": "1",  # (default) a column's type name: types without a fixed OID convert by it
    "include-typmod": "1",  # (default)
    "include-schemas": "1",  # (default)
    # Not asked for: include-pk. The connector keys a table by its catalog's key (capture.tables), never by
    # the stream's "pk", which a change would carry at every record (≈ 50 bytes for one bigint key, parsed
    # by the native core each time: 13-25 % of its wal2json time on the pre-filled table workload;
    # docs/capture.md, "The pre-filled table workload"). A "pk" that comes all the same is still read.
    # Left at their defaults: include-domain-data-type off (a domain keeps its own name, as
    # the snapshot's catalog names it, so both paths convert it alike); include-unchanged-toast
    # is rejected by 2.5; numeric-data-types-as-string is unknown to 2.5.
}

_TEXT_OID = 25
_NUMERIC_VALUE = b'"typeoid":1700,"value":'
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)
_EXCERPT_BYTES = 160
_MAX_INT_DIGITS = 4000  # below Python's int-from-text limit (4300 digits)


class Wal2JsonDecoder:
    """Decodes wal2json format-version 2 payloads (see the module docstring for the fields).

    Not thread-safe (it caches converters and the last timestamp): one per replication stream.

    >>> decoder = Wal2JsonDecoder()
    >>> [m] = decoder.decode(b'{"action":"I","xid":7,"timestamp":"2024-03-31 01:30:00.5+00",'
    ...     b'"lsn":"0/16B3748","schema":"public","table":"t","columns":[{"name":"n",'
    ...     b'"type":"numeric(38,10)","typeoid":1700,"value":12345678901234567890.0123456789}],"pk":[]}')
    >>> m.kind, m.lsn, m.timestamp_ms, m.columns[0].value
    (<Kind.INSERT: 'I'>, 23803720, 1711848600500, Decimal('12345678901234567890.0123456789'))
    """

    plugin = Plugin.WAL2JSON

    def __init__(self) -> None:
        self._timestamp_text: str | None = None
        self._timestamp_ms: int | None = None
        self._converters: dict[int | str, Callable[[Any], Any] | None] = {}

    @classmethod
    def configured(cls, settings: DecoderSettings) -> Wal2JsonDecoder:
        """The connector's decoder: wal2json needs none of the settings (it streams every table)."""
        return cls()

    def slot_options(self) -> dict[str, str]:
        """Options for ``START_REPLICATION … LOGICAL … (options)`` or ``pg_logical_slot_get_changes``."""
        return dict(SLOT_OPTIONS)

    def close(self) -> None:
        """Forget the cached converters (the decoder holds nothing else)."""
        self._converters.clear()

    def decode(self, payload: bytes, lsn: int = 0) -> list[ChangeMessage]:
        """The one message of a payload; raises DecodeError naming what is wrong.

        ``lsn`` (the XLogData position) is not needed: every wal2json record carries its own.
        """
        try:
            record = orjson.loads(_quote_numeric_values(payload) if _NUMERIC_VALUE in payload else payload)
        except ValueError:  # orjson.JSONDecodeError, or no '}' after a numeric value
            record = _loads_exact(payload)
        try:
            return [self._message(record, payload)]
        except InexactValueError:
            return [self._message(_loads_exact(payload), payload)]

    def _message(self, record: Any, payload: bytes) -> ChangeMessage:
        if type(record) is not dict:
            raise DecodeError(f"wal2json payload is not a JSON object: {_excerpt(payload)}")
        action = record.get("action")
        build = _BUILDERS.get(action) if type(action) is str else None
        if build is None:
            raise DecodeError(
                f"wal2json payload has unknown action {action!r} (expected one of B, C, I, U, D, T, M; "
                f"is format-version 2 on?): {_excerpt(payload)}"
            )
        try:
            return build(self, record)
        except InexactValueError:
            raise
        except KeyError as e:
            raise DecodeError(f"wal2json {action} record without field {e.args[0]!r}: {_excerpt(payload)}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise DecodeError(f"wal2json {action} record: {e}: {_excerpt(payload)}") from e

    # -- one builder per action ----------------------------------------------------------

    def _transaction(self, record: dict[str, Any], kind: Kind) -> ChangeMessage:
        return ChangeMessage(
            kind,
            _lsn(record["lsn"]),  # the commit record
            xid=_xid(record["xid"]),
            timestamp_ms=self._epoch_ms(record["timestamp"]),  # commit time
            next_lsn=_lsn(record["nextlsn"]),  # end of the commit record: what we confirm
        )

    def _row(self, record: dict[str, Any], kind: Kind) -> ChangeMessage:
        schema, table = _name(record["schema"]), _name(record["table"])
        if kind is Kind.DELETE:
            columns, identity = [], self._columns(record["identity"], schema, table)
        else:
            columns = self._columns(record["columns"], schema, table)
            identity = self._columns(record["identity"], schema, table) if "identity" in record else []
        return ChangeMessage(  # positional: measurably cheaper than keywords on this hot path
            kind,
            _lsn(record["lsn"]),
            _xid(record["xid"]),
            self._epoch_ms(record["timestamp"]),
            None,  # next_lsn: B and C only
            schema,
            table,
            columns,
            identity,
            [item["name"] for item in record["pk"]] if "pk" in record else [],
        )

    def _truncate(self, record: dict[str, Any], kind: Kind) -> ChangeMessage:
        return ChangeMessage(
            kind,
            _lsn(record["lsn"]),
            xid=_xid(record["xid"]),
            timestamp_ms=self._epoch_ms(record["timestamp"]),
            schema=_name(record["schema"]),
            table=_name(record["table"]),
        )

    def _logical_message(self, record: dict[str, Any], kind: Kind) -> ChangeMessage:
        transactional, content = record["transactional"], record["content"]
        if type(transactional) is not bool or type(content) is not str:
            raise TypeError("transactional must be a boolean and content a string")
        return ChangeMessage(
            kind,
            _lsn(record["lsn"]),
            xid=_xid(record["xid"]),  # null when not transactional
            timestamp_ms=self._epoch_ms(record["timestamp"]),  # null when not transactional
            transactional=transactional,
            prefix=_name(record["prefix"]),
            content=content.encode("utf-8", "surrogateescape"),
        )

    def _columns(self, items: Any, schema: str, table: str) -> list[Column]:
        """Column records → Columns with converted values (errors name the column)."""
        converters = self._converters
        columns = []
        for item in items:
            value, type_oid = item["value"], item.get("typeoid", 0)
            if value is not None:
                # OIDs are unique within the slot's database; without them, the name decides.
                convert = converters.get(type_oid or item["type"], _UNCACHED)
                if convert is _UNCACHED:
                    convert = converters[type_oid or item["type"]] = _value_converter(item["type"], type_oid)
                if convert is not None:
                    try:
                        value = convert(value)
                    except InexactValueError:
                        raise
                    except (ValueError, TypeError, ArithmeticError) as e:
                        raise ValueError(f"column {schema}.{table}.{item['name']} ({item['type']}): {e}") from e
                elif type(value) is not str:
                    raise ValueError(f"column {schema}.{table}.{item['name']} ({item['type']}): not a string")
            columns.append(Column(item["name"], item["type"], type_oid, value))
        return columns

    def _epoch_ms(self, text: Any) -> int | None:
        """'2024-03-31 01:30:00.123456+00' → epoch ms; one transaction's records share it (cached)."""
        if text is None:
            return None
        if text == self._timestamp_text:
            return self._timestamp_ms
        if type(text) is not str:
            raise TypeError(f"timestamp must be a string, got {text!r}")
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            raise ValueError(f"timestamp without a time zone offset: {text!r}")
        self._timestamp_text, self._timestamp_ms = text, (moment - _EPOCH) // _MILLISECOND
        return self._timestamp_ms


_BUILDERS: dict[str, Callable[[Wal2JsonDecoder, dict[str, Any]], ChangeMessage]] = {
    "B": lambda d, r: d._transaction(r, Kind.BEGIN),
    "C": lambda d, r: d._transaction(r, Kind.COMMIT),
    "I": lambda d, r: d._row(r, Kind.INSERT),
    "U": lambda d, r: d._row(r, Kind.UPDATE),
    "D": lambda d, r: d._row(r, Kind.DELETE),
    "T": lambda d, r: d._truncate(r, Kind.TRUNCATE),
    "M": lambda d, r: d._logical_message(r, Kind.MESSAGE),
}


_UNCACHED: Any = object()


def _value_converter(type_name: str, type_oid: int) -> Callable[[Any], Any] | None:
    """The type's converter, None for types whose value is the JSON string as is (text, unknown types)."""
    convert = converter(type_name, type_oid)
    return None if convert is converter("text", _TEXT_OID) else convert


def _lsn(text: Any) -> int:
    """'16/B374D848' → 0x16B374D848."""
    high, slash, low = text.partition("/")
    if not slash:
        raise ValueError(f"not an LSN: {text!r}")
    return int(high, 16) << 32 | int(low, 16)


def _xid(value: Any) -> int | None:
    if value is None or type(value) is int:
        return value
    raise TypeError(f"xid must be an integer, got {value!r}")


def _name(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a name string, got {value!r}")
    return value


def _quote_numeric_values(payload: bytes) -> bytes:
    """b'"typeoid":1700,"value":12.30}' → b'"typeoid":1700,"value":"12.30"}' (null stays null)."""
    parts = payload.split(_NUMERIC_VALUE)
    out = [parts[0]]
    for part in parts[1:]:
        out.append(_NUMERIC_VALUE)
        if part.startswith(b"null"):
            out.append(part)
        else:
            end = part.index(b"}")
            out += (b'"', part[:end], b'"', part[end:])
    return b"".join(out)


def _exact_int(text: str) -> int | Decimal:
    # Python refuses to parse ints of more than 4300 digits; a numeric can have 131072.
    return int(text) if len(text) <= _MAX_INT_DIGITS else Decimal(text)


def _loads_exact(payload: bytes) -> Any:
    """Parse with Decimal for every fraction; raw non-UTF-8 bytes survive as surrogates."""
    try:
        return json.loads(payload.decode("utf-8", "surrogateescape"), parse_float=Decimal, parse_int=_exact_int)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise DecodeError(f"malformed JSON from wal2json ({e}): {_excerpt(payload)}") from None


def _excerpt(payload: bytes) -> str:
    head = payload[:_EXCERPT_BYTES].decode("utf-8", "replace")
    more = "…" if len(payload) > _EXCERPT_BYTES else ""
    return f"{head!r}{more} ({len(payload)} bytes)"
