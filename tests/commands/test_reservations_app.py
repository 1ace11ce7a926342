"""The reservations example's front ends: the HTTP API (FastAPI TestClient) and the CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from commands_util import rows
from fastapi.testclient import TestClient
from readiness import patience
from typer.testing import CliRunner

from examples.reservations.__main__ import app as cli_app
from examples.reservations.api import create_app


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with TestClient(create_app(dsn)) as c:
        yield c


def test_http_api_commands_reads_and_errors(client: TestClient, dsn: str) -> None:
    r = client.post("/users", json={"username": "alice", "user_id": "u1"}, headers={"X-Correlation-Id": "req-1"})
    assert r.status_code == 201, r.text
    assert r.json()["state"] == {"registered": True, "user_id": "u1", "username": "alice", "display_name": "alice"}
    assert r.json()["result"]["commit_lsn"]
    r = client.post("/users", json={"username": "alice", "user_id": "u2"})
    assert r.status_code == 409 and r.json()["error"] == "DuplicateClaimError"
    r = client.post("/users", json={"username": "A!", "user_id": "u3"})
    assert r.status_code == 422 and r.json()["error"] == "ValidationError"

    body = {"show_id": "hamlet", "seat": "A12", "customer_id": "u1", "reservation_id": "r1"}
    first = client.post("/reservations", json=body, headers={"Idempotency-Key": "k1"})
    again = client.post("/reservations", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 201
    assert again.json()["result"]["replayed"] and not first.json()["result"]["replayed"]
    taken = client.post("/reservations", json={**body, "reservation_id": "r2", "customer_id": "u9"})
    assert taken.status_code == 409 and "hamlet/A12" in taken.json()["detail"]

    moved = client.post("/reservations/r1/seat", json={"seat": "B3"})
    assert moved.status_code == 201 and moved.json()["state"]["seat"] == "B3" and moved.json()["version"] == 2
    assert client.post("/reservations/r1/cancel").json()["state"]["status"] == "cancelled"
    assert client.post("/reservations/r1/cancel").status_code == 409
    assert client.get("/reservations/r1").json()["version"] == 3
    assert client.get("/users/u1").json()["state"]["username"] == "alice"
    assert client.get("/users/nobody").status_code == 404
    assert rows(dsn, "SELECT metadata->>'correlation_id' FROM events WHERE stream_id = 'user-u1'") == [("req-1",)]
    assert rows(dsn, "SELECT count(*) FROM events") == [(4,)]  # UserRegistered, SeatReserved, SeatChanged, Cancelled


def test_cli_issues_commands(dsn: str) -> None:
    runner = CliRunner()

    def run(*args: str) -> tuple[int, str]:
        result = runner.invoke(cli_app, ["--dsn", dsn, *args])
        return result.exit_code, result.output

    code, out = run("register-user", "bob", "--user-id", "u7")
    assert code == 0 and json.loads(out)["events"] == ["UserRegistered"]
    code, out = run("reserve", "macbeth", "C4", "--customer", "u7", "--reservation-id", "r7", "--command-id", "c1")
    assert code == 0 and json.loads(out)["version"] == 1
    code, out = run("reserve", "macbeth", "C4", "--customer", "u7", "--reservation-id", "r7", "--command-id", "c1")
    assert code == 0 and json.loads(out)["replayed"] is True
    code, out = run("reserve", "macbeth", "C4", "--customer", "u8", "--reservation-id", "r8")
    assert code == 1 and "seat 'macbeth/C4' is already claimed by 'reservation-r7'" in out
    assert run("change-seat", "r7", "D1")[0] == 0
    code, out = run("show-reservation", "r7")
    assert code == 0 and json.loads(out)["state"]["seat"] == "D1"
    assert run("cancel", "r7")[0] == 0
    code, out = run("show-user", "u7")
    assert json.loads(out) == {
        "version": 1,
        "state": {"registered": True, "user_id": "u7", "username": "bob", "display_name": "bob"},
    }


def test_documented_serve_command_runs_a_server(dsn: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "examples.reservations", "--dsn", dsn, "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + patience(30)
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/users", json={"username": "zed", "user_id": "z1"})
                break
            except httpx.TransportError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        assert r.status_code == 201 and r.json()["result"]["stream_id"] == "user-z1"
        assert httpx.get(f"http://127.0.0.1:{port}/users/z1").json()["version"] == 1
    finally:
        os.kill(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()
