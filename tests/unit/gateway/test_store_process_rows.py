"""What a store in its own process receives of an exchange row (polar_mitm/gateway/store_process.py): the row
pickled with its engine request and reply as their wire texts. The journal records the store writes from it must be
byte for byte those it writes from the gateway's own row, in chat mode (prompt ids a slice of the reply's text) and
tokens mode (prompt ids an array, the request carrying them), for strict and non-strict JSON."""

from __future__ import annotations

import json
import pickle
from array import array

from polar_mitm.engines.base import TokenIds, WireJSON, _decode
from polar_mitm.gateway.store_process import _dumps
from polar_mitm.store import journal_records

PROMPT = list(range(1000, 1400))


def _reply(prompt: list[int], extra: str = "") -> str:
    return (
        '{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
        f'"token_ids":[5,6],"logprobs":{{"content":[{{"token":"hi","logprob":-0.5}}]}}}}],"prompt_token_ids":{json.dumps(prompt, separators=(",", ":"))}{extra}}}'
    )


def _row(request: WireJSON, response: WireJSON, prompt_ids: object) -> dict:
    return {
        "exchange_id": "x-1", "session_id": "s", "seq": 1, "status": "ok", "api": "openai_chat", "stream": False,
        "request_body": b'{"model":"m","messages":[{"role":"user","content":"caf\xc3\xa9"}]}',
        "engine_request": request, "engine_response": response, "prompt_token_ids": prompt_ids,
        "completion_token_ids": [5, 6], "completion_logprobs": [-0.5, float("-inf")], "response_body": '{"ok":true}',
    }


def _through_the_socket(row: dict) -> dict:
    return pickle.loads(_dumps(("commit", 1, row), rows=True))[2]


def test_a_chat_mode_row_is_journaled_the_same_after_crossing_to_the_store_process() -> None:
    response = _decode(_reply(PROMPT))
    assert isinstance(response, WireJSON) and isinstance(response["prompt_token_ids"], TokenIds)
    row = _row(WireJSON({"model": "m", "messages": [{"role": "user", "content": "café"}]}), response, response["prompt_token_ids"])
    copy = _through_the_socket(row)
    assert journal_records(copy) == journal_records(row)
    # the prompt ids still point into the reply's text (one string, sent once): the body keeps only where they are
    assert copy["prompt_token_ids"].source is copy["engine_response"].text
    assert b"prompt_token_ids_at" in journal_records(copy)[1]
    # the parsed reply does not cross: the store reads its text
    assert dict(copy["engine_response"]) == {} and copy["engine_response"].text == response.text


def test_a_tokens_mode_row_and_a_non_strict_reply_are_journaled_the_same() -> None:
    request = WireJSON({"model": "m", "prompt": PROMPT, "max_tokens": 4})
    response = _decode(_reply(PROMPT))
    row = _row(request, response, array("I", PROMPT))
    assert journal_records(_through_the_socket(row)) == journal_records(row)
    # a reply orjson refused (NaN): kept as the object, re-encoded by the store either way
    loose = _decode(_reply(PROMPT, extra=',"score":NaN'))
    assert isinstance(loose, WireJSON) and not loose.strict
    row = _row(request, loose, array("I", PROMPT))
    assert journal_records(_through_the_socket(row)) == journal_records(row)
