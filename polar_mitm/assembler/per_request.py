"""`per_request`: one trainable sequence per exchange — its prompt ids, then its sampled ids.

The baseline every trainer can take: nothing is merged, so nothing can drift. loss_mask is 1 exactly on
the sampled ids, rollout_logprobs holds their logprobs. A sample of a prompt already sent in the session
(an SDK retry, the same request re-sent) is flagged `retry_of` the first exchange with that prompt.
"""

from __future__ import annotations

from polar_mitm.assembler.chain import Chain
from polar_mitm.assembler.diagnosis import Diagnoser
from polar_mitm.assembler.source import Exchange, prompt_key

NAME = "per_request"
SUPPORTS_LENIENT = False


def build_session(exchanges: list[Exchange], diagnoser: Diagnoser | None = None, lenient: bool = False) -> list[Chain]:
    """One chain per exchange (nothing merges, so nothing breaks: `diagnoser` and `lenient` are not used)."""
    first_with_prompt: dict[bytes, Exchange] = {}
    chains = []
    for exchange in exchanges:
        earlier = first_with_prompt.setdefault(prompt_key(exchange), exchange)
        retry_of = earlier.exchange_id if earlier is not exchange else None
        chains.append(Chain.start(NAME, exchange, retry_of=retry_of))
    return chains
