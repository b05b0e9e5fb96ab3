"""The dashboard's small parts: a token's exact text (a character split over tokens), sequence ids, links to
mitmweb, the throughput chart's buckets, which messages of an exchange are new."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models

from polar_mitm.assembler.diagnosis import TokenText
from polar_mitm.ui.app import mitmweb_link, text_of
from polar_mitm.ui.run_view import bucket_width, chart
from polar_mitm.ui.session_view import _mark_new_messages
from polar_mitm.ui.tokens import piece, split_sequence_id


def byte_level_tokens() -> TokenText:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, as Qwen's): 'é' is the bytes C3 A9, 'Ã' and '©' here."""
    tokenizer = Tokenizer(models.BPE(vocab={"Ã": 0, "©": 1, "Ã©": 2, "h": 3, "Ċ": 4}, merges=[("Ã", "©")]))
    tokenizer.decoder = decoders.ByteLevel()
    return TokenText(tokenizer, "test")


def test_a_token_shows_its_exact_bytes_and_half_a_character_as_escapes() -> None:
    tokens = byte_level_tokens()
    assert piece(tokens, 2) == ("é", True)
    assert piece(tokens, 0) == ("\\xc3", False) and piece(tokens, 1) == ("\\xa9", False)
    assert piece(tokens, 4) == ("\n", True)
    assert piece(None, 17) == ("⟨17⟩", True)  # no tokenizer: the id


def test_sequence_ids_split_at_their_last_two_colons() -> None:
    assert split_sequence_id("a:b:prefix_merging:3") == ("a:b", "prefix_merging", False)
    assert split_sequence_id("s:prefix_merging_lenient:1") == ("s", "prefix_merging", True)
    for bad in ("s", "s:prefix_merging", "s:prefix_merging:x"):
        try:
            split_sequence_id(bad)
        except LookupError:
            continue
        raise AssertionError(f"{bad!r} was taken for a sequence id")


def test_the_mitmweb_link_filters_on_the_exchange_s_reply_header() -> None:
    assert mitmweb_link(None, "e1") is None
    assert mitmweb_link("http://127.0.0.1:8081", "3f-aa") == "http://127.0.0.1:8081/#/flows?s=~hs%203f-aa"


def test_throughput_buckets_are_round_and_at_most_sixty() -> None:
    assert bucket_width(0, 50) == 1
    assert bucket_width(0, 3600) == 60
    assert bucket_width(0, 86400 * 3) == 7200
    assert bucket_width(None, None) == 1
    bars = chart([{"bucket": 0, "exchanges": 4, "errors": 1}, {"bucket": 120, "exchanges": 2, "errors": 0}], 60)["bars"]
    assert [b["x"] for b in bars] == [0, 20] and bars[0]["h"] > bars[1]["h"] > 0  # the empty minute between is a gap


def test_each_exchange_shows_what_it_adds_to_the_conversation() -> None:
    system = {"role": "system", "content": "be brief"}
    first = {"messages": [system, {"role": "user", "content": "hi"}], "reply": {"content": "hello", "tool_calls": None}}
    second = {"messages": [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}], "reply": {}}
    edited = {"messages": [system, {"role": "user", "content": "HI"}], "reply": {}}
    exchanges = [first, second, edited]
    _mark_new_messages(exchanges)
    assert [e["new_from"] for e in exchanges] == [0, 3, 1]


def test_message_content_parts_read_as_text() -> None:
    assert text_of([{"type": "text", "text": "a"}, {"type": "image_url"}]) == "a\n[image_url]"
    assert text_of(None) == "" and text_of("x") == "x"
