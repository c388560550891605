"""M-RoPE (Qwen2-VL, Qwen2.5-VL): each token has three positions, temporal, height and width,
and the rotary frequencies are split into three sections (``mrope_section``, in frequency
order), each turned by its own position.

Text tokens have three equal positions, and then M-RoPE is plain RoPE at that position. So a
step passes ``[T]`` positions (the runner's, already shifted by each request's M-RoPE delta:
``executor/step/mrope_rows.py``) unless it computes image placeholders, whose positions
differ; only then ``[3, T]``. A ``[T]`` step takes exactly the plain table's path (the
CPU's cached rows, CUDA's FlashInfer table), so decode steps cost nothing more.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.executor.kernels.where import host_kernel
from asyncengine.executor.models.rope import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, config: Any, head_dim: int, params: dict[str, Any] | None,
                 rotary_dim: int | None, section: tuple[int, ...], *,
                 interleaved: bool = False) -> None:
        super().__init__(config, head_dim, params, rotary_dim)
        half = self.rotary_dim // 2
        if sum(section) != half or len(section) != 3:
            raise ValueError(f"mrope_section {list(section)} does not split the {half} rotary "
                             "frequencies in three")
        # stream[j]: which of the three positions turns frequency j: the sections one after
        # the other, or (Qwen3-VL) taking turns, h and w each while their section lasts
        if interleaved:
            j = torch.arange(half)
            stream = torch.zeros(half, dtype=torch.int64)
            for axis in (1, 2):
                stream[(j % 3 == axis) & (j < 3 * section[axis])] = axis
        else:
            stream = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("stream", stream, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` (every stream equal: plain RoPE) or ``[3, T]``: cos, sin as
        :meth:`RotaryEmbedding.forward` gives them, each frequency from its own stream."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        flat = positions.reshape(-1)
        if host_kernel(flat):
            cos, sin = self._table(int(flat.max()) + 1 if flat.numel() else 0, dtype)
            cos, sin = cos.index_select(0, flat), sin.index_select(0, flat)
        else:
            cos, sin = self._compute(flat, dtype)
        n = positions.shape[1]
        # [3 * T, 1, 2, half] -> [3, T, 1, 2, half]; frequency j from stream[j]
        pick = self.stream.to(cos.device)[None, None, None, :].expand(n, 1, 2, -1)
        cos = cos.view(3, n, 1, 2, -1).gather(0, pick[None]).squeeze(0)
        sin = sin.view(3, n, 1, 2, -1).gather(0, pick[None]).squeeze(0)
        return cos, sin
