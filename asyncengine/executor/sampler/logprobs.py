"""Logprobs of the raw model distribution (``log_softmax`` of the unprocessed logits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncengine.core.request import Logprob, PositionLogprobs


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: Sequence[int]) -> list[PositionLogprobs]:
    """For each row: ``{token: Logprob}`` holding the given token's logprob and rank (1 + the
    number of tokens strictly more likely) and the row's ``num_top[i]`` most likely tokens
    with ranks 1..k, from ``log_softmax(logits)``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).long())
    ranks = (lp > chosen).sum(dim=-1) + 1
    max_k = max(num_top, default=0)
    top_vals = top_ids = None
    if max_k > 0:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[PositionLogprobs] = []
    for i, (tok, val, rank) in enumerate(zip(token_ids.tolist(), chosen.view(-1).tolist(),
                                             ranks.tolist(), strict=True)):
        entry: PositionLogprobs = {tok: Logprob(val, rank)}
        for r in range(num_top[i]):
            tid = top_ids[i][r]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[i][r], r + 1)
        out.append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor | Sequence[int],
                    k: int) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens: row ``i`` of ``logits`` [P, V] predicts ``next_token_ids[i]``;
    each entry holds that token's logprob and rank plus the top ``k`` alternatives."""
    ids = torch.as_tensor(next_token_ids, device=logits.device)
    return compute_logprobs(logits, ids, [k] * logits.shape[0])
