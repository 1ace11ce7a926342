"""``tideline log …`` end to end through the real CLI app on real log directories (no mocks)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from readiness import load_factor, patience
from typer.testing import CliRunner, Result

from eventstore.consumer import Consumer, TopicPartition
from eventstore.log import Log
from eventstore.partitioner import partition_for_key
from eventstore.producer import Producer
from tideline.cli import app
from tideline.log_cli import iter_line_chunks, parse_line, produce_lines

Run = Callable[..., Result]
TOMBSTONE = "\\N"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "log"


@pytest.fixture
def tl(data_dir: Path) -> Run:
    """Run ``tideline --data-dir <tmp> ARGS…`` in-process; ``input`` feeds stdin."""
    runner = CliRunner()

    def run(*args: str, input: bytes | str | None = None) -> Result:
        return runner.invoke(app, ["--data-dir", str(data_dir), *args], input=input)

    return run


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result


def one_line_error(result: Result, *needles: str) -> str:
    """Assert a failed run printed exactly one ``error: …`` line naming every needle."""
    assert result.exit_code != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not isinstance(result.exception, AssertionError | TypeError | AttributeError | KeyError)
    return lines[0]


def tail_json(tl: Run, topic: str, *args: str) -> list[dict[str, Any]]:
    out = ok(tl("log", "tail", topic, *args, "--json")).stdout
    return [json.loads(line) for line in out.splitlines()]


# ---------------------------------------------------------------------------- create / topics / describe


def test_create_topics_describe(tl: Run, data_dir: Path) -> None:
    settings = ["--config", "segment_bytes=65536", "-c", "delete_retention_ms=0"]
    ok(tl("log", "create", "orders", "--partitions", "3", *settings))
    ok(tl("log", "create", "profiles", "--compact"))
    assert (data_dir / "tideline-log.json").exists()

    assert ok(tl("log", "topics")).stdout.split() == ["orders", "profiles"]
    assert json.loads(ok(tl("log", "topics", "--json")).stdout) == [
        {"topic": "orders", "partitions": 3, "cleanup_policy": "delete"},
        {"topic": "profiles", "partitions": 1, "cleanup_policy": "compact"},
    ]

    info = json.loads(ok(tl("log", "describe", "orders", "--json")).stdout)
    assert info["topic"] == "orders"
    assert info["partitions"] == 3
    assert info["config"]["segment_bytes"] == 65536
    assert info["config"]["delete_retention_ms"] == 0
    assert info["config"]["cleanup_policy"] == "delete"
    assert [p["partition"] for p in info["partition_info"]] == [0, 1, 2]
    assert all(p["log_start_offset"] == 0 == p["log_end_offset"] for p in info["partition_info"])

    table = ok(tl("log", "describe", "orders")).stdout
    assert "segment_bytes" in table and "65536" in table and "end offset" in table

    one_line_error(tl("log", "create", "orders"), "orders", "already exists")


def test_config_parsing(tl: Run, data_dir: Path) -> None:
    """Kafka's dotted names work; a bad key, value or shape is one line, and creates nothing."""
    for args, needles in [
        (["-c", "segment_bites=4096"], ["segment_bites", "unknown topic setting"]),
        (["-c", "segment_bytes=lots"], ["segment_bytes", "'lots'"]),
        (["-c", "segment_bytes=100"], ["segment_bytes", "1024"]),
        (["-c", "cleanup_policy=shred"], ["shred"]),
        (["-c", "compression=snappy"], ["snappy"]),
        (["-c", "segment_bytes"], ["KEY=VALUE", "segment_bytes"]),
        (["--compact", "-c", "cleanup.policy=delete"], ["--compact", "cleanup.policy=delete"]),
        (["--partitions", "0"], ["partitions", "0"]),
        (["--partitions", "-2"], ["partitions", "-2"]),
    ]:
        one_line_error(tl("log", "create", "t", *args), *needles)
    one_line_error(tl("log", "create", "bad/name"), "bad/name")
    one_line_error(tl("log", "create", "t", "-p", "1000000"), "partitions", "1000000")
    assert not data_dir.exists()  # bad arguments are refused before the log is opened

    ok(
        tl(
            "log", "create", "t", "-c", "segment.bytes=2048", "-c", "cleanup.policy=compact,delete",
            "-c", "compression.type=zstd", "--config", "retention_ms=-1",
        )
    )  # fmt: skip
    config = json.loads(ok(tl("log", "describe", "t", "--json")).stdout)["config"]
    assert config["segment_bytes"] == 2048
    assert config["cleanup_policy"] == "compact,delete"
    assert config["compression"] == "zstd"
    assert config["retention_ms"] == -1


