"""The boundary with the Rust extension (capture.native.handle): capture's enums reach the core as the extension's
own enums, mapped in one place, each member as its capabilities say and no string ever read as a plugin; and
one owner keeps what the core holds and the Python side's record of it together.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest

import capture.messages
from capture.config import CaptureConfig, CoreChoice, NativeUnavailableError, ValueFormat
from capture.converters import JsonConverter
from capture.decoders.pgoutput import PgOutputDecoder
from capture.messages import Plugin
from capture.native import extension
from capture.native.core import connector_reason
from capture.native.handle import CoreHandle, core_plugin, core_value_format
from capture.replication import XLogData, XLogRun
from capture.tables import TableColumn, TableInfo

pytestmark = pytest.mark.skipif(not extension.available(), reason="tideline_native is not built (make native)")

OID = 16500
TABLE = TableInfo.make("public", "t", (TableColumn("id", "integer", 23), TableColumn("v", "text", 25)), ("id",),
                       "primary key", "d")  # fmt: skip


def test_each_member_maps_as_its_capabilities_say() -> None:
    assert extension.CorePlugin is not None and extension.CoreValueFormat is not None
    for plugin in Plugin:
        if plugin.capabilities.native_core:
            assert core_plugin(plugin) == getattr(extension.CorePlugin, plugin.name)
        else:
            with pytest.raises(NativeUnavailableError, match=f"does not decode plugin {plugin.value}"):
                core_plugin(plugin)
    for value_format in ValueFormat:
        if value_format.capabilities.native_changes:
            assert core_value_format(value_format) == getattr(extension.CoreValueFormat, value_format.name)
        else:
            with pytest.raises(NativeUnavailableError, match=f"does not write --value-format {value_format.value}"):
                core_value_format(value_format)
    assert len({core_plugin(p) for p in Plugin if p.capabilities.native_core}) == sum(
        p.capabilities.native_core for p in Plugin
    ), "one extension member per plugin"


def test_a_string_is_no_plugin_or_value_format_on_either_side() -> None:
    for text in ("wal2json", "pgoutput", "decoderbufs"):
        with pytest.raises(NativeUnavailableError, match=f"plugin '{text}' has no counterpart in the native core"):
            core_plugin(text)  # type: ignore[arg-type]
    with pytest.raises(NativeUnavailableError, match="value format 'json' has no counterpart in the native core"):
        core_value_format("json")  # type: ignore[arg-type]
    assert extension.Core is not None and extension.CorePlugin is not None and extension.CoreValueFormat is not None
    with pytest.raises(TypeError, match="'str' object cannot be converted to 'Plugin'"):
        extension.Core("d", "db", "wal2json", extension.CoreValueFormat.JSON)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'str' object cannot be converted to 'ValueFormat'"):
        extension.Core("d", "db", extension.CorePlugin.WAL2JSON, "json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="missing 2 required positional arguments: 'plugin' and 'value_format'"):
        extension.Core("d", "db")  # type: ignore[call-arg]  # no default: nothing is wal2json by omission


def test_a_plugin_the_core_does_not_decode_takes_the_python_path_or_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    capabilities = dict(capture.messages._CAPABILITIES)
    capabilities[Plugin.PGOUTPUT] = dataclasses.replace(capabilities[Plugin.PGOUTPUT], native_core=False)
    monkeypatch.setattr(capture.messages, "_CAPABILITIES", capabilities)
    auto = CaptureConfig(dsn="postgresql://x", plugin=Plugin.PGOUTPUT, core=CoreChoice.AUTO)
    assert connector_reason(auto, JsonConverter()) == "the native core does not decode plugin pgoutput"
    with pytest.raises(NativeUnavailableError, match=r"^--core native: the native core does not decode plugin "
                                                     r"pgoutput; use --core auto or python"):  # fmt: skip
        dataclasses.replace(auto, core=CoreChoice.NATIVE).validate()
    with pytest.raises(NativeUnavailableError, match="does not decode plugin pgoutput"):
        CoreHandle("d", "db", Plugin.PGOUTPUT, ValueFormat.JSON)
    assert connector_reason(dataclasses.replace(auto, plugin=Plugin.WAL2JSON), JsonConverter()) is None


def test_a_table_unregistered_takes_its_relations_with_it_in_the_core_and_in_the_record() -> None:
    """The drift capture/native.py had: a table unregistered (the stream at another shape than the catalog) lost
    its relations in the core but not in the Python record, so its Relation message was never given again."""
    decoder = PgOutputDecoder("pub", proto_version=1)
    columns = b"\x01id\0" + struct.pack("!Ii", 23, -1) + b"\x00v\0" + struct.pack("!Ii", 25, -1)  # id the key
    relation_message = b"R" + struct.pack("!I", OID) + b"public\0t\0d" + struct.pack("!H", 2) + columns
    assert list(decoder.decode(relation_message, 0x100)) == []
    relation = decoder.relation(OID)
    assert relation is not None
    insert = b"I" + struct.pack("!I", OID) + b"N" + struct.pack("!H", 2) + b"t\0\0\0\x017" + b"t\0\0\0\x02ab"
    run = XLogRun.of([XLogData(0x200, 0x200, insert).raw()])

    def handled(handle: CoreHandle) -> int:
        n, *_ = handle.process(run.data, run.offsets, 0, 10, 7, 0x300, 0, "false", 0, {}, 0, 0)
        return n

    handle = CoreHandle("d", "db", Plugin.PGOUTPUT, ValueFormat.JSON)
    registered = handle.register(TABLE, "d.public.t", None)
    handle.give_relation(relation, registered.id)
    assert handled(handle) == 1
    assert handle.unregister("public", "t")
    assert handle.relation(OID) is None and not handle, "the record has neither the table nor its relation"
    again = handle.register(TABLE, "d.public.t", None)
    assert again.id != registered.id and handle.registration("public", "t") is again
    assert handled(handle) == 0, "nor has the core: the relation went with the table"
    handle.give_relation(relation, again.id)  # what NativeCore does, as the record does not hold the relation
    assert handled(handle) == 1
    handle.forget_relation(OID)
    assert handle.relation(OID) is None and handled(handle) == 0
    with pytest.raises(KeyError, match="table id 0"):
        handle.give_relation(relation, registered.id)  # a relation of a table the core does not hold
