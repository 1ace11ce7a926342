"""Native snapshot reads (capture.snapshot_readers + native/src/snapshot.rs) against the Python reference path.

A parallel snapshot's reader processes read their ranges with ``COPY … TO STDOUT`` and encode the rows
between each batch's first and last in compiled code; the connector joins those images into whole
envelopes (``splice_reads``). The contract is byte equality with the Python path:

* generated rows (hypothesis) of every natively converted kind, written as PostgreSQL's COPY text
  writes them (its escapes, and the octal/hex escapes COPY reads), through both encoders: the same
  record key and value bytes, or a fallback row the Python path encodes;
* a real table of every kind with tricky values (escapes, control characters, NaN and ±Infinity, an
  infinite timestamp, a big row) read both ways — ``FETCH`` + ``result_rows`` and COPY + native —
  gives the same keys, values and TOAST-able values of big rows, row for row;
* the compiled COPY reader (``SnapshotEncoder.read_copy``: libpq's copy calls, no Python object per
  line) gives the batches :func:`copy_lines` + ``encode`` give, under both bounds, and raises a COPY's
  error as psycopg does;
* a whole parallel snapshot with the native readers equals one with ``--core python`` (readers on
  the Python path) record for record, apart from each envelope's processing time.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow as pa
import pytest
from capture_util import capture, drop_slots, fresh_database, latest_by_key, records, sql
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import capture.snapshot_readers as snapshot_readers
from capture.config import CoreChoice
from capture.converters import JsonConverter
from capture.errors import CaptureError
from capture.events import EventEncoder, TxnContext
from capture.native import extension
from capture.pgtypes import SESSION_OPTIONS, text_converter
from capture.snapshot import SnapshotSource
from capture.snapshot_readers import (
    PythonPath,
    ReaderSpec,
    copy_lines,
    copy_row_columns,
    copy_unescape,
    encode_native_batch,
    libpq_copy_functions,
    native_batch,
    native_encoder,
    read_copy,
)
from capture.tables import TableCatalog, TableColumn, TableFilter, TableInfo, result_rows, select_columns_sql
from tideline.pgharness import LocalPostgres

if not extension.available():
    pytest.skip("tideline_native is not built (make native)", allow_module_level=True)
assert extension.SnapshotEncoder is not None and extension.splice_reads is not None
SnapshotEncoder = extension.SnapshotEncoder
splice_reads = extension.splice_reads

NOW = 1_700_000_000_000
CTX = TxnContext(None, 123_456, 1_700_000_000_000, snapshot="true")


def encoder() -> EventEncoder:
    return EventEncoder("cdc", "db", TableFilter(), JsonConverter())


def native_values(enc: EventEncoder, table: TableInfo, lines: list[bytes]) -> tuple[list[bytes | None], list[bytes]]:
    """Lines (≥ 2) through the native path as the connector finishes them: keys and values, event index = position."""
    native = native_encoder(ReaderSpec("", "", "cdc", "db", TableFilter(), 1, 1, native=True), table)
    assert native is not None
    convs = [text_converter(c.type_name, c.type_oid) for c in table.columns]
    batch = encode_native_batch(PythonPath.of(enc, CTX), native, table, convs, lines, 0)
    assert batch.last is not None and batch.between == len(lines) - 2
    first_key, first, _ = enc.read_record(table, batch.first, CTX, 0, NOW)
    last_key, last, _ = enc.read_record(table, batch.last, CTX, len(lines) - 1, NOW)
    lead, mid, tail = enc.read_parts(table, CTX, NOW)
    data, offsets = splice_reads(lead, batch.afters, batch.after_offsets, mid, 1, tail)
    values = pa.Array.from_buffers(pa.binary(), batch.between, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    keys: list[bytes | None] = [None] * batch.between
    if batch.keys is not None and batch.key_offsets is not None:
        key_buffers = [None, pa.py_buffer(batch.key_offsets), pa.py_buffer(batch.keys)]
        keys = pa.Array.from_buffers(pa.binary(), batch.between, key_buffers).to_pylist()
    return [first_key, *keys, last_key], [first, *values.to_pylist(), last]


def reference_values(enc: EventEncoder, table: TableInfo, rows: list[list[Any]]) -> tuple[list[Any], list[bytes]]:
    out = [enc.read_record(table, columns, CTX, i, NOW) for i, columns in enumerate(rows)]
    return [key for key, _, _ in out], [value for _, value, _ in out]


# ---------------------------------------------------------------------------- generated COPY lines

COPY_ESCAPES = {"\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}


def copy_text(value: str, style: int) -> str:
    """``value`` as COPY text: PostgreSQL's own escapes (style 0), or for ASCII letters the octal (1) or hex (2)
    escapes COPY FROM reads, which the reader must take too."""
    out = []
    for ch in value:
        if ch in COPY_ESCAPES:
            out.append(COPY_ESCAPES[ch])
        elif style == 1 and ch.isascii() and ch.isalpha():
            out.append(f"\\{ord(ch):03o}")
        elif style == 2 and ch.isascii() and ch.isalpha():
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


GENERATED = TableInfo.make(
    "public",
    "gen",
    (
        TableColumn("id", "bigint", 20),
        TableColumn("t", "text", 25),
        TableColumn("v", "character varying(40)", 1043),
        TableColumn("n", "numeric", 1700),
        TableColumn("f", "double precision", 701),
        TableColumn("b", "boolean", 16),
        TableColumn("ts", "timestamp with time zone", 1184),
        TableColumn("j", "jsonb", 3802),
    ),
    ("id",),
    "primary key",
    "d",
)

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\x00"), max_size=40)
numerics = st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(lambda d: format(d, "f")),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "-0", "00.5", "1e5", "0.000"]),
)
floats = st.one_of(
    st.floats(allow_nan=False).map(repr), st.sampled_from(["NaN", "Infinity", "-Infinity", "-0", "1e+300"])
)
timestamps = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 1)).map(lambda d: d.isoformat(" ") + "+00"),
    st.sampled_from(["infinity", "-infinity", "2024-02-29 23:59:59.999999+05:30", "0044-03-15 12:00:00+00 BC"]),
)
jsons = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
).map(lambda v: orjson.dumps(v).decode())
rows = st.lists(
    st.tuples(
        st.integers(-(2**63), 2**63 - 1),
        st.none() | texts | texts.filter(bool).map(lambda t: t * (1100 // len(t) + 1)),  # big: TOAST-able size
        st.none() | texts,
        st.none() | numerics,
        st.none() | floats,
        st.none() | st.sampled_from(["t", "f"]),
        st.none() | timestamps,
        st.none() | jsons,
        st.integers(0, 2),
    ),
    min_size=2,
    max_size=12,
)


def line_of(row: tuple[Any, ...]) -> bytes:
    *values, style = row
    fields = ["\\N" if v is None else copy_text(str(v), style) for v in values]
    return ("\t".join(fields) + "\n").encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows)
def test_generated_copy_lines_encode_as_the_python_path_does(generated: list[tuple[Any, ...]]) -> None:
    enc = encoder()
    lines = [line_of(row) for row in generated]
    convs = [text_converter(c.type_name, c.type_oid) for c in GENERATED.columns]
    try:
        reference = reference_values(enc, GENERATED, [copy_row_columns(GENERATED, convs, line) for line in lines])
    except (ValueError, ArithmeticError, CaptureError) as e:  # the reference refuses a value: so does the native path
        with pytest.raises(type(e)):
            native_values(enc, GENERATED, lines)
        return
    assert native_values(enc, GENERATED, lines) == reference


def test_copy_unescape_reads_every_escape_copy_knows() -> None:
    assert copy_unescape(b"plain") == "plain"
    assert copy_unescape(b"a\\tb\\nc\\\\d\\re\\bf\\fg\\vh") == "a\tb\nc\\d\re\bf\fg\vh"
    assert copy_unescape(b"\\101\\x42\\7\\x4") == "AB\x07\x04"
    assert copy_unescape(b"\\q\\N") == "qN"  # another character stands for itself (\N is NULL only as a whole field)
    assert copy_unescape("é\\t€".encode()) == "é\t€"
    with pytest.raises(CaptureError, match="lone backslash"):
        copy_unescape(b"ends\\")


def test_a_line_of_another_width_is_an_error_naming_the_table() -> None:
    convs = [text_converter(c.type_name, c.type_oid) for c in GENERATED.columns]
    with pytest.raises(CaptureError, match=r"public\.gen has 2 fields, not 8"):
        copy_row_columns(GENERATED, convs, b"1\tx\n")
    with pytest.raises(CaptureError, match="does not end with a newline"):
        copy_row_columns(GENERATED, convs, b"1")


def test_the_encoder_refuses_what_it_cannot_convert() -> None:
    with pytest.raises(ValueError, match='column "i" has type OID 1186'):
        SnapshotEncoder(["id", "i"], [20, 1186], ["id"], [])
    with pytest.raises(ValueError, match='key column "nope"'):
        SnapshotEncoder(["id"], [20], ["nope"], [])
    with pytest.raises(ValueError, match="offsets do not fit"):
        splice_reads(b"", b"abc", (0).to_bytes(4, "little") + (9).to_bytes(4, "little"), b"", 0, b"")


# ---------------------------------------------------------------------------- a real table, read both ways


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "nsnap")
    yield dsn
    drop_slots(dsn)


KINDS_TABLE = (
    "CREATE TABLE kinds (id bigint PRIMARY KEY, s smallint, i integer, o oid, n numeric(20,4), r real, "
    "d double precision, b boolean, t text, c char(5), v varchar(20), nm name, j json, jb jsonb, u uuid, "
    "by bytea, dt date, ts timestamp, tz timestamptz, tm time, ttz timetz, bx box)"
)
KINDS_ROWS = (
    "INSERT INTO kinds SELECT g, g % 32000, g * 7, g, g / 3.0, g / 7.0, g / 9.0, g % 2 = 0, "
    "'text ' || g || E'\\t tab \\\\ back \\n nl \\u0001 ctl é €', 'c' || (g % 100), 'v' || g, 'nm' || g, "
    "json_build_object('g', g, 's', E'q\"\\\\'), jsonb_build_object('a', g, 'b', ARRAY[1, 2]), "
    "md5(g::text)::uuid, decode(md5(g::text), 'hex'), '2024-01-01'::date + g, "
    "'2024-01-01 12:00:00'::timestamp + g * interval '1 second', "
    "'2024-01-01 12:00:00+00'::timestamptz + g * interval '1 millisecond', '12:34:56.789'::time, "
    "'12:34:56+05:30'::timetz, box(point(g, g), point(0, 0)) FROM generate_series(1, 3000) g"
)
UNUSUAL_ROWS = (  # forms the native path leaves to the Python one, a big row, NULLs everywhere, and a last row
    "INSERT INTO kinds (id, n, r, d, ts, tz, tm, t) VALUES "
    "(100001, 'NaN', 'NaN', '-Infinity', 'infinity', '-infinity', '24:00:00', NULL), "
    "(100002, 1.5, 2.5, 3.5, '2024-01-01 00:00:00', '2024-01-01 00:00:00+00', '01:02:03', repeat('x', 3000)), "
    "(100003, '-0.0', 'Infinity', '-0', '0044-03-15 12:00:00 BC', NULL, NULL, NULL), "
    "(100004, NULL, NULL, NULL, NULL, NULL, NULL, E'\\\\N'), "
    "(100005, 1, 1, 1, '2024-01-01 00:00:00', '2024-01-01 00:00:00+00', '01:02:03', 'last')"
)


def test_a_table_of_every_kind_reads_natively_as_the_python_path_reads_it(db: str) -> None:
    sql(db, KINDS_TABLE, KINDS_ROWS, UNUSUAL_ROWS)
    table = TableCatalog(db, TableFilter()).load()[0]
    enc = encoder()
    native = native_encoder(ReaderSpec(db, "", "cdc", "db", TableFilter(), 1, 1, native=True), table)
    assert native is not None
    convs = [text_converter(c.type_name, c.type_oid) for c in table.columns]
    select = select_columns_sql(table) + " ORDER BY id"
    with psycopg.connect(db, options=SESSION_OPTIONS) as c:
        res = c.execute(select.encode()).pgresult
        assert res is not None
        reference = reference_values(enc, table, list(result_rows(res, table)))
        lines = [line for chunk in copy_lines(c, f"COPY ({select}) TO STDOUT", 1000) for line in chunk]
    assert len(lines) == 3005
    # one batch: the first and last lines take the Python path, every other row the native one (or its fallback)
    assert native_values(enc, table, lines) == reference
    batch = encode_native_batch(PythonPath.of(enc, CTX), native, table, convs, lines, 0)
    _, _, _, _, fallback = native.encode(lines[1:-1])
    # positions among the rows between: ids 100001 (infinite timestamps, 24:00:00), 100002 (big: its size alone),
    # 100003 (a BC timestamp); 100004 (every value NULL, a text that reads \N) is native
    assert sorted(fallback) == [2999, 3000, 3001]
    assert list(batch.big) == [3000]  # the big row's TOAST-able values, as the Python path keeps them
    big_after = enc.read_record(table, copy_row_columns(table, convs, lines[3001]), CTX, 0, NOW)[2]
    assert batch.big[3000] == enc.toast_values(table, big_after)


def test_the_compiled_copy_reader_gives_the_batches_psycopg_lines_give(db: str) -> None:
    sql(db, KINDS_TABLE, KINDS_ROWS, UNUSUAL_ROWS)
    table = TableCatalog(db, TableFilter()).load()[0]
    enc = encoder()
    native = native_encoder(ReaderSpec(db, "", "cdc", "db", TableFilter(), 1, 1, native=True), table)
    libpq = libpq_copy_functions()
    assert native is not None and libpq is not None  # psycopg's libpq found: the reader's usual path
    convs = [text_converter(c.type_name, c.type_oid) for c in table.columns]
    copy = f"COPY ({select_columns_sql(table)} ORDER BY id) TO STDOUT"
    for size, max_bytes in ((1000, 1 << 62), (7, 1 << 62), (1000, 20_000), (1, 1 << 62), (3005, 1 << 62)):
        with psycopg.connect(db, options=SESSION_OPTIONS) as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            expected = [encode_native_batch(PythonPath.of(enc, CTX), native, table, convs, lines, 4)
                        for lines in copy_lines(c, copy, size, max_bytes)]  # fmt: skip
            python = PythonPath.of(enc, CTX)
            got = [native_batch(python, table, convs, 4, *read)
                   for read in read_copy(c, native, libpq, copy, size, max_bytes)]  # fmt: skip
            assert c.execute("SELECT count(*) FROM kinds").fetchone() == (3005,)  # the connection is idle again
        assert repr(got) == repr(expected), (size, max_bytes)  # repr: NaN values (id 100001) equal themselves
        assert sum(b.rows for b in got) == 3005
    assert any(b.big for b in got) and len(got) == 1  # the whole table in one batch: the big row's values kept


def test_the_compiled_copy_reader_raises_a_copy_error_as_psycopg_does(db: str) -> None:
    sql(db, "CREATE TABLE plain (id int PRIMARY KEY)", "INSERT INTO plain SELECT generate_series(1, 10)")
    libpq = libpq_copy_functions()
    assert libpq is not None
    one_int = SnapshotEncoder(["x"], [23], [], [])

    def sizes(c: psycopg.Connection[Any], copy: str, size: int, max_bytes: int = 1 << 62) -> list[int]:
        return [1 + between + (last is not None)
                for _, last, between, _, _ in read_copy(c, one_int, libpq, copy, size, max_bytes)]  # fmt: skip

    with psycopg.connect(db) as c:  # in a transaction, as a reader reads: it is failed, and psycopg knows it
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        assert sizes(c, "COPY plain TO STDOUT", 100, max_bytes=6) == [3, 3, 3, 1]
        with pytest.raises(psycopg.errors.DivisionByZero):
            sizes(c, "COPY (SELECT 1 / (id - 5) FROM plain) TO STDOUT", 3)
        assert c.info.transaction_status is psycopg.pq.TransactionStatus.INERROR
        c.rollback()
        assert c.execute("SELECT count(*) FROM plain").fetchone() == (10,)
    with psycopg.connect(db, autocommit=True) as c:
        with pytest.raises(psycopg.errors.DivisionByZero):
            sizes(c, "COPY (SELECT 1 / (id - 5) FROM plain) TO STDOUT", 3)
        with pytest.raises(psycopg.errors.UndefinedTable):
            sizes(c, "COPY (SELECT * FROM missing) TO STDOUT", 3)
        assert sizes(c, "COPY plain TO STDOUT", 4) == [4, 4, 2]
        assert sizes(c, "COPY plain TO STDOUT", 5) == [5, 5]  # the COPY's end met by a call that reads no line
        assert sizes(c, "COPY (SELECT 1 WHERE false) TO STDOUT", 5) == []
    with pytest.raises(ValueError, match="null"):
        one_int.read_copy(0, *libpq, 1, 1)
    with psycopg.connect(db, autocommit=True) as c:  # bounds that may read nothing: refused, not "more" forever
        for max_rows, max_bytes in ((0, 1 << 20), (100, 0)):
            with pytest.raises(ValueError, match="must be at least 1"):
                sizes(c, "COPY plain TO STDOUT", max_rows, max_bytes)


def test_a_table_with_a_type_not_converted_natively_is_read_by_the_python_path(db: str) -> None:
    sql(db, "CREATE TABLE odd (id int PRIMARY KEY, span interval)")
    table = TableCatalog(db, TableFilter()).load()[0]
    spec = ReaderSpec(db, "", "cdc", "db", TableFilter(), 1, 1, native=True)
    assert native_encoder(spec, table) is None
    assert native_encoder(ReaderSpec(db, "", "cdc", "db", TableFilter(), 1, 1, native=False), table) is None
    masked = TableFilter(mask_columns=["public.odd.span"])
    sql(db, "CREATE TABLE plain (id int PRIMARY KEY, v text)")
    plain = next(t for t in TableCatalog(db, TableFilter()).load() if t.name == "plain")
    assert native_encoder(ReaderSpec(db, "", "cdc", "db", masked, 1, 1, native=True), plain) is None
    assert native_encoder(spec, plain) is not None


def test_a_copy_error_is_raised_as_psycopg_raises_it_and_the_connection_stays_usable(db: str) -> None:
    sql(db, "CREATE TABLE plain (id int PRIMARY KEY)", "INSERT INTO plain SELECT generate_series(1, 10)")
    with psycopg.connect(db) as c:  # in a transaction, as a reader reads: it is failed, and psycopg knows it
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        assert [len(chunk) for chunk in copy_lines(c, "COPY plain TO STDOUT", 100, max_bytes=6)] == [3, 3, 3, 1]
        with pytest.raises(psycopg.errors.DivisionByZero):
            list(copy_lines(c, "COPY (SELECT 1 / (id - 5) FROM plain) TO STDOUT", 3))
        assert c.info.transaction_status is psycopg.pq.TransactionStatus.INERROR
        c.rollback()
        assert c.execute("SELECT count(*) FROM plain").fetchone() == (10,)
    with psycopg.connect(db, autocommit=True) as c:
        with pytest.raises(psycopg.errors.DivisionByZero):
            list(copy_lines(c, "COPY (SELECT 1 / (id - 5) FROM plain) TO STDOUT", 3))
        assert c.execute("SELECT count(*) FROM plain").fetchone() == (10,)
        with pytest.raises(psycopg.errors.UndefinedTable):
            list(copy_lines(c, "COPY (SELECT * FROM missing) TO STDOUT", 3))
        assert [len(chunk) for chunk in copy_lines(c, "COPY plain TO STDOUT", 4)] == [4, 4, 2]


# ---------------------------------------------------------------------------- whole snapshots


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges of 8 blocks (64 KiB), so the test tables split into several."""
    monkeypatch.setattr(snapshot_readers, "MIN_RANGE_BLOCKS", 8)


