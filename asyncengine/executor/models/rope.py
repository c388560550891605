"""Rotary position embeddings (RoPE), neox layout (rotate the two halves of each head).

Reads both config styles: transformers 5 ``rope_parameters`` ({rope_type, rope_theta, factor,
...}) and the older ``rope_theta`` + ``rope_scaling``. Own code for ``default``, ``linear`` and
``llama3``; other static types (``yarn``, Phi-3's ``longrope``) come from transformers' own
initializers. Partial rotary (Phi-4-mini: ``partial_rotary_factor``) rotates the first
``rotary_dim`` of each head and leaves the rest.

LongRoPE has two sets of factors, short and long. transformers switches per forward pass at
``original_max_position_embeddings``; a paged cache cannot re-rotate keys already written, so
here the choice is made once for the whole context, as llama.cpp does: long factors when the
served context (``--max-model-len``) exceeds the original one, else short.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from asyncengine.executor.kernels.cuda_layer_ops import RopeTable, cos_sin_table
from asyncengine.executor.kernels.where import host_kernel

_OWN_TYPES = ("default", "linear", "llama3")
_BORROWED_TYPES = ("yarn", "longrope")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of ``config`` as one dict with at least rope_type and rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by all layers."""

    def __init__(self, config: Any, head_dim: int, params: dict[str, Any] | None = None,
                 rotary_dim: int | None = None, *, layer_type: str | None = None,
                 long_context: bool = False) -> None:
        """``params``: this table's RoPE parameters (default: the config's); ``rotary_dim``:
        how many of each head's dims rotate (default: all); ``layer_type``: the key of
        ``params`` in a per-layer-type ``rope_parameters`` (Gemma 3); ``long_context``:
        LongRoPE's long factors."""
        super().__init__()
        p = params if params is not None else rope_parameters(config)
        rope_type = p.get("rope_type") or p.get("type") or "default"
        dim = rotary_dim or head_dim
        self.rope_type = rope_type
        self.rotary_dim = dim
        self.attention_scaling = 1.0
        if rope_type in _OWN_TYPES:
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float()
            inv_freq = 1.0 / (p["rope_theta"] ** (exponents / dim))  # [rotary_dim / 2]
            if rope_type == "linear":
                inv_freq = inv_freq / p["factor"]
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, p)
        elif rope_type in _BORROWED_TYPES:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kw: dict[str, Any] = {"layer_type": layer_type} if layer_type else {}
            if rope_type == "longrope" and long_context:
                kw["seq_len"] = p["original_max_position_embeddings"] + 1
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None,
                                                                              **kw)
        else:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (supported: "
                             f"{', '.join(_OWN_TYPES + _BORROWED_TYPES)})")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # the CPU's cos / sin tables by dtype (forward), made from inv_freq
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        # CUDA with FlashInfer's layer ops: every position's float32 cos | sin (``use_table``)
        self.cos_sin: torch.Tensor | None = None

    def use_table(self, max_positions: int, device: torch.device | str) -> None:
        """From now on, a step's tables on ``device`` are FlashInfer's: its positions and one
        ``cos | sin`` table of every position, made here (``cuda_layer_ops.RopeTable``)."""
        self.cos_sin = cos_sin_table(self.inv_freq, self.attention_scaling, max_positions,
                                     device)

    @torch.no_grad()
    def apply_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency factors (llama.cpp's form of Llama 3 RoPE
        scaling), unless the config already described the scaling."""
        if self.rope_type == "default":
            self.inv_freq.div_(factors.to(self.inv_freq))
            self._tables.clear()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``apply_rope``, both [T, 1, 2, rotary_dim / 2] in ``dtype``: cos for both
        halves of a head; sin negated for the first half, as the rotation needs it.

        On the CPU, rows of a table of every position so far (made by the same elementwise
        ops, so the same bits): two row gathers instead of ~10 small ops a step, whose cost
        (~60-90 us inside a step) was a few % of a one-token step of a small model. On CUDA
        after ``use_table``: ``(RopeTable, None)``, for FlashInfer's RoPE kernel."""
        if self.cos_sin is not None and positions.device == self.cos_sin.device \
                and not torch.compiler.is_compiling():
            return RopeTable(positions, self.cos_sin), None  # type: ignore[return-value]
        if host_kernel(positions):
            cos, sin = self._table(int(positions.max()) + 1 if positions.numel() else 0, dtype)
            return cos.index_select(0, positions), sin.index_select(0, positions)
        return self._compute(positions, dtype)

    def _table(self, need: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU table of positions ``[0, n)``, ``n >= need`` (grown by doubling)."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * table[0].shape[0] if table is not None else 1024)
            with torch.inference_mode(False), torch.no_grad():
                table = self._tables[dtype] = self._compute(torch.arange(size), dtype)
        return table

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim / 2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return (torch.stack((cos, cos), dim=1)[:, None],
                torch.stack((-sin, sin), dim=1)[:, None])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (last dim contiguous); cos, sin from ``RotaryEmbedding``.

    With halves x1, x2 this is ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, rounded the
    same way op by op, in four kernels (the halves swapped by ``flip``).
    """
    T, heads, head_dim = x.shape
    rot = 2 * cos.shape[-1]
    if rot != head_dim:  # partial rotary: the first ``rot`` dims turn, the rest pass
        x[..., :rot] = apply_rope(x[..., :rot].contiguous(), cos, sin)
        return x
    halves = x.view(T, heads, 2, head_dim // 2)
    return (halves * cos + halves.flip(2) * sin).view(T, heads, head_dim)
