"""The producers a partition holds open, and a commit marker written for one: two requests librdkafka lacks.

    markers = TxnMarkers("127.0.0.1:9092")
    for p in markers.producers([("shop.public.orders", 0)])[("shop.public.orders", 0)]:
        p.txn_start_offset                 # -1, or where its open transaction begins in the partition
    markers.commit("shop.public.orders", 0, p)   # that transaction's COMMIT marker, written there now

What they are for (``capture.sinks.kafka``, docs/capture.md "Kafka transactions and the double
fault"): Kafka's transaction coordinator skips the markers of a partition that has no leader at the
moment it writes them (Kafka 4.4, ``TransactionMarkerChannelManager``: "Couldn't find leader endpoint
for partitions … likely deleted already and hence can be skipped") and completes the transaction
anyway. The producer's records there stay open — the partition's last stable offset stops at them —
until that producer's next marker in that partition, COMMIT or ABORT, ends them. Writing the COMMIT
marker the coordinator skipped ends them as the coordinator decided, without a transaction of ours
that could abort. It is what ``kafka-transactions.sh abort`` does with ABORT (Kafka's Admin
``abortTransaction``): a ``WriteTxnMarkers`` request to the partition's leader with the producer's
id, epoch and coordinator epoch, as ``DescribeProducers`` reports them.

Both are Kafka's own requests (``DescribeProducers`` v0, API key 61; ``WriteTxnMarkers`` v1, API key
27), sent here over a plain TCP connection to the partition's leader (PLAINTEXT, as every client of
this package). ``WriteTxnMarkers`` needs the ``ClusterAction`` (or ``Alter``) permission on the
cluster where an authorizer is configured; without it :class:`TxnMarkersError` says so.

Thread safety: one caller at a time (each call opens and closes its own connections).
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import IsolationLevel, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec

from eventstore.errors import RetriableError, TidelineError
from eventstore.kafka.config import client_config, translate

API_WRITE_TXN_MARKERS = 27
API_DESCRIBE_PRODUCERS = 61
WRITE_TXN_MARKERS_VERSION = 1  # v0 was removed in Kafka 4.0; v1 is flexible
DESCRIBE_PRODUCERS_VERSION = 0  # flexible
CLIENT_ID = "tideline-txn-markers"
DEFAULT_TIMEOUT_S = 10.0
RETRY_BACKOFF_S = 0.2
# Kafka's error codes met here: the leader moved (ask the metadata again), or the request is not allowed.
# UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER, FENCED/UNKNOWN_LEADER_EPOCH
_LEADERSHIP = frozenset({3, 5, 6, 74, 75})
_NOT_AUTHORIZED = frozenset({29, 31})  # TOPIC_AUTHORIZATION_FAILED, CLUSTER_AUTHORIZATION_FAILED


class TxnMarkersError(TidelineError):
    """A DescribeProducers or WriteTxnMarkers request failed; the message names the partition and Kafka's error."""


@dataclass(frozen=True, slots=True)
class ProducerState:
    """One producer a partition keeps state for (``DescribeProducers``)."""

    producer_id: int
    producer_epoch: int
    coordinator_epoch: int  # of the last marker it got there (a marker must carry at least this one)
    txn_start_offset: int  # the first offset of its open transaction in the partition; -1: none open


