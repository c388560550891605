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


@pytest.mark.parametrize("rows,vocab,slice_size", [(1, 10, 4), (17, 1000, 128), (64, 5000, 4096),
                                                   (33, 4096, 4096), (5, 300, 7),
                                                   (200, 3001, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_equals_argmax_of_full_logits(rows, vocab, slice_size, dtype, kernel, monkeypatch):
    # kernel: float32 below KERNEL_ROWS rows goes through greedy_head.cpp; else the slices
    if not kernel:
        monkeypatch.setattr(greedy_head, "KERNEL_ROWS", 0)
    elif dtype != torch.float32:
        pytest.skip("the kernel is float32 only")
    g = torch.Generator().manual_seed(rows * vocab)
    hidden = torch.randn(rows, 32, generator=g).to(dtype)
    weight = torch.randn(vocab, 32, generator=g).to(dtype)
    bias = torch.randn(vocab, generator=g).to(dtype)
    for b in (None, bias):
        got = greedy_from_hidden(hidden, weight, b, slice_size=slice_size, no_token=NO_TOKEN)
        assert torch.equal(got, reference(hidden, weight, b))


def test_ties_go_to_the_lowest_id_across_slices():
    # Integer-valued weights: exact logits, with the maximum repeated in several slices.
    weight = torch.zeros(40, 2)
    weight[[3, 13, 25, 39], 0] = 5.0  # row 0's maximum, four times
    weight[[30, 31], 1] = 7.0  # row 1's maximum, twice in one slice
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # row 2: all zero, id 0
    got = greedy_from_hidden(hidden, weight, slice_size=10)
    assert got.tolist() == [3, 30, 0] == reference(hidden, weight).tolist()


def test_rows_without_a_finite_maximum_get_no_token():
    weight = torch.randn(50, 4)
    hidden = torch.randn(4, 4)
    hidden[1, 0] = float("nan")  # every logit NaN
    hidden[2] = float("inf")  # +inf / NaN logits
    got = greedy_from_hidden(hidden, weight, slice_size=16)
    assert got[1] == NO_TOKEN and got[2] == NO_TOKEN
    assert torch.equal(got, reference(hidden, weight))
    bias = torch.zeros(50)
    bias[20] = float("nan")  # one NaN logit in a later slice, after finite maxima
    assert torch.equal(greedy_from_hidden(torch.randn(3, 4), weight, bias, slice_size=16),
                       torch.full((3,), NO_TOKEN))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_greedy_steps_use_it_and_match_transformers(family, tiny_models, monkeypatch):
    """16 greedy requests in one batch (no logprobs): the decode steps go through the sliced
    head, and every request's tokens equal transformers' generate. Llama has its own head;
    Qwen2 and Qwen3 tie it to the embedding, as the embedded SmolLM2 does."""
    from transformers import AutoModelForCausalLM

    from asyncengine import LLM, SamplingParams
    from asyncengine.executor import runner as runner_module
    from tests.test_engine import PROMPTS, hf_greedy

    calls = []
    real = runner_module.greedy_from_hidden

    def counting(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(runner_module, "greedy_from_hidden", counting)
    path = tiny_models[family]
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
