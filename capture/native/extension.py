"""The boundary with the Rust extension: the one module of Tideline that imports ``tideline_native``.

``tideline_native`` (PyO3, built by maturin from ``native/``: ``make native``) may be missing (never
built), fail to import, or be older than its sources. This module imports it once and says which:
:data:`UNAVAILABLE` (the reason, as the reports and ``--core native``'s error say it; None when it can be
used), :func:`available`, :func:`unavailable_reason`. The rest of Tideline reaches the extension only
through the names below, each None unless it is available (a build older than its sources is not used at
all: every compiled path falls back to its Python one):

* :data:`Core`, :data:`CorePlugin`, :data:`CoreValueFormat`: the streaming core and the enums it is
  made with (driven by capture.native.handle, which alone constructs a core and maps capture's enums to
  these two);
* :data:`SnapshotEncoder` and :func:`converts`: the compiled snapshot encoder (capture.snapshot_readers)
  and the core's own test of a column type (native/src/convert.rs, ``kind_of``);
* :data:`splice_reads` (capture.snapshot) and :data:`read_xlog` (capture.replication);
* :data:`KafkaProducer`, :data:`KafkaCallError` and :func:`librdkafka_version`: the Kafka sink's native
  producer (capture.native.kafka), None with :data:`KAFKA_UNAVAILABLE` saying why when the extension is
  unavailable or predates it.

It imports nothing of capture and nothing heavy: the replication connection, the configuration's checks
and the snapshot reader processes (which start lean: capture.snapshot_readers) import it without
importing the core's modules (capture.native.core: pyarrow, the converters, Avro).

Thread-safety: read-only module state, set at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tideline_native

# What capture needs of the extension: a build without one of these is older than its sources (`make native`).
REQUIRED = ("Core.register_avro", "SnapshotEncoder.converts", "Plugin.PGOUTPUT", "ValueFormat.AVRO")

ReadXlog = Callable[[int, int, int, int, bytes | None, int, int], tuple[int, bytes, bytes, bytes | None]]
SpliceReads = Callable[[bytes, bytes | memoryview, bytes | memoryview, bytes, int, bytes], tuple[bytes, bytes]]

Core: type[tideline_native.Core] | None = None
CorePlugin: type[tideline_native.Plugin] | None = None
CoreValueFormat: type[tideline_native.ValueFormat] | None = None
SnapshotEncoder: type[tideline_native.SnapshotEncoder] | None = None
splice_reads: SpliceReads | None = None
read_xlog: ReadXlog | None = None
KafkaProducer: type[tideline_native.KafkaProducer] | None = None
KafkaCallError: type[tideline_native.KafkaCallError] | None = None
librdkafka_version: Callable[[], str] | None = None
# the Kafka producer's own requirement: a build older than it still runs the core
KAFKA_REQUIRED = ("KafkaProducer.take_delivered", "KafkaCallError", "librdkafka_version")


def missing_attributes(module: object, required: tuple[str, ...] = REQUIRED) -> list[str]:
    """The ``required`` names (default :data:`REQUIRED`) ``module`` lacks."""
    missing = []
    for dotted in required:
        node = module
        for part in dotted.split("."):
            node = getattr(node, part, None)
        if node is None:
            missing.append(dotted)
    return missing


UNAVAILABLE: str | None  # why the extension cannot be used (None: it can), as the reports say it
try:
    import tideline_native as _loaded
except ImportError as e:  # not built: the Python path (or a clear error when --core native asks for it)
    if isinstance(e, ModuleNotFoundError) and e.name == "tideline_native":
        UNAVAILABLE = f"the extension tideline_native is not built ({e})"
    else:
        UNAVAILABLE = f"the extension tideline_native cannot be imported ({e})"
else:
    _missing = missing_attributes(_loaded)
    UNAVAILABLE = (f"the extension tideline_native is older than its sources (it has no {', '.join(_missing)})"
                   if _missing else None)  # fmt: skip
    if UNAVAILABLE is None:
        Core, CorePlugin, CoreValueFormat = _loaded.Core, _loaded.Plugin, _loaded.ValueFormat
        SnapshotEncoder, splice_reads, read_xlog = _loaded.SnapshotEncoder, _loaded.splice_reads, _loaded.read_xlog
BUILT = UNAVAILABLE is None
KAFKA_UNAVAILABLE: str | None = UNAVAILABLE  # why the native Kafka producer cannot be used (None: it can)
if BUILT:
    _missing_kafka = missing_attributes(_loaded, KAFKA_REQUIRED)
    if _missing_kafka:
        KAFKA_UNAVAILABLE = ("the extension tideline_native predates its Kafka producer (it has no "
                             f"{', '.join(_missing_kafka)}): run `make native`")  # fmt: skip
    else:
        KafkaProducer, KafkaCallError = _loaded.KafkaProducer, _loaded.KafkaCallError
        librdkafka_version = _loaded.librdkafka_version


def available() -> bool:
    """Whether the extension is importable and as new as its sources."""
    return BUILT


def unavailable_reason() -> str:
    """Why the extension cannot be used (when :func:`available` is false)."""
    return UNAVAILABLE or "the extension tideline_native is not built"


def converts(type_oid: int) -> bool:
    """Whether the native code converts values of the type ``type_oid`` (False without the extension)."""
    return SnapshotEncoder is not None and SnapshotEncoder.converts(type_oid)
