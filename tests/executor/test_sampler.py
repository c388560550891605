"""Batched sampling: processing order, filters, seeds, the sampled distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from asyncengine.core.sampling_params import SamplingParams
from asyncengine.executor.sampler import (
    NO_TOKEN,
    SamplingBatch,
    apply_top_k,
    apply_top_p,
    process_logits,
    prompt_logprobs,
    reference_uniform,
    sample,
    seeded_uniform,
)

V = 64


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def batch_of(*params: SamplingParams, outputs=None, prompts=None,
             eos=frozenset(), method=None) -> SamplingBatch:
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    prompts = prompts or [[] for _ in range(n)]
    return SamplingBatch.build(list(zip(params, prompts, outputs, strict=True)),
                               eos_token_ids=eos, vocab_size=V, method=method)


def draw(logits: torch.Tensor, params: SamplingParams, n: int, method: str) -> torch.Tensor:
    """Sample one row ``n`` times at once (a batch of identical rows)."""
    batch = batch_of(*[params] * n, method=method)
    return torch.tensor(sample(logits.expand(n, -1), batch).token_ids)


def test_greedy_is_argmax():
    logits = logits_for(5)
    before = logits.clone()
    out = sample(logits, batch_of(*[SamplingParams(temperature=0)] * 5))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


@pytest.mark.parametrize("method", ["cdf", "race"])
def test_top_k_1_and_tiny_top_p_are_greedy(method):
    torch.manual_seed(0)
    logits = logits_for(8, seed=1)
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6, temperature=2.0),
                   SamplingParams(top_k=3, top_p=1e-6)):
        for _ in range(5):
            assert sample(logits, batch_of(*[params] * 8, method=method)).token_ids == greedy


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(0)
    logits = logits_for(4, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0),
              SamplingParams(temperature=0), SamplingParams(top_p=0.5)]
    for _ in range(5):
        out = sample(logits, batch_of(*params)).token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


@pytest.mark.parametrize("method", ["cdf", "race"])
def test_empirical_distribution_matches_softmax(method):
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20000

    def check(params: SamplingParams, probs: torch.Tensor) -> None:
        sampled = draw(logits[None], params, n, method)
        counts = torch.bincount(sampled, minlength=len(logits)).double()
        assert counts[probs == 0].sum() == 0
        keep = probs > 0
        expected = probs[keep].double() * n
        chi2 = (((counts[keep] - expected) ** 2) / expected).sum().item()
        assert chi2 < 30, (params, counts, expected)  # df <= 7: p ~ 1e-4

    check(SamplingParams(temperature=1.0), torch.softmax(logits, -1))
    check(SamplingParams(temperature=0.7), torch.softmax(logits / 0.7, -1))
    top3 = torch.softmax(logits[:3], -1)
    check(SamplingParams(top_k=3), torch.cat([top3, torch.zeros(5)]))
    # top_p=0.7: the first tokens whose preceding mass is <= 0.7 (here 3), renormalized.
    p = torch.softmax(logits, -1)
    assert p[:2].sum() < 0.7 < p[:3].sum()
    check(SamplingParams(top_p=0.7), torch.cat([top3, torch.zeros(5)]))
    # min_p=0.3: tokens with p >= 0.3 * p_max.
    keep = p >= 0.3 * p.max()
    check(SamplingParams(min_p=0.3), torch.where(keep, p, 0) / p[keep].sum())


def test_top_p_nucleus_on_large_vocabularies():
    # On the CPU the nucleus is first looked for among the top candidates; a flat
    # distribution's nucleus is wider than those and takes the full-sort fallback.
    vocab = 5000
    gen = torch.Generator().manual_seed(6)
    logits = torch.cat([torch.randn(1, vocab, generator=gen) * 8,  # narrow nucleus
                        torch.randn(1, vocab, generator=gen) * 0.1,  # wide nucleus
                        torch.randn(1, vocab, generator=gen),
                        torch.randn(1, vocab, generator=gen) * 0.1,
                        torch.randn(1, vocab, generator=gen)])
    params = [SamplingParams(top_p=0.8), SamplingParams(top_p=0.8),
              SamplingParams(top_k=3000),  # no top-p
              SamplingParams(top_p=0.8, top_k=4000), SamplingParams(top_p=0.999, top_k=10)]

    def filtered(rows: list[int]) -> torch.Tensor:
        batch = SamplingBatch.build([(params[r], [], [], None) for r in rows])
        x = logits[rows].clone()
        if batch.top_k is not None:
            apply_top_k(x, batch.top_k, batch.max_top_k)
        if batch.top_p is not None:
            apply_top_p(x, batch)
        return x

    got = filtered([0, 1, 2, 3, 4])
    for row, p in enumerate(params):
        x = logits[row].clone()
        if p.top_k:
            x[x < x.sort(descending=True).values[p.top_k - 1]] = float("-inf")
        order = x.argsort(descending=True)
        probs = torch.softmax(x, -1)[order]
        keep = order[(probs.cumsum(0) - probs) <= p.top_p]
        expected = torch.full_like(x, float("-inf"))
        expected[keep] = x[keep]
        assert torch.equal(got[row], expected), row
        assert torch.equal(filtered([row])[0], expected), row
    kept = torch.isfinite(got).sum(-1).tolist()
    assert kept[0] < 1024 < kept[1] and 1024 < kept[3] < 4000 and kept[4] <= 10


def test_penalties_match_hand_computation():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -1.0, 2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    prompt, output = [0, 1], [2, 3, 3]
    batch = SamplingBatch.build([(params, prompt, output, None)])
    got = process_logits(logits, batch)[0].tolist()
    expected = [
        1.0 / 2,  # prompt token, positive: divided
        -2.0 * 2,  # prompt token, negative: multiplied
        3.0 / 2 - 0.5 - 0.25 * 1,  # output once
        0.5 / 2 - 0.5 - 0.25 * 2,  # output twice
        -1.0,  # unseen
        2.0,  # unseen
    ]
    assert got == pytest.approx(expected)
    # Presence/frequency only look at the output; a row without penalties is untouched.
    params2 = SamplingParams(presence_penalty=1.0)
    batch = SamplingBatch.build([(params2, [5], [4], None), (SamplingParams(), [4], [4], None)])
    got = process_logits(logits.expand(2, -1), batch)
    assert got[0].tolist() == pytest.approx([1.0, -2.0, 3.0, 0.5, -2.0, 2.0])
    assert torch.equal(got[1], logits[0])


def test_logit_bias():
    logits = logits_for(2)
    target = int(logits[0].argmin())
    params = SamplingParams(temperature=0, logit_bias={target: 100.0, 3: -5.0})
    batch = batch_of(params, SamplingParams(temperature=0))
    processed = process_logits(logits, batch)
    assert processed[0, target] == pytest.approx(logits[0, target] + 100)
    assert processed[0, 3] == pytest.approx(logits[0, 3] - 5)
    assert torch.equal(processed[1], logits[1])
    assert sample(logits, batch).token_ids == [target, int(logits[1].argmax())]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0  # eos
    logits[0, 9] = 9.0  # a stop token id
    logits[0, 11] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])

    def pick(output, p=params):
        return sample(logits, batch_of(p, outputs=[output], eos=frozenset({7}))).token_ids[0]

    assert pick([1]) == 11
    assert pick([1, 2]) == 7
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9], ignore_eos=True)
    assert pick([1], ignore) == 7  # with ignore_eos the eos token is an ordinary token


@pytest.mark.parametrize("method", ["cdf", "race"])
def test_seeded_rows_reproducible_alone_and_in_batch(method):
    logits = logits_for(1, seed=3)
    seeded = SamplingParams(temperature=0.9, seed=42)

    def run(others: list[SamplingParams], steps: int = 20) -> list[int]:
        tokens = []
        for step in range(steps):
            rows = [(seeded, [1, 2], tokens[:])]
            rows += [(p, [5], [0] * step) for p in others]
            batch = SamplingBatch.build(rows, eos_token_ids=frozenset({0}), vocab_size=V,
                                        method=method)
            tokens.append(sample(logits.expand(len(rows), -1), batch).token_ids[0])
        return tokens

    alone = run([])
    assert len(set(alone)) > 1
    torch.manual_seed(99)
    others = [SamplingParams(temperature=0), SamplingParams(top_p=0.8, top_k=5, seed=7),
              SamplingParams(min_p=0.1, repetition_penalty=1.3, min_tokens=5),
              SamplingParams(temperature=1.5)]
    assert run(others) == alone
    assert run(others[::-1]) == alone


def test_seeded_noise_is_the_exact_hash_and_uniform():
    """The vectorized int64 hash equals the exact integer one (so wrap-around multiplication
    behaves), and its uniforms look uniform."""
    seeds = torch.tensor([0, 1, 42, -5, 2**62, -(2**63)], dtype=torch.long)
    counters = torch.tensor([0, 7, 3, 1, 100, 9], dtype=torch.long)
    got = seeded_uniform(seeds, counters).tolist()
    want = [reference_uniform(s, c) for s, c in zip(seeds.tolist(), counters.tolist(),
                                                     strict=True)]
    assert got == pytest.approx(want, abs=0)
    wide = seeded_uniform(seeds[:2], counters[:2], width=5)
    assert wide[1, 3].item() == reference_uniform(1, 7, 3)
    many = seeded_uniform(torch.full((20000,), 7), torch.arange(20000))
    assert 0 < many.min() and many.max() < 1
    hist = torch.histc(many, bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200  # ~4.7 sigma for a binomial(20000, 0.1)


@pytest.mark.parametrize("method", ["cdf", "race"])
def test_rows_without_valid_tokens_get_no_token(method):
    """NaN or infinite logits, or every token masked, end that row alone; the others sample
    normally and no id is ever outside the vocabulary."""
    logits = logits_for(4, seed=8)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, 5] = float("inf")
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
                   SamplingParams(temperature=0.7, top_p=0.9, top_k=10)):
        out = sample(logits, batch_of(*[params] * 4, method=method)).token_ids
        assert out[:3] == [NO_TOKEN] * 3
        assert 0 <= out[3] < V
    # A repetition penalty that pushes logits to infinity (past what validation lets in:
    # this is the defence behind it)
    huge = SamplingParams(temperature=0.8)
    huge.repetition_penalty = 1e-45
    out = sample(logits_for(2, seed=1) * 10, batch_of(huge, SamplingParams(temperature=0),
                                                      prompts=[list(range(V)), []],
                                                      method=method)).token_ids
    assert out[0] == NO_TOKEN and 0 <= out[1] < V


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = logits_for(3, seed=4)
    params = [SamplingParams(temperature=0.3, logprobs=5, logit_bias={0: 50.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]
    out = sample(logits, batch_of(*params))
    assert out.token_ids[0] == 0  # the bias decided the sample...
    assert out.logprobs[1] is None
    expected = torch.log_softmax(logits, -1)
    for row in (0, 2):
        entry = out.logprobs[row]
        order = expected[row].argsort(descending=True).tolist()
        tok = out.token_ids[row]
        # ...but logprobs are those of the raw distribution.
        assert entry[tok].logprob == pytest.approx(expected[row, tok].item(), abs=1e-5)
        assert entry[tok].rank == order.index(tok) + 1
        k = params[row].logprobs
        assert set(entry) == {tok, *order[:k]}
        for rank, t in enumerate(order[:k], start=1):
            assert entry[t].rank == rank
            assert entry[t].logprob == pytest.approx(expected[row, t].item(), abs=1e-5)
    assert len(out.logprobs[2]) == 1 and out.logprobs[2][out.token_ids[2]].rank == 1


def test_prompt_logprobs():
    logits = logits_for(4, seed=5)
    next_ids = [3, 10, 0, 63]
    entries = prompt_logprobs(logits, next_ids, 2)
    lp = torch.log_softmax(logits, -1)
    for row, (tok, entry) in enumerate(zip(next_ids, entries, strict=True)):
        assert entry[tok].logprob == pytest.approx(lp[row, tok].item(), abs=1e-5)
        assert entry[tok].rank == int((lp[row] > lp[row, tok]).sum()) + 1
        top = lp[row].topk(2).indices.tolist()
        assert [entry[t].rank for t in top] == [1, 2]
        assert len(entry) == len({tok, *top})
