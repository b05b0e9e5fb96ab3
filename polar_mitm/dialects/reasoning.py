"""Opaque reasoning carriers: the engine's reasoning text travels inside a provider's opaque field
(Responses `encrypted_content`, Anthropic thinking `signature`, Gemini `thoughtSignature`) so that, when the
harness sends it back next turn, the engine sees the original reasoning again."""

from __future__ import annotations

import base64
import json

PREFIX = "polar1."


def seal(reasoning: str) -> str:
    payload = json.dumps({"reasoning": reasoning}, ensure_ascii=False).encode()
    return PREFIX + base64.urlsafe_b64encode(payload).decode().rstrip("=")


def unseal(blob: object) -> str | None:
    """The reasoning text inside a blob we sealed; None for anything else (a real provider's signature)."""
    if not isinstance(blob, str) or not blob.startswith(PREFIX):
        return None
    encoded = blob[len(PREFIX):]
    try:
        payload = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (ValueError, UnicodeDecodeError):
        return None
    reasoning = payload.get("reasoning") if isinstance(payload, dict) else None
    return reasoning if isinstance(reasoning, str) else None
