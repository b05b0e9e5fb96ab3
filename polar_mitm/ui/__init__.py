"""The rollout dashboard: a read-only web view of a store (issue 30), served at /ui.

    polar-mitm ui --db STORE          any store, offline (polar_mitm/cli/ui.py)
    rollout serve                     /ui on the server (its node's store; on Ray, every node's, as one)
    polar-mitm gateway                /ui on the gateway itself (its own store; links to mitmweb with --web)

Modules:
    source      UiSource: where a page's StoreReader comes from (a path, this process's Store, a rollout server)
                and StoreProblem, the clear page for a store that cannot be read
    reading     small read helpers over a StoreReader
    run_view    Run: tasks and groups (the assembler's GRPO scoring), sessions by status, policy versions and
                staleness, throughput, nodes and engines, errors
    session_view Session: stage timeline, the conversation, prompt diffs (polar_mitm.debug.diff), sequences
    tokens      Trajectory: one assembled sequence token by token (polar_mitm.assembler.assemble)
    app         the FastAPI app, its templates/ and static/ (plain JS: live refresh, the token view's search)
    gateway     /ui answered by the gateway's mitmproxy addon, in process

Every view reads through polar_mitm.store.StoreReader and never writes.
"""

from polar_mitm.ui.app import create_ui_app, rollout_dashboard, standalone_app
from polar_mitm.ui.source import PathSource, ReaderSource, RolloutSource, StoreProblem, StoreView, UiSource

__all__ = ["PathSource", "ReaderSource", "RolloutSource", "StoreProblem", "StoreView", "UiSource", "create_ui_app", "rollout_dashboard", "standalone_app"]