def comparable(log_dir: Path, topic: str) -> list[tuple[bytes, bytes]]:
    """(key, value) of every record, sorted, without what differs between two snapshots of one table: the
    envelope's processing time, the snapshot's start and its slot's LSN, and each read's event index and marker
    (they follow the order readers finish their ranges in)."""
    out = []
    for key, value, _ in records(log_dir, topic):
        assert value is not None
        del value["ts_ms"]
        for field in ("ts_ms", "commit_lsn", "lsn", "event_index", "snapshot"):
            del value["source"][field]
        out.append((orjson.dumps(key), orjson.dumps(value)))
    return sorted(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_native_snapshot_equals_one_on_the_python_path(db: str, tmp_path: Path, workers: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Reader processes (2), or the connector's own connection (1), reading natively or on the Python path."""
    sql(db, KINDS_TABLE, KINDS_ROWS, UNUSUAL_ROWS, "CREATE TABLE loose (a int, b text)",
        "INSERT INTO loose SELECT g % 100, 'b' || g FROM generate_series(1, 5000) g", "VACUUM ANALYZE")  # fmt: skip
    own_native: list[str] = []  # tables the connector's own connection read natively
    read_native = SnapshotSource._read_native

    def counting(self: SnapshotSource, c: Any, table: TableInfo, *args: Any) -> None:
        own_native.append(table.name)
        read_native(self, c, table, *args)

    monkeypatch.setattr(SnapshotSource, "_read_native", counting)
    native, python = tmp_path / "native", tmp_path / "python"
    a = capture(native, db, slot="native", snapshot_workers=workers, state_dir=tmp_path / "sn")
    assert sorted(own_native) == (["kinds", "loose"] if workers == 1 else [])
    b = capture(python, db, slot="python", snapshot_workers=workers, state_dir=tmp_path / "sp",
                core=CoreChoice.PYTHON)  # fmt: skip
    assert sorted(own_native) == (["kinds", "loose"] if workers == 1 else [])  # --core python: none
    assert a.snapshot_rows == b.snapshot_rows == 3005 + 5000
    for topic in ("cdc.public.kinds", "cdc.public.loose"):
        assert comparable(native, topic) == comparable(python, topic), topic


def test_after_a_native_snapshot_deletes_and_a_truncate_reach_every_key_once(db: str, tmp_path: Path) -> None:
    """The snapshot's keys went to the key state in bulk (a key run): after a restart, rows deleted since are
    not live any more, and a TRUNCATE tombstones every other key exactly once."""
    sql(db, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20000) g")  # fmt: skip
    log_dir, state = tmp_path / "log", tmp_path / "state"
    assert capture(log_dir, db, snapshot_workers=2, state_dir=state).snapshot_rows == 20_000
    assert list(state.glob("*.runs/*.keys")), "the snapshot's keys were not written as a key run"
    sql(db, "DELETE FROM t WHERE id % 10 = 0", "INSERT INTO t VALUES (30000, 'late')", "TRUNCATE t")
    capture(log_dir, db, snapshot_workers=2, state_dir=state)  # a new connector process would do the same
    after_truncate: list[Any] = []
    seen_truncate = False
    for key, value, _ in records(log_dir, "cdc.public.t"):
        if value is not None and value["op"] == "t":
            seen_truncate = True
        elif seen_truncate:
            assert value is None
            after_truncate.append(key["id"])
    expected = sorted([i for i in range(1, 20_001) if i % 10] + [30000])
    assert sorted(after_truncate) == expected  # each live key once; none of the deleted ones
    assert latest_by_key(log_dir, "cdc.public.t") == {}
