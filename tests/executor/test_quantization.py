"""--quantization int8: weight round trip, the packed int8 kernel vs the dequantized weights,
logits of int8 models vs the unquantized ones, the engine end to end, bad values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.llm import LLM
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.models.llama import Linear
from asyncengine.executor.weights.int8 import Int8Linear, dequantize_int8, quantize_int8
from asyncengine.executor.weights.loader import load_model, resolve_model
from asyncengine.executor.weights.quantization import quantize_model
from tests.executor.test_models import PagedRunner


def test_int8_weights_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * torch.rand(96, 1, generator=gen)
    w[3] = 0.0  # a row of zeros must not divide by zero
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (96,)
    assert int(q.abs().max()) == 127
    back = dequantize_int8(q, scales)
    # rounding to the nearest step: at most half a step per element, per row
    assert ((back - w).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(256))
    assert ((back - w).norm() / w.norm()).item() < 0.01


@pytest.mark.parametrize("kernel", [True, False])
def test_the_int8_logits_head_gives_float32_logits_from_bfloat16_rows(kernel):
    """A bfloat16 model's int8 head keeps its float32 sums: logits rounded to bfloat16 tie
    where float32 tells them apart, and greedy then takes the lower id."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 64, generator=gen) * 0.05
    head = Int8Linear(w, torch.randn(300, generator=gen) * 0.01, float32_out=True)
    head.use_kernel = kernel and head.use_kernel
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    got = head(x)
    assert got.dtype == torch.float32
    want = x.float() @ head.dequantized().t() + head.bias.float()
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert len(set(got[0].tolist())) > len(set(got[0].to(torch.bfloat16).tolist()))
    assert Int8Linear(w.to(torch.bfloat16))(x).dtype == torch.bfloat16  # other linears: as given


@pytest.mark.skipif(not packed_kernels.available("int8"), reason="no packed CPU kernel here")
def test_int8_kernel_agrees_with_the_dequantized_weights():
    # From 16 rows on (8 without AVX-512 VNNI): float32 activations times the int8 weights,
    # the dequantized matmul up to float32 summation order. Below: byte dot products against
    # activations rounded twice per block of 32 (exact to ~1.5e-5 of the block maximum),
    # stated within 2e-4 of the output scale, with an outlier activation in the rows.
    # Per-channel scales and GGUF's per-32 (Q8_0) scales both.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen) * 0.1
    q8_0 = (torch.randint(-127, 128, (96, 128), generator=gen, dtype=torch.int8),
            torch.rand(96, 4, generator=gen) * 0.01)
    for dtype, grid in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, q8_0)):
        layer = Int8Linear(w.to(dtype), bias.to(dtype), grid=grid)
        assert layer.use_kernel and layer.scales.shape == ((96, 1) if grid is None else (96, 4))
        assert not hasattr(layer, "weight")  # only the int8 weights are held
        for rows in (1, 3, 4, 5, 7, 8, 16):
            x = torch.randn(rows, 128, generator=gen).to(dtype)
            x[0, 5] = 30.0  # an outlier in one block
            want = x.float() @ layer.dequantized().t() + bias.to(dtype).float()
            got = layer(x).float()
            if dtype == torch.bfloat16:
                torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
            elif rows >= 16:  # float32 from 16 rows on (8 on CPUs without AVX-512 VNNI)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:
                assert ((got - want).abs().max() / want.abs().max()).item() < 2e-4
    # widths the kernel does not take compute with the dequantized weights
    odd = Int8Linear(w[:, :100].contiguous())
    assert not odd.use_kernel
    x = torch.randn(2, 100, generator=gen)
    torch.testing.assert_close(odd(x), F.linear(x, odd.dequantized()))


def _logits(model, dtype, tokens: torch.Tensor) -> torch.Tensor:
    runner = PagedRunner(model, dtype=dtype)
    # a prefill, then single-token decodes: the int8 kernel's rows and the dequantized path
    out = [runner.step({"r": tokens[:8]})["r"]]
    out += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(8, len(tokens))]
    return torch.cat(out)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied lm_head; tied + q/k/v bias
def test_int8_model_logits_stay_close(tiny_models, family):
    source = resolve_model(tiny_models[family])
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(2))
    want = _logits(load_model(source, "auto", torch.float32, "cpu"), torch.float32, tokens)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(source, "auto", dtype, "cpu", quantization="int8")
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        # 4 projections per layer (q/k/v and gate/up fused) and the logits head
        assert len(layers) == 4 * model.num_layers + 1
        assert not any(isinstance(m, Linear) for m in model.modules())
        assert model.model.embed_tokens.weight.dtype == dtype  # the lookup stays exact
        assert all(m.use_kernel for m in layers) == packed_kernels.available("int8")
        got = _logits(model, dtype, tokens)
        cos = F.cosine_similarity(got, want, dim=-1)
        assert cos.min().item() > 0.999, (dtype, cos)  # measured: ~0.9999


def test_engine_generates_with_int8(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", quantization="int8", max_num_seqs=4,
              num_gpu_blocks_override=16, block_size=8, max_model_len=64)
    assert isinstance(llm.engine.runner.model.lm_head, Int8Linear)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], params)
    for out in outs:
        got = out.outputs[0]
        assert len(got.token_ids) == 6
        assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for lp, t in
                   zip(got.logprobs, got.token_ids, strict=True))


def test_bad_quantization_values():
    with pytest.raises(ValueError,
                       match="--quantization: invalid value 'int2'.*auto, none, int8, int4"):
        EngineConfig.from_dict({"quantization": "int2"})
    with pytest.raises(ValueError, match="--quantization"):
        quantize_model(torch.nn.Sequential(), "fp8")
    with pytest.raises(ValueError, match="--quantization int8: Sequential has no linear"):
        quantize_model(torch.nn.Sequential(torch.nn.ReLU()), "int8")
