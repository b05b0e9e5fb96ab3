"""Freed memory given back to the OS while the gateway runs: glibc's `malloc_trim(0)` from a thread, every
`--heap-trim-s` seconds.

A gateway's heap churns through harness-sized buffers (50-170 KB requests, engine requests and replies, journal
records) from several threads, and glibc keeps what they free: a probe inside a gateway at 1,000 sessions (mallinfo2
each second, bench/scale.py) saw its heap at ~750 MB with 150-300 MB of it free under load and 570 MB free after it,
so RSS stayed where the busiest moment left it. `malloc_trim(0)` hands the free pages inside the heap back
(madvise), not only its top. Measured (bench/README.md, "The heap given back, and two holders of memory"), three
interleaved pairs of bench/scale.py at 1,000 sessions and 10 turns, trimming against not: peak RSS 977 / 960 against
1025 / 986 MB in chat mode, 1055 against 1129 in tokens mode, RSS at the end 70-140 MB lower, CPU per exchange no
higher (6.78 / 7.26 against 6.84 / 7.48 ms). At ~200 exchanges/s (bench/memory_bench.py, 512 sessions) RSS was
25-32 MB lower in the middle and at the end of a level (at 64 sessions 0-7 MB) and CPU within the runs' ±0.5 ms
spread: the cost, page faults when given-back memory is used again, is not resolved there. One call giving back
127 MB took 7.7 ms; it runs without the GIL (ctypes lets it go), on a thread of its own.

Only glibc has `malloc_trim`; elsewhere (musl, macOS) the trimmer does nothing, and says so in the debug log.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("polar_mitm.gateway")


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """A daemon thread that calls malloc_trim(0) every `interval` seconds until stop()."""

    def __init__(self, interval: float):
        self.interval = interval
        self.trims = 0  # calls made so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        trim = malloc_trim()
        if trim is None:
            log.debug("polar: this C library has no malloc_trim; freed memory is given back as it allows")
            return
        self._thread = threading.Thread(target=self._run, args=(trim,), name="polar-heap-trim", daemon=True)
        self._thread.start()

    def _run(self, trim: Callable[[int], int]) -> None:
        while not self._stop.wait(self.interval):
            trim(0)
            self.trims += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
