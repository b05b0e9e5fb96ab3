"""The rollout server's parts that need no harness: request validation, rewards from evaluator output,
callback delivery against a real HTTP receiver, the gateway relay, local sandbox teardown."""

from __future__ import annotations

import asyncio
import json
import typing
from email.message import Message
from pathlib import Path
from typing import Any

import pydantic
import pytest

from polar_mitm import harnesses
from polar_mitm.rollout import relay
from polar_mitm.rollout.callbacks import CallbackSender
from polar_mitm.rollout.evaluation import EvaluatorError, reward_from_output
from polar_mitm.rollout.models import Agent, Delivery, Runtime, TaskRequest
from polar_mitm.rollout.runtimes import GatewayAccess, SandboxSpec
from polar_mitm.rollout.runtimes.local import LocalSandbox, marked_processes
from tests.support.callback_endpoint import CallbackEndpoint


def test_request_models_match_the_harness_presets() -> None:
    assert set(typing.get_args(Agent.model_fields["harness"].annotation)) == set(harnesses.NAMES)
    request = TaskRequest.model_validate({"instruction": "x", "agent": {"harness": "codex"}})
    assert (request.num_samples, request.runtime.backend, request.builder.name, request.evaluator) == (1, "local", "prefix_merging", None)
    with pytest.raises(pydantic.ValidationError, match="workdir"):
        Runtime(backend="local", workdir="/abs")
    with pytest.raises(pydantic.ValidationError, match="inside its workspace"):
        Runtime(backend="local", prepare=[{"upload": {"content": "x", "target": "../escape"}}])
    with pytest.raises(pydantic.ValidationError, match="ANTHROPIC_BASE_URL"):
        Runtime(env={"ANTHROPIC_BASE_URL": "http://elsewhere"})
    with pytest.raises(pydantic.ValidationError, match="memory"):
        Runtime(backend="docker", memory="lots")


def test_reward_from_evaluator_output() -> None:
    assert reward_from_output("", 0) == (1.0, {})
    assert reward_from_output("FAILED 3 tests\n", 1) == (0.0, {})
    out = 'log line\n{"reward": 0.25, "passed": 1}\n{"not": "a reward"}\ntrailing text\n'
    assert reward_from_output(out, 1) == (0.25, {"passed": 1})  # the JSON line wins over the exit status
    with pytest.raises(EvaluatorError):
        reward_from_output('{"reward": "high"}', 0)


class FlakyReceiver(CallbackEndpoint):
    """Answers its attempts with `statuses` in turn (the last one from then on)."""

    def __init__(self, statuses: list[int]):
        self.statuses = statuses
        self.seen: list[tuple[str, dict[str, Any]]] = []
        super().__init__("/cb")

    def answer(self, headers: Message, body: dict[str, Any]) -> int:
        self.seen.append((headers["x-polar-delivery-id"], body))
        return self.statuses[min(len(self.seen), len(self.statuses)) - 1]


def test_callback_retried_until_delivered_once_then_final_errors() -> None:
    async def deliver(url: str, delivery_id: str) -> Delivery:
        sender = CallbackSender(attempts=4, backoff=0.01)
        try:
            return await sender.deliver(Delivery(delivery_id=delivery_id, kind="session_result", url=url), {"kind": "session_result", "session_id": "s"})
        finally:
            await sender.close()

    flaky = FlakyReceiver([500, 503, 200])
    delivery = asyncio.run(deliver(flaky.url, "s:session_result"))
    assert (delivery.status, delivery.attempts, delivery.last_error) == ("delivered", 3, None)
    # every attempt carried the same delivery id and body, so a receiver keeps exactly one
    assert [d for d, _ in flaky.seen] == ["s:session_result"] * 3 and len({json.dumps(b) for _, b in flaky.seen}) == 1
    flaky.close()

    refused = FlakyReceiver([400])
    delivery = asyncio.run(deliver(refused.url, "t:task_result"))
    assert (delivery.status, delivery.attempts) == ("failed", 1) and delivery.last_error.startswith("HTTP 400")
    refused.close()

    delivery = asyncio.run(deliver(f"http://127.0.0.1:{_closed_port()}/cb", "x"))
    assert (delivery.status, delivery.attempts) == ("failed", 4) and "ConnectError" in delivery.last_error


def _closed_port() -> int:
    from polar_mitm.util import free_port

    return free_port()


def test_relay_carries_bytes_both_ways_through_a_unix_socket(tmp_path: Path) -> None:
    async def main() -> bytes:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"echo:" + await reader.read())
            await writer.drain()
            writer.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = target.sockets[0].getsockname()[1]
        socket_path = str(tmp_path / "gateway.sock")
        host_side = await relay.serve_unix_to_tcp(socket_path, "127.0.0.1", port)
        sandbox_side = await relay.serve_tcp_to_unix(0, socket_path)
        reader, writer = await asyncio.open_connection("127.0.0.1", sandbox_side.sockets[0].getsockname()[1])
        writer.write(b"x" * 200_000)
        writer.write_eof()
        answer = await reader.read()
        for server in (target, host_side, sandbox_side):
            server.close()
        return answer

    assert asyncio.run(main()) == b"echo:" + b"x" * 200_000


