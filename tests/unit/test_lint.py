"""The tree passes `ruff check` with the project's configuration ([tool.ruff] in pyproject.toml), so CI lints as part
of the README's test command. Lint only: `ruff format` is not part of the project's style."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# the repository root: the nearest folder above this file with pyproject.toml (stays right if tests/ gets subfolders)
ROOT = next(folder for folder in Path(__file__).resolve().parents if (folder / "pyproject.toml").exists())


def test_ruff_check_is_clean() -> None:
    """`python -m ruff check .` from the repository root finds nothing; on failure, the message lists every finding."""
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"ruff is not installed in {sys.executable}'s environment (it comes with the test extra: pip install -e '.[test]'):\n{probe.stderr}", pytrace=False)
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "--no-fix", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"ruff check found problems ({probe.stdout.strip()}; fix them, `ruff check --fix .` does the safe ones):\n{result.stdout}{result.stderr}", pytrace=False)
