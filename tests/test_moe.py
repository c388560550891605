"""Mixtures of experts give transformers' greedy tokens: Qwen3-MoE and Mixtral (the top-k
renormalized), Qwen2-MoE (not renormalized, a shared expert), from safetensors
and from an F32 GGUF with llama.cpp's MoE tensors (``ffn_gate_inp``, ``ffn_*_exps``; Mixtral
as ``llama`` with an ``expert_count``), under chunked prefill, preemption and prefix hits.
The experts run as one C++ call per layer over tokens sorted by expert, also on packed int8 /
int4 weights, equal to the dequantized weights' result; torch's grouped_mm where the kernel
does not build."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncengine.executor.models import moe
from asyncengine.executor.models.family import describe
from asyncengine.executor.models.loader import load_model, resolve_model
from asyncengine.executor.models.moe import SparseMoE
from tests.test_families import check_greedy_in_the_engine
from tests.test_models import PagedRunner, reference_logits
from tests.utils import FAMILIES as ALL_FAMILIES
from tests.utils import hf_reference_model, make_tiny_gguf, make_tiny_model, tiny_config

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (safetensors directory, GGUF file)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        # std 0.1: routing decided by clear margins, and a wrong expert moves the tokens
        d = make_tiny_model(root / family, family, initializer_range=0.1)
        out[family] = (d, make_tiny_gguf(d, root / f"{family}.gguf"))
    return out


def test_the_families_read_as_mixtures(models):
    from transformers import AutoConfig

    specs = {f: describe(AutoConfig.from_pretrained(models[f][0])) for f in FAMILIES}
    assert specs["qwen3_moe"].moe.renormalize and specs["mixtral"].moe.renormalize
    assert not specs["qwen2_moe"].moe.renormalize  # norm_topk_prob false
    assert specs["qwen2_moe"].moe.shared_intermediate == 64
    assert specs["qwen3_moe"].qk_norm and specs["qwen3_moe"].moe.num_experts == 8


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(models, family, fmt):
    directory, gguf = models[family]
    check_greedy_in_the_engine(directory, directory if fmt == "safetensors" else gguf)


def test_one_kernel_call_per_layer_and_the_torch_path(models, monkeypatch, caplog):
    """A prefill and decodes through the paged runner equal transformers' logits, with one
    C++ call per layer per step whatever the number of tokens; with the kernel unavailable,
    torch's grouped path gives the same logits and says so once in the log."""
    directory, gguf = models["qwen2_moe"]
    tokens = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(5))
    want = reference_logits(hf_reference_model(directory), tokens)
    model = load_model(resolve_model(gguf), "auto", torch.float32, "cpu")
    calls = []
    real = moe.kernel()
    assert real is not None

    def counting(*args):
        calls.append(args[9])  # T: the step's tokens
        return real(*args)

    monkeypatch.setattr(moe, "kernel", lambda: counting)
    runner = PagedRunner(model, block_size=4)
    got = [runner.step({"r": tokens[:12]})["r"]]
    got += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    assert calls == [12] * model.num_layers + [1] * model.num_layers * 8

    monkeypatch.setattr(moe, "kernel", lambda: None)
    monkeypatch.setattr(moe, "_warned", set())
    with caplog.at_level(logging.INFO, logger=moe.__name__):
        runner = PagedRunner(model, block_size=4)
        got = [runner.step({"r": tokens[:12]})["r"]]
        got += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    assert len([r for r in caplog.records if "grouped_mm" in r.message]) == 1


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
               w2: torch.Tensor) -> torch.Tensor:
    """The layer token by token, expert by expert, in float64, with weights w13 / w2."""
    want = torch.zeros(x.shape, dtype=torch.float64)
    weights, experts = layer.route(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            want[t] += w * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return want


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


@pytest.mark.parametrize("method", ["float32", "int8", "int4"])
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
    if method != "float32":
        layer.quantize_experts(method)
    if method == "int4" and not (H % 32 == 0 and n_inter % 32 == 0):
        assert layer.quant == "float32"  # int4 takes multiples of 32 only
        return
    assert layer.quant == method
    w13, w2 = layer.dequantized("w13"), layer.dequantized("w2")
    calls = []
    real = moe.kernel()
    assert real is not None

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(moe, "kernel", lambda: counting)
    for T in (1, 2, 5, 8, 33):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + T))
        got = layer(x).double()
        exact = _reference(layer, x, w13, w2)
        if method == "float32":
            torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-4)
            continue
        own = ((got - exact).norm() / exact.norm()).item()
        budget = ((exact - _reference(layer, x, float13, float2)).norm()
                  / exact.norm()).item()
        assert own < 1e-3, (T, own)
        assert budget < {"int8": 0.03, "int4": 0.3}[method], (T, budget)
        assert own < 0.05 * budget, (T, own, budget)
    assert len(calls) == 5  # one kernel call each


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


def test_int4_and_int8_experts_stay_near_the_float_model(models):
    """--quantization int8 / int4 pack the experts too, and the logits stay near the float
    model's (the error budget of 8 and 4 bits, not a wrong expert layout)."""
    directory = models["qwen3_moe"][0]
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(2))
    ref = PagedRunner(load_model(resolve_model(directory), "auto", torch.float32, "cpu"))
    want = ref.step({"r": tokens})["r"]
    for method, tol in (("int8", 0.05), ("int4", 0.3)):
        model = load_model(resolve_model(directory), "auto", torch.float32, "cpu",
                           quantization=method)
        assert {m.quant for m in model.modules() if isinstance(m, SparseMoE)} == {method}
        got = PagedRunner(model).step({"r": tokens})["r"]
        err = (got - want).abs().mean() / want.abs().mean()
        assert err < tol, (method, err)


def test_each_family_says_which_fast_path_it_lacks_in_one_line(caplog):
    """Every family either takes the C++ decode stack, --compile, tensor parallelism and the
    greedy head, or its description names the one it lacks and loading it says so in one
    log line; --tensor-parallel-size on a family that lacks it is refused naming the flag."""
    from asyncengine.executor.models import decoder

    known = {"decode_stack", "compile", "tensor_parallel", "greedy_head"}
    for family in ALL_FAMILIES:
        config = tiny_config(family, vocab_size=256)
        lacks = describe(config).lacks()
        assert set(lacks) <= known, family
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=decoder.__name__):
            decoder.CausalLM(config)
        lines = [r.message for r in caplog.records if "fast paths" in r.message]
        assert len(lines) == (1 if lacks else 0), (family, lines)
        for path in lacks:
            assert path in lines[0]
    assert "tensor_parallel" in describe(tiny_config("mixtral")).lacks()
    assert "greedy_head" in describe(tiny_config("gemma2")).lacks()
    assert not describe(tiny_config("llama")).lacks()
