"""Results to the trainer: POST each SessionResult and the TaskResult to the task's callback_url.

Each delivery has a stable id, sent on every attempt as `X-Polar-Delivery-Id` and `Idempotency-Key`
(session results: '<session_id>:session_result', the task's: '<task_id>:task_result'). A receiver whose
answer got lost sees the retry with the same id and can drop it: a retried delivery is never counted twice.
Retried, with exponential backoff: connection errors, 408, 425, 429 and 5xx. Another 4xx is final. A delivery
that failed for good is one line on the server's terminal (logger `polar_mitm.rollout`): kind, id, URL, error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from polar_mitm.rollout.models import Delivery
from polar_mitm.store import now

RETRYABLE = {408, 425, 429}

log = logging.getLogger("polar_mitm.rollout")


class CallbackSender:
    def __init__(self, attempts: int = 6, backoff: float = 0.5, max_backoff: float = 30.0, timeout: float = 30.0):
        self.attempts = attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        # straight to the receiver: the server's own proxy settings are not for callbacks
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False)

    async def deliver(self, delivery: Delivery, payload: dict[str, Any]) -> Delivery:
        """POST until delivered or out of attempts; `delivery` is updated in place (and returned)."""
        headers = {"X-Polar-Delivery-Id": delivery.delivery_id, "Idempotency-Key": delivery.delivery_id, "X-Polar-Event": delivery.kind}
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            delivery.attempts += 1
            try:
                response = await self.client.post(delivery.url, json=payload, headers=headers)
            except httpx.HTTPError as error:
                delivery.last_error = f"{type(error).__name__}: {error}"
                continue
            if response.is_success:
                delivery.status, delivery.delivered_at, delivery.last_error = "delivered", now(), None
                return delivery
            delivery.last_error = f"HTTP {response.status_code}" + (f": {response.text[:300]}" if response.text else "")
            if response.status_code < 500 and response.status_code not in RETRYABLE:
                break
        delivery.status = "failed"
        log.warning(f"polar-mitm rollout: callback {delivery.delivery_id} to {delivery.url} failed after {delivery.attempts} attempt(s): {delivery.last_error}")
        return delivery

    async def close(self) -> None:
        await self.client.aclose()
