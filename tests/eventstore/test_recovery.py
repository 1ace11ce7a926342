"""Recovery: torn tails are truncated, corruption before the tail is refused untouched.

Covers: truncation at every byte of a region around a batch boundary (with and without
the recovery checkpoint), zero-filled tails, bit flips in the last batch (torn) and in
a middle batch or its length field (corruption: error naming file and byte, file left
unmodified), and the clean-shutdown checkpoint skipping the scan.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eventstore.consumer import Consumer, TopicPartition
from eventstore.errors import ConfigError, CorruptLogError
from eventstore.log import Log
from eventstore.record_batch import build_records, encode_batch, unpack_header
from eventstore.segment import list_segment_bases, log_path

TP = TopicPartition("r", 0)


def _append(log: Log, values: list[bytes]) -> int:
    batch = encode_batch(build_records([None] * len(values), values), first_timestamp=1, max_timestamp=1)
    return log.append("r", 0, batch).base_offset


def _all_values(log: Log) -> list[tuple[int, bytes | None]]:
    consumer = Consumer(log)
    consumer.assign([TP])
    consumer.seek_to_beginning()
    out: list[tuple[int, bytes | None]] = []
    while polled := consumer.poll():
        out.extend((r.offset, r.value) for r in polled)
    return out


def _make(tmp: Path, batches: list[list[bytes]]) -> list[int]:
    """A one-partition log with these batches; returns the byte position of each batch."""
    with Log(tmp) as log:
        log.create_topic("r", 1)
        for values in batches:
            _append(log, values)
    data = log_path(tmp / "r-0", 0).read_bytes()
    positions, pos = [], 0
    while pos < len(data):
        positions.append(pos)
        pos += unpack_header(data, pos).size
    return positions


BATCHES = [[b"a" * 10], [b"b" * 20, b"bb"], [b"c" * 5], [b"d" * 40, b"dd", b"ddd"], [b"e"]]


@pytest.mark.parametrize("keep_checkpoint", [False, True])
def test_truncate_at_every_byte_around_a_batch_boundary(tmp_path: Path, keep_checkpoint: bool) -> None:
    golden = tmp_path / "golden"
    positions = _make(golden, BATCHES)
    seg = log_path(golden / "r-0", 0)
    size = seg.stat().st_size
    expected = [(o, v) for o, v in enumerate(v for b in BATCHES for v in b)]
    # from inside batch 2 to past the end of batch 4, every byte
    region = range(positions[2] - 5, size + 1)
    for cut in region:
        work = tmp_path / f"cut{cut}"
        shutil.copytree(golden, work)
        with open(log_path(work / "r-0", 0), "r+b") as f:
            f.truncate(cut)
        if not keep_checkpoint:
            (work / "r-0" / "recovery-point").unlink()
        whole = sum(1 for end in [*positions[1:], size] if end <= cut)
        survivors = sum(len(b) for b in BATCHES[:whole])
        with Log(work) as log:
            new_offset = _append(log, [b"after"])
            assert new_offset == survivors, cut
            assert _all_values(log) == [*expected[:survivors], (survivors, b"after")], cut
        shutil.rmtree(work)


def test_zero_filled_tail_is_truncated(tmp_path: Path) -> None:
    _make(tmp_path, BATCHES)
    seg = log_path(tmp_path / "r-0", 0)
    with open(seg, "ab") as f:
        f.write(b"\0" * 300)  # an OS crash after the size grew but before the data landed
    with Log(tmp_path) as log:
        assert _append(log, [b"z"]) == 8
        assert _all_values(log)[-2:] == [(7, b"e"), (8, b"z")]


def test_bit_flip_in_the_last_batch_is_a_torn_tail(tmp_path: Path) -> None:
    positions = _make(tmp_path, BATCHES)
    seg = log_path(tmp_path / "r-0", 0)
    data = bytearray(seg.read_bytes())
    data[positions[-1] + 80] ^= 0xFF
    seg.write_bytes(bytes(data))
    (tmp_path / "r-0" / "recovery-point").unlink()
    with Log(tmp_path) as log:
        assert _append(log, [b"z"]) == 7
        assert [v for _, v in _all_values(log)][-2:] == [b"ddd", b"z"]


@pytest.mark.parametrize("where", ["payload", "length", "base_offset", "magic"])
def test_corruption_before_the_tail_raises_and_modifies_nothing(tmp_path: Path, where: str) -> None:
    positions = _make(tmp_path, BATCHES)
    seg = log_path(tmp_path / "r-0", 0)
    data = bytearray(seg.read_bytes())
    target = positions[1] + {"payload": 90, "length": 9, "base_offset": 3, "magic": 20}[where]
    data[target] ^= 0x04
    seg.write_bytes(bytes(data))
    (tmp_path / "r-0" / "recovery-point").unlink()
    before = {p.name: p.read_bytes() for p in (tmp_path / "r-0").iterdir()}
    with Log(tmp_path) as log, pytest.raises(CorruptLogError) as err:
        _append(log, [b"z"])
    assert err.value.path == seg and err.value.position == positions[1]
    assert str(seg) in str(err.value) and f"byte {positions[1]}" in str(err.value)
    after = {p.name: p.read_bytes() for p in (tmp_path / "r-0").iterdir() if p.name != ".lock"}
    assert after == {k: v for k, v in before.items() if k != ".lock"}
    with Log(tmp_path) as log, pytest.raises(CorruptLogError):
        _all_values(log)  # readers refuse it too, rather than skipping data


def test_clean_shutdown_checkpoint_skips_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _make(tmp_path, BATCHES * 20)
    import eventstore.partition_log as pl

    scanned: list[int] = []
    real = pl.scan_batches

    def counting(fd: int, path: Path, start: int, **kw: int) -> object:
        result = real(fd, path, start, **kw)  # type: ignore[arg-type]
        scanned.append(len(result.batches))
        return result

    monkeypatch.setattr(pl, "scan_batches", counting)
    with Log(tmp_path) as log:
        _append(log, [b"x"])
    assert scanned == [0]  # nothing past the clean-shutdown point
    (tmp_path / "r-0" / "recovery-point").unlink()
    scanned.clear()
    with Log(tmp_path) as log:
        _append(log, [b"y"])
    assert scanned == [len(BATCHES) * 20 + 1]  # no checkpoint: the whole active segment


def test_unreadable_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "stuff.txt").write_text("not a log")
    with pytest.raises(Exception, match="not a Tideline log directory"):
        Log(tmp_path)
    assert list_segment_bases(tmp_path) == []


def test_corrupt_end_of_a_closed_segment_is_an_error_for_readers_and_compaction(tmp_path: Path) -> None:
    """Regression: a bad last batch of a *closed* segment was read as a torn tail and skipped."""
    from eventstore.cleaner import compact_partition
    from eventstore.producer import Producer

    with Log(tmp_path) as log:
        log.create_topic("r", 1, overrides={"segment_bytes": "1024", "cleanup_policy": "compact"})
        with Producer(log) as producer:
            for _ in range(3):  # one batch per segment
                producer.send_batch("r", [b"v"] * 10, [b"k%d" % j for j in range(10)])
    seg = log_path(tmp_path / "r-0", 0)
    data = bytearray(seg.read_bytes())
    data[200] ^= 0xFF
    seg.write_bytes(bytes(data))
    with Log(tmp_path) as log:
        with pytest.raises(CorruptLogError, match=r"00000000000000000000\.log at byte 0"):
            _all_values(log)
        with pytest.raises(CorruptLogError):
            compact_partition(log.partition("r", 0))
    assert seg.read_bytes() == bytes(data)  # nothing overwritten


def test_send_keeps_per_partition_order_across_threads(tmp_path: Path) -> None:
    """Regression: a batch taken by the linger thread could be overtaken by flush()."""
    from eventstore.producer import Producer

    with Log(tmp_path) as log:
        log.create_topic("o", 4)
        with Producer(log, linger_ms=1, batch_size=4096) as producer:
            for i in range(20000):
                producer.send("o", str(i).encode(), key=b"k%d" % (i % 64))
                if i % 997 == 0:
                    producer.flush()
        consumer = Consumer(log)
        consumer.assign([TopicPartition("o", p) for p in range(4)])
        consumer.seek_to_beginning()
        last: dict[bytes | None, int] = {}
        while polled := consumer.poll():
            for r in polled:
                seq = int(r.value or b"-1")
                assert seq > last.get(r.key, -1), f"record {seq} of key {r.key!r} stored after a later one"
                last[r.key] = seq
        assert len(last) == 64


def test_create_topic_reuses_empty_leftovers_but_refuses_orphaned_data(tmp_path: Path) -> None:
    """A crash during creation leaves empty partition directories (reused); data without metadata is refused."""
    with Log(tmp_path / "log") as log:
        log.create_topic("t", 2)
        log.append("t", 1, encode_batch(build_records([b"k"], [b"v"]), first_timestamp=1, max_timestamp=1))
    (tmp_path / "log" / "_topics" / "t.json").unlink()  # as if the metadata was never published
    with Log(tmp_path / "log") as log:
        with pytest.raises(ConfigError, match="t-1 already holds data"):
            log.create_topic("t", 2)
        shutil.rmtree(tmp_path / "log" / "t-1")
        log.create_topic("t", 2)  # t-0 (an empty leftover) is reused
        assert log.partition("t", 0).log_end_offset() == 0
