"""FP8 checkpoints (compressed-tensors, fp8, fbgemm_fp8), as vLLM serves them: their float8
matrices are dequantized at load, and the greedy tokens equal transformers' on the dequantized
model. Before this, such a checkpoint loaded silently with its scales ignored (wrong tokens).
Other quantization methods are refused, naming the method (AWQ:
tests/executor/test_awq_checkpoint.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import LLM, SamplingParams
from asyncengine.executor.weights.checkpoint_quant import FP8Scheme, dequantize, dequantize_fp8
from tests.engine.test_engine import hf_greedy
from tests.utils import hf_reference_model, make_tiny_model

FP8_MAX = 448.0
# intermediate 96 in blocks of 64: partial blocks at the edges of the MLP's matrices
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)
CT_GROUP = {"targets": ["Linear"], "input_activations": {
    "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}}


def quantize(w: torch.Tensor, how: str, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 weight and its scale: per tensor, per channel (row) or per block."""
    w = w.float()
    if how == "tensor":
        scale = w.abs().amax().reshape(1) / FP8_MAX
        full = scale
    elif how == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale
    else:
        rows, cols = w.shape
        nr, nc = -(-rows // block), -(-cols // block)
        scale = torch.zeros(nr, nc)
        for i in range(nr):
            for j in range(nc):
                tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                scale[i, j] = tile.abs().amax() / FP8_MAX
        full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def make_fp8(base: str, out: Path, method: str, how: str) -> tuple[str, str]:
    """An FP8 copy of ``base`` and a float32 copy of what it dequantizes to (the reference)."""
    ref = out.parent / f"{out.name}-ref"
    for d in (out, ref):
        shutil.copytree(base, d)
    (st,) = Path(base).glob("*.safetensors")
    weights = load_file(st)
    quant, deq = {}, {}
    suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            q, scale = quantize(w, how)
            quant[name], quant[name[:-len("weight")] + suffix] = q, scale
            quant[name[:-len("weight")] + "input_scale"] = torch.ones(1)  # dropped
            deq[name] = dequantize(q, scale, (64, 64) if how == "block" else None)
        else:
            quant[name] = deq[name] = w.float()
    # the scales first, in a shard of their own: a scale may come before its weight
    index = {"metadata": {}, "weight_map": {}}
    (out / st.name).unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in quant.items()
                                                   if "scale" in k},
              "model-00002-of-00002.safetensors": {k: v for k, v in quant.items()
                                                   if "scale" not in k}}
    for file, tensors in shards.items():
        save_file(tensors, out / file, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, file))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(deq, ref / st.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if method == "compressed-tensors":
        qc = {"quant_method": method, "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {**CT_GROUP, "weights": {
                  "num_bits": 8, "type": "float", "strategy": how, "symmetric": True,
                  "dynamic": False}}}}
    elif method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [64, 64]}
    else:
        qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    return str(out), str(ref)


def check_against_dequantized(path: str, ref: str, **kw) -> LLM:
    """A quantized checkpoint at ``path`` gives the greedy tokens transformers gives on
    ``ref`` (what it dequantizes to), and loads exactly ``ref``'s matrices. ``kw``: more
    ``LLM`` arguments (``quantization="none"``: a 4-bit checkpoint dequantized)."""
    llm = LLM(path, dtype="float32", max_model_len=128, **kw)
    prompts = [[5, 17, 300, 42, 7], list(range(100, 130))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                ignore_eos=True))
    hf = hf_reference_model(ref)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 16)[0]
    # the matrices loaded are the dequantized ones, exactly (the scales were applied)
    loaded = dict(llm.engine.runner.model.named_parameters())
    want = load_file(next(Path(ref).glob("*.safetensors")))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(loaded[name], want[name])
    return llm


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "base", "llama",
                           initializer_range=0.1, **SHAPE)


@pytest.mark.parametrize("method, how", [("compressed-tensors", "channel"),
                                         ("compressed-tensors", "tensor"),
                                         ("fp8", "block"), ("fbgemm_fp8", "channel")])
