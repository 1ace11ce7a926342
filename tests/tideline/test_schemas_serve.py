"""``tideline schemas serve``: the Confluent Schema Registry REST API, as a real process on a free port.

One contract test runs against both stores — the embedded log's ``__schemas`` and Kafka's
``_schemas`` — through raw HTTP (status codes, Confluent's error bodies, content type).
The Kafka registry is shared by the session's cluster, so subjects are unique per run
and ids are compared, not assumed. Bad input: one-line errors from the CLI.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from schemas_serve_util import Served, serving
from typer.testing import CliRunner

from eventstore.kafka import KafkaReader
from eventstore.kafka.schema_store import SCHEMAS_TOPIC
from eventstore.log import Log
from eventstore.offsets import TopicPartition
from eventstore.schema_store import SCHEMAS_TOPIC as LOG_SCHEMAS_TOPIC
from tideline.cli import app
from tideline.kafkaharness import LocalKafka

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


def record(*fields: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": "Order", "fields": list(fields)})


V1 = record({"name": "id", "type": "long"})
V2 = record({"name": "id", "type": "long"}, {"name": "note", "type": ["null", "string"], "default": None})
ADDS_REQUIRED = record({"name": "id", "type": "long"}, {"name": "total", "type": "int"})


class Registry:
    """A served registry and how to count the records of its store (to see that nothing was written)."""

    def __init__(self, served: Served, store_records: Callable[[], int], global_args: list[str]) -> None:
        self.served = served
        self.global_args = global_args
        self.store_records = store_records
        self.http = httpx.Client(base_url=served.url, timeout=30)

    def call(self, method: str, path: str, body: Any = None, *, status: int = 200) -> Any:
        response = self.http.request(method, path, content=None if body is None else json.dumps(body),
                                     headers={"Content-Type": CONTENT_TYPE})  # fmt: skip
        assert response.status_code == status, (method, path, response.status_code, response.text)
        assert response.headers["content-type"] == CONTENT_TYPE
        return response.json()

    def error(self, method: str, path: str, body: Any, status: int, error_code: int) -> str:
        found = self.call(method, path, body, status=status)
        assert set(found) == {"error_code", "message"} and found["error_code"] == error_code, found
        return str(found["message"])


@pytest.fixture(params=["log", "kafka"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Registry]:
    if request.param == "log":
        data_dir = tmp_path / "log"
        Log(data_dir).close()

        def log_records() -> int:
            with Log(data_dir) as log:
                if LOG_SCHEMAS_TOPIC not in log.topics():
                    return 0
                return log.partition(LOG_SCHEMAS_TOPIC, 0).log_end_offset()

        with serving("--data-dir", str(data_dir)) as served:
            yield Registry(served, log_records, ["--data-dir", str(data_dir)])
    else:
        kafka: LocalKafka = request.getfixturevalue("kafka")

        def kafka_records() -> int:
            with KafkaReader(kafka.bootstrap_servers) as reader:
                return sum(1 for _ in reader.read_to_end(TopicPartition(SCHEMAS_TOPIC, 0)))

        with serving("--kafka", kafka.bootstrap_servers) as served:
            yield Registry(served, kafka_records, ["--kafka", kafka.bootstrap_servers])


def test_the_confluent_rest_api(registry: Registry) -> None:
    call, error = registry.call, registry.error
    orders, other = f"orders-{uuid.uuid4().hex[:8]}-value", f"other-{uuid.uuid4().hex[:8]}-value"

    # register: ids are global, registration is idempotent
    id1 = call("POST", f"/subjects/{orders}/versions", {"schema": V1})["id"]
    assert call("POST", f"/subjects/{orders}/versions", {"schema": V1, "schemaType": "AVRO"}) == {"id": id1}
    id2 = call("POST", f"/subjects/{orders}/versions", {"schema": V2})["id"]
    assert id2 != id1
    assert call("POST", f"/subjects/{other}/versions", {"schema": V1}) == {"id": id1}

    # subjects and versions
    assert {orders, other} <= set(call("GET", "/subjects"))
    assert call("GET", f"/subjects/{orders}/versions") == [1, 2]
    latest = {"subject": orders, "version": 2, "id": id2, "schema": V2}
    assert call("GET", f"/subjects/{orders}/versions/latest") == latest
    assert call("GET", f"/subjects/{orders}/versions/-1") == latest
    assert call("GET", f"/subjects/{orders}/versions/1") == {"subject": orders, "version": 1, "id": id1, "schema": V1}
    assert call("GET", f"/subjects/{orders}/versions/1/schema") == json.loads(V1)
    assert call("GET", f"/subjects/{orders}/versions/2/referencedby") == []
    assert call("POST", f"/subjects/{orders}", {"schema": V1})["version"] == 1  # lookup

    # by id
    assert call("GET", f"/schemas/ids/{id1}") == {"schema": V1}
    assert call("GET", f"/schemas/ids/{id1}/schema") == json.loads(V1)
    assert call("GET", f"/schemas/ids/{id1}/subjects") == sorted([orders, other])
    assert call("GET", f"/schemas/ids/{id2}/versions") == [{"subject": orders, "version": 2}]
    assert call("GET", "/schemas/types") == ["AVRO"]

    # compatibility checks write nothing
    against_latest = call("POST", f"/compatibility/subjects/{orders}/versions/latest?verbose=true",
                          {"schema": ADDS_REQUIRED})  # fmt: skip
    assert against_latest["is_compatible"] is False
    assert any("field 'total' added without a default" in m and "version 2" in m for m in against_latest["messages"])
    assert call("POST", f"/compatibility/subjects/{orders}/versions/1", {"schema": V2}) == {"is_compatible": True}
    assert call("POST", f"/compatibility/subjects/{orders}/versions", {"schema": V2}) == {"is_compatible": True}

    # an incompatible registration: 409, Confluent's body, nothing stored
    before = registry.store_records()
    message = error("POST", f"/subjects/{orders}/versions", {"schema": ADDS_REQUIRED}, 409, 409)
    assert f'incompatible with an earlier schema for subject "{orders}"' in message
    assert "field 'total' added without a default" in message
    assert registry.store_records() == before
    assert call("GET", f"/subjects/{orders}/versions") == [1, 2]
    error("POST", f"/subjects/{orders}", {"schema": ADDS_REQUIRED}, 404, 40403)

    # compatibility levels: per subject, and registry-wide
    assert call("GET", "/config") == {"compatibilityLevel": "BACKWARD"}
    error("GET", f"/config/{orders}", None, 404, 40408)
    assert call("GET", f"/config/{orders}?defaultToGlobal=true") == {"compatibilityLevel": "BACKWARD"}
    assert call("PUT", f"/config/{orders}", {"compatibility": "none"}) == {"compatibility": "NONE"}
    assert call("GET", f"/config/{orders}") == {"compatibilityLevel": "NONE"}
    id3 = call("POST", f"/subjects/{orders}/versions", {"schema": ADDS_REQUIRED})["id"]  # NONE lets it through
    assert call("GET", f"/subjects/{orders}/versions/3")["id"] == id3
    assert call("DELETE", f"/config/{orders}") == {"compatibilityLevel": "NONE"}
    error("GET", f"/config/{orders}", None, 404, 40408)
    assert call("PUT", "/config", {"compatibility": "FULL"}) == {"compatibility": "FULL"}
    assert call("GET", f"/config/{other}?defaultToGlobal=true") == {"compatibilityLevel": "FULL"}
    assert call("DELETE", "/config") == {"compatibilityLevel": "FULL"}
    assert call("GET", "/config") == {"compatibilityLevel": "BACKWARD"}

    # errors: Confluent's codes
    error("GET", f"/subjects/nobody-{uuid.uuid4().hex}/versions", None, 404, 40401)
    error("GET", f"/subjects/{orders}/versions/9", None, 404, 40402)
    error("GET", f"/subjects/{orders}/versions/0", None, 422, 42202)
    error("GET", "/schemas/ids/987654321", None, 404, 40403)
    error("POST", f"/subjects/{orders}/versions", {"schema": '{"type": "record"}'}, 422, 42201)
    error("POST", f"/subjects/{orders}/versions", {"schema": V1, "schemaType": "PROTOBUF"}, 422, 42201)
    error("PUT", "/config", {"compatibility": "SIDEWAYS"}, 422, 42203)
    error("DELETE", f"/subjects/{orders}", None, 405, 405)
    error("GET", "/no/such/path", None, 404, 404)
    not_json = registry.http.post(f"/subjects/{orders}/versions", content=b"{not json")
    assert not_json.status_code == 400 and not_json.json()["error_code"] == 400
    assert registry.store_records() == before + 5  # version 3 and four level changes; no rejected write

    # the CLI reads the same registry
    shown = CliRunner().invoke(app, [*registry.global_args, "schemas", "show", orders, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output) | {"schema": None} == {"subject": orders, "version": 3, "id": id3,
        "compatibility": "BACKWARD", "schema": None, "versions": [1, 2, 3], "started": None}  # fmt: skip
    # no capture wrote under it: no start (schemas.starts), also in the table of versions
    listed = CliRunner().invoke(app, [*registry.global_args, "schemas", "versions", orders, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["version"], r["started"]) for r in json.loads(listed.output)] == [(1, None), (2, None), (3, None)]

    # one logfmt line per request; Ctrl-C stops cleanly
    assert any(f"method=POST path=/subjects/{orders}/versions status=409" in line for line in registry.served.lines)
    assert registry.served.stop() == 0
    assert "stopped by=SIGINT" in registry.served.lines[-1]


def test_bad_input_is_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    runner = CliRunner()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening: connections are refused
        for args in (["schemas", "list"], ["schemas", "serve", "--port", "0"]):
            result = runner.invoke(app, ["--kafka", nobody, *args])
            assert result.exit_code == 1, result.output
            assert result.output.count("\n") == 1 and result.output.startswith(f"error: cannot reach Kafka at {nobody}")

    data_dir = tmp_path / "log"
    Log(data_dir).close()
    result = runner.invoke(app, ["--data-dir", str(data_dir), "schemas", "serve", "--port", "70000"])
    assert (result.exit_code, result.output) == (2, "error: --port must be within 0 … 65535, got 70000\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["--data-dir", str(data_dir), "schemas", "serve", "--port", str(port)])
    assert result.exit_code == 2
    assert result.output == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    missing = runner.invoke(app, ["--data-dir", str(tmp_path / "none"), "schemas", "serve", "--port", "0"])
    assert missing.exit_code == 1 and missing.output.count("\n") == 1 and missing.output.startswith("error: ")
