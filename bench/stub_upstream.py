"""A stand-in inference engine for the overhead benchmark: the proxies are what is measured, not the engine.

It answers every chat completion with the same fixed, vLLM-shaped reply after a fixed delay: a short text and
one hermes-parsed tool call (finish_reason "tool_calls"), 119 completion tokens. Like vLLM it adds
`prompt_token_ids` and per-choice `token_ids` when the request says `return_token_ids`, `logprobs.content`
when it says `logprobs`, and streams one SSE event per token (written at once after the delay) when it says
`stream`. The prompt length is taken as a quarter of the request body's bytes, so a 56 KB harness request
comes back with ~14k prompt token ids, as a real engine's would.

Run: python bench/stub_upstream.py --port 18090 --delay-ms 25 [--model-dir DIR]
Endpoints: POST .../chat/completions, POST /tokenize (a count, for the count endpoints), GET .../models, GET /stats
(requests served, for the harness's sanity checks).
With --model-dir (a model directory with tokenizer.json; bench/tokens_bench.py), also POST .../completions with
`prompt` as token ids (token-in, as tokens mode calls vLLM): the prompt ids echoed, and as sampled ids the
canonical tokens of the same reply text + <|im_end|>; /models names the directory as its `root`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

MODEL = "qwen3-tiny-stub"
CONTENT = "I'll look at the repository layout first, then run the failing test to see the exact error before changing anything."
TOOL_NAME = "run_shell_command"
TOOL_ARGUMENTS = json.dumps(
    {
        "command": "cd /sandbox/work/project && ls -la && python -m pytest tests/test_parser.py -x -q 2>&1 | tail -n 40",
        "description": "List the project files and run the failing parser test to read its traceback",
        "is_background": False,
        "timeout": 120000,
        "directory": "/sandbox/work/project",
    }
)
TOOL_TEXT = f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {TOOL_ARGUMENTS}}}\n</tool_call>'
MAX_PROMPT_TOKENS = 65536


def _pieces(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


class Reply:
    """Every byte of the fixed reply that does not depend on the request, built once."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.content_pieces = _pieces(CONTENT)
        self.tool_pieces = _pieces(TOOL_TEXT)
        pieces = self.content_pieces + self.tool_pieces
        self.completion_ids = [rng.randrange(200, 151000) for _ in pieces]
        self.logprobs = [{"token": p, "logprob": round(-rng.random() * 2, 6), "bytes": list(p.encode()), "top_logprobs": []} for p in pieces]
        ids = [rng.randrange(200, 151000) for _ in range(MAX_PROMPT_TOKENS)]
        # prompt ids as one comma-joined string plus where each id ends, so any prefix is a slice
        self.prompt_ids_text = ",".join(map(str, ids))
        self.prompt_id_ends: list[int] = []
        end = -1
        for token_id in ids:
            end += len(str(token_id)) + 1
            self.prompt_id_ends.append(end)
        self.id = "chatcmpl-benchstub0000000001"
        self.created = int(time.time())
        self.tool_call = {"id": "chatcmpl-tool-benchstub000001", "type": "function", "function": {"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS}}
        self._bodies: dict[tuple[bool, bool], tuple[bytes, bytes]] = {}
        self._streams: dict[tuple[bool, bool], bytes] = {}

    def prompt_ids(self, n: int) -> bytes:
        n = max(1, min(n, MAX_PROMPT_TOKENS))
        return b"[" + self.prompt_ids_text[: self.prompt_id_ends[n - 1]].encode() + b"]"

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        completion = len(self.completion_ids)
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion, "completion_tokens": completion}

    def body(self, prompt_tokens: int, logprobs: bool, token_ids: bool) -> bytes:
        """The non-streaming reply, vLLM 0.3x field order and shape."""
        head, tail = self._bodies.get((logprobs, token_ids)) or self._split_body(logprobs, token_ids)
        usage = json.dumps(self.usage(prompt_tokens), separators=(",", ":")).encode()
        ids = self.prompt_ids(prompt_tokens) if token_ids else b"null"
        return head + usage + b',"prompt_logprobs":null,"prompt_token_ids":' + ids + tail

    def _split_body(self, logprobs: bool, token_ids: bool) -> tuple[bytes, bytes]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": CONTENT, "refusal": None, "annotations": None, "audio": None, "function_call": None, "tool_calls": [self.tool_call], "reasoning": None},
            "logprobs": {"content": self.logprobs} if logprobs else None,
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "token_ids": self.completion_ids if token_ids else None,
            "routed_experts": None,
        }
        head = {"id": self.id, "object": "chat.completion", "created": self.created, "model": MODEL, "choices": [choice], "service_tier": None, "system_fingerprint": "vllm-stub"}
        parts = (
            json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"usage":',
            b',"prompt_text":null,"kv_transfer_params":null,"metrics":null}',
        )
        self._bodies[(logprobs, token_ids)] = parts
        return parts

    def stream(self, prompt_tokens: int, logprobs: bool, include_usage: bool) -> bytes:
        """The streaming reply: one event per token, as vLLM's hermes tool parser emits them."""
        key = (logprobs, include_usage)
        if key not in self._streams:
            self._streams[key] = self._build_stream(logprobs)
        events = self._streams[key]
        if include_usage:
            usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": MODEL, "choices": [], "usage": self.usage(prompt_tokens)}
            events += b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
        return events + b"data: [DONE]\n\n"

    def _build_stream(self, logprobs: bool) -> bytes:
        out = []

        def event(delta: dict, index: int | None = None, finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": {"content": [self.logprobs[index]]} if logprobs and index is not None else None, "finish_reason": finish}
            chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": MODEL, "choices": [choice]}
            out.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

        event({"role": "assistant", "content": ""})
        for index, piece in enumerate(self.content_pieces):
            event({"content": piece}, index)
        offset = len(self.content_pieces)
        call = self.tool_call
        event({"tool_calls": [{"index": 0, "id": call["id"], "type": "function", "function": {"name": TOOL_NAME, "arguments": ""}}]}, offset)
        arguments = _pieces(TOOL_ARGUMENTS, max(1, len(TOOL_ARGUMENTS) // (len(self.tool_pieces) - 1)))
        for index, piece in enumerate(arguments):
            event({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, min(offset + 1 + index, len(self.logprobs) - 1))
        event({}, finish="tool_calls")
        return b"".join(out)


class StubServer:
    def __init__(self, delay: float, model_dir: str | None = None) -> None:
        self.delay = delay
        self.reply = Reply()
        self.requests = 0
        self.model_dir = model_dir
        self.sampled_ids: list[int] = []
        if model_dir:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
            self.sampled_ids = tokenizer.encode(CONTENT + "\n" + TOOL_TEXT, add_special_tokens=False).ids + [tokenizer.token_to_id("<|im_end|>")]

    def completion(self, request: dict) -> bytes:
        """vLLM's /v1/completions reply to a token-in request with return_token_ids and logprobs=0."""
        prompt = request["prompt"]
        choice = {
            "index": 0, "text": CONTENT + "\n" + TOOL_TEXT, "logprobs": {"token_logprobs": [-0.5] * len(self.sampled_ids)}, "finish_reason": "stop",
            "stop_reason": None, "token_ids": self.sampled_ids, "prompt_logprobs": None, "prompt_token_ids": prompt,
        }
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(self.sampled_ids), "completion_tokens": len(self.sampled_ids)}
        return json.dumps({"id": "cmpl-benchstub", "object": "text_completion", "created": self.reply.created, "model": MODEL, "choices": [choice], "usage": usage}, separators=(",", ":")).encode()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = await _read_chunked(reader)
                else:
                    body = await reader.readexactly(int(headers.get("content-length") or 0))
                if not await self.respond(writer, method, target.split("?", 1)[0], body) or headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes) -> bool:
        """Answer one request on `writer`; False: the connection is done (a stand-in that breaks it on purpose,
        bench/soak_engine.py, overrides this)."""
        status, content_type, payload = await self.answer(method, path, body)
        if content_type.startswith("text/event-stream"):
            # streamed like uvicorn does: chunked transfer encoding
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
                + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n"
            )
        else:
            writer.write(f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        return True

    async def answer(self, method: str, path: str, body: bytes) -> tuple[str, str, bytes]:
        if method == "GET" and path.endswith("/models"):
            models = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": self.reply.created, "owned_by": "vllm", "root": self.model_dir or MODEL, "max_model_len": MAX_PROMPT_TOKENS}]}
            return "200 OK", "application/json", json.dumps(models).encode()
        if method == "GET" and path == "/stats":
            return "200 OK", "application/json", json.dumps({"requests": self.requests, "delay_s": self.delay}).encode()
        if method == "GET" and path in ("/health", "/v1/health"):
            return "200 OK", "application/json", b"{}"
        if method == "POST" and path.endswith("/completions") and not path.endswith("/chat/completions") and self.model_dir:
            self.requests += 1
            await asyncio.sleep(self.delay)
            return "200 OK", "application/json", self.completion(json.loads(body))
        if method == "POST" and path == "/tokenize":
            # vLLM's chat /tokenize (the count endpoints' engine call): a quarter of the body's bytes, as above
            return "200 OK", "application/json", json.dumps({"count": max(1, len(body) // 4), "max_model_len": MAX_PROMPT_TOKENS, "tokens": [], "token_strs": None}).encode()
        if method != "POST" or not path.endswith("/chat/completions"):
            return "404 Not Found", "application/json", b'{"error":{"message":"not found","type":"NotFoundError","code":404}}'
        try:
            request = json.loads(body)
            assert isinstance(request, dict) and request.get("messages")
        except (ValueError, AssertionError):
            return "400 Bad Request", "application/json", b'{"error":{"message":"bad request body","type":"BadRequestError","code":400}}'
        self.requests += 1
        await asyncio.sleep(self.delay)
        prompt_tokens = len(body) // 4
        logprobs = bool(request.get("logprobs"))
        if request.get("stream"):
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            return "200 OK", "text/event-stream; charset=utf-8", self.reply.stream(prompt_tokens, logprobs, include_usage)
        return "200 OK", "application/json", self.reply.body(prompt_tokens, logprobs, bool(request.get("return_token_ids")))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def serve(host: str, port: int, delay: float, model_dir: str | None = None) -> None:
    stub = StubServer(delay, model_dir)
    server = await asyncio.start_server(stub.handle, host, port, limit=1 << 20, backlog=1024)
    print(f"stub upstream (a stand-in engine: fixed reply after {delay * 1000:g} ms) on http://{host}:{port}/v1", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="the fixed 'engine' time per completion")
    parser.add_argument("--model-dir", help="serve token-in /completions too, with this model's tokenizer")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port, args.delay_ms / 1000, args.model_dir))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
