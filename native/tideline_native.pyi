"""Type stub of the native capture core (native/src/lib.rs); imported by capture/native/extension.py only,
driven by capture/native/ (handle.py makes the Core and maps capture's enums to these)."""

from typing import Any, ClassVar, final

VERSION: str

# One output per table of a run: (table_id, changes, keys, values, nbytes, puts, deletes)
# an Arrow binary array's buffers: data, offsets (i32 little-endian), validity bitmap (None: no nulls), nulls, length
Column = tuple[bytes, bytes, bytes | None, int, int]
# a key set (capture.keystate.KeySet): the keys back to back, a JSON array of start << 32 | length (start 1-based)
KeySet = tuple[bytes, str]
Output = tuple[int, int, Column, Column, int, KeySet | None, KeySet | None]

@final
class Plugin:
    """Whose payloads a Core reads (capture.messages.Plugin's members the core decodes)."""

    WAL2JSON: ClassVar[Plugin]
    PGOUTPUT: ClassVar[Plugin]
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ValueFormat:
    """The format a Core writes keys and values in (capture.config.ValueFormat)."""

    JSON: ClassVar[ValueFormat]
    AVRO: ClassVar[ValueFormat]
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Core:
    def __init__(self, prefix: str, db: str, plugin: Plugin, value_format: ValueFormat) -> None: ...
    def register_table(
        self,
        table_id: int,
        schema: str,
        name: str,
        columns: list[str],
        key: list[str],
        toastable: list[str],
        replica_identity: str,
    ) -> None: ...
    def register_avro(
        self,
        table_id: int,
        key_id: int,
        value_id: int,
        columns: list[tuple[str, int, str, str, int, int, int, int]],
        envelope: list[tuple[str, int, int]],
        source: list[tuple[str, str, int, int]],
        transaction: list[tuple[str, str, int, int]],
    ) -> None: ...
    def unregister_table(self, schema: str, name: str) -> None: ...
    def register_relation(
        self, oid: int, table_id: int, names: list[str], type_oids: list[int], key_flags: list[bool]
    ) -> None: ...
    def forget_relation(self, oid: int) -> None: ...
    def process(
        self,
        data: bytes,
        offsets: bytes,
        start: int,
        limit: int,
        xid: int | None,
        commit_lsn: int,
        ts_ms: int,
        snapshot: str,
        total_order: int,
        per_table: dict[str, int],
        index: int,
        now_ms: int,
    ) -> tuple[int, int, int, list[tuple[str, int]], list[Output]]: ...
    @staticmethod
    def json_string(text: str) -> bytes: ...
    @staticmethod
    def json_float(value: float) -> bytes | None: ...

def read_xlog(
    conn: int,
    get_copy_data: int,
    free_mem: int,
    consume_input: int,
    first: bytes | None,
    limit: int,
    max_bytes: int,
) -> tuple[int, bytes, bytes, bytes | None]: ...

class SnapshotEncoder:
    def __init__(self, names: list[str], type_oids: list[int], key: list[str], toastable: list[str]) -> None: ...
    @staticmethod
    def converts(type_oid: int) -> bool: ...
    def encode(self, rows: list[Any]) -> tuple[bytes, bytes, bytes | None, bytes | None, list[int]]: ...

def splice_reads(
    lead: bytes,
    afters: bytes | memoryview,
    after_offsets: bytes | memoryview,
    mid: bytes,
    first_index: int,
    tail: bytes,
) -> tuple[bytes, bytes]: ...

# capture's Kafka producer (src/kafka.rs): librdkafka fed Arrow buffers
class KafkaCallError(Exception):
    """args = (code, name, reason, fatal, retriable, txn_requires_abort)"""

ArrowParts = tuple[Any, Any, Any, int, int]  # validity or None, offsets, data or None, offset, length

class KafkaProducer:
    def __init__(self, config: list[tuple[str, str]]) -> None: ...
    def init_transactions(self, timeout_ms: int) -> None: ...
    def begin_transaction(self) -> None: ...
    def commit_transaction(self, timeout_ms: int) -> None: ...
    def abort_transaction(self, timeout_ms: int) -> None: ...
    def produce(
        self,
        topic: str,
        partitions: Any,
        keys: ArrowParts,
        values: ArrowParts,
        headers: list[list[tuple[str, bytes | None]] | None] | None = None,
    ) -> int: ...
    def poll(self) -> None: ...
    def flush(self, timeout_ms: int) -> int: ...
    def take_delivered(
        self,
    ) -> tuple[list[tuple[str, int, int, int]], list[tuple[int, str, str, str, bool]], int]: ...
    def take_logs(self) -> tuple[list[tuple[int, str, str]], int]: ...
    def close(self) -> None: ...

def librdkafka_version() -> str: ...
