"""The rollout server's boundary: what a trainer submits (TaskRequest) and what it gets back (SessionResult,
TaskResult). Every model forbids unknown fields, so a typo is a 422 that names the field.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polar_mitm.harnesses import BASE_URL_VARIABLES

# a session id is the user part of a proxy URL; task ids are part of session ids
ID_PATTERN = r"^[A-Za-z0-9._~+=-]{1,100}$"
MEMORY_PATTERN = re.compile(r"^[0-9]+[bkmg]?$", re.IGNORECASE)
DEFAULT_IMAGE = "polar-mitm/sandbox:bookworm"

HarnessName = Literal["codex", "claude", "qwen", "gemini", "opencode", "pi", "cline", "kilo", "continue-cli", "openclaw", "openai-agents-facts", "pydantic-ai-form", "smolagents-planner", "mini-swe-agent", "aider", "openhands", "hermes", "gptme", "vibe", "kimi"]  # polar_mitm.harnesses.NAMES; a test keeps them equal

FinalStatus = Literal["completed", "failed", "timed_out", "cancelled"]
SessionStatus = Literal["queued", "preparing", "running", "post_run", "building", "evaluating", "completed", "failed", "timed_out", "cancelled"]
FINAL_STATUSES: frozenset[str] = frozenset(FinalStatus.__args__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _no_base_url_overrides(env: dict[str, str]) -> dict[str, str]:
    routed = sorted(set(env) & set(BASE_URL_VARIABLES))
    if routed:
        raise ValueError(f"{', '.join(routed)} would send model calls past the gateway; remove it (harnesses reach the engine through the proxy)")
    return env


class Upload(Strict):
    """A file or directory put into the sandbox: `source` (a path on the rollout server's machine) or `content`."""

    target: str = Field(description="Where it lands: relative to the workdir, or absolute (docker only).")
    source: str | None = Field(None, description="File or directory on the server's machine, copied recursively.")
    content: str | None = Field(None, description="Text written to `target` as a file.")
    mode: int | None = Field(None, ge=0, le=0o7777, description="File mode for `content`, e.g. 0o755 (default 0o644).")

    @model_validator(mode="after")
    def _one_source(self) -> Upload:
        if (self.source is None) == (self.content is None):
            raise ValueError("give exactly one of 'source' (a path on the server) or 'content' (the file's text)")
        return self


class UploadStep(Strict):
    upload: Upload


class ExecStep(Strict):
    exec: str = Field(min_length=1, description="A shell command run in the workdir (bash -c).")
    timeout_seconds: float | None = Field(None, gt=0, description="Default: what is left of the task's budget.")


PrepareStep = UploadStep | ExecStep


class Runtime(Strict):
    backend: Literal["local", "docker"] = Field("local", description="local: a subprocess in a fresh temp workspace; docker: a container.")
    image: str = Field(DEFAULT_IMAGE, description="docker: the image (built by sandboxes/docker/build-image.sh by default).")
    prepare: list[PrepareStep] = Field(default_factory=list, description="Ordered steps run before the harness: {upload: {...}} or {exec: CMD}.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of prepare steps, the harness and the evaluator.")
    workdir: str | None = Field(
        None,
        description="Where everything runs. docker: an absolute path in the container (default /workspace); local: a directory relative to the fresh workspace (default its root).",
    )
    cpus: float | None = Field(None, gt=0, description="docker: CPU limit (e.g. 1.5).")
    memory: str | None = Field(None, description="docker: memory limit, e.g. '2g', '512m'.")
    network: Literal["gateway", "host"] = Field(
        "gateway",
        description="gateway: the sandbox reaches the gateway and nothing else (docker: no network, a relayed socket to the gateway; local: proxy settings only, not enforced). host: the machine's network (docker --network host).",
    )
    capture: Literal["proxy", "transparent"] = Field(
        "proxy",
        description="How the harness's model calls reach the gateway. proxy: HTTPS_PROXY with the session's credentials. transparent (local backend, root; the node's gateway started with --transparent-port): the harness runs in a network namespace whose only way out is the gateway's transparent listener, with no proxy settings at all, for an agent that ignores them (polar_mitm/capture.py); prepare steps and the evaluator run outside it.",
    )
    mount_harnesses: bool = Field(
        True,
        description="docker: bind-mount the host's pinned Node + harness install read-only at the same path; false: the image has them on its PATH.",
    )

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        return _no_base_url_overrides(env)

    @field_validator("memory")
    @classmethod
    def _memory(cls, memory: str | None) -> str | None:
        if memory is not None and not MEMORY_PATTERN.match(memory):
            raise ValueError(f"memory must look like '512m' or '2g', got {memory!r}")
        return memory

    @model_validator(mode="after")
    def _paths(self) -> Runtime:
        if self.workdir is not None:
            path = PurePosixPath(self.workdir)
            if self.backend == "docker" and not path.is_absolute():
                raise ValueError(f"workdir: the docker runtime needs an absolute path in the container, got {self.workdir!r}")
            if self.backend == "local" and (path.is_absolute() or ".." in path.parts):
                raise ValueError(f"workdir: the local runtime takes a path inside its fresh workspace (relative, no '..'), got {self.workdir!r}")
        if self.capture == "transparent" and self.backend != "local":
            raise ValueError("capture: transparent runs with the local backend; a docker sandbox already reaches nothing but the gateway (network: gateway)")
        if self.backend == "local":
            for step in self.prepare:
                if isinstance(step, UploadStep) and (PurePosixPath(step.upload.target).is_absolute() or ".." in PurePosixPath(step.upload.target).parts):
                    raise ValueError(f"prepare: the local runtime uploads inside its workspace (relative target, no '..'), got {step.upload.target!r}")
        return self


class Agent(Strict):
    harness: HarnessName = Field(description="Which real harness runs: codex, claude, qwen or gemini.")
    model: str | None = Field(None, description="The model name the harness asks for (default: the preset's).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the harness only.")
    home_files: dict[str, str] = Field(default_factory=dict, description="Extra files (path relative to HOME -> text) written after the preset's own config.")

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        return _no_base_url_overrides(env)

    @field_validator("home_files")
    @classmethod
    def _home_files(cls, files: dict[str, str]) -> dict[str, str]:
        for name in files:
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise ValueError(f"home_files paths are relative to HOME, without '..', got {name!r}")
        return files


class Builder(Strict):
    name: Literal["per_request", "prefix_merging"] = Field("prefix_merging", description="The assembler's trajectory builder.")
    options: dict[str, Any] = Field(default_factory=dict, description="Builder options, e.g. {lenient: true} for prefix_merging.")

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any]) -> dict[str, Any]:
        unknown = set(options) - {"lenient"}
        if unknown:
            raise ValueError(f"unknown builder option(s) {', '.join(sorted(unknown))}; known: lenient")
        return options


