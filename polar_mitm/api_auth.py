"""Bearer tokens for polar-mitm's own HTTP APIs: the rollout server's API and each gateway's /control/* and /ui.

One rule for both servers: bound to a loopback address (127.0.0.0/8, ::1, localhost) a token is optional (given, it
is required); bound beyond loopback (0.0.0.0, a LAN address, ...) a server refuses to start without one. The token
comes from a flag or an environment variable and is only ever compared (constant-time), never logged or stored.

    rollout server:  --api-token      / $POLAR_MITM_API_TOKEN      (clients: RolloutClient(token=...), --api-token)
    gateway:         --control-token  / $POLAR_MITM_CONTROL_TOKEN  (clients: GatewayControl(token=...), --token)
"""

from __future__ import annotations

import hmac
import ipaddress
import os

ROLLOUT_TOKEN_ENV = "POLAR_MITM_API_TOKEN"
GATEWAY_TOKEN_ENV = "POLAR_MITM_CONTROL_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only. "" / 0.0.0.0 / :: (every interface) are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost resolves to who knows what: not loopback


def env_token(variable: str) -> str | None:
    """The token in an environment variable, None when unset or empty."""
    return os.environ.get(variable) or None


def refusal_to_listen(host: str, token: str | None, server: str, how: str) -> str | None:
    """Why `server` must not start listening on `host` (one line), or None when it may: beyond loopback it needs a
    token. `how` names the flag and variable that set one."""
    if token or is_loopback(host):
        return None
    shown = host or "every interface"
    return f"{server} would listen on {shown}, beyond loopback, without a bearer token: set {how}, or listen on 127.0.0.1"


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries `Bearer <token>` (compared in constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())
