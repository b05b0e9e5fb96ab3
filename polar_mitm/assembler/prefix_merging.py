"""`prefix_merging`: merge a session's exchanges into as few sequences as the tokens allow.

Strict (the default). Exchanges are taken in seq order. Exchange x joins the chain whose tokens so far
(prompt(1) + sampled(1) + ... + sampled(k), i.e. prompt(k) + sampled(k)) are a token prefix of prompt(x);
the longest such chain wins, so interleaved lineages (sub-agents, title or memory side calls) keep their
own chains. The joined sequence gains prompt(x)'s new tokens (mask 0) and x's sampled tokens (mask 1).
Every sampled token is thus trained in exactly the context it was sampled in.

An exchange that extends no chain starts a chain. When it continues a conversation all the same
(`diagnosis.predecessor`), the new chain records a `BreakDiagnosis` (first differing token, class); the
old chain ends there and keeps its samples — nothing is dropped.

Retries. An exchange whose prompt equals that of an earlier exchange in the session (an SDK retry with
`x-stainless-retry-count`, or the same request re-sent) does not fork the conversation: if the earlier one
is a chain's tip, both samples wait as alternatives and the chain goes on from whichever sample the next
exchange extends; every other sample of that prompt becomes its own sequence with `retry_of` naming the
sample the chain kept. Each sampled token appears in exactly one sequence.

Lenient (`lenient=True`, builder name `prefix_merging_lenient`): for comparison with Polar-style merging,
NOT token-faithful. x joins the chain whose tip's *prompt* is a prefix of prompt(x); the interstitial is
taken from prompt(x) after the first end-of-turn token following prompt(tip) (the template's canonical
re-rendering of the tip's reply is skipped and the raw sample kept). When that re-rendering differs from
the sample, later samples are trained in a context they were not sampled in: the sequence is marked
`faithful = False` and the run counts `unfaithful_merges`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from polar_mitm.assembler.chain import Chain
from polar_mitm.assembler.diagnosis import Diagnoser, generation_tail, predecessor
from polar_mitm.assembler.source import Exchange, prompt_key

NAME = "prefix_merging"
LENIENT_NAME = "prefix_merging_lenient"
SUPPORTS_LENIENT = True
NATURAL_STOPS = ("stop", "tool_calls")


def build_session(exchanges: list[Exchange], diagnoser: Diagnoser, lenient: bool = False, end_of_turn: int | None = None) -> list[Chain]:
    name = LENIENT_NAME if lenient else NAME
    if lenient and end_of_turn is None:
        end_of_turn = detect_end_of_turn(exchanges)
    tail = generation_tail([e.prompt for e in exchanges])
    chains: list[Chain] = []
    standalone: list[Chain] = []
    seen: dict[bytes, tuple[Chain, int]] = {}
    for exchange in exchanges:
        key = prompt_key(exchange)
        earlier = seen.get(key)
        if earlier is not None:
            chain, step = earlier
            if step == len(chain.exchanges) - 1:
                chain.alternates.append(exchange)
            else:
                standalone.append(Chain.start(name, exchange, retry_of=chain.exchanges[step].exchange_id))
            continue
        joined = _join_lenient(chains, exchange, end_of_turn) if lenient else _join_strict(chains, exchange)
        if joined is not None:
            seen[key] = (joined, len(joined.exchanges) - 1)
            continue
        chain = Chain.start(name, exchange)
        found = predecessor(chains, exchange, tail)
        if found is not None:
            chain.break_diagnosis = diagnoser.diagnose(found[0], found[1], exchange, tail)
        chains.append(chain)
        seen[key] = (chain, 0)
    for chain in chains:
        chain.release_alternates()
        standalone.extend(chain.released)
    return sorted(chains + standalone, key=lambda c: c.exchanges[0].seq)


def _join_strict(chains: list[Chain], exchange: Exchange) -> Chain | None:
    # a strict chain's tokens are always prompt(tip) + sampled(tip)
    prompt = exchange.prompt
    best: tuple[int, Chain, Exchange] | None = None
    for chain in chains:
        start = chain.tip_start
        if start > len(prompt) or not np.array_equal(prompt[:start], chain.tip.prompt):
            continue
        for sample in (chain.tip, *chain.alternates):
            end = start + len(sample.completion)
            if end <= len(prompt) and (best is None or end > best[0]) and np.array_equal(prompt[start:end], sample.completion):
                best = (end, chain, sample)
    if best is None:
        return None
    end, chain, sample = best
    if sample is not chain.tip:
        chain.swap_tip(sample)
    chain.append(exchange, prompt[end:])
    return chain


def _join_lenient(chains: list[Chain], exchange: Exchange, end_of_turn: int | None) -> Chain | None:
    prompt = exchange.prompt
    best: Chain | None = None
    for chain in chains:
        tip_prompt = chain.tip.prompt
        if len(tip_prompt) <= len(prompt) and (best is None or len(tip_prompt) > len(best.tip.prompt)) and np.array_equal(prompt[: len(tip_prompt)], tip_prompt):
            best = chain
    if best is None:
        return None
    after = len(best.tip.prompt)
    sample = best.tip.completion
    if np.array_equal(prompt[after: after + len(sample)], sample):
        interstitial = prompt[after + len(sample):]  # the reply rendered back exactly as sampled
    else:
        ends = np.flatnonzero(prompt[after:] == end_of_turn) if end_of_turn is not None else []
        if not len(ends):
            return None  # no end of the re-rendered reply to splice after
        end = after + int(ends[0])
        interstitial = prompt[end + 1:] if len(sample) and sample[-1] == end_of_turn else prompt[end:]
        best.faithful = False
        best.unfaithful_merges += 1
    best.append(exchange, interstitial)
    return best


def detect_end_of_turn(exchanges: list[Exchange]) -> int | None:
    """The token samples end with when the model stopped by itself (`<|im_end|>` for ChatML models)."""
    last = Counter(int(e.completion[-1]) for e in exchanges if len(e.completion) and e.finish_reason in NATURAL_STOPS)
    return last.most_common(1)[0][0] if last else None
