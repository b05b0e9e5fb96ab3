"""The one switch for the long matrix: POLAR_MITM_FULL_MATRIX=1 adds the runs the default suite (and CI) leaves out
to stay well inside CI's time: every agent in both render modes and without an output cap, the keepalive case
that must outwait a harness limit nothing can shrink (Gemini CLI's 300 s), and the long cases (`long_case`)."""

from __future__ import annotations

import os

import pytest

FULL_MATRIX = os.environ.get("POLAR_MITM_FULL_MATRIX") == "1"
full_matrix = pytest.mark.skipif(not FULL_MATRIX, reason="the full agent matrix runs with POLAR_MITM_FULL_MATRIX=1")
# A long case whose feature the default suite still meets in a shorter test (each says which): CI's default suite
# leaves it out to stay well inside CI's time; README lists them.
long_case = pytest.mark.skipif(not FULL_MATRIX, reason="a long case: runs with POLAR_MITM_FULL_MATRIX=1")


def harness_matrix(names: list[str], default: tuple[str, ...]) -> list[object]:
    """Parameters for a feature tested on every harness: the `default` ones run in every suite, the rest only in
    the full matrix. Each default suite's subset is chosen per feature so that every harness and every wire
    dialect still meets the feature's hard case in the default run (its docstring says which and why)."""
    unknown = set(default) - set(names)
    assert not unknown, f"default harnesses not in the matrix: {sorted(unknown)}"
    return [name if name in default else pytest.param(name, marks=full_matrix) for name in names]
