"""Mixtures of experts give transformers' greedy tokens: Qwen3-MoE and Mixtral (the top-k
renormalized), Qwen2-MoE (not renormalized, a shared expert), from safetensors
and from an F32 GGUF with llama.cpp's MoE tensors (``ffn_gate_inp``, ``ffn_*_exps``; Mixtral
as ``llama`` with an ``expert_count``), under chunked prefill, preemption and prefix hits.
The experts run as one C++ call per layer over tokens sorted by expert, also on packed int8 /
int4 weights (the kernel itself: ``test_moe_kernel.py``); a GGUF file's Q8_0 / Q4_0 experts
kept as stored; torch's grouped_mm where the kernel does not build."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from asyncengine.executor.models import moe
from asyncengine.executor.models.family import describe
from asyncengine.executor.models.moe import SparseMoE
from asyncengine.executor.weights.loader import load_model, resolve_model
from tests.executor.test_families import check_greedy_in_the_engine
from tests.executor.test_models import PagedRunner, reference_logits
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


def test_bfloat16_experts_take_the_kernel_near_the_float_model(models, monkeypatch):
    """bfloat16 weights (the CPU's --dtype auto where it has bfloat16 dot products) run their
    experts through the kernel where it has its 512-bit tiles, as near the float32 model's
    logits as torch's grouped_mm in bfloat16 is."""
    directory = models["qwen3_moe"][0]
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(4))
    want = PagedRunner(load_model(resolve_model(directory), "auto", torch.float32, "cpu")
                       ).step({"r": tokens})["r"]
    model = load_model(resolve_model(directory), "auto", torch.bfloat16, "cpu")
    calls = []
    real = moe.kernel()

    def counting(*args):
        calls.extend([args] if args[9] else [])
        return real(*args)

    monkeypatch.setattr(moe, "kernel", lambda: counting)
    got = PagedRunner(model).step({"r": tokens})["r"].float()
    assert len(calls) == (model.num_layers if moe.wide_tiles() else 0)
    monkeypatch.setattr(moe, "kernel", lambda: None)
    torch_path = PagedRunner(model).step({"r": tokens})["r"].float()
    err = ((got - want).abs().mean() / want.abs().mean()).item()
    ref = ((torch_path - want).abs().mean() / want.abs().mean()).item()
    assert err < max(2 * ref, 0.02), (err, ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_experts_are_kept_as_stored(models, tmp_path, qtype):
    """A GGUF file with Q8_0 (Q4_0) matrices and experts runs them packed by default: the
    experts on the file's own blocks (int8 with its scale per block of 32), their weights
    exactly the file's (what ``--quantization none`` dequantizes), not a re-quantization of
    them; the logits stay near the dequantized model's, the same greedy tokens."""
    gguf = make_tiny_gguf(models["qwen3_moe"][0], tmp_path / f"{qtype}.gguf", quant=qtype)
    packed = load_model(resolve_model(gguf), "auto", torch.float32, "cpu", quantization="auto")
    plain = load_model(resolve_model(gguf), "auto", torch.float32, "cpu", quantization="none")
    method = {"Q8_0": "int8", "Q4_0": "int4"}[qtype]
    pairs = list(zip([m for m in packed.modules() if isinstance(m, SparseMoE)],
                     [m for m in plain.modules() if isinstance(m, SparseMoE)], strict=True))
    assert pairs
    for mine, theirs in pairs:
        assert mine.quant == method and theirs.quant == "float32"
        if method == "int8":
            assert mine.w13_scale.shape == (8, 2 * mine.intermediate, mine.hidden // 32)
        for name in ("w13", "w2"):
            assert torch.equal(mine.dequantized(name), getattr(theirs, name).data), name
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(3))
    want = PagedRunner(plain).step({"r": tokens})["r"]
    got = PagedRunner(packed).step({"r": tokens})["r"]
    # Q4_0: the logits head is int8, quantized from the file's Q4_0 embedding (--quantization
    # int4's head), which moves the logits by ~0.5%; Q8_0's head is the embedding's own blocks
    tol = {"Q8_0": 2e-3, "Q4_0": 0.02}[qtype]
    assert ((got - want).abs().mean() / want.abs().mean()).item() < tol
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_each_family_says_which_fast_path_it_lacks_in_one_line(caplog, monkeypatch):
    """Every built-in family takes the C++ decode stack (its description is the stack's
    input), --compile, tensor parallelism and the greedy head. A family description that lacks
    one names it, the chooser's one log line of step paths says why it passed that path over,
    and --tensor-parallel-size on it is refused naming the flag."""
    from asyncengine.config import EngineConfig
    from asyncengine.executor import build
    from asyncengine.executor.models import decoder
    from asyncengine.executor.models.family import ModelSpec
    from asyncengine.executor.paths.base import PathContext
    from asyncengine.executor.paths.choose import choose
    from asyncengine.executor.paths.compiled import Compiled

    for family in ALL_FAMILIES:
        assert describe(tiny_config(family, vocab_size=256)).lacks() == {}, family
    lacks = {"compile": "not traceable", "tensor_parallel": "not sharded",
             "greedy_head": "its head is not plain"}
    monkeypatch.setattr(ModelSpec, "lacks", lambda self: dict(lacks))
    hf_config = tiny_config("gemma2", vocab_size=256)
    runner = types.SimpleNamespace(model=decoder.CausalLM(hf_config), attn_backend=None,
                                   device=torch.device("cpu"))
    cpu = types.SimpleNamespace(type="cpu")
    with caplog.at_level(logging.INFO, logger="asyncengine"):
        plan = choose(PathContext(runner, cpu, EngineConfig.from_dict({})))
    (line,) = [r.message for r in caplog.records if r.message.startswith("step paths")]
    assert lacks["greedy_head"] in line, line
    with_compile = EngineConfig.from_dict({"compile": True})
    assert Compiled.why_not(PathContext(runner, cpu, with_compile)) == lacks["compile"]
    assert [p.name for p in plan.chains["decode"]] == ["eager"]
    assert runner.greedy_head is False
    with pytest.raises(ValueError, match="--tensor-parallel-size: not sharded"):
        build._check_family_supports(hf_config, "tensor_parallel", "--tensor-parallel-size")
