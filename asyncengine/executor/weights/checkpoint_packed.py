"""AWQ's and GPTQ's packed integer matrices (``checkpoint_quant.py`` reads the checkpoints):
unpacking the int32 words, each matrix's values, zeros and scales, its float weights, and its
grid in int4's blocks of 32 inputs (``int4_grid``), on which ``--quantization int4`` keeps a
4-bit matrix as stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Where AWQ's packing puts output column k of a group of eight: nibble AWQ_REVERSE_ORDER[k].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class AWQScheme:
    group_size: int
    method: str = "awq"


@dataclass(frozen=True)
class GPTQScheme:
    bits: int
    group_size: int  # -1: one group of all the inputs
    zero_offset: int  # 1 for the original format (zeros stored minus one), 0 for gptq_v2
    act_order: bool = False  # desc_act: g_idx maps each input row to its group
    method: str = "gptq"


def record(name: str, q: torch.Tensor, zeros: torch.Tensor, s: torch.Tensor,
            g_idx: torch.Tensor, grids: dict[str, Any] | None) -> torch.Tensor:
    """``W = (q - zeros[g_idx]) * s[g_idx]`` as nn.Linear's float32 ``[out, in]``; its grid
    in ``grids`` where it fits int4's blocks."""
    if grids is not None:
        grid = int4_grid(zeros, s, g_idx)
        if grid is not None:
            grids[name] = grid
    return ((q - zeros[g_idx]) * s[g_idx]).t().contiguous()


def int4_grid(zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> Any:
    """A 4-bit matrix's grid (``zeros``, ``scales``: ``[groups, out]``; ``g_idx``: each input
    row's group) as int4's ``(scale, min)`` per block of 32 inputs (``gguf.QuantGrid`` "q4":
    ``w = q * scale + min``, ``min = -zero * scale``), or None where a block of 32 inputs
    spans two groups (act-order's scattered groups, a group size that 32 does not divide).
    Int4 keeps scales and minimums in float16: the scales are the checkpoint's own, a minimum
    rounds within 2**-11 of itself."""
    from asyncengine.executor.weights.gguf import QuantGrid
    from asyncengine.executor.weights.int4 import GROUP

    rows = g_idx.shape[0]
    if rows % GROUP:
        return None
    blocks = g_idx.reshape(-1, GROUP)
    if not bool((blocks == blocks[:, :1]).all()):
        return None
    first = blocks[:, 0]
    scale = scales[first].to(torch.float32)  # [in / 32, out]
    low = -zeros[first].to(torch.float32) * scale
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant block
    return QuantGrid("q4", scale.t().contiguous().numpy(), low.t().contiguous().numpy())


def unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers packed ``32 / bits`` to an int32 word, value i at bits ``i * bits`` on,
    along ``dim`` (0: rows, 1: columns) -> the values, ``32 / bits`` times as many there."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, per_word]
    if dim == 1:
        return values.reshape(packed.shape[0], -1)
    return values.permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 words ``[rows, cols]`` -> the 4-bit values ``[rows, 8 * cols]``, in column
    order (within each word's eight, column k is nibble ``AWQ_REVERSE_ORDER[k]``)."""
    nibbles = unpack_words(packed, 4, 1).reshape(packed.shape[0], -1, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def unpack_awq_matrix(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AWQ matrix's values ``[in, out]``, zeros and scales ``[in / group, out]`` (float32)."""
    q = unpack_awq(qweight).to(torch.float32)  # [in, out]
    zeros = unpack_awq(qzeros).to(torch.float32)  # [in / group, out]
    s = scales.to(torch.float32)
    if zeros.shape != s.shape or q.shape[0] != s.shape[0] * group_size or \
            q.shape[1] != s.shape[1]:
        raise ValueError(f"an AWQ matrix of {tuple(q.shape)} values with zeros "
                         f"{tuple(zeros.shape)} and scales {tuple(s.shape)} in groups of "
                         f"{group_size}")
    return q, zeros, s


def dequantize_awq_matrix(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """One AWQ matrix as a float32 ``[out, in]`` weight (nn.Linear's layout)."""
    q, zeros, s = unpack_awq_matrix(qweight, qzeros, scales, group_size)
    g_idx = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[g_idx]) * s[g_idx]).t().contiguous()


def unpack_gptq_matrix(parts: dict[str, torch.Tensor], scheme: GPTQScheme
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GPTQ matrix's values ``[in, out]``, zeros (the offset applied) and scales
    ``[groups, out]`` (float32), and each input row's group."""
    q = unpack_words(parts["qweight"], scheme.bits, 0).to(torch.float32)  # [in, out]
    zeros = unpack_words(parts["qzeros"], scheme.bits, 1).to(torch.float32)  # [groups, out]
    s = parts["scales"].to(torch.float32)
    zeros = zeros + scheme.zero_offset
    rows = q.shape[0]
    g_idx = parts.get("g_idx")
    if g_idx is None:
        size = rows if scheme.group_size == -1 else scheme.group_size
        g_idx = torch.arange(rows) // size
    g_idx = g_idx.to(torch.int64)
    if zeros.shape != s.shape or s.shape[1] != q.shape[1] or g_idx.shape != (rows,) or \
            int(g_idx.max()) >= s.shape[0] or int(g_idx.min()) < 0:
        raise ValueError(f"a GPTQ matrix of {tuple(q.shape)} values with zeros "
                         f"{tuple(zeros.shape)}, scales {tuple(s.shape)} and g_idx "
                         f"{tuple(g_idx.shape)}")
    return q, zeros, s, g_idx


def dequantize_gptq_matrix(parts: dict[str, torch.Tensor], scheme: GPTQScheme) -> torch.Tensor:
    """One GPTQ matrix as a float32 ``[out, in]`` weight (nn.Linear's layout)."""
    q, zeros, s, g_idx = unpack_gptq_matrix(parts, scheme)
    return ((q - zeros[g_idx]) * s[g_idx]).t().contiguous()