class Evaluator(Strict):
    """Reward after the harness. `command` runs in the sandbox: the reward is the `reward` of the last JSON object
    line it prints, else 1.0 for exit status 0 and 0.0 otherwise. `python` is 'module:function' or
    'file.py:function', called on the server with an EvaluationContext; it returns a number or {"reward": x, ...}.
    """

    command: str | None = Field(None, min_length=1)
    python: str | None = Field(None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    timeout_seconds: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _one_kind(self) -> Evaluator:
        if (self.command is None) == (self.python is None):
            raise ValueError("give exactly one of 'command' (run in the sandbox) or 'python' ('module:function')")
        return self


class TaskRequest(Strict):
    task_id: str | None = Field(None, pattern=ID_PATTERN, description="The caller's id (letters, digits, . _ ~ + = -); default: generated. Resubmitting the same request with the same id is answered with the existing task.")
    instruction: str = Field(min_length=1, description="The prompt the harness gets.")
    num_samples: int = Field(1, ge=1, le=1024, description="Sessions run for this task (a GRPO group).")
    timeout_seconds: float = Field(600.0, gt=0, description="Per session: the time it may spend preparing and running (waiting for a slot does not count).")
    runtime: Runtime = Field(default_factory=Runtime)
    agent: Agent
    builder: Builder = Field(default_factory=Builder)
    evaluator: Evaluator | None = None
    callback_url: str | None = Field(None, pattern=r"^https?://", description="Receives one SessionResult per session and one TaskResult, by POST.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Copied into every result and the store (e.g. group id, policy version).")
    dispatch_priority: int = Field(0, ge=0, le=100, description="Order of the head's dispatch queue (Ray scale-out): higher first, then first come; running sessions are never preempted.")
    early_stop_min_usable_sessions: int | None = Field(
        None, ge=1, description="Cancel the task's unfinished sessions once this many are usable (completed, with at least one sampled token); cancelled ones end empty and untrainable."
    )

    @model_validator(mode="after")
    def _early_stop_within_samples(self) -> TaskRequest:
        if self.early_stop_min_usable_sessions is not None and self.early_stop_min_usable_sessions > self.num_samples:
            raise ValueError(f"early_stop_min_usable_sessions ({self.early_stop_min_usable_sessions}) exceeds num_samples ({self.num_samples})")
        return self


class StageTiming(BaseModel):
    started_at: datetime
    ended_at: datetime | None = None
    seconds: float | None = None


class TrajectorySummary(BaseModel):
    """A session's trajectory as its node assembled it, and what a trainer checks before it trains on it."""

    builder: str
    sequences: int = 0
    exchanges: int = 0
    sampled_tokens: int = 0
    sequence_tokens: int = 0
    breaks: dict[str, int] = Field(default_factory=dict)
    tool_call_parse_failures: int = Field(
        0, description="Answered exchanges whose sampled tool calls did not parse and went back as text (tokens mode parses them; "
        "a parser failing silently trains a model that never calls a tool).",
    )
    tokens_mode_exchanges: int = Field(0, description="Answered exchanges the gateway rendered (tokens mode).")
    bridged_fraction: float | None = Field(
        None, description="Of the tokens-mode exchanges that continue an earlier turn (all but first turns), the fraction bridged "
        "onto its exact tokens; None: no such exchange.",
    )
    sequence_policy_versions: list[list[int | None]] = Field(
        default_factory=list, description="Per sequence, [lowest, highest] policy version its exchanges were sampled under.",
    )
    policy_version: int | None = Field(None, description="The node gateway's policy version when the session was assembled.")
    staleness: list[int | None] = Field(
        default_factory=list, description="Per sequence, policy_version minus its lowest version (what max_staleness compares).",
    )


class Evaluation(BaseModel):
    reward: float | None
    exit_code: int | None = None
    output: str = Field("", description="The end of the evaluator's output.")
    details: dict[str, Any] = Field(default_factory=dict, description="Everything else its JSON line or Python function returned.")


class SessionResult(BaseModel):
    kind: Literal["session_result"] = "session_result"
    session_id: str
    task_id: str
    sample_index: int
    status: SessionStatus
    reward: float | None = None
    timings: dict[str, StageTiming] = Field(default_factory=dict, description="Per stage reached: when it started and ended.")
    n_exchanges: int = 0
    harness: str
    model: str | None = None
    harness_exit_code: int | None = None
    harness_output: str = Field("", description="The end of the harness's stdout and stderr.")
    trajectory: TrajectorySummary | None = None
    evaluation: Evaluation | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    node: str | None = Field(None, description="The gateway node that ran it (scale-out on Ray); None on a single-node server.")

    @property
    def done(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def usable(self) -> bool:
        """Trainable material: completed, with at least one sampled token (what early stop counts)."""
        return self.status == "completed" and self.trajectory is not None and self.trajectory.sampled_tokens > 0


class Delivery(BaseModel):
    """One result POSTed to the callback URL. `delivery_id` is sent as X-Polar-Delivery-Id (and Idempotency-Key)
    on every attempt, so a receiver that saw an attempt whose answer was lost can drop the retry."""

    delivery_id: str
    kind: Literal["session_result", "task_result"]
    url: str
    status: Literal["pending", "delivered", "failed"] = "pending"
    attempts: int = 0
    delivered_at: datetime | None = None
    last_error: str | None = None


class TaskResult(BaseModel):
    kind: Literal["task_result"] = "task_result"
    task_id: str
    status: Literal["running", "completed", "cancelled"] = Field(description="completed: every session has ended, whatever its own status (see counts).")
    created_at: datetime
    finished_at: datetime | None = None
    counts: dict[str, int] = Field(default_factory=dict, description="Sessions per status.")
    sessions: list[SessionResult]
    trajectories: str | None = Field(None, description="The task's Parquet file (rewards and group advantages included), once all sessions ended.")
    trajectory_stats: dict[str, Any] | None = None
    deliveries: list[Delivery] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    early_stopped: bool = Field(False, description="Stragglers were cancelled once early_stop_min_usable_sessions were usable.")


class TaskAccepted(BaseModel):
    task_id: str
    session_ids: list[str]
    status_url: str
