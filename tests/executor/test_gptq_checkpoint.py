"""GPTQ checkpoints (AutoGPTQ / GPTQModel, vLLM's ``gptq``): 4 and 8 bits, the original format
(zeros stored minus one) and ``gptq_v2``, with and without act-order (``g_idx``): dequantized at
load (``--quantization none``, and by default for act-order and 8 bits), the greedy tokens
equal transformers' on the dequantized model; 4 bits in input order run as int4 on their own
grid by default on the CPU. Before, refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine.executor.weights.checkpoint_packed import (
    GPTQScheme,
    dequantize_gptq_matrix,
    unpack_words,
)
from asyncengine.executor.weights.checkpoint_quant import dequantize_checkpoint
from tests.executor.test_fp8_checkpoint import check_against_dequantized, check_on_int4_grid
from tests.utils import make_tiny_model

GROUP = 32


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers -> int32 words, ``32 / bits`` per word along ``dim``, value i at bit i * bits."""
    per = 32 // bits
    v = values.numpy().astype(np.uint32)
    if dim == 0:
        v = v.reshape(v.shape[0] // per, per, v.shape[1]).transpose(0, 2, 1)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per, per)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for i in range(per):
        words |= v[..., i] << np.uint32(bits * i)
    return torch.from_numpy(words.view(np.int32).copy())


def quantize_gptq(w: torch.Tensor, bits: int, offset: int, g_idx: torch.Tensor):
    """nn.Linear's ``[out, in]`` weight -> qweight, qzeros, scales (asymmetric; row k in group
    g_idx[k]), as the GPTQ packers store them."""
    wt = w.float().t()  # [in, out]
    top = 2**bits - 1
    groups = int(g_idx.max()) + 1
    scales = torch.zeros(groups, wt.shape[1])
    zeros = torch.zeros(groups, wt.shape[1])
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.amin(0), rows.amax(0)
        scales[g] = ((hi - lo) / top).clamp(min=1e-6)
        zeros[g] = (-lo / scales[g]).round().clamp(offset, top)  # v1 stores zero - 1 >= 0
    q = (wt / scales[g_idx] + zeros[g_idx]).round().clamp(0, top)
    return (pack(q.to(torch.int64), bits, 0), pack((zeros - offset).to(torch.int64), bits, 1),
            scales.half())


def make_gptq(base: str, out: Path, bits: int, fmt: str, act_order: bool) -> tuple[str, str]:
    ref = out.parent / f"{out.name}-ref"
    for d in (out, ref):
        shutil.copytree(base, d)
    (st,) = Path(base).glob("*.safetensors")
    scheme = GPTQScheme(bits, GROUP, 0 if fmt == "gptq_v2" else 1, act_order)
    gen = torch.Generator().manual_seed(0)
    quant, deq = {}, {}
    for name, w in load_file(st).items():
        if name.endswith("proj.weight"):
            prefix, rows = name[:-len(".weight")], w.shape[1]
            g_idx = torch.arange(rows, dtype=torch.int32) // GROUP
            if act_order:  # act-order: the rows' groups in another order
                g_idx = g_idx[torch.randperm(rows, generator=gen)]
            qw, qz, sc = quantize_gptq(w, bits, scheme.zero_offset, g_idx)
            parts = {"qweight": qw, "qzeros": qz, "scales": sc, "g_idx": g_idx}
            quant |= {f"{prefix}.{k}": v for k, v in parts.items()}
            deq[name] = dequantize_gptq_matrix(parts, scheme)
        else:
            quant[name] = deq[name] = w.float()
    save_file(quant, out / st.name, metadata={"format": "pt"})
    save_file(deq, ref / st.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": GROUP,
                                     "desc_act": act_order, "sym": False,
                                     "checkpoint_format": fmt}
    (out / "config.json").write_text(json.dumps(config))
    return str(out), str(ref)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("gptq") / "base", "llama",
                           initializer_range=0.1, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def test_unpacking_along_rows_and_columns():
    values = torch.randint(0, 16, (16, 24))
    assert torch.equal(unpack_words(pack(values, 4, 0), 4, 0), values)
    assert torch.equal(unpack_words(pack(values, 4, 1), 4, 1), values)
    values = torch.randint(0, 256, (8, 12))
    assert torch.equal(unpack_words(pack(values, 8, 0), 8, 0), values)
    # value i of a word at bits 4i: the word of rows 0..7 holding 1, 2, ..., 8
    assert int(pack(torch.arange(1, 9).reshape(8, 1), 4, 0)[0, 0]) & 0xFFFFFFFF == 0x87654321


@pytest.mark.parametrize("bits, fmt, act_order", [(4, "gptq", False), (4, "gptq", True),
                                                  (4, "gptq_v2", False), (8, "gptq", True)])
def test_gptq_checkpoint_gives_transformers_tokens_on_the_dequantized_model(
        base, tmp_path, bits, fmt, act_order):
    path, ref = make_gptq(base, tmp_path / "q", bits, fmt, act_order)
    # 4 bits in input order run as int4 on their own grid by default on the CPU; act-order
    # (groups scattered across int4's blocks) and 8 bits are dequantized
    packed = bits == 4 and not act_order
    llm = check_against_dequantized(path, ref, quantization="none" if packed else "auto")
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    if packed:
        check_on_int4_grid(path, ref)


def test_act_order_needs_g_idx_and_the_zeros_offset_matters():
    w = torch.randn(8, 64)
    g_idx = torch.arange(64, dtype=torch.int32) // GROUP
    qw, qz, sc = quantize_gptq(w, 4, 1, g_idx)
    scheme = GPTQScheme(4, GROUP, 1, act_order=True)
    with pytest.raises(ValueError, match="'x' has no g_idx"):
        list(dequantize_checkpoint(iter([("x.qweight", qw), ("x.qzeros", qz),
                                         ("x.scales", sc)]), scheme))
    parts = {"qweight": qw, "qzeros": qz, "scales": sc}
    v1 = dequantize_gptq_matrix(parts, GPTQScheme(4, GROUP, 1))
    v2 = dequantize_gptq_matrix(parts, GPTQScheme(4, GROUP, 0))
    step = sc.float().repeat_interleave(GROUP, 0).t()
    assert ((v1 - w).abs() <= step * 0.5 + 1e-3).all()  # the original format: zero - 1
    assert torch.allclose(v2 - v1, step)  # read as gptq_v2, every value one step off


def test_int4_grid_takes_groups_that_tile_blocks_of_32():
    from asyncengine.executor.weights.checkpoint_packed import int4_grid

    zeros = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [groups, out]
    scales = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    g_idx = torch.tensor([1] * 32 + [0] * 32)  # whole blocks of 32, in any order
    grid = int4_grid(zeros, scales, g_idx)
    assert grid.kind == "q4"
    assert grid.scale.tolist() == [[1.0, 0.5], [2.0, 0.25]]  # [out, blocks]
    assert grid.other.tolist() == [[-3.0, -0.5], [-8.0, -0.5]]  # -zero * scale
    assert int4_grid(zeros, scales, torch.arange(64) % 2) is None  # scattered (act-order)
    assert int4_grid(zeros, scales, torch.zeros(48, dtype=torch.int64)) is None  # 48 inputs


def test_auto_packs_4_bit_checkpoints_whose_groups_tile_int4_blocks():
    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.weights.checkpoint_quant import AWQScheme, FP8Scheme
    from asyncengine.executor.weights.quantization import resolve_auto

    cpu = torch.device("cpu")
    kernels = packed_kernels.available("int4") and packed_kernels.available("int8")
    for scheme in (AWQScheme(128), AWQScheme(32), GPTQScheme(4, 128, 1), GPTQScheme(4, -1, 0)):
        assert resolve_auto("auto", "safetensors", cpu, set(), scheme) == (
            "int4" if kernels else "none")
    for scheme in (AWQScheme(16), GPTQScheme(4, 128, 1, act_order=True), GPTQScheme(8, 128, 1),
                   FP8Scheme("fp8", (128, 128)), None):
        assert resolve_auto("auto", "safetensors", cpu, set(), scheme) == "none"
    assert resolve_auto("auto", "safetensors", torch.device("cuda"), set(),
                        AWQScheme(128)) == "none"  # no int4 kernels on CUDA: dequantized
    assert resolve_auto("none", "safetensors", cpu, set(), AWQScheme(128)) == "none"
