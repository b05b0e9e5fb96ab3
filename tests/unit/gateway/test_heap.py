"""The gateway gives memory its threads freed back to the OS (polar_mitm/gateway/heap.py): glibc keeps freed chunks
inside its heap, so without a trim RSS stays where the busiest moment left it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from polar_mitm.gateway import heap, server
from polar_mitm.gateway.config import GatewayConfig

pytestmark = pytest.mark.skipif(heap.malloc_trim() is None, reason="only glibc has malloc_trim")


def _rss_mb() -> float:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def _fragmented_heap_freed_in(thread_name: str) -> list[bytes]:
    """What a gateway's heap looks like after a burst: 128 MB of 64 KB buffers (below glibc's mmap threshold, so on
    the heap), allocated on a thread and freed there, each with a small buffer after it that stays alive, so no
    freed buffer is at the heap's top, where free() itself would give it back. Returns the small ones, to keep."""
    kept: list[bytes] = []

    def burst() -> None:
        big = []
        for index in range(2048):
            big.append(bytes(64 * 1024 - 64) + index.to_bytes(4, "big"))  # touched: every page resident
            kept.append(bytes(1024) + index.to_bytes(4, "big"))
        big.clear()

    worker = threading.Thread(target=burst, name=thread_name)
    worker.start()
    worker.join()
    return kept


def test_the_trimmer_gives_a_burst_of_freed_buffers_back_to_the_os() -> None:
    kept = _fragmented_heap_freed_in("burst")
    before = _rss_mb()
    trimmer = heap.HeapTrimmer(0.05)
    trimmer.start()
    try:
        deadline = time.monotonic() + 10
        while trimmer.trims < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        after = _rss_mb()
    finally:
        trimmer.stop()
    assert trimmer.trims >= 2 and not any(t.name == "polar-heap-trim" for t in threading.enumerate())
    assert before - after > 64, (before, after)  # of the 128 MB freed
    assert len(kept) == 2048


def test_the_gateway_runs_the_trimmer_at_its_option_and_stops_it(tmp_path: Path) -> None:
    async def main() -> None:
        config = GatewayConfig(upstream="http://127.0.0.1:9/v1", db=tmp_path / "store.duckdb", confdir=str(tmp_path / "confdir"), heap_trim_s=0.05)
        master = server.make_master(config)
        addon = master.addons.get("polaraddon")
        run = asyncio.ensure_future(master.run())
        try:
            for _ in range(600):
                if addon.trimmer is not None and addon.trimmer.trims >= 2:
                    break
                await asyncio.sleep(0.02)
            assert addon.trimmer is not None and addon.trimmer.trims >= 2 and addon.trimmer.interval == 0.05
            master.options.update(polar_heap_trim_s=0.0)  # changed while running: no trimmer
            assert addon.trimmer is None
            master.options.update(polar_heap_trim_s=2.0)
            assert addon.trimmer is not None and addon.trimmer.interval == 2.0
        finally:
            master.shutdown()
            await asyncio.wait_for(run, 60)
        assert addon.trimmer is None and not any(t.name == "polar-heap-trim" for t in threading.enumerate())

    asyncio.run(main())
