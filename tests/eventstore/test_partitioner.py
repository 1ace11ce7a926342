"""Tests for the Kafka-compatible partitioner (reference vectors + vectorized path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventstore import partitioner
from eventstore.partitioner import (
    MAX_PARTITIONS,
    murmur2,
    murmur2_batch,
    partition_for_key,
    partitions_for_keys,
)

VECTORS_PATH = Path(__file__).parents[3] / "shared" / "testdata" / "kafka_murmur2.json"


def _load_vectors() -> list[dict[str, Any]]:
    if not VECTORS_PATH.is_file():
        pytest.fail(
            f"Kafka murmur2 reference vectors not found at {VECTORS_PATH} "
            "(expected shared/testdata/ beside the repository root)",
            pytrace=False,
        )
    vectors: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text())["vectors"]
    assert vectors, f"no vectors in {VECTORS_PATH}"
    return vectors


@pytest.fixture(scope="module")
def vectors() -> list[dict[str, Any]]:
    return _load_vectors()


def _key(vector: dict[str, Any]) -> bytes:
    key: str = vector["key"]
    return key.encode("utf-8")


# --------------------------------------------------------------------------
# Reference vectors
# --------------------------------------------------------------------------


def test_reference_murmur2_matches_kafka_vectors(vectors: list[dict[str, Any]]) -> None:
    for v in vectors:
        h = murmur2(_key(v))
        assert h == v["murmur2_u32"], v["key"]
        signed = h - (1 << 32) if h >= 1 << 31 else h
        assert signed == v["murmur2_i32"], v["key"]


def test_partition_for_key_matches_kafka_vectors(vectors: list[dict[str, Any]]) -> None:
    for v in vectors:
        assert partition_for_key(_key(v), 12) == v["partition_of_12"], v["key"]


def test_vectors_cover_every_tail_length(vectors: list[dict[str, Any]]) -> None:
    assert {len(_key(v)) % 4 for v in vectors} == {0, 1, 2, 3}
    assert any(len(_key(v)) == 0 for v in vectors)


@pytest.mark.parametrize("as_arrow", [False, True])
def test_batch_matches_kafka_vectors(vectors: list[dict[str, Any]], as_arrow: bool) -> None:
    # Repeat so the batch is large enough for the numpy path (not the small-batch shortcut).
    keys = [_key(v) for v in vectors] * 5
    batch: Any = pa.array(keys, type=pa.binary()) if as_arrow else keys
    expected_hash = [v["murmur2_u32"] for v in vectors] * 5
    expected_part = [v["partition_of_12"] for v in vectors] * 5
    assert murmur2_batch(batch).tolist() == expected_hash
    assert partitions_for_keys(batch, 12).tolist() == expected_part


# --------------------------------------------------------------------------
# Vectorized path == reference
# --------------------------------------------------------------------------

_keys = st.lists(st.one_of(st.none(), st.binary(min_size=0, max_size=64)), max_size=300)
_partitions = st.one_of(
    st.integers(min_value=1, max_value=64),
    st.sampled_from([1, 2, 12, 256, 1000, MAX_PARTITIONS]),
    st.integers(min_value=1, max_value=MAX_PARTITIONS),
)


def _expected(keys: list[bytes | None], n: int) -> list[int]:
    return [-1 if k is None else partition_for_key(k, n) for k in keys]


@settings(max_examples=300, deadline=None)
@given(keys=_keys, num_partitions=_partitions)
def test_vectorized_equals_reference(keys: list[bytes | None], num_partitions: int) -> None:
    expected = _expected(keys, num_partitions)
    got = partitions_for_keys(keys, num_partitions)
    assert got.dtype == np.int32
    assert got.tolist() == expected
    assert partitions_for_keys(pa.array(keys, type=pa.binary()), num_partitions).tolist() == (expected)
    hashes = murmur2_batch(keys).tolist()
    assert hashes == [-1 if k is None else murmur2(k) for k in keys]
    in_range = [p for p, k in zip(got.tolist(), keys, strict=True) if k is not None]
    assert all(0 <= p < num_partitions for p in in_range)


@settings(max_examples=50, deadline=None)
@given(
    keys=st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=200),
    start=st.integers(min_value=0, max_value=50),
    length=st.integers(min_value=0, max_value=200),
)
def test_sliced_and_chunked_arrow_inputs(keys: list[bytes], start: int, length: int) -> None:
    arr = pa.array(keys, type=pa.binary()).slice(start, length)
    sliced = keys[start : start + length]
    assert partitions_for_keys(arr, 7).tolist() == _expected(list(sliced), 7)
    chunked = pa.chunked_array([pa.array(keys[:3], pa.binary()), pa.array(keys[3:], pa.binary())])
    assert partitions_for_keys(chunked, 7).tolist() == _expected(list(keys), 7)


@pytest.mark.parametrize("arrow_type", [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()])
def test_arrow_types(arrow_type: Any) -> None:
    words = [f"order-{i}" * (i % 7) for i in range(200)]
    values: list[str | None] = [None if i % 11 == 0 else w for i, w in enumerate(words)]
    arr = pa.array(values, type=arrow_type)
    expected = _expected([None if w is None else w.encode() for w in values], 12)
    assert partitions_for_keys(arr, 12).tolist() == expected


def test_binary_view_and_fixed_size_binary() -> None:
    keys = [bytes([i]) * 16 for i in range(100)]
    expected = _expected(list(keys), 5)
    assert partitions_for_keys(pa.array(keys, type=pa.binary_view()), 5).tolist() == expected
    assert partitions_for_keys(pa.array(keys, type=pa.binary(16)), 5).tolist() == expected


def test_uniform_length_and_long_key_tail() -> None:
    rng = np.random.default_rng(7)
    uniform = [rng.bytes(36) for _ in range(1000)]
    assert partitions_for_keys(uniform, 24).tolist() == _expected(list(uniform), 24)
    # A few very long keys among short ones: finished by the reference fallback.
    mixed: list[bytes | None] = [rng.bytes(int(n)) for n in rng.integers(0, 40, 500)]
    mixed += [rng.bytes(5000), rng.bytes(4099), None, rng.bytes(10_001)]
    assert partitions_for_keys(mixed, 10).tolist() == _expected(mixed, 10)


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(st.one_of(st.none(), st.binary(max_size=64)), min_size=17, max_size=400))
def test_runs_of_rows_are_stitched_in_order(keys: list[bytes | None]) -> None:
    # Shrink the run size so one batch spans many runs (each sorted on its own).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(partitioner, "_CHUNK_ROWS", 37)
        assert partitions_for_keys(keys, 13).tolist() == _expected(keys, 13)


def test_batch_larger_than_one_run() -> None:
    rng = np.random.default_rng(3)
    keys = [rng.bytes(int(n)) for n in rng.integers(0, 24, 40_000)]
    assert partitions_for_keys(keys, 12).tolist() == _expected(list(keys), 12)


def test_empty_and_all_null_batches() -> None:
    assert partitions_for_keys([], 3).tolist() == []
    assert partitions_for_keys(pa.array([], pa.binary()), 3).tolist() == []
    assert partitions_for_keys([None] * 100, 3).tolist() == [-1] * 100
    assert partitions_for_keys([b""] * 100, 12).tolist() == [9] * 100


@pytest.mark.parametrize("bad", [0, -1, MAX_PARTITIONS + 1])
def test_rejects_bad_partition_counts(bad: int) -> None:
    with pytest.raises(ValueError):
        partition_for_key(b"k", bad)
    with pytest.raises(ValueError):
        partitions_for_keys([b"k"] * 100, bad)


def test_rejects_non_binary_arrow_arrays() -> None:
    with pytest.raises(TypeError):
        partitions_for_keys(pa.array([1, 2, 3]), 3)