class TxnMarkers:
    """``DescribeProducers`` and COMMIT ``WriteTxnMarkers`` against the cluster at ``bootstrap_servers``."""

    def __init__(self, bootstrap_servers: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.timeout_s = timeout_s
        try:
            self._admin = AdminClient(client_config(bootstrap_servers))
        except KafkaException as e:
            translate(e, what="creating an admin client", bootstrap=bootstrap_servers)
        self._correlation = itertools.count(1)

    def ask_stable_offsets(self, partitions: Iterable[tuple[str, int]]) -> StableOffsets:
        """Ask the partitions' last stable offsets without waiting: the answer is collected later
        (:meth:`StableOffsets.result`), so the round trip overlaps other work."""
        tps = [KafkaTopicPartition(topic, partition) for topic, partition in partitions]
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        committed = IsolationLevel.READ_COMMITTED
        try:
            futures = self._admin.list_offsets({tp: latest for tp in tps}, isolation_level=committed,
                                               request_timeout=self.timeout_s)  # fmt: skip
        except KafkaException:
            futures = {}
        return StableOffsets(futures, self._admin, self.timeout_s)

    def producers(
        self, partitions: Iterable[tuple[str, int]], *, timeout_s: float | None = None
    ) -> dict[tuple[str, int], list[ProducerState]]:
        """The producers each partition keeps state for, as its leader reports them now; asked again while
        a leader moves, for up to ``timeout_s`` (default: the instance's)."""
        wanted = sorted(set(partitions))
        found: dict[tuple[str, int], list[ProducerState]] = {}
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = [tp for tp in wanted if tp not in found]
            try:
                for address, tps in self._by_leader(left).items():
                    found.update(self._describe(address, tps))
                return found
            except RetriableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_BACKOFF_S)

    def commit(self, topic: str, partition: int, producer: ProducerState, *, timeout_s: float | None = None) -> None:
        """Write a COMMIT marker for ``producer`` in ``topic[partition]``: its open records there become
        visible to ``read_committed`` readers. Only for a transaction its coordinator committed. Asked
        again while the leader moves, for up to ``timeout_s`` (default: the instance's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                ((address, _),) = self._by_leader([(topic, partition)]).items()
                self._write_commit(address, topic, partition, producer)
                return
            except RetriableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_BACKOFF_S)

    # -- internals -----------------------------------------------------------

    def _by_leader(self, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """The partitions grouped by their leader's ``(host, port)``; RetriableError while one has none."""
        try:
            metadata = self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as e:
            translate(e, what="reading metadata", bootstrap=self.bootstrap_servers)
        grouped: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for topic, partition in partitions:
            meta = metadata.topics.get(topic)
            part = meta.partitions.get(partition) if meta is not None and meta.error is None else None
            broker = metadata.brokers.get(part.leader) if part is not None else None
            if broker is None:
                raise RetriableError(f"Kafka at {self.bootstrap_servers}: {topic}[{partition}] has no leader now")
            grouped.setdefault((str(broker.host), int(broker.port)), []).append((topic, partition))
        return grouped

    def _describe(
        self, address: tuple[str, int], partitions: list[tuple[str, int]]
    ) -> dict[tuple[str, int], list[ProducerState]]:
        by_topic: dict[str, list[int]] = {}
        for topic, partition in partitions:
            by_topic.setdefault(topic, []).append(partition)
        body = _Writer()
        body.array_length(len(by_topic))
        for topic, indexes in by_topic.items():
            body.string(topic)
            body.array_length(len(indexes))
            for index in indexes:
                body.int32(index)
            body.no_tags()
        body.no_tags()
        reply = self._send(address, API_DESCRIBE_PRODUCERS, DESCRIBE_PRODUCERS_VERSION, bytes(body.data))
        reply.int32()  # throttle time
        found: dict[tuple[str, int], list[ProducerState]] = {}
        for _ in range(reply.array_length()):
            topic = reply.string()
            for _ in range(reply.array_length()):
                partition, error = reply.int32(), reply.int16()
                message = reply.nullable_string()
                producers = []
                for _ in range(reply.array_length()):
                    pid, epoch, _seq, _ts = reply.int64(), reply.int32(), reply.int32(), reply.int64()
                    coordinator_epoch, start = reply.int32(), reply.int64()
                    reply.skip_tags()
                    producers.append(ProducerState(pid, epoch, coordinator_epoch, start))
                reply.skip_tags()
                self._check(error, f"describing the producers of {topic}[{partition}]", message)
                found[(topic, partition)] = producers
            reply.skip_tags()
        return found

    def _write_commit(self, address: tuple[str, int], topic: str, partition: int, producer: ProducerState) -> None:
        body = _Writer()
        body.array_length(1)
        body.int64(producer.producer_id)
        body.int16(producer.producer_epoch)
        body.int8(1)  # TransactionResult: COMMIT
        body.array_length(1)
        body.string(topic)
        body.array_length(1)
        body.int32(partition)
        body.no_tags()
        body.int32(producer.coordinator_epoch)
        body.no_tags()
        body.no_tags()
        reply = self._send(address, API_WRITE_TXN_MARKERS, WRITE_TXN_MARKERS_VERSION, bytes(body.data))
        for _ in range(reply.array_length()):
            reply.int64()
            for _ in range(reply.array_length()):
                name = reply.string()
                for _ in range(reply.array_length()):
                    index, error = reply.int32(), reply.int16()
                    reply.skip_tags()
                    self._check(error, f"writing a commit marker of producer {producer.producer_id} in {name}[{index}]")
                reply.skip_tags()
            reply.skip_tags()

    def _check(self, error: int, what: str, message: str | None = None) -> None:
        if error == 0:
            return
        name = KafkaError(error).name()
        detail = f"{what}: {name}" + (f" ({message})" if message else "")
        if error in _LEADERSHIP:
            raise RetriableError(f"Kafka at {self.bootstrap_servers}: {detail}")
        if error in _NOT_AUTHORIZED:
            raise TxnMarkersError(f"Kafka at {self.bootstrap_servers}: {detail}: the client needs the ClusterAction "
                                  "permission on the cluster")  # fmt: skip
        raise TxnMarkersError(f"Kafka at {self.bootstrap_servers}: {detail}")

    def _send(self, address: tuple[str, int], api_key: int, version: int, body: bytes) -> _Reader:
        """One request on its own connection; the response body (after its flexible header)."""
        correlation = next(self._correlation)
        client = CLIENT_ID.encode()
        header = struct.pack(">hhih", api_key, version, correlation, len(client)) + client + b"\x00"  # header v2
        request = header + body
        try:
            with socket.create_connection(address, timeout=self.timeout_s) as conn:
                conn.sendall(struct.pack(">i", len(request)) + request)
                (size,) = struct.unpack(">i", _read_exactly(conn, 4))
                response = _read_exactly(conn, size)
        except OSError as e:
            raise RetriableError(f"Kafka at {address[0]}:{address[1]}: {e}") from e
        reply = _Reader(response)
        if reply.int32() != correlation:
            raise TxnMarkersError(f"Kafka at {address[0]}:{address[1]}: a response to another request")
        reply.skip_tags()  # response header v1
        return reply


