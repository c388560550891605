"""--quantization int4 / auto: packed Q4 weights read by the packed CPU kernel, GGUF Q4_0/Q4_1
blocks kept exactly, and logprobs against transformers' (stated tolerances)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.models.llama import Linear
from asyncengine.executor.weights.gguf import quant_grid
from asyncengine.executor.weights.int4 import (
    GROUP,
    Int4Linear,
    dequantize_int4,
    quantize_int4,
)
from asyncengine.executor.weights.int8 import Int8Linear
from asyncengine.executor.weights.loader import load_model, resolve_model
from asyncengine.executor.weights.quantization import weight_footprint
from tests.executor.test_models import PagedRunner, reference_logits
from tests.utils import embedded_gguf_path, hf_reference_model

TEXT = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 314, 260, 3458, 282,
                     260, 1345, 30, 378, 3817, 314, 2365, 288, 2391, 28])

needs_kernel = pytest.mark.skipif(not packed_kernels.available("int4"),
                                  reason="the packed CPU kernel does not build here")


def test_int4_weights_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * torch.rand(48, 1, generator=gen)
    w[5] = 0.0  # a block with max == min must not divide by zero
    q, scale, mn = quantize_int4(w)
    assert q.shape == w.shape and scale.shape == mn.shape == (48, 128 // GROUP)
    assert scale.dtype == mn.dtype == torch.float16
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    back = dequantize_int4(q, scale, mn)
    step = scale.float().repeat_interleave(GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all()  # half a step per weight
    assert torch.equal(back[5], torch.zeros(128))
    assert torch.equal(packed_kernels.unpack_int4(packed_kernels.pack_int4(q)), q)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 17, 70, 100])
def test_int4_kernel_agrees_with_the_dequantized_weights(rows):
    # Below 8 rows the kernel rounds activations to int8 twice per block of 32 (the value,
    # then its rounding error): stated tolerance, relative error of the output < 2e-4
    # (measured ~2e-5). From 8 rows on it multiplies dequantized rows in float32 (~3e-7), from
    # 96 rows on the layer hands the dequantized weights to F.linear.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen) * 0.1
    layer = Int4Linear(w, bias)
    assert layer.use_kernel
    x = torch.randn(rows, 128, generator=gen)
    x[0, 5] = 40.0  # an outlier in one block
    got, want = layer(x), x @ layer.dequantized().T + bias
    assert ((got - want).norm() / want.norm()).item() < 2e-4


@needs_kernel
@pytest.mark.parametrize("shape", [(96, 128), (7, 576), (33, 1536)])
def test_dequantized_weights_from_the_kernel_equal_pytorch(shape):
    # The one-pass C++ dequantization (prefill chunks) against the PyTorch ops: q * scale is
    # exact in float32 (a 4-bit integer times a float16), so both round once, identically.
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.05
    layer = Int4Linear(w)
    q = packed_kernels.unpack_int4(layer.packed)
    want = dequantize_int4(q, layer.scale_min[..., 0], layer.scale_min[..., 1])
    assert torch.equal(layer.dequantized(), want)
    # bfloat16 (the prefill GEMM's weights) straight from the kernel: rounded as .to() rounds
    got = layer.dequantized(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_are_kept_exactly(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    rows = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.1
    raw = quantize(rows, t)
    w = torch.from_numpy(dequantize(raw, t).reshape(48, 256).copy())
    g = quant_grid(raw, t)
    assert g.kind == "q4"
    q, scale, mn = quantize_int4(w, (torch.from_numpy(g.scale), torch.from_numpy(g.other)))
    # the file's weights, not a re-quantization (for Q4_0's symmetric grid a min/max one
    # would move them; Q4_1's own grid is min/max)
    torch.testing.assert_close(dequantize_int4(q, scale, mn), w, atol=1e-6, rtol=1e-6)
    if qtype == "Q4_0":
        assert (dequantize_int4(*quantize_int4(w)) - w).abs().max() > 1e-3


def test_gguf_q8_0_blocks_are_kept_exactly():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType.Q8_0
    rows = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    raw = quantize(rows, t)
    w = torch.from_numpy(dequantize(raw, t).reshape(40, 128).copy())
    g = quant_grid(raw, t)
    layer = Int8Linear(w, grid=(torch.from_numpy(g.other), torch.from_numpy(g.scale)))
    assert layer.scales.shape == (40, 4)
    torch.testing.assert_close(layer.dequantized(), w, atol=0, rtol=0)
    x = torch.randn(3, 128)  # decode rows: activations rounded twice per block of 32
    want = x @ w.T
    assert ((layer(x) - want).abs().max() / want.abs().max()).item() < 2e-4
    x = torch.randn(16, 128)  # float32 arithmetic from 16 rows on (8 without AVX-512 VNNI)
    torch.testing.assert_close(layer(x), x @ w.T, atol=1e-4, rtol=1e-4)


def test_byte_dot_rows_do_not_depend_on_the_row_count():
    """A row's result is the same alone or among up to 7 others (any CPU; up to 15 with
    AVX-512 VNNI): a verification step of 1 + k rows computes each token as a one-token step
    would, so greedy output is the same with and without speculative decoding."""
    if not (packed_kernels.available("int4") and packed_kernels.available("int8")):
        pytest.skip("no C++ kernels here")
    torch.manual_seed(0)
    w4 = torch.randn(72, 576) * 0.05
    layer4 = Int4Linear(w4)
    layer8 = Int8Linear(torch.randn(72, 576) * 0.05)
    x = torch.randn(8, 576)
    for layer in (layer4, layer8):
        alone = torch.cat([layer(x[i:i + 1]) for i in range(8)])
        for m in range(2, 8):
            assert torch.equal(layer(x[:m]), alone[:m]), (type(layer).__name__, m)


def _logprobs(model, tokens: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    runner = PagedRunner(model, block_size=block_size)
    split = len(tokens) // 2  # a prefill, then single-token decodes
    out = [runner.step({"r": tokens[:split]})["r"]]
    out += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(split, len(tokens))]
    return torch.cat(out).log_softmax(-1)


@needs_kernel
def test_embedded_q4_1_gguf_runs_packed_by_default_close_to_transformers():
    # auto: the file's Q4_1 linears packed on their own grid (the very weights transformers
    # dequantizes) and its Q8_0 embedding as an int8 head (exactly the embedding's values).
    # What differs from transformers is the kernels' arithmetic. Stated tolerance over this
    # text: max |logprob difference| < 0.05 and mean KL < 1e-4 (measured: 0.019 and 3e-7);
    # top-1 agrees everywhere.
    path = embedded_gguf_path()
    model = load_model(resolve_model(None), "auto", torch.float32, "cpu", quantization="auto")
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(packed) == 4 * model.num_layers  # q/k/v, o, gate/up, down
    assert not any(isinstance(m, Linear) for m in model.model.layers.modules())
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.scales.shape[1] == 576 // 32
    sizes = weight_footprint(model)
    assert 45 < sizes["int4"] < 55  # 106M weights at half a byte: 50.6 MiB
    want = reference_logits(hf_reference_model(path), TEXT).log_softmax(-1)
    got = _logprobs(model, TEXT, block_size=16)
    diff = (got - want).abs().max().item()
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    print(f"max |dlogprob| {diff:.3f}, mean KL {kl:.2e}, top-1 {agree}/{len(TEXT)}")
    assert diff < 0.05 and kl < 1e-4 and agree == len(TEXT)


@needs_kernel
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
def test_embedded_gguf_close_to_llama_cpp_own_logprobs():
    # The same GGUF through llama.cpp (llama-cpp-python): its Q4_1 x Q8_1 dot products round
    # the activations once per block, ours twice, so the two differ by llama.cpp's rounding
    # more than by ours. Stated tolerance over this text: mean KL < 0.05 and top-1 agreement
    # at 20 of 24 positions or more (measured with llama-cpp-python 0.3.36: KL 7.9e-3, top-1
    # 23/24; max |logprob difference| 1.26, on a token both give little probability).
    from llama_cpp import Llama

    llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=64, n_threads=2, logits_all=True,
                verbose=False)
    llm.eval(TEXT.tolist())
    want = torch.from_numpy(np.array(llm.scores[:len(TEXT)], dtype=np.float32)).log_softmax(-1)
    model = load_model(resolve_model(None), "auto", torch.float32, "cpu", quantization="auto")
    got = _logprobs(model, TEXT, block_size=16)
    diff = (got - want).abs().max().item()
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    print(f"vs llama.cpp: max |dlogprob| {diff:.3f}, mean KL {kl:.2e}, top-1 "
          f"{agree}/{len(TEXT)}")
    assert kl < 0.05 and agree >= 20


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int4_safetensors_model_logprobs_close_to_transformers(tiny_models, family):
    # min/max int4 of random tiny weights, int8 head, against transformers' float32 logprobs.
    # Stated tolerance: max |logprob difference| < 0.25 and mean KL < 2e-3 (measured: 0.09
    # and 1e-4); top-1 agrees
    # wherever transformers' top-1 leads its runner-up by more than 0.3. (A random tiny
    # model's top two are often closer than that.)
    path = tiny_models[family]
    model = load_model(resolve_model(path), "auto", torch.float32, "cpu", quantization="int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * model.num_layers
    tokens = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(2))
    want = reference_logits(hf_reference_model(path), tokens).log_softmax(-1)
    got = _logprobs(model, tokens)
    diff = (got - want).abs().max().item()
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    print(f"{family}: max |dlogprob| {diff:.3f}, mean KL {kl:.2e}")
    assert diff < 0.25 and kl < 2e-3
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.3
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_quantization_choices():
    assert EngineConfig.from_dict({}).model.quantization == "auto"
    assert EngineConfig.from_dict({"quantization": "int4"}).model.quantization == "int4"
    with pytest.raises(ValueError, match="--quantization int4: a 8x100 linear"):
        Int4Linear(torch.randn(8, 100))


def test_auto_is_none_for_safetensors(tiny_models):
    model = load_model(resolve_model(tiny_models["llama"]), "auto", torch.float32, "cpu")
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())


def test_bfloat16_kernels_agree_and_do_not_depend_on_the_row_count():
    """``int4_bf16.cpp`` and ``int8_bf16.cpp`` (AVX-512 BF16): the products of bfloat16
    activations and the bfloat16 weights (int4: q * scale + min rounded once; int8: exact),
    summed in float32; each row the same alone or among others (1-15 rows)."""
    if not (packed_kernels.bf16_available("int4_bf16")
            and packed_kernels.bf16_available("int8_bf16")):
        pytest.skip("no AVX-512 BF16 here")
    torch.manual_seed(0)
    x = torch.randn(15, 576).bfloat16()
    layer = Int4Linear(torch.randn(72, 576) * 0.05)
    q = packed_kernels.unpack_int4(layer.packed)
    w = dequantize_int4(q, layer.scale_min[..., 0], layer.scale_min[..., 1]).bfloat16().float()
    alone = torch.cat([packed_kernels.int4_bf16_mm(x[i:i + 1], layer.packed, layer.scale_min)
                       for i in range(15)])
    torch.testing.assert_close(alone, x.float() @ w.T, atol=1e-5, rtol=1e-5)
    for m in range(2, 16):
        assert torch.equal(packed_kernels.int4_bf16_mm(x[:m], layer.packed, layer.scale_min),
                           alone[:m]), m
    assert layer(x[:3]).dtype == torch.bfloat16
    qi = torch.randint(-127, 128, (40, 576), dtype=torch.int8)
    for scales in (torch.rand(40, 1) * 0.01, torch.rand(40, 18) * 0.01):
        w8 = (qi.float().view(40, scales.shape[1], -1) * scales[..., None]).view(40, 576)
        alone = torch.cat([packed_kernels.int8_bf16_mm(x[i:i + 1], qi, scales)
                           for i in range(15)])
        torch.testing.assert_close(alone, x.float() @ w8.T, atol=1e-4, rtol=1e-5)
        for m in range(2, 16):
            assert torch.equal(packed_kernels.int8_bf16_mm(x[:m], qi, scales), alone[:m]), m


def test_bfloat16_prefill_rows_take_the_int8_tiles_or_the_bfloat16_gemm():
    """From ``BF16_GEMM_ROWS`` bfloat16 rows (prefill chunks) an int4 layer multiplies by byte
    dot products over activations rounded to int8 per block (``int4_tile8.cpp``, where AVX-512
    VNNI and BITALG are), the same bits as the GGUF Q4_1 tiles given the same weights as Q4_1
    blocks; else by its weights dequantized to bfloat16 (a GEMM). Below, the row kernel: all
    agree to the activations' rounding."""
    from asyncengine.executor.weights import int4

    if not packed_kernels.bf16_available("int4_bf16"):
        pytest.skip("no AVX-512 BF16 here")
    torch.manual_seed(0)
    n, k = 100, 576  # 6 strips of 16 weight rows and a short one
    layer = Int4Linear(torch.randn(n, k) * 0.05)
    x = torch.randn(int4.BF16_GEMM_ROWS + 8, k).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    w = layer.dequantized().bfloat16()
    gemm = torch.nn.functional.linear(x, w)
    if packed_kernels.int4_tile8_available():
        # the layer's blocks as GGUF Q4_1 ones (d, m, then the 16 bytes of nibbles)
        blocks = torch.cat([layer.scale_min.view(torch.uint8).view(n, k // 32, 4),
                            layer.packed.view(n, k // 32, 16)], dim=2).reshape(n, k // 32 * 20)
        q4_1 = torch.empty(len(x), n, dtype=torch.bfloat16)
        packed_kernels.kquant_mm(x, blocks.contiguous(), 3, q4_1)  # GGML type 3: Q4_1
        assert torch.equal(got.view(torch.int16), q4_1.view(torch.int16))
        torch.testing.assert_close(got.float(), gemm.float(), atol=3e-2, rtol=3e-2)
    else:
        assert torch.equal(got, gemm)
    rows = torch.cat([layer(x[i:i + 8]) for i in range(0, len(x), 8)])  # the row kernel
    torch.testing.assert_close(got.float(), rows.float(), atol=3e-2, rtol=3e-2)


def test_bfloat16_decode_steps_of_many_requests_take_the_int8_tiles():
    """From ``TILE_REQUESTS`` requests in a step (``step_requests``; outside a step, a call's
    rows count as requests) a bfloat16 int4 layer multiplies by the byte tiles at any row
    count; a step of fewer requests keeps the row kernel whatever its rows (a verification's
    drafts are rows of their own), so a row's bits depend on its step's requests only."""
    from asyncengine.executor.weights import int4

    if not (packed_kernels.bf16_available("int4_bf16")
            and packed_kernels.int4_tile8_available()):
        pytest.skip("no AVX-512 BF16 / VNNI tiles here")
    torch.manual_seed(0)
    layer = Int4Linear(torch.randn(100, 576) * 0.05)
    x = torch.randn(int4.TILE_REQUESTS + 4, 576).bfloat16()
    tiles = packed_kernels.int4_tile8_mm(x, layer.packed, layer.scale_min)
    rows = packed_kernels.int4_bf16_mm(x, layer.packed, layer.scale_min).bfloat16()
    assert not torch.equal(tiles, rows)  # the activations' rounding to int8 shows
    torch.testing.assert_close(tiles.float(), rows.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(layer(x), tiles)
    assert torch.equal(layer(x[:int4.TILE_REQUESTS - 1]), rows[:int4.TILE_REQUESTS - 1])
    with int4.step_requests(2):  # two requests verifying their drafts
        assert torch.equal(layer(x), rows)
    with int4.step_requests(int4.TILE_REQUESTS):  # a row's result, whatever beside it
        assert torch.equal(layer(x[:3]), tiles[:3])
    assert int4._Step.requests is None


def test_int8_layers_and_head_take_the_int8_tiles_in_steps_of_many_requests():
    """An int8 layer (the logits head of the embedded model) in bfloat16: from
    ``TILE_REQUESTS`` requests, byte dot products over the activations rounded to int8 per
    block of 32 (``int8_tile8.cpp``): exactly those products, to float32 rounding, per row
    whatever the rows beside it; fewer requests keep the exact-weights row kernel."""
    from asyncengine.executor.weights import int4

    if not (packed_kernels.bf16_available("int8_bf16")
            and packed_kernels.bf16_available("int8_tile8")):
        pytest.skip("no AVX-512 BF16 / VNNI tiles here")
    torch.manual_seed(0)
    n, k = 100, 576  # 6 strips of 16 weight rows and a short one
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x = torch.randn(int4.TILE_REQUESTS + 4, k).bfloat16()
    # the activations as the kernel rounds them, in float32: d = max|x| / 127 per block of 32,
    # x * (1 / d) to nearest even (llama.cpp's Q8_0 activations)
    xb = x.float().view(len(x), k // 32, 32)
    d = xb.abs().amax(dim=2, keepdim=True) / 127
    xq = torch.round(xb * (1 / d)).double()
    d = d.double()
    for scales in (torch.rand(n, 1) * 0.01, torch.rand(n, k // 32) * 0.01):
        w = (q.double().view(n, scales.shape[1], -1) * scales.double()[..., None]).view(n, k)
        want = (xq * d).view(len(x), k) @ w.T
        got = packed_kernels.int8_tile8_mm(x, q, scales)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        alone = torch.cat([packed_kernels.int8_tile8_mm(x[i:i + 1], q, scales)
                           for i in range(len(x))])
        assert torch.equal(alone, got)
    layer = Int8Linear(torch.randn(n, k) * 0.05, float32_out=True)
    tiles = packed_kernels.int8_tile8_mm(x, layer.qweight, layer.scales)
    rows = packed_kernels.int8_bf16_mm(x, layer.qweight, layer.scales)
    assert not torch.equal(tiles, rows)
    assert torch.equal(layer(x), tiles)
    assert torch.equal(layer(x[:3]), rows[:3])
    with int4.step_requests(2):  # two requests verifying their drafts
        assert torch.equal(layer(x), rows)
    with int4.step_requests(int4.TILE_REQUESTS):
        assert torch.equal(layer(x[:3]), tiles[:3])