def test_read_commands_do_not_create_a_log(tl: Run, data_dir: Path) -> None:
    for args in (["topics"], ["describe", "t"], ["tail", "t"], ["compact", "t"], ["produce", "t"], ["groups"]):
        one_line_error(tl("log", *args, input=b"k\tv\n"), "no Tideline log at", str(data_dir))
    assert not data_dir.exists()


def test_unknown_topic(tl: Run) -> None:
    ok(tl("log", "create", "orders"))
    for args in (["describe", "nope"], ["tail", "nope"], ["compact", "nope"], ["produce", "nope"]):
        one_line_error(tl("log", *args, input=b"k\tv\n"), "unknown topic", "nope")


def test_every_command_has_help(tl: Run) -> None:
    for command in ("create", "topics", "describe", "produce", "tail", "compact", "groups"):
        result = ok(tl("log", command, "--help"))
        assert "Usage" in result.stdout
    assert "base64" in ok(tl("log", "tail", "--help")).stdout  # the binary marker is documented


# ---------------------------------------------------------------------------- produce / tail

ROUND_TRIP_INPUT = (
    b"order-1\tcreated\n"
    b"a keyless value\n"
    b'order-2\t{"total": 3}\n'
    b"order-1\t\\N\n"  # tombstone
    b"\n"  # skipped
    b"order-3\tvalue\twith\ttabs\n"
    b"\\N\tkeyless, explicitly\n"
    b"\\N\n"  # keyless tombstone
    b"caf\xc3\xa9\t\xe2\x82\xac 5 \xf0\x9f\x9a\x80\n"  # UTF-8
    b"order-4\twindows line\r\n"
    b"bin\t\xff\x00\xfe\n"  # not UTF-8
    b"\xfekey\tv\n"  # key not UTF-8
    b"order-5\tlast line without newline"
)
EXPECTED = [
    (b"order-1", b"created"),
    (None, b"a keyless value"),
    (b"order-2", b'{"total": 3}'),
    (b"order-1", None),
    (b"order-3", b"value\twith\ttabs"),
    (None, b"keyless, explicitly"),
    (None, None),
    ("café".encode(), "€ 5 🚀".encode()),
    (b"order-4", b"windows line"),
    (b"bin", b"\xff\x00\xfe"),
    (b"\xfekey", b"v"),
    (b"order-5", b"last line without newline"),
]


def _decode(field: Any) -> bytes | None:
    if field is None:
        return None
    if isinstance(field, dict):
        import base64

        assert set(field) == {"base64"}
        return base64.b64decode(field["base64"])
    assert isinstance(field, str)
    return field.encode()


