"""A consumer-group member in its own process, for tests/eventstore/test_groups.py.

Usage: ``python group_worker.py LOG_DIR TOPIC GROUP OUT_FILE STOP_FILE [MAX_RECORDS [PAUSE_MS]]``

Subscribes to TOPIC in GROUP (auto-commit every 100 ms, so also on rebalance and close)
and polls until STOP_FILE exists, then closes cleanly. It appends one line per event to
OUT_FILE (written before the next poll, so before the commit that covers it; not
fsynced: a kill -9 keeps what was written)::

    M <member_id>                      first line
    A <partition> <position> <t_ns>    partition acquired, starting at <position> (t: CLOCK_MONOTONIC)
    V <partition> <t_ns>               partition revoked
    R <partition> <offset>             record processed
    C <partition> <offset>             offset committed (logged after the commit is durable)
    CLOSED                             clean exit
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from eventstore.consumer import Consumer, OffsetAndMetadata, TopicPartition
from eventstore.log import Log
from eventstore.partition_log import FsyncMode, FsyncPolicy


class LoggingConsumer(Consumer):
    """A consumer that logs every commit it makes (auto, on revoke, on close, explicit)."""

    out: TextIO

    def commit(self, offsets: Mapping[TopicPartition, int | OffsetAndMetadata] | None = None) -> None:
        if offsets is None:
            offsets = {tp: self.position(tp) for tp in self.assignment()}
        super().commit(offsets)
        lines = []
        for tp, om in sorted(offsets.items()):
            lines.append(f"C {tp.partition} {om.offset if isinstance(om, OffsetAndMetadata) else om}\n")
        self.out.write("".join(lines))
        self.out.flush()


def main() -> None:
    log_dir, topic, group, out_path, stop_path = sys.argv[1:6]
    max_records = int(sys.argv[6]) if len(sys.argv) > 6 else 25
    pause_s = int(sys.argv[7]) / 1000 if len(sys.argv) > 7 else 0.002
    stop = Path(stop_path)
    with open(out_path, "a", buffering=1 << 16) as out, Log(log_dir, fsync=FsyncPolicy(FsyncMode.NONE)) as log:
        consumer = LoggingConsumer(log, group_id=group, auto_commit_interval_ms=100, heartbeat_interval_ms=50)
        consumer.out = out

        def on_assign(tps: list[TopicPartition]) -> None:
            t = time.monotonic_ns()
            out.write("".join(f"A {tp.partition} {consumer.position(tp)} {t}\n" for tp in tps))
            out.flush()

        def on_revoke(tps: list[TopicPartition]) -> None:
            t = time.monotonic_ns()
            out.write("".join(f"V {tp.partition} {t}\n" for tp in tps))
            out.flush()

        consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
        out.write(f"M {consumer.member_id}\n")
        out.flush()
        while not stop.exists():
            records = consumer.poll(50, max_records=max_records)
            if records:
                out.write("".join(f"R {r.partition} {r.offset}\n" for r in records))
                out.flush()
                time.sleep(pause_s)
        consumer.close()
        out.write("CLOSED\n")


if __name__ == "__main__":
    main()
