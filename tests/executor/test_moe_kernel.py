"""The experts' kernel (``kernels/moe.cpp``, ``kernels/moe512.h``) against float64 references:
float32 experts up to the order of summation, int8 (a scale per row or per block of 32) and int4
experts up to the rounding of the activations; the 512-bit tiles where the CPU has AVX-512
VNNI, the portable path built without them."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.models import moe
from asyncengine.executor.models.moe import SparseMoE


def _layer(E: int = 8, k: int = 3, H: int = 64, n_inter: int = 96) -> SparseMoE:
    from types import SimpleNamespace

    from asyncengine.executor.models.family import MoESpec

    spec = SimpleNamespace(moe=MoESpec(E, k, n_inter, renormalize=False), activation="silu",
                           hidden=H, family="test")
    layer = SparseMoE(spec)
    gen = torch.Generator().manual_seed(1)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer


def _reference(layer: SparseMoE, x: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """The layer token by token, expert by expert, in float64, with weights w13 / w2;
    ``bf16``: silu(gate) * up rounded to bfloat16, as a bfloat16 model's activations are."""
    want = torch.zeros(x.shape, dtype=torch.float64)
    weights, experts = layer.route(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            a = torch.nn.functional.silu(gate) * up
            a = a.bfloat16().double() if bf16 else a
            want[t] += w * (w2[e].double() @ a)
    return want


def _quantize(layer: SparseMoE, method: str) -> None:
    """``method``: float32 (nothing), bfloat16 weights, int8 / int4 (``quantize_experts``), or
    int8-blocks: int8 with a scale per block of 32 inputs, as a GGUF file's Q8_0 experts are
    kept."""
    if method == "float32":
        return
    if method == "bfloat16":  # the CPU's default dtype where it has bfloat16 dot products
        for name in ("w13", "w2"):
            getattr(layer, name).data = getattr(layer, name).data.bfloat16()
        return
    floats = {name: getattr(layer, name).data.clone() for name in ("w13", "w2")}
    layer.quantize_experts(method.split("-")[0])
    if method != "int8-blocks":
        return
    for name, w in floats.items():
        E, N, K = w.shape
        blocks = w.view(E, N, K // 32, 32)
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        setattr(layer, name, torch.round(blocks / scale).clamp(-127, 127).to(torch.int8)
                .view(E, N, K))
        setattr(layer, f"{name}_scale", scale.view(E, N, K // 32))


@pytest.mark.parametrize("method", ["float32", "int8", "int4"])
def test_packed_experts_equal_their_dequantized_weights(method):
    """The kernel on packed experts equals, per token, a plain reference loop over the
    dequantized weights; 1, 3 and 40 tokens (decode rows and prefill groups). float32 up to
    the order of summation; int8 / int4 up to the rounding of the activations (per row to
    int16, or twice to int8: ~1e-5 of a row's maximum an element), which moves the output by
    ~1e-4 of its norm, a hundredth of what the weights' own rounding moves it."""
    layer = _layer()
    if method != "float32":
        layer.quantize_experts(method)
        assert layer.quant == method and layer.w13.dtype in (torch.int8, torch.uint8)
    w13, w2 = layer.dequantized("w13"), layer.dequantized("w2")
    for T in (1, 3, 40):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        want = _reference(layer, x, w13, w2).float()
        if method == "float32":
            torch.testing.assert_close(layer(x), want, atol=2e-5, rtol=1e-4)
        else:
            assert (layer(x) - want).norm() / want.norm() < 1e-3


@pytest.mark.parametrize("method", ["float32", "bfloat16", "int8", "int8-blocks", "int4"])
@pytest.mark.parametrize("shape", [(64, 8, 512, 128), (8, 2, 72, 40), (6, 2, 96, 32)],
                         ids=["qwen3-moe-shaped", "ragged", "odd-blocks"])
def test_expert_tiles_against_a_float_reference(method, shape, monkeypatch):
    """The kernel's tiles (4 weight rows x up to 4 routed rows; AVX-512 with byte / int16 dot
    products where the CPU has VNNI) against float64 references: the benchmark's shape, and
    shapes with ragged vector tails (72, 40) and an odd number of int4 blocks (96 = 3, 32 = 1),
    1 to 33 tokens (groups of every size mod 4). Quantized experts: within 1e-3 of the output
    of their dequantized weights, and the float weights' output within the error budget of
    their bits (what a user accepts choosing int8 / int4), the kernel's own share of it under
    5%."""
    E, k, H, n_inter = shape
    layer = _layer(E, k, H, n_inter)
    float13, float2 = layer.w13.data.clone(), layer.w2.data.clone()
    if method in ("int4", "int8-blocks") and not (H % 32 == 0 and n_inter % 32 == 0):
        return  # blocks of 32 need multiples of 32
    _quantize(layer, method)
    assert layer.quant == {"bfloat16": "float32"}.get(method, method.split("-")[0])
    w13, w2 = layer.dequantized("w13"), layer.dequantized("w2")
    calls = []
    real = moe.kernel()
    assert real is not None

    def counting(*args):
        calls.extend([args] if args[9] else [])  # not wide_tiles()'s query (no tokens)
        return real(*args)

    monkeypatch.setattr(moe, "kernel", lambda: counting)
    for T in (1, 2, 5, 8, 33):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + T))
        if method == "bfloat16":  # a bfloat16 model's activations
            x = x.bfloat16().float()
        got = layer(x).double()
        exact = _reference(layer, x, w13, w2)
        if method == "float32":
            torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-4)
            continue
        if method == "bfloat16":  # bfloat16 dot products: silu(gate) * up rounded as a
            # bfloat16 model rounds it (where the CPU has them; else float32 arithmetic)
            rounded = _reference(layer, x, w13, w2, bf16=True)
            err = min(((got - ref).norm() / ref.norm()).item() for ref in (rounded, exact))
            assert err < 1e-4, (T, err)
            continue
        own = ((got - exact).norm() / exact.norm()).item()
        budget = ((exact - _reference(layer, x, float13, float2)).norm()
                  / exact.norm()).item()
        assert own < 1e-3, (T, own)
        assert budget < {"int8": 0.03, "int8-blocks": 0.03, "int4": 0.3}[method], (T, budget)
        assert own < 0.05 * budget, (T, own, budget)
    # one kernel call each (bfloat16 experts: with the 512-bit tiles, else torch's grouped_mm)
    assert len(calls) == (5 if method != "bfloat16" or moe.wide_tiles() else 0)


@pytest.mark.parametrize("method", ["float32", "int8", "int8-blocks", "int4"])
def test_the_portable_path_without_the_512_bit_tiles(method, tmp_path, monkeypatch):
    """The kernel built without its AVX-512 tiles (``AE_MOE_NO512``: the AVX2 / plain C++
    path of CPUs without VNNI) gives the dequantized weights' output too."""
    import shutil

    from asyncengine.executor.kernels import build

    shutil.copytree(build.kernel_dir(), tmp_path / "k")
    src = tmp_path / "k" / "moe.cpp"
    src.write_text("#define AE_MOE_NO512 1\n" + src.read_text())
    portable = build.load("moe", moe._ARGS, None, tmp_path / "k")
    assert portable is not None
    monkeypatch.setattr(moe, "kernel", lambda: portable)
    flag, none = torch.zeros(1), torch.zeros(2, dtype=torch.int64)
    portable(flag, none, none, flag, none, none, none, none, flag, 0, 1, 1, 8, 8, 0, 0, 0)
    assert flag.item() == 0
    layer = _layer()
    _quantize(layer, method)
    w13, w2 = layer.dequantized("w13"), layer.dequantized("w2")
    for T in (1, 3, 40):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(layer(x), _reference(layer, x, w13, w2).float(), atol=2e-5,
                                   rtol=1e-4)


@pytest.mark.parametrize("method", ["float32", "bfloat16", "int8", "int4"])
def test_a_token_that_is_not_finite_stays_in_its_row(method):
    """A NaN or infinite activation makes its own token's output NaN / non-finite, as float
    arithmetic does, and leaves the other tokens' alone (the rounded rows carry it)."""
    layer = _layer(64, 8, 512, 128)
    _quantize(layer, method)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(9))
    x[1, 7], x[4, 100] = float("nan"), float("inf")
    routes = layer.route(x.nan_to_num(0.0, 0.0, 0.0))
    layer.route = lambda _x: routes  # the router itself would spread the NaN
    out = layer(x)
    assert not out[1].isfinite().any() and not out[4].isfinite().all()
    assert out[[0, 2, 3, 5]].isfinite().all()


def test_the_cpu_with_vnni_takes_the_512_bit_tiles():
    """Where the CPU has AVX-512 VNNI (inductor builds the kernels for this CPU), the kernel
    reports its 512-bit tiles compiled in; elsewhere the AVX2 / plain C++ path runs."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":")[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        pass
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags):
        pytest.skip("no AVX-512 VNNI here")
    assert moe.wide_tiles()
