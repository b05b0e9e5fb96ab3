"""The one switch for the long matrix: POLAR_MITM_FULL_MATRIX=1 adds the runs the default suite (and CI) leaves out
to stay well inside CI's time: every agent in both render modes and without an output cap, and the keepalive case
that must outwait a harness limit nothing can shrink (Gemini CLI's 300 s)."""

from __future__ import annotations

import os

import pytest

FULL_MATRIX = os.environ.get("POLAR_MITM_FULL_MATRIX") == "1"
full_matrix = pytest.mark.skipif(not FULL_MATRIX, reason="the full agent matrix runs with POLAR_MITM_FULL_MATRIX=1")
