"""The greedy head (its C++ kernel and its slices) equals argmax over the full logits: ties
to the lowest id, rows with NaN or infinite logits get NO_TOKEN, and the runner uses it only
for plain greedy steps."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.sampler import NO_TOKEN, greedy_head
from asyncengine.executor.sampler.greedy_head import greedy_from_hidden
from asyncengine.executor.sampler.sampler import _greedy


def reference(hidden, weight, bias=None):
    return _greedy(torch.nn.functional.linear(hidden, weight, bias).float())


@pytest.fixture(params=["kernel", "sliced"])
def path(request, monkeypatch):
    """Float32 rows through greedy_head.cpp, or the sliced matmuls."""
    if request.param == "sliced":
        monkeypatch.setattr(greedy_head, "KERNEL", False)
    return request.param


def assert_argmax(got, hidden, weight, bias=None, tol=1e-5):
    """``got`` is the argmax of the full logits in every row whose top two logits are more
    than ``tol`` (relative) apart; in the others (the kernel sums in another order than MKL,
    so a near tie may go either way) its logit is within ``tol`` of the maximum."""
    logits = torch.nn.functional.linear(hidden.double(), weight.double(),
                                        None if bias is None else bias.double())
    top2 = logits.topk(2, dim=-1).values
    margin = tol * logits.abs().amax(dim=-1).clamp_min(1.0)
    near = top2[:, 0] - top2[:, 1] <= margin
    assert torch.equal(got[~near], reference(hidden, weight, bias)[~near])
    chosen = logits[near].gather(1, got[near, None]).squeeze(1)
    assert (top2[near, 0] - chosen <= margin[near]).all()


@pytest.mark.parametrize("rows,hidden_size,vocab,slice_size", [
    (1, 32, 10, 4), (17, 32, 1000, 128), (64, 32, 5000, 4096), (33, 32, 4096, 4096),
    (5, 32, 300, 7), (200, 32, 3001, 1024),
    # many rows; hidden sizes that are no multiple of 8; vocabularies no multiple of 16
    (256, 64, 4099, 1024), (300, 72, 2003, 512), (3, 37, 1001, 256), (7, 37, 517, 64),
    (40, 576, 3000, 1024), (4, 5, 33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_argmax_of_full_logits(rows, hidden_size, vocab, slice_size, dtype, path):
    if path == "kernel" and dtype != torch.float32:
        pytest.skip("the kernel is float32 only")
    g = torch.Generator().manual_seed(rows * vocab)
    hidden = torch.randn(rows, hidden_size, generator=g).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=g).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype)
    for b in (None, bias):
        got = greedy_from_hidden(hidden, weight, b, slice_size=slice_size, no_token=NO_TOKEN)
        if dtype == torch.float32:
            assert_argmax(got, hidden, weight, b)
        else:  # the slices round like the full matmul
            assert torch.equal(got, reference(hidden, weight, b))


def test_ties_go_to_the_lowest_id_across_slices(path):
    # Integer-valued weights: exact logits, with the maximum repeated in several slices.
    weight = torch.zeros(40, 2)
    weight[[3, 13, 25, 39], 0] = 5.0  # row 0's maximum, four times
    weight[[30, 31], 1] = 7.0  # row 1's maximum, twice in one slice
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # row 2: all zero, id 0
    got = greedy_from_hidden(hidden, weight, slice_size=10)
    assert got.tolist() == [3, 30, 0] == reference(hidden, weight).tolist()


@pytest.mark.parametrize("rows", [1, 3, 5, 20, 64, 257])
@pytest.mark.parametrize("hidden_size", [8, 37, 72])
def test_exact_ties_go_to_the_lowest_id(rows, hidden_size, path):
    """Small integers: every logit exact in any summation order, and maxima repeated in
    other lanes, tiles, chunks and threads (duplicated weight rows, 1,501 ids apart)."""
    g = torch.Generator().manual_seed(rows * hidden_size)
    vocab = 3001
    weight = torch.randint(-2, 3, (vocab, hidden_size), generator=g).float()
    weight[1501:] = weight[:1500].clone()  # each id below 1500 tied with id + 1501
    planted = [5, 17, 18, 33, 1500, 2000, 2990, 3000]
    weight[planted] = 3.0  # row 0's maximum, in several lanes, tiles, chunks and threads
    hidden = torch.randint(-2, 3, (rows, hidden_size), generator=g).float()
    hidden[0] = 2.0
    bias = torch.randint(-1, 2, (vocab,), generator=g).float()
    bias[1501:] = bias[:1500].clone()
    bias[planted] = 1.0
    for b in (None, bias):
        logits = torch.nn.functional.linear(hidden, weight, b)
        repeated = (logits == logits.amax(dim=-1, keepdim=True)).sum(dim=-1) > 1
        assert repeated[0] and repeated.float().mean() > 0.9
        got = greedy_from_hidden(hidden, weight, b, slice_size=256)
        assert got[0] == 5
        assert torch.equal(got, reference(hidden, weight, b))


@pytest.mark.parametrize("rows,hidden_size", [(3, 4), (40, 4), (3, 37), (20, 37), (48, 37)])
def test_rows_without_a_finite_maximum_get_no_token(rows, hidden_size, path):
    g = torch.Generator().manual_seed(rows * hidden_size)
    vocab = 3001
    weight = torch.randn(vocab, hidden_size, generator=g)
    hidden = torch.randn(rows, hidden_size, generator=g)
    hidden[1, 0] = float("nan")  # every logit NaN
    hidden[2] = float("inf")  # +inf / NaN logits
    got = greedy_from_hidden(hidden, weight, slice_size=256)
    assert got[1] == NO_TOKEN and got[2] == NO_TOKEN
    assert torch.equal(got, reference(hidden, weight))
    hidden = torch.randn(rows, hidden_size, generator=g)
    for nan_id in (0, 20, 2990, vocab - 1):  # one NaN logit per row, before or after maxima
        bias = torch.zeros(vocab)
        bias[nan_id] = float("nan")
        assert torch.equal(greedy_from_hidden(hidden, weight, bias, slice_size=256),
                           torch.full((rows,), NO_TOKEN))
    bias = torch.zeros(vocab)
    bias[1234] = float("inf")  # a +inf maximum
    assert torch.equal(greedy_from_hidden(hidden, weight, bias, slice_size=256),
                       torch.full((rows,), NO_TOKEN))
    bias = torch.full((vocab,), float("-inf"))  # no logit above -inf
    assert torch.equal(greedy_from_hidden(hidden, weight, bias, slice_size=256),
                       torch.full((rows,), NO_TOKEN))
    bias[2000] = 0.0  # one finite logit: it wins
    assert torch.equal(greedy_from_hidden(hidden, weight, bias, slice_size=256),
                       torch.full((rows,), 2000))
    weight[2500, 0] = float("nan")  # a NaN weight: a NaN logit in every row
    assert torch.equal(greedy_from_hidden(hidden, weight, slice_size=256),
                       torch.full((rows,), NO_TOKEN))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
def test_engine_greedy_steps_use_it_and_match_transformers(family, tiny_models, monkeypatch,
                                                           tmp_path):
    """16 greedy requests in one batch (no logprobs): the decode steps go through the sliced
    head, and every request's tokens equal transformers' generate. Llama has its own head;
    Qwen2 and Qwen3 tie it to the embedding, as the embedded SmolLM2 does; Gemma 2 soft-caps
    its logits (the raw logits' argmax is the capped ones')."""
    from transformers import AutoModelForCausalLM

    from asyncengine import LLM, SamplingParams
    from asyncengine.executor import runner as runner_module
    from tests.engine.test_engine import PROMPTS, hf_greedy

    calls = []
    real = runner_module.greedy_from_hidden

    def counting(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(runner_module, "greedy_from_hidden", counting)
    if family in tiny_models:
        path = tiny_models[family]
    else:
        from tests.utils import make_tiny_model

        path = make_tiny_model(tmp_path / family, family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_num_seqs=32, max_model_len=128)
    tok = llm.tokenizer
    prompts = [tok.encode(f"{p} ({i})") for i in range(4) for p in PROMPTS][:16]
    n = 10
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert calls and max(calls) == 16
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, n)[0]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (9, 49152), (3, 17), (2, 15), (1, 1),
                                        (4, 49155)])
def test_argmax_rows_is_torch_argmax(rows, vocab):
    # the sampler's argmax kernel (argmax_rows.cpp) against torch.argmax: ties to the first
    # index, all -inf rows, +inf, a row's first NaN, -0.0 beside +0.0
    from asyncengine.executor.sampler.argmax import _kernel, argmax_rows, greedy_rows

    if _kernel() is None:
        pytest.skip("the CPU kernels do not build here")
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    ties = x.clone()
    ties[:, vocab // 2] = ties[:, vocab - 1] = 1e9
    nans = x.clone()
    nans[0, vocab // 3] = nans[0, vocab - 1] = float("nan")
    infs = x.clone()
    infs[:, 0] = infs[:, -1] = float("inf")
    zeros = torch.zeros(rows, vocab)
    zeros[:, 0] = -0.0
    for case in (x, ties, nans, infs, zeros, torch.full((rows, vocab), float("-inf"))):
        assert torch.equal(argmax_rows(case), case.argmax(dim=-1))
        # the greedy sampler's pass: the argmax, or -1 where the chosen logit is not finite,
        # in the kernel and in the fallback (a strided tensor) alike
        ids = case.argmax(dim=-1)
        want = torch.where(torch.isfinite(case.gather(1, ids[:, None]).squeeze(1)), ids, -1)
        assert torch.equal(greedy_rows(case, -1), want)
        assert torch.equal(greedy_rows(case.t().contiguous().t(), -1), want)
    assert torch.equal(argmax_rows(x.t().contiguous().t()), x.argmax(dim=-1))  # strided