def test_produce_then_tail_round_trip(tl: Run) -> None:
    ok(tl("log", "create", "orders", "--partitions", "3"))
    result = ok(tl("log", "produce", "orders", input=ROUND_TRIP_INPUT))
    assert result.stdout == ""
    summary = result.stderr.strip()
    assert summary.startswith("produced 12 records to orders (3 keyless, 2 tombstones)"), summary
    assert "records per partition:" in summary

    records = tail_json(tl, "orders", "--from-beginning")
    assert len(records) == len(EXPECTED)
    assert all(set(r) == {"partition", "offset", "timestamp", "key", "value", "headers"} for r in records)
    assert all(r["headers"] == [] and isinstance(r["timestamp"], int) for r in records)
    assert {"base64": "/wD+"} in [r["value"] for r in records]  # binary values are marked, not mangled

    by_partition: dict[int, list[tuple[bytes | None, bytes | None]]] = {}
    for r in records:
        rows = by_partition.setdefault(r["partition"], [])
        assert r["offset"] == len(rows)  # dense offsets, printed in offset order per partition
        rows.append((_decode(r["key"]), _decode(r["value"])))
    # Every record came back once, each keyed one in its murmur2 partition, in input order per partition.
    placed = {kv: p for p, rows in by_partition.items() for kv in rows}
    assert sorted(placed, key=repr) == sorted(EXPECTED, key=repr)
    for key, value in EXPECTED:
        if key is not None:
            assert placed[(key, value)] == partition_for_key(key, 3)
    for p, rows in by_partition.items():
        assert rows == [kv for kv in EXPECTED if placed[kv] == p]

    # Without --follow and --from-beginning: the same records (from the start up to the end offsets).
    assert tail_json(tl, "orders") == records
    # Plain lines: PARTITION:OFFSET, time, COPY-style key and value.
    lines = ok(tl("log", "tail", "orders")).stdout.splitlines()
    assert len(lines) == len(EXPECTED)
    p3 = partition_for_key(b"order-3", 3)
    assert any(line.startswith(f"{p3}:") and line.endswith("\torder-3\tvalue\\twith\\ttabs") for line in lines)
    assert any(line.endswith("\torder-1\t\\N") for line in lines)
    assert any(line.endswith("\t\\N\t\\N") for line in lines)
    assert any(line.endswith("\tbin\t\\xff\x00\\xfe") for line in lines)
    assert all(line.split("\t")[1].endswith("Z") for line in lines)


def test_produce_to_one_partition_and_tail_from_offset(tl: Run) -> None:
    ok(tl("log", "create", "t", "-p", "3"))
    lines = "".join(f"k{i}\tv{i}\n" for i in range(10))
    assert "2:10" in ok(tl("log", "produce", "t", "--partition", "2", input=lines)).stderr
    records = tail_json(tl, "t", "--partition", "2", "--offset", "7")
    assert [(r["offset"], r["key"], r["value"]) for r in records] == [(i, f"k{i}", f"v{i}") for i in (7, 8, 9)]
    assert tail_json(tl, "t", "--partition", "0") == []
    assert tail_json(tl, "t", "--offset", "100") == []  # past the end: nothing, and it stops
    assert [r["offset"] for r in tail_json(tl, "t", "--offset", "8")] == [8, 9]  # every partition from 8

    one_line_error(tl("log", "produce", "t", "--partition", "3", input=lines), "partitions 0 … 2", "3")
    one_line_error(tl("log", "produce", "t", "--partition", "-1", input=lines), "-1")
    one_line_error(tl("log", "tail", "t", "--partition", "5"), "partitions 0 … 2", "5")
    one_line_error(tl("log", "tail", "t", "--offset", "-1"), "--offset")
    one_line_error(tl("log", "tail", "t", "--offset", "1", "--from-beginning"), "--offset", "--from-beginning")


def test_keyless_line_on_compacted_topic_is_refused(tl: Run) -> None:
    ok(tl("log", "create", "c", "--compact"))
    one_line_error(tl("log", "produce", "c", input=b"k\tv\n\nno key here\n"), "line 3", "'c'", "compacted")
    assert tail_json(tl, "c") == []  # the chunk holding the bad line was not written


def test_produce_lines_across_tiny_chunks(tmp_path: Path) -> None:
    """Lines split across reads, CRLF at chunk ends: order and content survive; errors name the line."""
    lines = [b"key-%d\tvalue %d\r\n" % (i % 7, i) for i in range(500)]
    text = b"".join(lines)
    chunks = list(iter_line_chunks(io.BytesIO(text), 64))
    assert len(chunks) > 50
    assert [parse_line(ln) for chunk in chunks for ln in chunk] == [
        (b"key-%d" % (i % 7), b"value %d" % i) for i in range(500)
    ]
    with Log(tmp_path / "log") as log:
        log.create_topic("t", 2)
        log.create_topic("c", 1, overrides={"cleanup_policy": "compact"})
        summary = produce_lines(log, "t", io.BytesIO(text), chunk_bytes=64)
        assert summary.records == 500 and sum(summary.per_partition.values()) == 500
        with pytest.raises(Exception, match="line 301 has no key"):
            produce_lines(log, "c", io.BytesIO(b"".join(lines[:300]) + b"oops\n"), chunk_bytes=64)
    runner = CliRunner()
    out = runner.invoke(app, ["--data-dir", str(tmp_path / "log"), "log", "tail", "t", "--json"]).stdout
    values = {p: [json.loads(x)["value"] for x in out.splitlines() if json.loads(x)["partition"] == p] for p in (0, 1)}
    for p, vals in values.items():
        assert [int(v.split()[1]) for v in vals] == sorted(int(v.split()[1]) for v in vals), p


