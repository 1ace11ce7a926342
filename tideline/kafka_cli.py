"""``tideline kafka``: start, stop and inspect a private local Apache Kafka cluster (KRaft)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tideline.cli_common import fail, one_line_errors

app = typer.Typer(
    help="A private Apache Kafka cluster (KRaft, from the jar cache) in a directory.",
    no_args_is_help=True,
)

DirOption = Annotated[
    Path,
    typer.Option("--dir", help="Cluster directory (formatted on first start).", show_default=False),
]


@app.command()
def start(
    directory: DirOption,
    brokers: Annotated[
        int | None,
        typer.Option("--brokers", help="1 or 3 nodes (fixed at the first start; default 1).", show_default=False),
    ] = None,
) -> None:
    """Start the cluster (formatting it on first use) and print its bootstrap servers; no-op if it runs."""
    from tideline.kafkaharness import LocalKafka

    if brokers is not None and brokers not in (1, 3):
        raise fail(f"--brokers must be 1 or 3, got {brokers}")
    with one_line_errors():
        servers = LocalKafka(directory, brokers=brokers).start()
    typer.echo(servers)


@app.command()
def stop(directory: DirOption) -> None:
    """Stop every node by PID (controlled shutdown, SIGKILL if it hangs)."""
    from tideline.kafkaharness import LocalKafka, NodeShutdown

    with one_line_errors():
        kafka = LocalKafka(directory)
        results = kafka.stop()
    stopped = [r for r in results if r.shutdown is not NodeShutdown.NOT_RUNNING]
    if not stopped:
        typer.echo(f"no Kafka running in {kafka.directory}")
    for r in stopped:
        typer.echo(f"stopped Kafka node {r.node_id} PID {r.pid} in {kafka.directory} ({r.shutdown.value})")


@app.command()
def status(
    directory: DirOption,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Say which nodes run, with their PIDs and ports, and the bootstrap servers."""
    from tideline.kafkaharness import LocalKafka

    with one_line_errors():
        info = LocalKafka(directory).status()
    if as_json:
        typer.echo(json.dumps(info.to_json()))
    elif not info.formatted:
        typer.echo(f"no Kafka cluster in {info.directory}")
    else:
        for node in info.nodes:
            state = f"running, PID {node.pid}" if node.running else "stopped"
            typer.echo(f"node {node.node_id}: {state}, {node.bootstrap_server} (controller :{node.controller_port})")
        typer.echo(f"bootstrap servers: {info.bootstrap_servers or '(none running)'}")
