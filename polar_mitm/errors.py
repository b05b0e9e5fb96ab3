"""One exception tree for polar-mitm (the bottom of the import graph: this module imports nothing of ours).

Catch `PolarError` to catch everything the project raises on purpose. Classes that used to derive from a
built-in (`RuntimeError`, `ValueError`) still do, so callers written against those keep working.

    PolarError
    ├── ConfigError            a bad option or flag value, found before anything is opened
    ├── DialectError           a request the gateway refuses, rendered in the called provider's shape
    │   └── RenderError        tokens mode cannot render this prompt (no chat template, template failure, image)
    ├── EngineError            the inference engine failed an exchange; `status_class` goes on the row
    ├── CallAbandoned          an engine call cancelled because nobody waits for it (client gone, gateway stopping)
    ├── LocalEngineError       starting/stopping the bundled local engine (EngineBuildError: building it)
    ├── HarnessNotInstalled    a harness binary is missing
    ├── RunError               `polar-mitm run` cannot reach or trust its gateway
    ├── ClientError            a CLI client cannot reach or use its server
    │   ├── ServerRefused      a polar-mitm server answered >= 400 (also a ControlError), with its message
    │   └── WeightSyncError    an engine refused or failed a weight-sync call (vLLM LoRA load, SGLang reload)
    ├── RolloutError           the rollout server: RequestRejected, TaskConflict, BackendStartError, EvaluatorError, ...
    └── ControlError           a gateway control call (pause/resume) refused, with its HTTP status
"""

from __future__ import annotations

from typing import Any


class PolarError(Exception):
    """Base of every exception polar-mitm raises on purpose."""


class ConfigError(PolarError, ValueError):
    """A bad option value; the message names the flag."""


class DialectError(PolarError):
    """A request the gateway refuses; rendered in the shape of the provider the client called."""

    def __init__(
        self, status: int, kind: str, message: str, param: str | None = None,
        prompt_tokens: int | None = None, max_context: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        # kind "context_length_exceeded": the numbers each provider's own message states
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class EngineError(PolarError):
    """The inference engine failed us; `status_class` is what the exchange row records."""

    def __init__(
        self, status_class: str, message: str, http_status: int, engine_body: Any = None,
        prompt_tokens: int | None = None, max_context: int | None = None,
    ):
        super().__init__(message)
        self.status_class = status_class
        self.message = message
        self.http_status = http_status
        self.engine_body = engine_body
        # status_class "context_length_exceeded": the prompt's length and the engine's context
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context

    def for_client(self) -> DialectError:
        """The error the harness gets, in the shape of the provider it called (the dialect renders it)."""
        return DialectError(self.http_status, self.status_class, self.message, prompt_tokens=self.prompt_tokens, max_context=self.max_context)


class CallAbandoned(PolarError):
    """An engine call the gateway cancelled: its client went away (`client_disconnected`) or the gateway is
    stopping (`gateway_shutdown`); `status_class` goes on the row."""

    def __init__(self, status_class: str, message: str):
        super().__init__(message)
        self.status_class = status_class
        self.message = message


class LocalEngineError(PolarError, RuntimeError):
    """The bundled local engine could not be started, found or stopped."""


class EngineBuildError(LocalEngineError):
    """The bundled local engine could not be built."""


class HarnessNotInstalled(PolarError, RuntimeError):
    pass


class RunError(PolarError):
    """`polar-mitm run` cannot find, reach or authenticate to its gateway."""


class ClientError(PolarError):
    """A command-line client cannot reach or use its server."""


class WeightSyncError(ClientError):
    """An engine's weight-sync endpoint failed: `endpoint` is the URL called, `status` its HTTP status (None: the
    engine could not be reached), `message` what the engine said."""

    def __init__(self, endpoint: str, status: int | None, message: str):
        reached = "unreachable" if status is None else f"HTTP {status}"
        super().__init__(f"POST {endpoint}: {reached}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message


class RolloutError(PolarError):
    """Base of the rollout server's errors."""


class RequestRejected(RolloutError, ValueError):
    """A request no node could run; `loc` names the field, as pydantic's errors do."""

    def __init__(self, loc: tuple[str, ...], message: str):
        super().__init__(message)
        self.loc = loc


class BackendStartError(RolloutError, RuntimeError):
    """The rollout server's backend (its gateway node, or its Ray cluster) cannot start; one line that says why
    and what to do. Nothing was served and nothing is left behind."""


class GatewayStartError(RolloutError, RuntimeError):
    """A node's in-process gateway exited while starting; the message says why (mitmproxy's startup errors)."""

    def __init__(self, port: int, causes: list[str]):
        super().__init__(f"the gateway did not start on 127.0.0.1:{port}: {'; '.join(causes)}")
        self.port = port
        self.causes = causes

    @property
    def port_in_use(self) -> bool:
        return any("address already in use" in cause.lower() for cause in self.causes)


class TaskConflict(RolloutError, ValueError):
    pass


class EvaluatorError(RolloutError, RuntimeError):
    pass


class DockerUnavailable(RolloutError, RuntimeError):
    pass


class RenderError(DialectError):
    """Tokens mode could not render a prompt or load the model's chat template; answered in the provider's shape."""


class ControlError(PolarError):
    """A gateway control call (pause/resume/status) refused: `status` is the HTTP status it answers with."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class ServerRefused(ClientError, ControlError):
    """A polar-mitm server (a gateway's /control/*, the rollout server) answered an HTTP error: `status`, `kind`
    (the error's type, else named after the status), `message` ("METHOD path: HTTP status: ..."), `server_message`
    (the server's own words), `body` (its parsed answer). Also a ControlError: the clients raised that for every
    refusal before they had their own class, and callers catch it."""

    def __init__(self, status: int, kind: str, message: str, server_message: str, body: Any = None):
        super().__init__(status, kind, message)
        self.server_message = server_message
        self.body = body
