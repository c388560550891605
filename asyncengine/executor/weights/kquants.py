"""GGUF matrices kept exactly as the file stores them (``--quantization gguf``), every type a
downloaded file uses: Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_XS, F16, BF16, F32.

A Q4_K_M file mixes types per tensor (Q4_K for most matrices, Q6_K for the head and some
attn_v / ffn_down, Q5_0 / Q8_0 where a row is not a multiple of 256, F32 norms). Each matrix
here is its file bytes, uint8 ``[rows, row bytes]``, read straight from the file into place
(no float copy, ever: the model's float linears are never written, then dropped), and
multiplied in place by ``kernels/kquant.cpp``: below ``TILE_ROWS`` input rows, Q4_0 / Q4_1 /
Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS by byte dot products (AVX2, VNNI, AVX-512
VNNI) over activations rounded to int8 twice per block of 32 (``int4.py``'s scheme, exact to
~1.5e-5 of a block's maximum; ``kquant_small.h`` for the 256-element types), F16, BF16 and
F32 by dequantizing one weight row at a time into L1 (bit-exact with
``gguf.quants.dequantize``) and multiplying in float32. A decode step of fewer than
``TILE_ROWS`` tokens runs all layers in one C++ call (``decode_stack.py``). A fused projection
(q/k/v, gate/up) whose parts differ in type keeps each part in its own type; each part writes
its columns of the shared output. A quantized token embedding is looked up by dequantizing
only the rows looked up; tied to the head, the head multiplies the same bytes.

Where the kernels cannot be compiled: one warning, then ``gguf.quants.dequantize`` a tile of
rows at a time (correct, slow). From ``TILE_ROWS`` input rows on (prefill chunks, decode
batches of 8 and more), a call dequantizes a tile of weight rows at a time and multiplies
through oneDNN / MKL, in bfloat16 where the CPU has bfloat16 dot products (``tile_dtype``,
chosen and logged once at start-up); where the kernel is built with AVX-512 BF16, the kernel
multiplies them itself: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K at any row
count by byte dot products across 16 weight rows over activations rounded to int8 once per
block of 32 (``kernels/kquant_tile8.h``, where the CPU also has AVX-512 VNNI and BITALG), the
other types up to ``FUSED_ROWS`` rows as bfloat16 tiles (``kernels/kquant_tile.h``); no tile
leaves the cache, no Python runs per tile.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.weights.kquant_paths import (  # noqa: F401 (kquants.* for callers)
    FUSED_ROWS,
    INT8_TILE_TYPES,
    TILE_ROWS,
    fused_tiles,
    kernels_available,
    tile_dtype,
)

logger = logging.getLogger(__name__)

# GGML type id -> (name, weights per block, bytes per block): the types kept packed.
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 23: ("IQ4_XS", 256, 136),
}
SUPPORTED = ", ".join(name for name, _, _ in TYPES.values())
# Weights per dequantized tile of ``_tiled`` (2 MB in bfloat16): oneDNN's bfloat16 GEMM over a
# 2048-token prefill chunk, one thread, the Zen 5 of docs/benchmarks.md: K = 4864 at 53 rows a
# tile (the old 2**18 weights) 356 GFLOP/s, at 128 492, at 256 499; K = 896 at 292 rows 469,
# at 1024 506.
_TILE_WEIGHTS = 1 << 20


def type_name(qtype: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def row_bytes(qtype: int, k: int) -> int:
    _, block, size = TYPES[qtype]
    return k // block * size


def check_type(path: str, tensor: str, qtype: int, k: int) -> None:
    """ValueError naming ``tensor`` and its type unless it is one of ``TYPES`` with whole
    blocks per row."""
    if qtype not in TYPES:
        raise ValueError(f"{path}: tensor {tensor} has GGML type {type_name(qtype)}, which is "
                         f"not supported (supported: {SUPPORTED}; --quantization none "
                         "dequantizes the other types the gguf package knows)")
    name, block, _ = TYPES[qtype]
    if k % block:
        raise ValueError(f"{path}: tensor {tensor} ({name}) has rows of {k} weights, not a "
                         f"multiple of its block of {block}")


def dequantize_rows(raw: torch.Tensor, qtype: int, k: int,
                    ids: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (all when None) of a packed matrix as float32 ``[n, k]``, bit-exact with
    ``gguf.quants.dequantize``; ``dtype`` bfloat16: that rounded once (the kernel writes
    bfloat16 directly where it builds, no float32 copy in between)."""
    if kernels_available():
        if ids is None:
            ids = torch.arange(raw.shape[0], dtype=torch.int64)
        if dtype in (torch.float32, torch.bfloat16):
            return packed_kernels.kquant_dequant(raw, ids.to(torch.int64), k, qtype, dtype)
        return packed_kernels.kquant_dequant(raw, ids.to(torch.int64), k, qtype).to(dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = raw if ids is None else raw[ids.to(torch.int64)]
    w = dequantize(rows.numpy(), GGMLQuantizationType(qtype)).reshape(rows.shape[0], k)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)


