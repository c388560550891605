"""GGUF checkpoints: tensors by transformers name, dequantized (one tensor at a time, with
``gguf.quants.dequantize``, from the memory-mapped file) or kept packed (``read_packed``).
The header and the config: ``gguf_header.py``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncengine.executor.weights import gguf_arch
from asyncengine.executor.weights.gguf_header import TensorInfo, read_header

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")
# llama.cpp's converter interleaves the rotary halves of q/k rows for these architectures.
_PERMUTED_ARCHS = ("llama",)
# llama.cpp stores Llama 3 RoPE scaling as per-frequency divisors in this tensor.
ROPE_FREQS = "rope_freqs.weight"

def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if m := _LAYER_RE.match(gguf_name):
        part = gguf_arch.layer_name(arch, m.group(2)) or _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    if m := _GLOBAL_RE.match(gguf_name):
        part = _GLOBAL_NAMES.get(m.group(1))
        return f"{part}.{m.group(2)}" if part else None
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (pairs interleaved) -> (halves)."""
    half = w.shape[0] // num_heads // 2
    # llama.cpp's row order within a head: (half, 2); transformers': (2, half)
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class QuantGrid:
    """A quantized matrix's own blocks, to keep it packed exactly as stored.

    ``kind`` "q4" (Q4_0 / Q4_1): ``w = q * scale + other`` per block of 32 (``other`` is the
    block minimum, float32 [rows, blocks]); "q8" (Q8_0): ``w = other * scale`` (``other`` the
    int8 quants [rows, cols], ``scale`` float32 [rows, blocks])."""

    kind: str
    scale: np.ndarray
    other: np.ndarray


def quant_grid(raw: np.ndarray, qtype: Any) -> QuantGrid | None:
    """The grid of Q4_0 / Q4_1 / Q8_0 rows (``raw``: uint8 [rows, row bytes]); None for other
    types. Q4_0 blocks are ``d, 16 bytes of nibbles`` with ``w = d * (q - 8)``, Q4_1 blocks
    ``d, m, nibbles`` with ``w = d * q + m``, Q8_0 blocks ``d, 32 int8`` with ``w = d * q``
    (``d, m`` float16)."""
    from gguf import GGMLQuantizationType

    kinds = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20,
             GGMLQuantizationType.Q8_0: 34}
    if qtype not in kinds:
        return None
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, kinds[qtype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
        return QuantGrid("q8", d, q)
    if qtype == GGMLQuantizationType.Q4_0:
        return QuantGrid("q4", d, -8 * d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return QuantGrid("q4", d, m)


def _check_tensor(path: str, t: TensorInfo, file_size: int, packed: bool) -> tuple[int, int]:
    """(rows, bytes per row) of tensor ``t``; ValueError naming it, its type (or its offset)
    and the supported types when the type is unknown or the file ends before its data."""
    from asyncengine.executor.weights import kquants

    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    except (ValueError, KeyError):
        block = 0
    if packed or not block:
        kquants.check_type(path, t.name, t.ggml_type, t.dims[0] if t.dims else 0)
        _, block, block_bytes = kquants.TYPES[t.ggml_type]
    if not t.dims or t.dims[0] % block:
        raise ValueError(f"{path}: tensor {t.name} ({kquants.type_name(t.ggml_type)}) has "
                         f"dims {t.dims}, rows not a multiple of its block of {block}")
    rows = int(np.prod(t.dims[1:], dtype=np.int64))
    row_bytes = t.dims[0] // block * block_bytes
    if t.offset + rows * row_bytes > file_size:
        raise ValueError(f"{path}: truncated or corrupt GGUF file: tensor {t.name} "
                         f"({kquants.type_name(t.ggml_type)}) at offset {t.offset} needs "
                         f"{rows * row_bytes} bytes, the file ends at {file_size}")
    return rows, row_bytes


@dataclass
class PackedTensor:
    """A GGUF matrix as the file stores it: uint8 ``[rows, row bytes]`` of GGML type
    ``qtype``, rows of ``k`` weights (in transformers' row order: q/k un-permuted)."""

    raw: torch.Tensor
    qtype: int
    k: int


def read_packed(path: str, config: Any, only: set[str] | None = None
                ) -> dict[str, PackedTensor]:
    """Every matrix of a GGUF file kept packed, by transformers name (``kquants.py``); raises
    ValueError for a type outside ``kquants.TYPES`` or a truncated file. ``only``: just these
    names."""
    from asyncengine.executor.weights import kquants

    header = read_header(path)
    arch = header.metadata.get("general.architecture", "llama")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    size = os.path.getsize(path)
    out: dict[str, PackedTensor] = {}
    for t in header.tensors:
        if len(t.dims) != 2 or t.name in gguf_arch.CONFIG_TENSORS or t.name == ROPE_FREQS:
            continue
        if only is not None and hf_name(t.name, arch) not in only:
            continue
        rows, row_bytes = _check_tensor(path, t, size, packed=True)
        name = hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} has no counterpart in the model")
        raw = kquants.read_rows(path, t.offset, rows, row_bytes)
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else 0
        if arch in _PERMUTED_ARCHS and heads:  # whole rows move: lossless
            raw = torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(raw.numpy(), heads)))
        out[name] = PackedTensor(raw, t.ggml_type, t.dims[0])
    return out


def iter_gguf_tensors(path: str, config: Any, grids: dict[str, QuantGrid] | None = None,
                      skip: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers name, float32 tensor) for every tensor of a GGUF file, streaming,
    each read by plain reads (``kquants.read_rows``: file pages mapped and touched would count
    in the process's resident set until the whole file is read).

    ``grids``, when given, receives the grid (``quant_grid``) of every Q4_0 / Q4_1 / Q8_0
    matrix (or stack of experts' matrices, its rows expert by expert) by transformers name,
    its rows in the yielded tensor's order. ``skip``: names not
    to yield (the matrices ``read_packed`` keeps packed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from asyncengine.executor.weights.kquants import read_rows

    header = read_header(path)
    arch = header.metadata.get("general.architecture", "llama")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    size = os.path.getsize(path)
    for t in header.tensors:
        if skip and hf_name(t.name, arch) in skip:
            continue
        rows, row_bytes = _check_tensor(path, t, size, packed=False)
        qtype = GGMLQuantizationType(t.ggml_type)
        raw = read_rows(path, t.offset, rows, row_bytes).numpy()
        try:
            w = dequantize(raw, qtype).reshape(*reversed(t.dims))  # [out, in] for matrices
        except NotImplementedError:
            from asyncengine.executor.weights import kquants

            kquants.check_type(path, t.name, t.ggml_type, t.dims[0])
            raise
        # matrices, and a mixture's stacked experts ([experts * rows, row bytes])
        grid = quant_grid(raw, qtype) if grids is not None and len(t.dims) in (2, 3) else None
        if t.name == ROPE_FREQS:
            yield ROPE_FREQS, torch.from_numpy(np.array(w, dtype=np.float32))  # a copy
            continue
        if t.name in gguf_arch.CONFIG_TENSORS:
            continue
        name = hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} has no counterpart in the model")
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else 0
        if arch in _PERMUTED_ARCHS and heads:
            w = unpermute_rope_rows(w, heads)
            if grid is not None:
                grid = QuantGrid(grid.kind, unpermute_rope_rows(grid.scale, heads),
                                 unpermute_rope_rows(grid.other, heads))
        if grid is not None:
            grids[name] = grid
        w = gguf_arch.fix_tensor(arch, name, w)
        w = np.asarray(w, dtype=np.float32)
        yield name, torch.from_numpy(w if w.flags.writeable else w.copy())
