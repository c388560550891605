"""AWQ checkpoints (AutoAWQ's 4-bit GEMM format, what vLLM serves as ``awq``): ``qweight``,
``qzeros`` and ``scales``. On the CPU it runs as int4 on its own grid by default (the
weights as stored, within float16's rounding of a block's minimum; logprobs close to
transformers' on the dequantized model); ``--quantization none`` dequantizes it at load, and
the greedy tokens equal transformers' on the dequantized model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine.executor.weights.checkpoint_packed import (
    AWQScheme,
    dequantize_awq_matrix,
    unpack_awq,
)
from asyncengine.executor.weights.checkpoint_quant import dequantize_checkpoint
from tests.executor.test_fp8_checkpoint import check_against_dequantized, check_on_int4_grid
from tests.utils import make_tiny_model

GROUP = 32
#: AutoAWQ's packing: nibble i of a word holds column INTERLEAVE[i] of its group of eight.
INTERLEAVE = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """4-bit values ``[rows, cols]`` -> AWQ's int32 words ``[rows, cols / 8]``."""
    rows, cols = values.shape
    v = values.numpy().astype(np.uint32).reshape(rows, cols // 8, 8)[:, :, INTERLEAVE]
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i in range(8):
        words |= v[:, :, i] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32).copy())


def quantize_awq(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nn.Linear's ``[out, in]`` weight -> qweight, qzeros, scales (asymmetric, per group of
    GROUP inputs), as AutoAWQ stores them."""
    wt = w.float().t()  # [in, out]
    g = wt.reshape(-1, GROUP, wt.shape[1])
    lo, hi = g.amin(1), g.amax(1)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (g / scales[:, None] + zeros[:, None]).round().clamp(0, 15).reshape(wt.shape)
    return pack_awq(q.to(torch.int64)), pack_awq(zeros.to(torch.int64)), scales.half()


def make_awq(base: str, out: Path) -> tuple[str, str]:
    ref = out.parent / f"{out.name}-ref"
    for d in (out, ref):
        shutil.copytree(base, d)
    (st,) = Path(base).glob("*.safetensors")
    quant, deq = {}, {}
    for name, w in load_file(st).items():
        if name.endswith("proj.weight"):
            prefix = name[:-len(".weight")]
            qw, qz, sc = quantize_awq(w)
            quant |= {f"{prefix}.qweight": qw, f"{prefix}.qzeros": qz, f"{prefix}.scales": sc}
            deq[name] = dequantize_awq_matrix(qw, qz, sc, GROUP)
        else:
            quant[name] = deq[name] = w.float()
    save_file(quant, out / st.name, metadata={"format": "pt"})
    save_file(deq, ref / st.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                     "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))
    return str(out), str(ref)


def test_unpacking_reads_autoawq_s_column_order():
    values = torch.arange(16).reshape(1, 16) % 16  # columns 0..15 hold 0..15
    words = pack_awq(values)
    # AutoAWQ: word 0's nibbles hold columns 0, 2, 4, 6, 1, 3, 5, 7 (from the lowest bits)
    nibbles = [(int(words[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(unpack_awq(words), values)
    # a weight within half a step of its group's grid
    w = torch.randn(64, 96)
    qw, qz, sc = quantize_awq(w)
    back = dequantize_awq_matrix(qw, qz, sc, GROUP)
    step = sc.float().repeat_interleave(GROUP, 0).t()
    assert back.shape == w.shape and ((back - w).abs() <= step * 0.5 + 1e-3).all()


def test_awq_checkpoint_gives_transformers_tokens_on_the_dequantized_model(tmp_path):
    base = make_tiny_model(tmp_path / "base", "llama", initializer_range=0.1, hidden_size=64,
                           intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2)
    path, ref = make_awq(base, tmp_path / "awq")
    llm = check_against_dequantized(path, ref, quantization="none")
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    check_on_int4_grid(path, ref)  # the default on the CPU


def test_an_awq_matrix_missing_a_part_is_an_error():
    qw, qz, sc = quantize_awq(torch.randn(8, 64))
    with pytest.raises(ValueError, match="'x' has no qzeros"):
        list(dequantize_checkpoint(iter([("x.qweight", qw), ("x.scales", sc)]),
                                   AWQScheme(GROUP)))
    with pytest.raises(ValueError, match="groups of 16"):
        dequantize_awq_matrix(qw, qz, sc, 16)


def test_vllm_quantization_names_run_a_checkpoint_of_their_format(tmp_path):
    """``vllm serve M --quantization awq`` (or awq_marlin) runs unchanged: the checkpoint's
    own format; another format's name, or fp8 on float weights, names the flag."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.executor.weights.checkpoint_quant import FP8Scheme
    from asyncengine.executor.weights.quantization import from_vllm_method

    assert from_vllm_method("awq_marlin", AWQScheme(128)) == "auto"
    assert from_vllm_method("fp8", FP8Scheme("compressed-tensors")) == "auto"
    assert from_vllm_method("int4", None) == "int4"
    with pytest.raises(ValueError, match="--quantization gptq: .* says 'awq'"):
        from_vllm_method("gptq", AWQScheme(128))
    with pytest.raises(ValueError, match="--quantization fp8: for checkpoints .* at load"):
        from_vllm_method("fp8", None)
    base = make_tiny_model(tmp_path / "base", "llama", initializer_range=0.1, hidden_size=64,
                           intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2)
    path, _ = make_awq(base, tmp_path / "awq")
    auto = LLM(path, dtype="float32", max_model_len=128)
    named = LLM(path, dtype="float32", max_model_len=128, quantization="awq")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in named.generate([[5, 17, 300]], params)] == [
        o.outputs[0].token_ids for o in auto.generate([[5, 17, 300]], params)]
    with pytest.raises(ValueError, match="--quantization gptq_marlin"):
        LLM(path, dtype="float32", max_model_len=128, quantization="gptq_marlin")