def test_produce_100k_lines_is_fast(tl: Run) -> None:
    ok(tl("log", "create", "big", "-p", "4"))
    text = "".join(f"customer-{i % 5000}\torder {i} " + "x" * 80 + "\n" for i in range(100_000))
    started = time.monotonic()
    result = ok(tl("log", "produce", "big", input=text))
    assert time.monotonic() - started < 10 * load_factor(), result.stderr  # 10 s on a quiet machine
    assert "produced 100000 records" in result.stderr
    info = json.loads(ok(tl("log", "describe", "big", "--json")).stdout)
    assert sum(p["log_end_offset"] for p in info["partition_info"]) == 100_000


def test_tail_follow_until_ctrl_c(data_dir: Path) -> None:
    """--follow starts at the end, prints new records as they come, and Ctrl-C ends it cleanly."""
    cli = [sys.executable, "-c", "from tideline.cli import main; main()", "--data-dir", str(data_dir)]
    subprocess.run([*cli, "log", "create", "live", "-p", "2"], check=True, capture_output=True)
    subprocess.run([*cli, "log", "produce", "live"], input=b"old\tbefore the tail started\n", check=True)
    follower = subprocess.Popen(
        [*cli, "log", "tail", "live", "--follow", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert follower.stdout is not None
        os.set_blocking(follower.stdout.fileno(), False)
        seen = b""
        deadline = time.monotonic() + patience(60)
        i = 0
        while b"\n" not in seen:  # produce until the follower (started at the end) shows a record
            assert time.monotonic() < deadline, "tail --follow printed nothing"
            subprocess.run([*cli, "log", "produce", "live"], input=b"new\t%d\n" % i, check=True, capture_output=True)
            i += 1
            time.sleep(0.3)
            seen += follower.stdout.read() or b""
        follower.send_signal(signal.SIGINT)
        rest, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    records = [json.loads(line) for line in (seen + rest).splitlines()]
    assert records and all(r["key"] == "new" for r in records)  # "old" came before the start
    assert b"processed" in err


def test_produce_sends_lines_as_they_arrive(data_dir: Path) -> None:
    """Interactive input: a line is appended when typed, not when stdin closes."""
    cli = [sys.executable, "-c", "from tideline.cli import main; main()", "--data-dir", str(data_dir)]
    subprocess.run([*cli, "log", "create", "typed"], check=True, capture_output=True)
    producer = subprocess.Popen([*cli, "log", "produce", "typed"], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert producer.stdin is not None
        producer.stdin.write(b"first\tline\n")
        producer.stdin.flush()
        deadline = time.monotonic() + patience(60)
        while True:
            with Log(data_dir, create=False) as log:
                if log.partition("typed", 0).log_end_offset() == 1:
                    break
            assert time.monotonic() < deadline, "the typed line was not appended while stdin stayed open"
            time.sleep(0.1)
        assert producer.poll() is None  # still reading
        _, err = producer.communicate(b"second\tline\n", timeout=30)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0
    assert b"produced 2 records" in err


# ---------------------------------------------------------------------------- corruption


def test_corrupt_batch_in_a_closed_segment_names_the_file(tl: Run, data_dir: Path) -> None:
    ok(tl("log", "create", "t", "-c", "segment_bytes=2048"))
    for round_ in range(12):  # one batch per produce call: several batches per segment, several segments
        ok(tl("log", "produce", "t", input="".join(f"k{i}\tround {round_} {i}\n" for i in range(3))))
    segments = sorted((data_dir / "t-0").glob("*.log"))
    assert len(segments) >= 3
    first = segments[0]
    raw = bytearray(first.read_bytes())
    raw[100] ^= 0x5A  # inside the payload of the first batch: its checksum fails, batches follow it
    first.write_bytes(bytes(raw))

    for args in (["--from-beginning"], ["--from-beginning", "--json"]):
        error = one_line_error(tl("log", "tail", "t", *args), str(first), "corrupt")
        assert "checksum" in error
    # Data past the damaged segment is still readable from an offset beyond it.
    later = int(segments[1].name[:20])
    assert tail_json(tl, "t", "--offset", str(later))[0]["offset"] == later


def test_unreadable_topic_metadata_is_one_line(tl: Run, data_dir: Path) -> None:
    ok(tl("log", "create", "t"))
    meta = data_dir / "_topics" / "t.json"
    meta.write_text(meta.read_text().replace('"partitions": 1', '"partitions": 2'))
    for args in (["describe", "t"], ["tail", "t"], ["topics", "--json"]):
        one_line_error(tl("log", *args), str(meta))


# ---------------------------------------------------------------------------- compact


def test_compact_keeps_the_last_value_of_every_key(tl: Run) -> None:
    settings = ["-c", "segment_bytes=1024", "-c", "delete_retention_ms=0"]
    ok(tl("log", "create", "profiles", "--compact", "-p", "2", *settings))
    keys = [f"user-{i}" for i in range(20)]
    expected: dict[str, str | None] = {}

    def produce(values: dict[str, str | None]) -> None:
        text = "".join(f"{k}\t{TOMBSTONE if v is None else v}\n" for k, v in values.items())
        ok(tl("log", "produce", "profiles", input=text))
        expected.update(values)

    pad = "x" * 80  # big enough that every produce call's batch rolls the segment (segment_bytes=1024)
    for round_ in range(5):
        produce({k: f"{k} v{round_} {pad}" for k in keys})
    produce({k: None for k in keys[:5]} | {k: f"{k} v5 {pad}" for k in keys[5:13]})  # delete 5 keys
    final_keys = keys[13:]  # the last batch of both partitions: their active segments, never compacted
    assert {partition_for_key(k.encode(), 2) for k in final_keys} == {0, 1}
    produce({k: f"{k} final {pad}" for k in final_keys})
    info = json.loads(ok(tl("log", "describe", "profiles", "--json")).stdout)
    assert [p["segments"] for p in info["partition_info"]] == [7, 7]
    before = tail_json(tl, "profiles")

    stats = json.loads(ok(tl("log", "compact", "profiles", "--json")).stdout)
    assert stats["cleanup_policy"] == "compact"
    assert sum(p["segments_cleaned"] for p in stats["partitions"]) > 0
    read = sum(p["records_read"] for p in stats["partitions"])
    kept = sum(p["records_kept"] for p in stats["partitions"])
    assert kept < read

    after = tail_json(tl, "profiles")
    assert len(after) < len(before)
    last: dict[str, str | None] = {}
    for r in sorted(after, key=lambda r: (r["partition"], r["offset"])):
        last[r["key"]] = r["value"]
    assert last == expected
    for k in keys[5:13]:  # keys written only in closed segments: exactly their last record is left
        assert [r["value"] for r in after if r["key"] == k] == [expected[k]]
    assert all(r in before for r in after)  # survivors keep their offsets, timestamps and values

    # A second pass after delete_retention_ms (0) drops the tombstones and the deleted keys for good.
    table = ok(tl("log", "compact", "profiles")).stdout
    assert "tombstones" in table and "profiles" in table
    final = tail_json(tl, "profiles")
    assert not any(r["key"] in keys[:5] for r in final)
    assert {r["key"]: r["value"] for r in final} == {k: v for k, v in expected.items() if v is not None}


def test_compact_on_a_delete_topic_applies_retention(tl: Run) -> None:
    ok(tl("log", "create", "events", "-c", "segment_bytes=1024", "-c", "retention_bytes=0"))
    for round_ in range(4):
        ok(tl("log", "produce", "events", input="".join(f"k{i}\tround {round_}\n" for i in range(10))))
    stats = json.loads(ok(tl("log", "compact", "events", "--json")).stdout)
    (partition,) = stats["partitions"]
    assert partition["segments_cleaned"] == 0  # not compacted: delete policy
    assert partition["segments_deleted"] == 3  # every closed segment (retention_bytes=0), never the active one
    records = tail_json(tl, "events")
    assert [r["value"] for r in records] == ["round 3"] * 10
    assert records[0]["offset"] == 30


# ---------------------------------------------------------------------------- groups / tail --group / --isolation


def _offsets(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return sorted((r["partition"], r["offset"]) for r in records)


def _committed_everywhere(tl: Run, group: str, partitions: int) -> bool:
    """Whether ``group`` has a committed offset for ``partitions`` partitions (per ``groups --json``)."""
    shown = [g for g in json.loads(ok(tl("log", "groups", "--json")).stdout) if g["group"] == group]
    rows = shown[0]["partitions"] if shown else []
    return len(rows) == partitions and all(r["committed_offset"] is not None for r in rows)


def test_tail_as_a_group_member_and_groups(tl: Run, data_dir: Path) -> None:
    ok(tl("log", "create", "orders", "-p", "3"))
    ok(tl("log", "produce", "orders", input="".join(f"k{i}\tv{i}\n" for i in range(30))))
    assert ok(tl("log", "groups")).stdout.strip() == "no consumer groups"
    assert json.loads(ok(tl("log", "groups", "--json")).stdout) == []

    first = tail_json(tl, "orders", "--group", "billing")
    assert _offsets(first) == _offsets(tail_json(tl, "orders"))  # everything, as the group had no offsets
    assert tail_json(tl, "orders", "--group", "billing") == []  # committed: nothing left for the group
    ok(tl("log", "produce", "orders", input="".join(f"k{i}\tnew {i}\n" for i in range(5))))
    assert sorted(r["value"] for r in tail_json(tl, "orders", "--group", "billing")) == [f"new {i}" for i in range(5)]
    assert len(tail_json(tl, "orders", "--group", "audit")) == 35  # another group has its own offsets

    # --follow without --from-beginning starts a group with no offsets at the end, and commits that
    # position even when it printed nothing, so the next run resumes there (as Kafka's auto-commit does).
    follower = subprocess.Popen(
        [sys.executable, "-c", "from tideline.cli import main; main()", "--data-dir", str(data_dir),
         "log", "tail", "orders", "--group", "late", "--follow", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + patience(60)
        while not _committed_everywhere(tl, "late", 3):
            assert time.monotonic() < deadline, "tail --group late --follow committed nothing"
            time.sleep(0.1)
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0 and out == b"", err
    ok(tl("log", "produce", "orders", input="k1\tlater\n"))
    assert [r["value"] for r in tail_json(tl, "orders", "--group", "late")] == ["later"]
    ok(tl("log", "produce", "orders", input="".join(f"k{i}\tcatch up {i}\n" for i in range(5))))
    for name in ("billing", "audit"):
        assert len(tail_json(tl, "orders", "--group", name)) == 6

    groups = json.loads(ok(tl("log", "groups", "--json")).stdout)
    assert [g["group"] for g in groups] == ["audit", "billing", "late"]
    billing = groups[1]
    assert billing["members"] == []  # tail left the group when it finished
    assert [(r["topic"], r["partition"]) for r in billing["partitions"]] == [("orders", p) for p in range(3)]
    for row in billing["partitions"]:
        assert row["committed_offset"] == row["log_end_offset"] == row["last_stable_offset"]
        assert row["lag"] == 0 and row["member_id"] is None and row["pending_transaction"] is False
    table = ok(tl("log", "groups")).stdout
    assert "group billing" in table and "committed" in table and "lag" in table

    # A live member (here, in this process) is listed with its partitions; its lag shows once it commits.
    with Log(data_dir, create=False) as log, Consumer(log, group_id="live", client_id="cli-test") as member:
        member.subscribe(["orders"])
        member.poll(0, max_records=4)
        member.commit()
        live = next(g for g in json.loads(ok(tl("log", "groups", "--json")).stdout) if g["group"] == "live")
        (shown,) = live["members"]
        assert (shown["member_id"], shown["client_id"], shown["pid"]) == (member.member_id, "cli-test", os.getpid())
        assert shown["assignment"] == [{"topic": "orders", "partition": p} for p in range(3)]
        assert {r["member_id"] for r in live["partitions"]} == {member.member_id}
        # one poll of 4 records read one partition; the others have no position, so no commit and no lag
        (read,) = [r for r in live["partitions"] if r["committed_offset"] is not None]
        assert read["committed_offset"] == 4 and read["lag"] == read["log_end_offset"] - 4
        assert all(r["lag"] is None for r in live["partitions"] if r is not read)
        assert member.member_id in ok(tl("log", "groups")).stdout


def test_tail_isolation_levels(tl: Run, data_dir: Path) -> None:
    ok(tl("log", "create", "t"))
    ok(tl("log", "produce", "t", input="k\tbefore\n"))
    with Log(data_dir, create=False) as log:
        producer = Producer(log, transactional_id="cli-txn", linger_ms=1)
        producer.init_transactions()
        producer.begin_transaction()
        producer.send("t", b"open", key=b"k")
        producer.flush()  # on disk, not committed
        try:
            assert [r["value"] for r in tail_json(tl, "t")] == ["before"]  # read_committed is the default
            assert [r["value"] for r in tail_json(tl, "t", "--isolation", "read_committed")] == ["before"]
            uncommitted = tail_json(tl, "t", "--isolation", "read_uncommitted")
            assert [r["value"] for r in uncommitted] == ["before", "open"]
            producer.send_offsets_to_transaction({TopicPartition("t", 0): 1}, "txn-group")
            (row,) = next(g for g in json.loads(ok(tl("log", "groups", "--json")).stdout))["partitions"]
            assert row["pending_transaction"] is True and row["committed_offset"] is None
            assert "txn open" in ok(tl("log", "groups")).stdout
        finally:
            producer.abort_transaction()
            producer.close()
    # the abort marker is never shown; the aborted record only to read_uncommitted
    assert [r["value"] for r in tail_json(tl, "t")] == ["before"]
    assert [r["value"] for r in tail_json(tl, "t", "--isolation", "read_uncommitted")] == ["before", "open"]


def test_tail_group_and_isolation_errors(tl: Run) -> None:
    ok(tl("log", "create", "t", "-p", "2"))
    one_line_error(tl("log", "tail", "t", "--isolation", "dirty"), "read_committed", "read_uncommitted", "dirty")
    one_line_error(tl("log", "tail", "t", "--group", "g", "--partition", "0"), "--partition", "--group")
    one_line_error(tl("log", "tail", "t", "--group", "g", "--offset", "3"), "--offset", "--group")
    one_line_error(tl("log", "tail", "t", "--group", "a/b"), "illegal group id", "a/b")
    one_line_error(tl("log", "tail", "nope", "--group", "g"), "unknown topic", "nope")
    assert "--group" in ok(tl("log", "tail", "--help")).stdout


def test_two_tail_followers_in_one_group_share_the_partitions(data_dir: Path) -> None:
    """Two `tail --group g --follow` processes split the partitions; together they print each record once."""
    cli = [sys.executable, "-c", "from tideline.cli import main; main()", "--data-dir", str(data_dir)]
    subprocess.run([*cli, "log", "create", "shared", "-p", "4"], check=True, capture_output=True)
    followers = [
        subprocess.Popen(
            [*cli, "log", "tail", "shared", "--group", "g", "--follow", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + patience(60)
        while True:  # until both are members with two partitions each
            assert time.monotonic() < deadline, "the followers never shared the partitions"
            groups = subprocess.run([*cli, "log", "groups", "--json"], check=True, capture_output=True).stdout
            members = [m for g in json.loads(groups) for m in g["members"]]
            if len(members) == 2 and all(len(m["assignment"]) == 2 for m in members):
                break
            time.sleep(0.2)
        lines = "".join(f"key-{i}\tvalue {i}\n" for i in range(200))
        subprocess.run([*cli, "log", "produce", "shared"], input=lines.encode(), check=True, capture_output=True)
        while True:  # until the group committed everything
            assert time.monotonic() < deadline, "the followers did not consume everything"
            groups = subprocess.run([*cli, "log", "groups", "--json"], check=True, capture_output=True).stdout
            rows = [r for g in json.loads(groups) for r in g["partitions"]]
            if len(rows) == 4 and all(r["lag"] == 0 for r in rows):
                break
            time.sleep(0.2)
        outputs = []
        for follower in followers:
            follower.send_signal(signal.SIGINT)
            out, err = follower.communicate(timeout=30)
            assert follower.returncode == 0, err
            outputs.append([json.loads(line) for line in out.splitlines()])
    finally:
        for follower in followers:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
    assert all(outputs), "one follower printed nothing: the partitions were not shared"
    assert not {r["partition"] for r in outputs[0]} & {r["partition"] for r in outputs[1]}
    assert sorted(r["value"] for out in outputs for r in out) == sorted(f"value {i}" for i in range(200))


# ---------------------------------------------------------------------------- cleaner


def test_cleaner_once_compacts_due_partitions(tl: Run) -> None:
    ok(tl("log", "create", "prices", "--compact", "--config", "segment_ms=0", "--config", "delete_retention_ms=0"))
    ok(tl("log", "create", "events"))  # a delete-policy topic: retention only
    for line in ("apple\t1.00", "pear\t2.00", "apple\t1.10", "pear\t\\N", "fig\t3.00"):
        ok(tl("log", "produce", "prices", input=line + "\n"))  # segment_ms=0: one segment per append
    result = ok(tl("log", "cleaner", "--once", "--json"))
    passes = [json.loads(line) for line in result.stdout.splitlines()]
    assert [p["partition"] for p in passes] == ["prices-0", "prices-0"], passes  # marks, then drops the tombstone
    assert passes[0]["dirty_ratio"] == 1.0 and passes[0]["records_kept"] == 2
    assert passes[1]["tombstones_dropped"] == 1
    assert "2 compaction passes" in result.stderr
    assert [(r["key"], r["value"]) for r in tail_json(tl, "prices", "--from-beginning")] == [
        ("apple", "1.10"),
        ("fig", "3.00"),
    ]
    again = ok(tl("log", "cleaner", "--once", "--json"))  # nothing is due any more
    assert again.stdout == "" and "0 compaction passes" in again.stderr


def test_cleaner_errors(tl: Run) -> None:
    ok(tl("log", "create", "t"))
    one_line_error(tl("log", "cleaner", "--io-max-bytes-per-second", "-1"), "--io-max-bytes-per-second")
    one_line_error(tl("log", "cleaner", "--backoff-ms", "-5"), "backoff_ms")
    one_line_error(tl("log", "create", "u", "-c", "min_cleanable_dirty_ratio=2"), "min_cleanable_dirty_ratio")


def test_cleaner_service_runs_until_sigterm(data_dir: Path) -> None:
    cli = [sys.executable, "-c", "from tideline.cli import main; main()", "--data-dir", str(data_dir)]
    subprocess.run([*cli, "log", "create", "kv", "--compact", "--config", "segment_ms=0"], check=True)
    service = subprocess.Popen(
        [*cli, "log", "cleaner", "--backoff-ms", "50", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        for i in range(3):  # one segment per append: the service compacts without being asked
            subprocess.run([*cli, "log", "produce", "kv"], input=f"k\tv{i}\n".encode(), check=True)
        deadline = time.monotonic() + 120
        while True:
            tail = subprocess.run([*cli, "log", "tail", "kv", "--json"], check=True, capture_output=True).stdout
            if [json.loads(line)["value"] for line in tail.splitlines()] == ["v1", "v2"]:  # v2: active segment
                break
            assert time.monotonic() < deadline, "the service never compacted the topic"
            time.sleep(0.1)
        service.send_signal(signal.SIGTERM)
        out, err = service.communicate(timeout=60)
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
    assert service.returncode == 0, err
    assert any(json.loads(line)["partition"] == "kv-0" for line in out.splitlines())
    assert b"log cleaner:" in err
