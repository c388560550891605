"""Accepting draft tokens after the verification forward pass.

A request with drafts ``d_1 .. d_k`` is computed at its last token and its k drafts, one
sampled row per position: row i holds the target distribution ``p_i`` after the sequence and
``d_1 .. d_i``. The sampler draws ``x_i ~ p_i`` on every row with the request's own
parameters (temperature, top-k/p, min-p, logit bias, min_tokens, grammar bitmask, its seed's
noise for that output position). The step's tokens are ``x_1 .. x_j`` for the first ``j``
with ``x_j != d_j`` (the drafts before it accepted, ``x_j`` in place of the rejected one), or
all k drafts and the bonus ``x_{k+1}``.

This is rejection sampling for a draft distribution that is a point mass (n-gram lookup and
a greedy draft model both propose one token with certainty): ``d_i`` is accepted with
probability ``P(x_i = d_i) = p_i(d_i)``, and on rejection ``x_i`` is distributed as ``p_i``
given ``x_i != d_i``, i.e. ``p_i`` with ``d_i`` removed and renormalised: the output follows
the target distribution exactly. Greedy rows take the argmax, so greedy output is the longest
matching prefix plus one token, identical to decoding without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncengine.core.request import PositionLogprobs
from asyncengine.core.sched.interface import ModelRunnerOutput

#: (request id, index of its first sampled row, its drafts).
SpecGroup = tuple[str, int, list[int]]


def accepted(ids: Sequence[int], first: int, drafts: list[int]) -> list[int]:
    """The tokens of one request: sampled ids of its rows, up to the first that differs from
    its draft (included), or every draft and the bonus token."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        x = ids[first + i]
        out.append(x)
        if x != d:
            return out
    out.append(ids[first + len(drafts)])
    return out


def accept_into(result: ModelRunnerOutput, groups: list[SpecGroup], ids: Sequence[int],
                logprobs: Sequence[PositionLogprobs | None] | None) -> None:
    """Fill ``result``'s draft fields from the step's per-row ids (and logprobs)."""
    for rid, first, drafts in groups:
        tokens = accepted(ids, first, drafts)
        result.spec_token_ids[rid] = tokens
        result.sampled_token_ids[rid] = tokens[-1]
        if logprobs is not None and logprobs[first] is not None:
            lps = list(logprobs[first:first + len(tokens)])
            result.spec_logprobs[rid] = lps  # type: ignore[assignment]
            if lps[-1] is not None:
                result.logprobs[rid] = lps[-1]
