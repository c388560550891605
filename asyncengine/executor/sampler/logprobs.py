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
    chosen, ranks, top_vals, top_ids = logprob_tensors(logits, token_ids, max(num_top, default=0))
    return logprob_entries(token_ids.tolist(), chosen.view(-1).tolist(), ranks.tolist(),
                           None if top_vals is None else top_vals.tolist(),
                           None if top_ids is None else top_ids.tolist(), num_top)


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, max_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                               torch.Tensor | None]:
    """On the logits' device, with no host synchronization: the given tokens' logprobs
    ``[N, 1]``, their ranks ``[N]``, and the top ``max_k`` logprobs and ids ``[N, max_k]``
    (None when ``max_k`` is 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).long())
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_vals = top_ids = None
    if max_k > 0:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
    return chosen, ranks, top_vals, top_ids


def logprob_entries(token_ids: list[int], chosen: list[float], ranks: list[int],
                    top_vals: list[list[float]] | None, top_ids: list[list[int]] | None,
                    num_top: Sequence[int]) -> list[PositionLogprobs]:
    """The per-row dicts from :func:`logprob_tensors`' results, read back to the host."""
    out: list[PositionLogprobs] = []
    for i, (tok, val, rank) in enumerate(zip(token_ids, chosen, ranks, strict=True)):
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
