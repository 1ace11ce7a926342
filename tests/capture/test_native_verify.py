"""The native core checked against the Python reference as it runs (capture.native.verify).

The suite turns the check on for every test (tests/conftest.py): these tests show that it really
runs on a real server's stream (for both plugins), that it catches a difference (a native result
tampered with stops the connector, naming the record), and that it is off unless asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from capture_util import capture as capture_into
from capture_util import drop_slots, fresh_database, records, sql

from capture.config import CoreChoice, SnapshotMode
from capture.messages import Plugin
from capture.native import extension
from capture.native.core import NativeCore
from capture.native.handle import binary_array
from capture.native.verify import ENV, NativeMismatchError, ReferenceCheck, enabled
from tideline.pgharness import LocalPostgres

pytestmark = pytest.mark.skipif(not extension.available(), reason="tideline_native is not built (make native)")

WORKLOAD = [
    "INSERT INTO acct SELECT g, 'owner ' || g, g / 7.0, now(), jsonb_build_object('g', g) "
    "FROM generate_series(1, 400) g",
    "UPDATE acct SET balance = balance + 1 WHERE id % 3 = 0",
    "DELETE FROM acct WHERE id % 5 = 0",
]


@pytest.fixture
def db(postgres: LocalPostgres) -> Iterator[str]:
    dsn = fresh_database(postgres, "verify")
    sql(dsn, "CREATE TABLE acct (id bigint PRIMARY KEY, owner text, balance numeric(12,2), seen timestamptz, "
        "doc jsonb)")
    yield dsn
    drop_slots(dsn)


def capture_workload(db: str, log_dir: Path, plugin: Plugin, slot: str) -> Any:
    capture_into(log_dir, db, slot=slot, plugin=plugin, core=CoreChoice.NATIVE, snapshot=SnapshotMode.INITIAL)
    for statement in WORKLOAD:
        sql(db, statement)
    return capture_into(log_dir, db, slot=slot, plugin=plugin, core=CoreChoice.NATIVE)


@pytest.mark.parametrize("plugin", [Plugin.WAL2JSON, Plugin.PGOUTPUT])
def test_every_native_run_is_checked(db: str, tmp_path: Path, plugin: Plugin,
                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    assert enabled(), f"the suite runs with {ENV}=1 (tests/conftest.py)"
    checked: list[int] = []
    handled: list[int] = []
    real_check, real_run = ReferenceCheck.check, NativeCore.run

    def counting_check(self: ReferenceCheck, messages: Any, *args: Any) -> None:
        real_check(self, messages, *args)
        checked.append(len(messages))

    def counting_run(self: NativeCore, *args: Any) -> tuple[int, int]:
        n, index = real_run(self, *args)
        handled.append(n)
        return n, index

    monkeypatch.setattr(ReferenceCheck, "check", counting_check)
    monkeypatch.setattr(NativeCore, "run", counting_run)
    stats = capture_workload(db, tmp_path / "log", plugin, f"checked_{plugin.value}")
    changes = 400 + 133 + 80  # inserts, updates (id % 3 = 0), deletes (id % 5 = 0)
    assert stats.events == changes + 80  # the deletes' tombstones
    # every run the core handled was checked, and that is nearly every change (a table's first one, which
    # registers it, and what follows it in its run take the Python path)
    assert sum(checked) == sum(handled) >= changes - 10, (sum(checked), sum(handled), changes)
    assert len(records(tmp_path / "log", "cdc.public.acct")) == changes + 80


class TamperedCore:
    """The extension's core, but the first value of every run it handles comes back altered."""

    real: Any = None

    def __init__(self, *args: Any) -> None:
        self._core = self.real(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def process(self, *args: Any) -> Any:
        handled, index, total_order, counts, outputs = self._core.process(*args)
        if outputs:
            tid, n, keys, values, nbytes, ks_keys, ks_values = outputs[0]
            records = binary_array(values).to_pylist()
            altered = pa.array([records[0].replace(b'"owner', b'"0wner', 1), *records[1:]], pa.binary())
            validity, offsets, data = altered.buffers()
            values = (data.to_pybytes(), offsets.to_pybytes(), None if validity is None else validity.to_pybytes(),
                      altered.null_count, len(altered))  # fmt: skip
            outputs = [(tid, n, keys, values, nbytes, ks_keys, ks_values), *outputs[1:]]
        return handled, index, total_order, counts, outputs


def test_a_difference_stops_the_connector(db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    TamperedCore.real = extension.Core
    monkeypatch.setattr(extension, "Core", TamperedCore)  # what capture.native.handle makes its core with
    with pytest.raises(NativeMismatchError, match=r'cdc\.public\.acct record 0 of the run: value native .*"0wner'):
        capture_workload(db, tmp_path / "log", Plugin.WAL2JSON, "tampered")
    assert records(tmp_path / "log", "cdc.public.acct") == []  # nothing of the stream was committed


def test_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("", False), ("0", False), (" 0 ", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(ENV, value)
        assert enabled() is expected, value
    monkeypatch.delenv(ENV)
    assert not enabled()
