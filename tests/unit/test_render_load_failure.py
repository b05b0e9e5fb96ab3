"""A render model that cannot be loaded is every call's error (tokens mode) or chat mode said once (--render auto);
either way each call's frames are released with it. The kept failure was raised again as the same object, so every
caller's frames were chained onto its traceback and held each exchange's request and reply for the gateway's life
(RSS 0.37 -> 1.4 GB in 10 s at 64 sessions in bench/memory_bench.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest

from polar_mitm.errors import RenderError
from polar_mitm.render.serve import TokenPath


class _Exchange:
    """Stands for what a caller's frame holds while it asks for the renderer (a flow, its parsed bodies)."""


async def _ask(path: TokenPath, held: list[weakref.ref[_Exchange]], fallback: bool) -> None:
    exchange = _Exchange()
    held.append(weakref.ref(exchange))
    if fallback:
        assert await path.in_use() is False
    else:
        with pytest.raises(RenderError, match="tokenizer"):
            await path.renderer()
    assert exchange is not None  # held by this frame until it returns, as a gateway's frames hold their flow


@pytest.mark.parametrize("fallback", [False, True], ids=["tokens", "auto"])
def test_a_render_model_that_cannot_load_holds_no_callers_frames(tmp_path: Path, fallback: bool) -> None:
    path = TokenPath(engine=None, model=str(tmp_path / "no-such-model"), fallback=fallback)  # type: ignore[arg-type]  # the engine is never asked: the model is given
    held: list[weakref.ref[_Exchange]] = []

    async def calls() -> None:
        for _ in range(20):
            await _ask(path, held, fallback)

    asyncio.run(calls())
    gc.collect()
    assert [ref() for ref in held] == [None] * 20