@dataclass
class Part:
    """Rows of a (fused) matrix in one GGML type: ``raw`` uint8 [rows, row bytes]."""

    raw: torch.Tensor
    qtype: int


class GGUFLinear(nn.Module):
    """``y = x @ W.T + bias`` with W kept as the GGUF file's blocks (one ``Part`` per
    checkpoint tensor fused into it, each in its own type)."""

    def __init__(self, in_features: int, parts: list[Part], bias: torch.Tensor | None = None
                 ) -> None:
        super().__init__()
        self.in_features = in_features
        self.qtypes = [p.qtype for p in parts]
        self.rows = [p.raw.shape[0] for p in parts]
        self.out_features = sum(self.rows)
        for i, p in enumerate(parts):
            if p.raw.shape[1] != row_bytes(p.qtype, in_features):
                raise ValueError(f"GGUF part of {p.raw.shape[1]} bytes per row, expected "
                                 f"{row_bytes(p.qtype, in_features)} for {in_features} "
                                 f"{type_name(p.qtype)} weights")
            self.register_buffer(f"raw{i}", p.raw)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.use_kernel = kernels_available()
        # every part in a type kquant_tile8.h multiplies at any row count (prefill chunks too)
        self.int8_tiles = (self.use_kernel and set(self.qtypes) <= INT8_TILE_TYPES
                           and packed_kernels.kquant_int8_tile())
        # ... and from 3 bfloat16 rows (use_few_row_tiles), where rows need not be invariant
        self.few_row_tiles = False

    def parts(self) -> list[tuple[torch.Tensor, int]]:
        return [(self._buffers[f"raw{i}"], t) for i, t in enumerate(self.qtypes)]

    def dequantized(self) -> torch.Tensor:
        """The float32 weights [out, in] (tests; never called by the forward)."""
        return torch.cat([dequantize_rows(raw, t, self.in_features) for raw, t in self.parts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if self.use_kernel and (rows < TILE_ROWS or fused_tiles(x2.dtype)
                                and (rows <= FUSED_ROWS or self.int8_tiles)):
            # bfloat16 rows go in as they are where kquant_tile8.h takes them (a 2048 x 4864
            # float32 copy cost a prefill chunk's down projection half its matmul time)
            keep = (x2.dtype == torch.bfloat16 and self.int8_tiles and rows >= TILE_ROWS)
            x2 = x2.contiguous() if keep else x2.float().contiguous()
            # and their sums come back in bfloat16, rounded once (a bias is added in float32
            # first: one rounding too)
            odt = torch.bfloat16 if keep and self.bias is None else torch.float32
            out = torch.empty(x2.shape[0], self.out_features, dtype=odt)
            flag = self.flag(x.dtype)
            col = 0
            for raw, qtype in self.parts():
                packed_kernels.kquant_mm(x2, raw, qtype | flag, out[:, col:col + raw.shape[0]])
                col += raw.shape[0]
        else:
            out = self._tiled(x2)
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.to(x.dtype).view(*lead, self.out_features)

    def flag(self, dtype: torch.dtype) -> int:
        """The kernel's type flag for this layer's calls on ``dtype`` rows: the int8 tiles
        from a few rows (``use_few_row_tiles``) for a bfloat16 model, else none."""
        few = self.few_row_tiles and dtype == torch.bfloat16
        return packed_kernels.KQ_TILE8_FEW if few else 0

    def _tiled(self, x2: torch.Tensor) -> torch.Tensor:
        """Many input rows (a prefill chunk, a large decode batch): a tile of weight rows
        dequantized at a time (2 MB in bfloat16), multiplied through oneDNN / MKL, in bfloat16
        where the CPU has bfloat16 dot products and the model runs in bfloat16
        (``tile_dtype``)."""
        dtype = tile_dtype(x2.dtype)
        xc = x2.to(dtype).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=dtype)
        rows = max(16, _TILE_WEIGHTS // self.in_features)
        col = 0
        for raw, qtype in self.parts():
            n = raw.shape[0]
            for r in range(0, n, rows):
                ids = torch.arange(r, min(r + rows, n), dtype=torch.int64)
                w = dequantize_rows(raw, qtype, self.in_features, ids, dtype)
                out[:, col + r:col + r + len(ids)] = torch.mm(xc, w.T)
            col += n
        return out

    def extra_repr(self) -> str:
        types = "+".join(type_name(t) for t in self.qtypes)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"types={types}, kernel={self.use_kernel}")


def use_few_row_tiles(model: nn.Module, on: bool) -> None:
    """Whether ``model``'s GGUF matrices take ``kquant_tile8.h``'s int8 tiles from 3 rows of a
    bfloat16 model (on) or, as by default, from ``TILE_ROWS`` (the byte dot products below,
    whose result for a row is the same at any row count: speculative verification needs it).
    From 3 to 15 rows the int8 tiles are 1.2-2.8x faster (every matrix of the Q4_K_M file of
    docs/benchmarks.md: 8 rows 76.6 -> 31.4 ms, 12 rows 106.5 -> 37.5 ms, one thread)."""
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.few_row_tiles = on and m.int8_tiles


@torch.library.custom_op("asyncengine::gguf_rows", mutates_args=())
def _rows_op(raw: torch.Tensor, ids: torch.Tensor, k: int, qtype: int,
             dtype: torch.dtype) -> torch.Tensor:
    return dequantize_rows(raw, qtype, k, ids, dtype)


@_rows_op.register_fake
def _(raw: torch.Tensor, ids: torch.Tensor, k: int, qtype: int,
      dtype: torch.dtype) -> torch.Tensor:
    return raw.new_empty(ids.shape[0], k, dtype=dtype)


class GGUFEmbedding(nn.Module):
    """A token embedding kept as the GGUF file's blocks: a lookup dequantizes only the rows
    looked up (to the model's dtype; the same values as the float embedding the file
    dequantizes to). Traced by ``--compile`` as one op."""

    def __init__(self, raw: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.qtype, self.dim, self.dtype = qtype, dim, dtype
        self.num_embeddings = raw.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if torch.compiler.is_compiling():
            rows = _rows_op(self.raw, flat, self.dim, self.qtype, self.dtype)
        else:
            rows = dequantize_rows(self.raw, self.qtype, self.dim, flat, self.dtype)
        return rows.view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, type={type_name(self.qtype)}"


def read_rows(path: str, offset: int, rows: int, nbytes: int) -> torch.Tensor:
    """``rows x nbytes`` bytes of the file from ``offset`` into a new uint8 tensor, by plain
    reads (not a mapping: mapped file pages would count in the process's RSS on top of the
    copy)."""
    out = torch.empty(rows, nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got < len(view):
        raise ValueError(f"{path}: truncated GGUF file: tensor data at offset {offset} needs "
                         f"{len(view)} bytes, the file has {got} there")
    return out


def file_size(path: str) -> int:
    return os.stat(path).st_size


def install(model: nn.Module, packed: dict[str, object], dtype: torch.dtype) -> set[str]:
    """Put ``packed`` (``gguf.read_packed``: transformers name -> ``PackedTensor``) in place
    of ``model``'s linears and token embedding; returns the names it used (the caller loads
    any other tensor as floats). The float linears the model was built with were never
    written (their pages never touched) and are dropped here."""
    from asyncengine.executor.models.layers import FUSED_SHARDS, Embedding, Linear

    renames = getattr(getattr(model, "spec", None), "renames", ())

    def ours(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    by_name = {ours(n): (n, t) for n, t in packed.items()}
    used: set[str] = set()
    for qual, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, (Linear, nn.Linear)):
                continue
            prefix = f"{qual}.{child_name}" if qual else child_name
            shards = [(part, shard) for part, (fused, shard) in FUSED_SHARDS.items()
                      if fused == child_name]
            if f"{prefix}.weight" in by_name:  # stored fused (Phi-3) or a plain linear
                names = [f"{prefix}.weight"]
            elif shards and all(f"{qual}.{p}.weight" in by_name for p, _ in shards):
                shards.sort(key=lambda ps: parent.shard_rows(ps[1])[0])
                names = [f"{qual}.{p}.weight" for p, _ in shards]
            else:
                continue
            tensors = [by_name[n][1] for n in names]
            out_f, in_f = child.weight.shape
            if any(t.k != in_f for t in tensors) or sum(t.raw.shape[0] for t in tensors) != out_f:
                raise ValueError(f"GGUF tensors {', '.join(by_name[n][0] for n in names)} do "
                                 f"not make the {out_f}x{in_f} matrix of {prefix}")
            bias = None if child.bias is None else child.bias.data
            setattr(parent, child_name, GGUFLinear(
                in_f, [Part(t.raw, t.qtype) for t in tensors], bias))
            used.update(by_name[n][0] for n in names)
    embed_name = "model.embed_tokens.weight"
    if embed_name in by_name and hasattr(model, "model"):
        ckpt, t = by_name[embed_name]
        old = getattr(model.model, "embed_tokens", None)
        if isinstance(old, Embedding) and tuple(old.weight.shape) == (t.raw.shape[0], t.k):
            model.model.embed_tokens = GGUFEmbedding(t.raw, t.qtype, t.k, dtype)
            used.add(ckpt)
            if getattr(model, "lm_head", False) is None:  # tied: the head reads the same bytes
                model.lm_head = GGUFLinear(t.k, [Part(t.raw, t.qtype)])
    return used


def describe(model: nn.Module) -> str:
    """``Q4_K 170, Q6_K 25, ...``: the packed matrices of ``model`` by type, for the log."""
    counts: dict[str, int] = {}
    for m in model.modules():
        for t in getattr(m, "qtypes", []) or ([m.qtype] if isinstance(m, GGUFEmbedding) else []):
            counts[type_name(t)] = counts.get(type_name(t), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
