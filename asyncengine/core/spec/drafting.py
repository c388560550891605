"""Between steps: which requests speculate, and their draft tokens.

After a step's results are applied, a request the step updated that is still running and
has none of its tokens in flight gets up to k draft tokens in ``request.spec_token_ids``, and
``spec_wait`` while it has drafts (the scheduler then waits for the verification's tokens
before scheduling it again). One with a token in flight gets ``spec_wait`` only where the
proposer's ``probe`` expects drafts once that token is known (the n-gram index has the
sequence's last n-gram); the others run as without speculation, their steps overlapping the
loop's host work. A proposer without ``probe`` (a draft model) waits for every token. k comes
from ``num_speculative_tokens_per_batch_size`` for the number of unfinished requests, capped
so the step cannot pass ``max_tokens`` or the context (the n-gram proposer adapts it further
per request). The scheduler puts the drafts in the next step; the runner verifies them.

Requests with repetition, presence or frequency penalties never speculate: their penalties
would have to count the draft tokens before the earlier ones are accepted.
"""

from __future__ import annotations

from typing import Protocol

from asyncengine.config.speculative import SpeculativeSettings
from asyncengine.core.request import Request, RequestStatus


class Proposer(Protocol):
    """``propose(request, k) -> drafts`` (on the loop, cheap: the n-gram index), or
    ``async propose_batch([(request, k), ...])`` setting ``spec_token_ids`` (device work);
    optionally ``probe(request) -> bool``: whether drafts are likely after the request's
    in-flight token (see the module doc)."""


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
        probe = getattr(self.proposer, "probe", None)
        for r in updated:
            if r.status is not running:
                continue
            if not can_speculate(r):
                r.spec_wait = False
                continue
            if r.num_output_placeholders or r.num_computed_tokens != len(r.all_token_ids) - 1:
                # A token in flight. Without a probe, wait for it (then propose); with one,
                # wait only where drafts are likely: the others keep their steps overlapped.
                if probe is None:
                    r.spec_wait = True
                elif not r.spec_wait:
                    r.spec_wait = probe(r)
                continue
            room = min(k, r.max_tokens - len(r.output_token_ids) - 1,
                       r.max_model_len - len(r.all_token_ids) - 1)
            if room <= 0:
                r.spec_wait = probe is None
            elif batch is not None:
                r.spec_wait = True
                batch.append((r, room))
            else:
                r.spec_token_ids = drafts = propose(r, room)
                # Waiting is needed while drafts are verified (their accepted count decides
                # the next step's positions); without drafts the request runs overlapped.
                r.spec_wait = bool(drafts) or probe is None
        return batch