def test_fp8_checkpoint_gives_transformers_tokens_on_the_dequantized_model(
        base, tmp_path, method, how):
    path, ref = make_fp8(base, tmp_path / "m", method, how)
    llm = check_against_dequantized(path, ref)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_an_fp8_checkpoint_packs_with_int8(base, tmp_path):
    path, _ = make_fp8(base, tmp_path / "m", "compressed-tensors", "channel")
    llm = LLM(path, dtype="float32", max_model_len=128, quantization="int8")
    out = llm.generate([[5, 17, 300]], SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "3 bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                          "strategy": "group"}}}}, "'pack-quantized'"),
    ({"quant_method": "fp8"}, "weight_block_size"),
])
def test_other_quantized_checkpoints_are_refused_naming_the_method(base, tmp_path, qc, words):
    path = tmp_path / "q"
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words):
        LLM(str(path), dtype="float32", max_model_len=128)


def test_a_float8_weight_without_its_scale_is_an_error():
    w = torch.ones(4, 4).to(torch.float8_e4m3fn)
    scheme = FP8Scheme("compressed-tensors")
    with pytest.raises(ValueError, match="'a.weight' has no weight_scale"):
        list(dequantize_fp8(iter([("a.weight", w)]), scheme))
    with pytest.raises(ValueError, match="not a float8 weight"):
        list(dequantize_fp8(iter([("b.weight_scale", torch.ones(1))]), scheme))
    # a scale per block, the last ones partial; a scale of the wrong shape is refused
    got = dequantize(torch.ones(3, 5).to(torch.float8_e4m3fn), torch.tensor([[2.0, 3.0],
                                                                             [4.0, 5.0]]),
                     (2, 4))
    assert got.tolist() == [[2, 2, 2, 2, 3], [2, 2, 2, 2, 3], [4, 4, 4, 4, 5]]
    with pytest.raises(ValueError, match="expected \\(2, 2\\)"):
        dequantize(torch.ones(3, 5).to(torch.float8_e4m3fn), torch.ones(1, 2), (2, 4))


def test_an_fp8_checkpoint_on_two_tensor_parallel_ranks(base, tmp_path):
    """Each rank dequantizes whole float8 matrices, then takes its shard: the tokens are the
    dequantized model's."""
    from tests.executor.test_tensor_parallel import stop_workers

    path, ref = make_fp8(base, tmp_path / "m", "fp8", "block")
    tp2 = LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        prompt = list(range(100, 130))
        out = tp2.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
        assert out[0].outputs[0].token_ids == hf_greedy(hf_reference_model(ref), prompt, 12)[0]
    finally:
        stop_workers(tp2)


def check_on_int4_grid(path: str, ref: str) -> None:
    """A 4-bit AWQ / GPTQ checkpoint on the CPU runs packed by default (``--quantization
    auto``): every decoder linear int4 on the checkpoint's own grid (the weights its own
    within float16's rounding of a block's minimum, 2**-11 of it), and logprobs close to
    transformers' on the dequantized model (test_int4.py's tolerances for int4 with the int8
    head: the kernel rounds activations to int8 per block, as llama.cpp does)."""
    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.weights.int4 import GROUP, Int4Linear
    from asyncengine.executor.weights.loader import load_model, resolve_model
    from tests.executor.test_models import PagedRunner, reference_logits

    if not (packed_kernels.available("int4") and packed_kernels.available("int8")):
        pytest.skip("the packed CPU kernels do not build here")
    model = load_model(resolve_model(path), "auto", torch.float32, "cpu", quantization="auto")
    linears = [m for layer in model.model.layers for m in layer.modules()
               if isinstance(m, Int4Linear)]
    assert len(linears) == 4 * model.num_layers
    want = load_file(next(Path(ref).glob("*.safetensors")))
    for name in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        layer = model.get_submodule(name)
        low = layer.scale_min[..., 1].float().abs().repeat_interleave(GROUP, 1)
        diff = (layer.dequantized() - want[f"{name}.weight"]).abs()
        assert (diff <= low * 2**-11 + 1e-7).all(), float((diff / (low + 1e-9)).max())
    tokens = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(2))
    expected = reference_logits(hf_reference_model(ref), tokens).log_softmax(-1)
    got = torch.cat([PagedRunner(model).step({"r": tokens})["r"]]).log_softmax(-1)
    assert (got - expected).abs().max().item() < 0.25
    assert (expected.exp() * (expected - got)).sum(-1).mean().item() < 2e-3
