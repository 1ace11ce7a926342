"""An I/O rate cap for background work (the log cleaner's ``io_max_bytes_per_second``).

As Kafka's ``Throttler``: the caller reports the bytes it just read or is about to write
(:meth:`Throttler.maybe_throttle`); once per check interval the observed rate is
compared with the cap and, when above it, the caller sleeps for as long as it takes
the average since the start of the interval to fall back to the cap. Bursts worth less
than one check interval at the cap are not smoothed (the next check pays for them);
a larger one is paid for at once.

The sleep waits on a :class:`threading.Event` so that a stop request ends it at once;
the throttler then raises :class:`ThrottleInterrupted` and the caller abandons its work
(the cleaner's passes are safe to abandon at any throttle point).

Thread-safety: not thread-safe; one throttler per worker thread.
"""

from __future__ import annotations

import math
import threading
import time

from eventstore.errors import TidelineError

CHECK_INTERVAL_S = 0.3  # Kafka's Throttler checks every 300 ms


class ThrottleInterrupted(TidelineError):
    """The stop event was set while (or before) the throttler slept: abandon the work."""


class Throttler:
    """Caps the average rate of :meth:`maybe_throttle` calls at ``bytes_per_second``.

    ``bytes_per_second`` = ``math.inf`` disables the cap (stop requests still interrupt).
    """

    def __init__(
        self,
        bytes_per_second: float,
        *,
        stop: threading.Event | None = None,
        check_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        if not bytes_per_second > 0:
            raise ValueError(f"bytes_per_second must be > 0, got {bytes_per_second}")
        self.bytes_per_second = bytes_per_second
        self.check_interval_s = check_interval_s
        self.stop = stop or threading.Event()
        self.slept_s = 0.0  # total time spent sleeping (for the cleaner's stats)
        self._period_start = time.monotonic()
        self._observed = 0

    def maybe_throttle(self, nbytes: int) -> None:
        """Account ``nbytes``; sleep if the rate since the period start exceeds the cap."""
        if self.stop.is_set():
            raise ThrottleInterrupted("stopped")
        self._observed += nbytes
        if math.isinf(self.bytes_per_second):
            return
        elapsed = time.monotonic() - self._period_start
        needed = self._observed / self.bytes_per_second
        if elapsed < self.check_interval_s and needed <= self.check_interval_s:
            return  # a short burst: the next check pays for it
        if needed > elapsed:
            if self.stop.wait(needed - elapsed):
                raise ThrottleInterrupted("stopped while throttled")
            self.slept_s += needed - elapsed
        self._period_start = time.monotonic()
        self._observed = 0

    __call__ = maybe_throttle
