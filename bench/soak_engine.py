"""The soak's stand-in engine (a fake, named as such: no real engine fails on demand): bench/stub_upstream.py's
fixed vLLM-shaped reply, and a fault wherever the request asks for one.

A request asks by carrying `fault=KIND` in its text (the soak's clients put it at the end of the last user
message, beside the request's id). In chat mode that text is in the engine request's messages; in tokens mode
the engine gets token ids only, so the stand-in decodes the prompt's last tokens with the model's tokenizer
(--model-dir) to read it. A fault chosen by the request, not by a counter here, stays with that request when
the gateway retries or re-issues it (pause/abort), so the soak knows which requests must not end as a success.

    engine_5xx   HTTP 500 in vLLM's error shape, after the usual delay
    reset        the request read, then the connection reset (RST)
    garbage      HTTP 200 whose body is random bytes
    truncated    HTTP 200 announcing the whole reply and sending half of it, then closed
    hang         the reply only after --hang-s (the gateway's --engine-timeout must end the call first)
    slow         the reply after --slow-s: time for a client to hang up while the engine works (not a fault)
    final        a plain text reply without a tool call (ends an agent's loop: the rollout phase's sessions)

GET /stats: requests served and the faults injected, by kind.

Run: python -m bench.soak_engine --port PORT [--delay-ms 20] [--hang-s 4] [--slow-s 1.5] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import struct
from collections import Counter

from bench.stub_upstream import MODEL, StubServer

FAULT = re.compile(rb"fault=([a-z0-9_]+)")
ENGINE_FAULTS = ("engine_5xx", "reset", "garbage", "truncated", "hang")
FINAL_TEXT = "Done: the task is finished."
# tokens mode: the marker sits in the last user turn, a few tokens before the prompt's end
TAIL_TOKENS = 160


class FaultyEngine(StubServer):
    def __init__(self, delay: float, hang_s: float, slow_s: float, model_dir: str | None = None, seed: int = 0):
        super().__init__(delay, model_dir)
        self.hang_s, self.slow_s = hang_s, slow_s
        self.rng = random.Random(seed)
        self.faults: Counter[str] = Counter()
        self.tokenizer = None
        if model_dir:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")

    def fault_of(self, path: str, body: bytes) -> str | None:
        if path.endswith("/chat/completions"):
            found = FAULT.findall(body)
            return found[-1].decode() if found else ("final" if b"SOAK-FINAL" in body else None)
        if path.endswith("/completions") and self.tokenizer is not None:
            try:
                prompt = json.loads(body).get("prompt") or []
            except ValueError:
                return None
            tail = self.tokenizer.decode(prompt[-TAIL_TOKENS:], skip_special_tokens=False).encode() if isinstance(prompt, list) else b""
            found = FAULT.findall(tail)
            return found[-1].decode() if found else None
        return None

    async def respond(self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes) -> bool:
        fault = self.fault_of(path, body) if method == "POST" else None
        if fault in ("slow", "hang"):
            await asyncio.sleep(self.slow_s if fault == "slow" else self.hang_s)
        if fault in ENGINE_FAULTS:
            self.faults[fault] += 1
        if fault == "engine_5xx":
            await asyncio.sleep(self.delay)
            payload = json.dumps({"object": "error", "message": "stand-in engine failure (soak fault)", "type": "InternalServerError", "param": None, "code": 500}).encode()
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
            await writer.drain()
            return True
        if fault == "reset":
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
            writer.transport.abort()
            return False
        if fault == "garbage":
            await asyncio.sleep(self.delay)
            payload = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(16, 2048)))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
            await writer.drain()
            return True
        if fault == "truncated":
            status, content_type, payload = await self.answer(method, path, body)
            writer.write(f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload[: len(payload) // 2])
            await writer.drain()
            writer.close()
            return False
        if fault == "final":
            await asyncio.sleep(self.delay)
            payload = json.dumps(final_reply(json.loads(body))).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
            await writer.drain()
            return True
        return await super().respond(writer, method, path, body)

    async def answer(self, method: str, path: str, body: bytes) -> tuple[str, str, bytes]:
        if method == "GET" and path == "/stats":
            return "200 OK", "application/json", json.dumps({"requests": self.requests, "faults": dict(self.faults)}).encode()
        return await super().answer(method, path, body)


def final_reply(request: dict) -> dict:
    """A vLLM-shaped text reply, finish_reason stop, with token ids and logprobs (an agent's last turn)."""
    pieces = ["Done", ":", " the", " task", " is", " finished", "."]
    return {
        "id": "chatcmpl-soakfinal", "object": "chat.completion", "created": 1795950000, "model": MODEL,
        "prompt_token_ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198] if request.get("return_token_ids") else None,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": FINAL_TEXT, "tool_calls": [], "reasoning": None},
            "logprobs": {"content": [{"token": p, "logprob": -0.5, "bytes": list(p.encode()), "top_logprobs": []} for p in pieces]},
            "finish_reason": "stop", "token_ids": [17453, 25, 279, 3383, 374, 8060, 13],
        }],
        "usage": {"prompt_tokens": 9, "completion_tokens": len(pieces), "total_tokens": 9 + len(pieces)},
    }


async def serve(port: int, engine: FaultyEngine) -> None:
    server = await asyncio.start_server(engine.handle, "127.0.0.1", port, limit=1 << 24, backlog=1024)
    print(f"soak stand-in engine (faults on request) on http://127.0.0.1:{port}/v1", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--hang-s", type=float, default=4.0)
    parser.add_argument("--slow-s", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    engine = FaultyEngine(args.delay_ms / 1000, args.hang_s, args.slow_s, args.model_dir, args.seed)
    try:
        asyncio.run(serve(args.port, engine))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
