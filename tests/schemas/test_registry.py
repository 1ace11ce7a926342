"""The schema registry: ids, versions, idempotence, compatibility levels, persistence in ``__schemas``.

Contract tests run against both stores (in memory and the log); the rest use the log.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy
from eventstore.schema_store import SCHEMAS_LOCK_FILE, SCHEMAS_TOPIC, LogSchemaStore
from eventstore.topic import CleanupPolicy
from schemas import cli_api
from schemas.compat import CompatibilityLevel
from schemas.errors import IncompatibleSchemaError, SchemaParseError, UnknownSchemaError
from schemas.registry import MemorySchemaStore, SchemaRegistry, SchemaStore


def rec(*fields: tuple[str, Any] | dict[str, Any], name: str = "Order") -> dict[str, Any]:
    return {
        "type": "record",
        "name": name,
        "fields": [f if isinstance(f, dict) else {"name": f[0], "type": f[1]} for f in fields],
    }


V1 = rec(("id", "long"))
V2 = rec(("id", "long"), {"name": "note", "type": ["null", "string"], "default": None})
V3_BAD = rec(("id", "long"), ("total", "int"))


@pytest.fixture(params=["memory", "log"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SchemaStore]:
    if request.param == "memory":
        yield MemorySchemaStore()
        return
    with Log(tmp_path / "log") as log:
        yield LogSchemaStore(log)


def test_ids_and_versions(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    a = registry.register("orders-value", V1)
    b = registry.register("orders-value", V2)
    assert (a.version, a.id, b.version, b.id) == (1, 1, 2, 2)
    assert registry.latest("orders-value") == b
    assert registry.get_version("orders-value", 1) == a
    assert json.loads(registry.schema_by_id(2)) == V2
    assert registry.versions("orders-value") == [1, 2]


def test_same_schema_two_subjects_one_id(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    a = registry.register("orders-value", V1)
    key = registry.register("orders-key", V1)
    assert key.id == a.id and key.version == 1
    assert registry.subjects() == ["orders-key", "orders-value"]


def test_reregister_is_idempotent_and_ignores_formatting(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    first = registry.register("orders-value", V1)
    registry.register("orders-value", V2)
    again = registry.register("orders-value", json.dumps(V1, indent=4))  # other text, same schema
    assert again == first
    assert registry.versions("orders-value") == [1, 2]


def test_logical_types_and_defaults_are_part_of_identity(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    registry.set_compatibility("d-value", CompatibilityLevel.NONE)
    d1 = registry.register("d-value", {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2})
    d2 = registry.register("d-value", {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 4})
    assert d1.id != d2.id
    with_default = rec({"name": "note", "type": "string", "default": "x"}, name="N")
    other_default = rec({"name": "note", "type": "string", "default": "y"}, name="N")
    assert registry.register("n-value", with_default).id != registry.register("n-value", other_default).id


def test_rejected_registration_names_the_field_and_writes_nothing(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    registry.register("orders-value", V1)
    before = store.read_from(0)[1]
    with pytest.raises(IncompatibleSchemaError, match="field 'total' added without a default") as info:
        registry.register("orders-value", V3_BAD)
    assert info.value.incompatibilities[0].path == "total"
    assert store.read_from(0)[1] == before
    with pytest.raises(SchemaParseError):
        registry.register("orders-value", '{"type": "record", "name": "X", "fields": [{"name": "a"}]}')
    assert store.read_from(0)[1] == before


def test_compatibility_level_per_subject(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    registry.register("orders-value", V1)
    assert registry.compatibility("orders-value") is CompatibilityLevel.BACKWARD
    registry.set_compatibility("orders-value", CompatibilityLevel.FORWARD)
    assert registry.compatibility("orders-value") is CompatibilityLevel.FORWARD
    assert registry.compatibility("other-value") is CompatibilityLevel.BACKWARD
    assert registry.register("orders-value", V3_BAD).version == 2  # FORWARD: V1 readers ignore 'total'
    registry.set_compatibility("orders-value", CompatibilityLevel.NONE)
    assert registry.register("orders-value", rec(("id", "string"))).version == 3
    registry.set_compatibility("orders-value", None)
    assert registry.compatibility("orders-value") is CompatibilityLevel.BACKWARD


def test_the_registry_wide_level_is_persisted_and_subjects_inherit_it(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    registry.set_compatibility("orders-value", CompatibilityLevel.FULL)
    registry.set_compatibility(None, CompatibilityLevel.NONE)  # Confluent's CONFIG key with subject null
    reopened = SchemaRegistry(store)
    assert reopened.compatibility(None) is CompatibilityLevel.NONE
    assert reopened.compatibility("other-value") is CompatibilityLevel.NONE
    assert reopened.configured_compatibility("other-value") is None
    assert reopened.compatibility("orders-value") is CompatibilityLevel.FULL  # its own setting wins
    reopened.register("other-value", V1)
    assert reopened.register("other-value", rec(("id", "string"))).version == 2  # NONE: anything goes
    reopened.set_compatibility(None, None)
    assert SchemaRegistry(store).compatibility("other-value") is CompatibilityLevel.BACKWARD


def test_confluent_noop_records_are_skipped_silently(caplog: pytest.LogCaptureFixture) -> None:
    store = MemorySchemaStore()
    store.append(b'{"keytype":"NOOP","magic":0}', None)  # what Confluent's leader writes into _schemas
    registry = SchemaRegistry(store)
    assert registry.register("orders-value", V1).id == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_check_reports_without_registering(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    registry.register("orders-value", V1)
    report = registry.check("orders-value", V3_BAD)
    assert not report.compatible
    assert "field 'total' added without a default" in report.incompatibilities[0].message
    assert registry.check("orders-value", V2).compatible
    assert registry.check("orders-value", V1).existing_version == 1
    assert registry.versions("orders-value") == [1]


def test_unknown_lookups(store: SchemaStore) -> None:
    registry = SchemaRegistry(store)
    with pytest.raises(UnknownSchemaError, match="schema id 7"):
        registry.schema_by_id(7)
    with pytest.raises(UnknownSchemaError, match="subject 'nope'"):
        registry.latest("nope")
    registry.register("orders-value", V1)
    with pytest.raises(UnknownSchemaError, match="no version 2"):
        registry.get_version("orders-value", 2)
    assert registry.lookup("orders-value", V2) is None


# ---------------------------------------------------------------------------- the log store


def test_reopen_sees_the_same_state(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        registry.register("orders-value", V1)
        registry.register("orders-value", V2)
        registry.register("orders-key", rec(("id", "long"), name="Key"))
        registry.set_compatibility("orders-key", CompatibilityLevel.FULL)
        meta = log.topic(SCHEMAS_TOPIC)
        assert meta.partitions == 1 and meta.config.cleanup_policy is CleanupPolicy.COMPACT
    with Log(tmp_path / "log") as log:
        reopened = SchemaRegistry(LogSchemaStore(log))
        assert reopened.subjects() == ["orders-key", "orders-value"]
        assert reopened.latest("orders-value").id == 2
        assert reopened.latest("orders-key").id == 3
        assert reopened.compatibility("orders-key") is CompatibilityLevel.FULL
        assert reopened.register("orders-value", V1).version == 1  # still idempotent after reopen
        assert (tmp_path / "log" / SCHEMAS_LOCK_FILE).exists()


def test_two_registries_over_one_log_agree(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log_a, Log(tmp_path / "log") as log_b:
        a, b = SchemaRegistry(LogSchemaStore(log_a)), SchemaRegistry(LogSchemaStore(log_b))
        assert a.register("x-value", V1).id == 1
        assert b.register("y-value", rec(("y", "int"), name="Y")).id == 2  # b refreshed before choosing an id
        assert json.loads(a.schema_by_id(2)) == rec(("y", "int"), name="Y")  # a finds it on a miss
        assert b.register("x-value", V2).version == 2
        assert a.latest("x-value").version == 2


def test_reads_do_not_create_the_topic(tmp_path: Path) -> None:
    with Log(tmp_path / "log") as log:
        assert SchemaRegistry(LogSchemaStore(log)).subjects() == []
        assert SCHEMAS_TOPIC not in log.topics()


def _register_many(log_dir: str, worker: int, count: int, queue: Any, start: Any) -> None:
    with Log(log_dir, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        registry.register("warm-up-value", V1)  # every process has the topic open before the race
        start.wait()
        for n in range(count):
            schema = rec(("id", "long"), name=f"W{worker}N{n}")
            queue.put((worker, n, registry.register(f"w{worker}-{n}-value", schema).id))


def test_concurrent_processes_get_distinct_ids(tmp_path: Path) -> None:
    log_dir = str(tmp_path / "log")
    Log(log_dir).close()
    ctx = multiprocessing.get_context("spawn")
    queue, start = ctx.Queue(), ctx.Event()
    workers, count = 4, 30
    procs = [ctx.Process(target=_register_many, args=(log_dir, w, count, queue, start)) for w in range(workers)]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=120) for _ in range(workers * count)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ids = [r[2] for r in results]
    assert sorted(ids) == list(range(2, workers * count + 2))  # id 1: the warm-up schema
    with Log(log_dir) as log:
        registry = SchemaRegistry(LogSchemaStore(log))
        for worker, n, schema_id in results:
            assert registry.latest(f"w{worker}-{n}-value").id == schema_id
            assert json.loads(registry.schema_by_id(schema_id))["name"] == f"W{worker}N{n}"


def test_cli_api(tmp_path: Path) -> None:
    registry = SchemaRegistry(MemorySchemaStore())
    registry.register("orders-value", V1)
    rows = cli_api.list_subjects(registry)
    assert rows == [{"subject": "orders-value", "latest_version": 1, "id": 1, "versions": [1],
                     "compatibility": "BACKWARD"}]  # fmt: skip
    assert "orders-value" in cli_api.render_subjects(rows)
    shown = cli_api.show_subject(registry, "orders-value")
    assert shown["schema"] == V1 and "version 1 (id 1" in cli_api.render_show(shown)
    bad = tmp_path / "bad.avsc"
    bad.write_text(json.dumps(V3_BAD))
    result = cli_api.check_file(registry, "orders-value", bad)
    assert not result["compatible"]
    assert "field 'total' added without a default" in cli_api.render_check(result)
    assert registry.versions("orders-value") == [1]
