"""Shared fixtures. Append new fixtures; other test modules depend on the ones here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    """OpenAI base URL (".../v1") of a real vLLM engine.

    $POLAR_MITM_ENGINE_URL if set; else the local engine on 127.0.0.1:8011, reused when one is live
    and otherwise started for this run and stopped at its end.
    """
    if url := os.environ.get("POLAR_MITM_ENGINE_URL"):
        yield url.rstrip("/")
        return
    from polar_mitm.local_engine import LocalEngine

    engine = LocalEngine()
    url = engine.start()
    yield url
    if engine.started_here:
        engine.stop()

