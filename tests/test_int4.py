"""--quantization int4: packed group-wise weights, the kernel vs the dequantized weights, GGUF
Q4_0/Q4_1 blocks kept exactly, and logprobs against transformers' (stated tolerances)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.executor.models import load_model
from asyncengine.executor.models.gguf import q4_grid
from asyncengine.executor.models.int4 import (
    GROUP,
    Int4Linear,
    dequantize_int4,
    quantize_int4,
)
from asyncengine.executor.models.llama import Linear
from asyncengine.executor.models.loader import resolve_model
from asyncengine.executor.models.quantization import weight_footprint
from tests.test_models import PagedRunner, reference_logits
from tests.utils import embedded_gguf_path, hf_reference_model

TEXT = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 314, 260, 3458, 282,
                     260, 1345, 30, 378, 3817, 314, 2365, 288, 2391, 28])


def test_int4_weights_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * torch.rand(48, 1, generator=gen)
    w[5] = 0.0  # a group with max == min must not divide by zero
    q, scale, zero = quantize_int4(w)
    assert q.shape == w.shape and scale.shape == zero.shape == (128 // GROUP, 48)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    back = dequantize_int4(q, scale, zero)
    step = scale.T.repeat_interleave(GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()  # at most half a step per weight
    assert torch.equal(back[5], torch.zeros(128))


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int4_kernel_agrees_with_the_dequantized_weights(rows):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen) * 0.1
    layer = Int4Linear(w, bias)
    q, scale, zero = quantize_int4(w)
    want_w = dequantize_int4(q, scale, zero)
    x = torch.randn(rows, 128, generator=gen)
    torch.testing.assert_close(layer(x), x @ want_w.T + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_are_kept_exactly(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    rows = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.1
    raw = quantize(rows, t)
    w = torch.from_numpy(dequantize(raw, t).reshape(48, 256).copy())
    grid = tuple(torch.from_numpy(g) for g in q4_grid(raw, t))
    q, scale, zero = quantize_int4(w, grid)
    # the file's weights, not a re-quantization (for Q4_0's symmetric grid a min/max one
    # would move them; Q4_1's own grid is min/max)
    torch.testing.assert_close(dequantize_int4(q, scale, zero), w, atol=1e-6, rtol=0)
    if qtype == "Q4_0":
        assert (dequantize_int4(*quantize_int4(w)) - w).abs().max() > 1e-3
    x = torch.randn(2, 256)
    torch.testing.assert_close(Int4Linear(w, grid=grid)(x), x @ w.T, atol=1e-4, rtol=1e-4)


def _logprobs(model, tokens: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    runner = PagedRunner(model, block_size=block_size)
    split = len(tokens) // 2  # a prefill, then single-token decodes
    out = [runner.step({"r": tokens[:split]})["r"]]
    out += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(split, len(tokens))]
    return torch.cat(out).log_softmax(-1)


def test_embedded_q4_1_gguf_as_int4_matches_transformers():
    # Its linears are Q4_1: packed on the file's own grid they are the very weights
    # transformers dequantizes, so logprobs agree to float32 rounding and top-1 everywhere.
    path = embedded_gguf_path()
    model = load_model(resolve_model(None), "auto", torch.float32, "cpu", quantization="int4")
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(packed) == 4 * model.num_layers  # q/k/v, o, gate/up, down
    assert not any(isinstance(m, Linear) for m in model.model.layers.modules())
    sizes = weight_footprint(model)
    assert 45 < sizes["int4"] < 55  # 106M weights at half a byte: 50.6 MiB
    want = reference_logits(hf_reference_model(path), TEXT).log_softmax(-1)
    got = _logprobs(model, TEXT, block_size=16)
    assert (got - want).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int4_safetensors_model_logprobs_close_to_transformers(tiny_models, family):
    # min/max int4 of random tiny weights against transformers' float32 logprobs. Stated
    # tolerance: max |logprob difference| < 0.15 and mean KL < 1e-3 (measured: ~0.09 and
    # ~1e-4); top-1 agrees wherever transformers' top-1 leads its runner-up by more than 0.2.
    # (A random tiny model's top two are often closer than that: measured overall top-1
    # agreement 15/24 for llama, 24/24 for qwen2.)
    path = tiny_models[family]
    model = load_model(resolve_model(path), "auto", torch.float32, "cpu", quantization="int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * model.num_layers
    tokens = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(2))
    want = reference_logits(hf_reference_model(path), tokens).log_softmax(-1)
    got = _logprobs(model, tokens)
    assert (got - want).abs().max().item() < 0.15
    assert (want.exp() * (want - got)).sum(-1).mean().item() < 1e-3
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_int4_is_a_quantization_choice():
    assert EngineConfig.from_dict({"quantization": "int4"}).model.quantization == "int4"
    with pytest.raises(ValueError, match="--quantization int4: a 8x100 linear"):
        Int4Linear(torch.randn(8, 100))
