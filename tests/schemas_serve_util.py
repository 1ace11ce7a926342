"""``tideline schemas serve`` as a real process, for the tests that talk to it over HTTP."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

STARTUP_TIMEOUT_S = 60.0
LISTENING = re.compile(r"schemas serve listening=(http://\S+)")
TIDELINE_MAIN = "from tideline.cli import main; main()"


@dataclass
class Served:
    """A running ``tideline … schemas serve``: its URL and the stderr lines it logged so far."""

    url: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        """Send ``sig`` and return the exit status once the process is gone."""
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)


@contextmanager
def serving(*global_args: str) -> Iterator[Served]:
    """Start ``tideline GLOBAL_ARGS… schemas serve --port 0``; yield once it listens; kill it if still running."""
    process = subprocess.Popen(
        [sys.executable, "-c", TIDELINE_MAIN, *global_args, "schemas", "serve", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    urls: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:  # keeps reading: a full pipe would block the server's request log
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line.rstrip("\n"))
            if found := LISTENING.search(line):
                urls.put(found.group(1))
        urls.put(None)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        try:
            url = urls.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            url = None
        assert url is not None, "schemas serve did not start:\n" + "\n".join(lines)
        yield Served(url, process, lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
        reader.join(timeout=10)
