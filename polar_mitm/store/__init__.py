"""The DuckDB store (moved into a package; split into modules by the next commit)."""

from polar_mitm.store.writer import *  # noqa: F403