class StableOffsets:
    """An answer of :meth:`TxnMarkers.ask_stable_offsets` on its way."""

    def __init__(self, futures: dict[Any, Any], admin: AdminClient, timeout_s: float) -> None:
        self._futures = futures
        self._admin = admin
        self._timeout_s = timeout_s

    def result(self, timeout_s: float) -> dict[tuple[str, int], int]:
        """The offsets that came back within ``timeout_s``; a partition whose answer failed is left out.
        After a failure the client's metadata is read again: librdkafka's ListOffsets sends the leader
        epoch it knows, and a broker restarted since answers FENCED_LEADER_EPOCH until it learns the
        new one (without this, for as long as its metadata refresh interval)."""
        found: dict[tuple[str, int], int] = {}
        failed: set[str] = set()
        deadline = time.monotonic() + timeout_s
        for tp, future in self._futures.items():
            try:
                answer = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception:  # a failed or late answer is only a missing hint: the caller asks again
                failed.add(tp.topic)
                continue
            found[(tp.topic, tp.partition)] = int(answer.offset)
        for topic in sorted(failed):
            try:
                self._admin.list_topics(topic, timeout=self._timeout_s)
            except KafkaException:
                break  # the cluster is out of reach: the next ask will say so again
        return found


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(left)
        if not chunk:
            raise OSError("connection closed by the broker")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Writer:
    """Kafka's flexible encoding: big-endian integers, compact (varint + 1) lengths, empty tagged fields."""

    def __init__(self) -> None:
        self.data = bytearray()

    def int8(self, v: int) -> None:
        self.data += struct.pack(">b", v)

    def int16(self, v: int) -> None:
        self.data += struct.pack(">h", v)

    def int32(self, v: int) -> None:
        self.data += struct.pack(">i", v)

    def int64(self, v: int) -> None:
        self.data += struct.pack(">q", v)

    def uvarint(self, v: int) -> None:
        while v >= 0x80:
            self.data.append((v & 0x7F) | 0x80)
            v >>= 7
        self.data.append(v)

    def array_length(self, n: int) -> None:
        self.uvarint(n + 1)

    def string(self, s: str) -> None:
        raw = s.encode()
        self.uvarint(len(raw) + 1)
        self.data += raw

    def no_tags(self) -> None:
        self.uvarint(0)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def int16(self) -> int:
        return int(self._take(">h"))

    def int32(self) -> int:
        return int(self._take(">i"))

    def int64(self) -> int:
        return int(self._take(">q"))

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def array_length(self) -> int:
        return max(self.uvarint() - 1, 0)

    def nullable_string(self) -> str | None:
        n = self.uvarint()
        if n == 0:
            return None
        raw = self.data[self.pos : self.pos + n - 1]
        self.pos += n - 1
        return raw.decode()

    def string(self) -> str:
        return self.nullable_string() or ""

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.pos += self.uvarint()  # size, then the value
