"""The engine deadline of a non-streamed call: just before the calling harness would give up on it.

The end-to-end case (a real gateway, Gemini CLI's user agent, a Google-shaped 504 after 55 s) is
tests/integration/test_streaming.py::test_a_non_streamed_call_is_answered_before_its_harness_gives_up, in the full
matrix because it waits out the harness's own 60 s."""

from __future__ import annotations

import pytest

from polar_mitm import harnesses
from polar_mitm.gateway.engine_side import UNSTREAMED_MARGIN_S, unstreamed_timeout


@pytest.mark.parametrize("name", [name for name in harnesses.NAMES if harnesses.get(name).unstreamed_timeout is not None])
def test_a_harness_with_a_limit_gets_its_reply_just_before_it(name: str) -> None:
    limit = harnesses.get(name).unstreamed_timeout
    assert limit is not None
    assert unstreamed_timeout(name, engine_timeout=10_000.0) == limit - UNSTREAMED_MARGIN_S
    # a shorter --engine-timeout wins: the gateway's own deadline is used as it is
    assert unstreamed_timeout(name, engine_timeout=limit - UNSTREAMED_MARGIN_S) is None


def test_gemini_cli_gets_55_seconds() -> None:
    assert unstreamed_timeout("gemini", engine_timeout=600.0) == 55.0


@pytest.mark.parametrize("harness", [None, "not-a-harness", "codex"])
def test_no_known_limit_means_the_gateway_s_own_deadline(harness: str | None) -> None:
    assert harnesses.get("codex").unstreamed_timeout is None
    assert unstreamed_timeout(harness, engine_timeout=600.0) is None
