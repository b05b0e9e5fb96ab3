"""Tokens mode's lineages stay compact and bounded: a long session's turns share their history, token ids are
4-byte arrays, and all sessions together stay under a byte budget (least recently used dropped first)."""

from __future__ import annotations

from array import array

from polar_mitm.render import bridge

SETUP = "setup"


def conversation(turns: int, size: int = 1000) -> list[dict]:
    """A user message, then `turns` times (our answer, a tool result of `size` characters)."""
    messages = [{"role": "user", "content": "fix the bug"}]
    for n in range(turns):
        messages += [{"role": "assistant", "content": f"step {n}"}, {"role": "tool", "content": f"{n}:" + "x" * size}]
    return messages


def grow(lineages: bridge.Lineages, session: str, turns: int, size: int = 1000) -> list[bridge.Turn]:
    """Remember `turns` turns of one session, each extending the one before, as the gateway does."""
    made: list[bridge.Turn] = []
    for n in range(turns):
        messages = conversation(n, size)
        parent, covered, reason = lineages.find(session, messages, SETUP)
        bridged = None
        if parent is not None:
            assert covered == len(parent.keys) and reason is None
            tail = array("I", [7])
            bridged = bridge.Bridged(prompt_ids=parent.prompt_array() + parent.completion_ids + tail, tail_ids=tail, parent=parent)
        else:
            assert n == 0, reason
        prompt = bridged.prompt_ids if bridged else array("I", [1, 2, 3])
        turn = bridge.make_turn(f"{session}-{n}", messages, bridge.answer_message(f"step {n}", []), SETUP, prompt, [5] * 10, bridged)
        lineages.remember(session, turn)
        made.append(turn)
    return made


def test_a_bridged_turn_shares_its_parents_keys_and_counts_only_its_own() -> None:
    lineages = bridge.Lineages()
    turns = grow(lineages, "s", 30)
    last, before = turns[-1], turns[-2]
    assert all(a is b for a, b in zip(last.keys, before.keys, strict=False)) and len(last.keys) == len(before.keys) + 2  # the same objects, not copies
    assert not hasattr(last, "history") and not hasattr(last, "__dict__")  # no message text, no per-turn dict
    # its prompt is its parent's prompt and sampled ids, then its own tail: only the tail is its own
    assert last.parent is before and last.tail_ids.itemsize == 4 and last.tail_ids.tolist() == [7]
    assert last.prompt_ids() == [*before.prompt_ids(), *before.completion_ids, 7] and last.prompt_ids()[:3] == [1, 2, 3]
    assert len(last.prompt_ids()) == 3 + 29 * 11
    # the same ids joined as 4-byte ones (what bridging sends on), no Python int made for each
    assert last.prompt_array().itemsize == 4 and last.prompt_array().tolist() == last.prompt_ids()
    # the 30th turn holds what the 3rd does beyond its own tokens and a pointer per message: the two keys it made
    own = [t.nbytes - 4 * (len(t.tail_ids) + len(t.completion_ids)) - 8 * len(t.keys) for t in turns[2:]]
    assert set(own) == {250 + 2 * 73}, own
    assert {4 * (len(t.tail_ids) + len(t.completion_ids)) for t in turns[1:]} == {44}
    assert lineages.nbytes == sum(t.nbytes for t in turns)


def test_the_byte_budget_drops_the_least_recently_used_sessions() -> None:
    lineages = bridge.Lineages(max_bytes=40_000)  # ~4 KB a session of 8 turns: about 10 of the 40 fit
    for n in range(40):
        grow(lineages, f"s{n}", 8, size=2000)
        assert lineages.nbytes <= 40_000 or len(lineages.sessions) == 1
    assert "s39" in lineages.sessions and "s0" not in lineages.sessions
    assert lineages.nbytes == sum(t.nbytes for turns in lineages.sessions.values() for t in turns.values()) == sum(lineages.session_bytes.values())
    # a dropped session's next turn is rendered in full, and says why
    _, _, reason = lineages.find("s0", conversation(3, 2000), SETUP)
    assert reason == bridge.NO_LINEAGE
    # a session in use is kept however old it is, since each turn moves it to the end
    grow(lineages, "s0", 2, size=10)
    assert list(lineages.sessions)[-1] == "s0"


def test_a_retry_replaces_its_first_attempt_in_the_count() -> None:
    lineages = bridge.Lineages()
    messages = conversation(0)
    for attempt in range(3):
        lineages.remember("s", bridge.make_turn(f"x{attempt}", messages, bridge.answer_message("hi", []), SETUP, [1, 2], [3]))
    [turn] = lineages.sessions["s"].values()
    assert turn.exchange_id == "x2" and lineages.nbytes == turn.nbytes


def test_turns_past_max_turns_cannot_be_found_but_stay_counted_while_later_turns_hold_them() -> None:
    lineages = bridge.Lineages(max_turns=4)
    turns = grow(lineages, "s", 10)
    assert list(lineages.sessions["s"].values()) == turns[-4:]
    assert turns[-1].prompt_ids()[:3] == [1, 2, 3]  # the first turn is still there, as the root of the chain
    assert lineages.nbytes == lineages.session_bytes["s"] == sum(t.nbytes for t in turns)
