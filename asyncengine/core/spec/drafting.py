"""Between steps: which requests speculate, and their draft tokens.

After a step's results are applied, every request the step updated that is still running
gets ``spec_wait`` (speculation is on for it at this batch size, so the scheduler waits for
its tokens to settle before scheduling it) and, when none of its tokens is in flight, up to k
draft tokens in ``request.spec_token_ids`` (k from ``num_speculative_tokens_per_batch_size``
for the number of unfinished requests, capped so the step cannot pass ``max_tokens`` or the
context). The scheduler puts them in the next step; the runner verifies them.

Requests with repetition, presence or frequency penalties never speculate: their penalties
would have to count the draft tokens before the earlier ones are accepted.
"""

from __future__ import annotations

from typing import Protocol

from asyncengine.config.speculative import SpeculativeSettings
from asyncengine.core.request import Request, RequestStatus


class Proposer(Protocol):
    """``propose(request, k) -> drafts`` (on the loop, cheap: the n-gram index), or
    ``async propose_batch([(request, k), ...])`` setting ``spec_token_ids`` (device work)."""


def can_speculate(request: Request) -> bool:
    sp = request.sampling_params
    return (sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0)


class Drafting:
    def __init__(self, settings: SpeculativeSettings, proposer: Proposer) -> None:
        self.settings = settings
        self.proposer = proposer

    def after_update(self, updated: list[Request], num_unfinished: int
                     ) -> list[tuple[Request, int]] | None:
        """Mark the requests and propose their drafts; with a batch proposer (a draft model,
        whose drafts are device work) return the ``(request, k)`` that want drafts instead,
        for the loop to await ``proposer.propose_batch`` on."""
        k = self.settings.k_for_batch(num_unfinished)
        running = RequestStatus.RUNNING
        if k == 0:
            for r in updated:
                if r.spec_wait:
                    r.spec_wait = False
            return None
        batch: list[tuple[Request, int]] | None = \
            [] if hasattr(self.proposer, "propose_batch") else None
        propose = getattr(self.proposer, "propose", None)
        for r in updated:
            if r.status is not running:
                continue
            if not can_speculate(r):
                r.spec_wait = False
                continue
            r.spec_wait = True
            if r.num_output_placeholders or r.num_computed_tokens != len(r.all_token_ids) - 1:
                continue
            room = min(k, r.max_tokens - len(r.output_token_ids) - 1,
                       r.max_model_len - len(r.all_token_ids) - 1)
            if room > 0:
                if batch is not None:
                    batch.append((r, room))
                else:
                    r.spec_token_ids = propose(r, room)
        return batch