def test_local_sandbox_timeout_and_teardown_leave_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        spec = SandboxSpec("parts-sandbox-1", Runtime(env={"GREETING": "hi"}), GatewayAccess("http://127.0.0.1:1", tmp_path))
        sandbox = LocalSandbox(spec)
        await sandbox.start()
        result = await sandbox.exec('echo "$GREETING from $PWD"; echo err >&2; exit 3', 30)
        assert (result.exit_code, result.stdout.strip(), result.stderr.strip()) == (3, f"hi from {sandbox.workdir}", "err")
        # a detached grandchild leaves the process group; its marker still finds it
        await sandbox.exec("setsid sleep 300 > /dev/null 2>&1 & echo started", 30)
        # the exec returns while that child may still be exec'ing (its environment reads empty for that moment)
        for _ in range(100):
            if marked_processes(sandbox.id):
                break
            await asyncio.sleep(0.05)
        assert marked_processes(sandbox.id)
        with pytest.raises(TimeoutError):
            await sandbox.exec("sleep 300", 0.5)
        root = sandbox.root
        await sandbox.destroy()
        assert marked_processes(sandbox.id) == [] and root is not None and not root.exists()

    asyncio.run(main())


def test_python_evaluator_reads_the_sandbox(tmp_path: Path) -> None:
    from polar_mitm.rollout.evaluation import EvaluationContext, evaluate
    from polar_mitm.rollout.models import Evaluator, Upload

    evaluator_file = tmp_path / "score.py"
    evaluator_file.write_text(
        "def score(ctx):\n"
        "    listing = ctx.exec('ls').stdout.split()\n"
        "    return {'reward': 0.75 if ctx.read_file('answer.txt') == b'42\\n' else 0.0, 'files': listing, 'session': ctx.session_id}\n"
    )

    async def main() -> Any:
        spec = SandboxSpec("parts-sandbox-2", Runtime(), GatewayAccess("http://127.0.0.1:1", tmp_path))
        sandbox = LocalSandbox(spec)
        await sandbox.start()
        try:
            await sandbox.upload(Upload(target="answer.txt", content="42\n"))
            request = TaskRequest.model_validate({"instruction": "x", "agent": {"harness": "qwen"}})
            context = EvaluationContext("parts-sandbox-2", request, 0, 2, sandbox, asyncio.get_running_loop())
            return await evaluate(Evaluator(python=f"{evaluator_file}:score"), sandbox, context)
        finally:
            await sandbox.destroy()

    evaluation = asyncio.run(main())
    assert evaluation.reward == 0.75 and evaluation.details == {"files": ["answer.txt"], "session": "parts-sandbox-2"}


def test_a_harness_that_is_not_installed_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout.node import GatewayNode, NodeConfig
    from polar_mitm.rollout.scheduler import RequestRejected

    monkeypatch.setenv("POLAR_MITM_HOME", str(tmp_path / "empty"))
    node = GatewayNode(NodeConfig(gateway=GatewayConfig(port=0, upstream="http://127.0.0.1:1/v1", db=tmp_path / "store.duckdb")))  # not started: checks only
    request = TaskRequest.model_validate({"instruction": "x", "agent": {"harness": "gemini"}})
    with pytest.raises(RequestRejected, match="gemini-cli.*not installed.*install.sh") as refused:
        asyncio.run(node.check(request))
    assert refused.value.loc == ("agent", "harness")


def test_nodes_on_one_machine_each_get_a_free_gateway_port_and_a_taken_port_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray bench's 2- and 4-node runs lost every node but one: a NodeConfig built from GatewayConfig's defaults
    gave every node the gateway command's port 8080, and each further node's gateway exited at start-up with only
    'Error logged during startup, exiting...'. A port nobody set is now a free one per node; a set one that is taken
    fails naming the cause; a picked free port taken before the gateway binds it is replaced."""
    import socket

    from polar_mitm.errors import GatewayStartError
    from polar_mitm.gateway.config import GatewayConfig
    from polar_mitm.rollout import node as node_module
    from polar_mitm.rollout.node import GatewayNode, NodeConfig
    from polar_mitm.util import free_port

    def config(name: str, **gateway: Any) -> NodeConfig:
        return NodeConfig(gateway=GatewayConfig(upstream="http://127.0.0.1:9/v1", engine_model="m", db=tmp_path / f"{name}.duckdb", confdir=str(tmp_path / "confdir"), **gateway))

    assert config("a").gateway.port == 0 and config("b", port=8123).gateway.port == 8123
    assert NodeConfig.model_validate(config("c", port=8123).model_dump(mode="json")).gateway.port == 8123  # across the actor boundary

    async def two_nodes() -> None:
        first, second = GatewayNode(config("first")), GatewayNode(config("second"))
        await first.start()
        try:
            await second.start()
            try:
                assert first.port != second.port and first.health()["gateway_listening"] and second.health()["gateway_listening"]
            finally:
                await second.stop()
        finally:
            await first.stop()

    asyncio.run(two_nodes())

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        # a set port that something else holds: the error says so (no other port is tried)
        async def set_port_taken() -> None:
            node = GatewayNode(config("set", port=port))
            try:
                await node.start()
            finally:
                await node.stop()

        with pytest.raises(GatewayStartError, match=f"127.0.0.1:{port}.*address already in use") as failed:
            asyncio.run(set_port_taken())
        assert failed.value.port_in_use

        # a free port picked in __init__ and taken before start(): another one is picked
        picks = iter([port])
        monkeypatch.setattr(node_module, "free_port", lambda: next(picks, 0) or free_port())

        async def picked_port_taken() -> int:
            node = GatewayNode(config("picked"))
            assert node.port == port
            await node.start()
            try:
                assert node.port != port and node.health()["gateway_listening"]
                return node.port
            finally:
                await node.stop()

        asyncio.run(picked_port_taken())
