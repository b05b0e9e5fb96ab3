"""Capture namespaces' pure parts (polar_mitm/capture.py): addresses, the registration the gateway reads, and the
runtime option's limits. The namespaces themselves: tests/integration/test_transparent_capture.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from polar_mitm import capture
from polar_mitm.rollout.models import Runtime


def test_each_namespace_has_its_own_slash_30_and_short_interface_names() -> None:
    first, far = capture.CaptureNamespace(0, "s", Path("."), None), capture.CaptureNamespace(capture.MAX_NAMESPACES - 1, "s", Path("."), None)
    assert first.addresses == ("10.213.0.1", "10.213.0.2") and far.addresses == ("10.213.255.253", "10.213.255.254")
    assert len(far.host_end) <= 15 and far.name == f"polar-cap-{capture.MAX_NAMESPACES - 1}"
    assert first.command(["node", "x.mjs"])[1:] == ["netns", "exec", "polar-cap-0", "node", "x.mjs"]


def test_a_registration_names_the_session_and_anything_else_is_none(tmp_path: Path) -> None:
    path = capture.registration_path(tmp_path, "10.213.0.2")
    assert capture.registered_session(tmp_path, "10.213.0.2") is None
    path.parent.mkdir()
    path.write_text(json.dumps({"session_id": "abc", "pid": 7, "netns": "polar-cap-0"}))
    assert capture.registered_session(tmp_path, "10.213.0.2") == capture.Registration("abc", 7, "polar-cap-0")
    path.write_text("{half")
    assert capture.registered_session(tmp_path, "10.213.0.2") is None


def test_transparent_capture_is_refused_for_docker_sandboxes() -> None:
    assert Runtime(capture="transparent").capture == "transparent"
    with pytest.raises(ValidationError, match="capture: transparent runs with the local backend"):
        Runtime(backend="docker", capture="transparent")
