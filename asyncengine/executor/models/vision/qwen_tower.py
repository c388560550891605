"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision tower and patch merger (:class:`~qwen_spec.
QwenTowerSpec`), over the patches of several images at once. Parameter names are the
checkpoint's under ``visual.`` (``patch_embed.proj``, ``blocks.N.attn.qkv``, ``merger.ln_q``,
``merger.mlp.0``...), so it loads by name; the 3D patch convolution, whose kernel is the whole
patch, is a linear over the flattened patch (``load_patch_embed``).

Each image attends to itself only; in Qwen2.5-VL's windowed layers each window of
``window_size`` px (whole merged patches) to itself only. The patches are reordered window
by window before the blocks (a merged patch's ``merge^2`` patches stay together) and the
merger's outputs put back in the image's order after it. Qwen3-VL's deepstack layers' outputs
are merged by mergers of their own and returned beside the main one (``[tokens, (1 + k) *
out_hidden]``); checkpoints name its layers ``linear_fc1`` / ``linear_fc2`` and its
mergers' norm ``norm`` (``QWEN3_NAMES``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.models.vision.qwen_spec import QwenTowerSpec
from asyncengine.executor.models.vision.tower import activation

#: Qwen3-VL's checkpoint names -> ours (regular expressions, in order).
QWEN3_NAMES = ((r"\.mlp\.linear_fc(\d)\.", r".mlp.fc\1."),
               (r"(merger|merger_list\.\d+)\.norm\.", r"\1.ln_q."),
               (r"(merger|merger_list\.\d+)\.linear_fc1\.", r"\1.mlp.0."),
               (r"(merger|merger_list\.\d+)\.linear_fc2\.", r"\1.mlp.2."))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over whole heads in float32 (halves rotated): x [N, heads, head_dim]."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lengths: list[int]) -> torch.Tensor:
    """Full attention inside each consecutive segment of ``lengths`` tokens (q, k, v
    ``[N, heads, head_dim]``): one SDPA call per distinct length, its segments batched."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = {}
    at = 0
    for n in lengths:
        starts.setdefault(n, []).append(at)
        at += n
    for n, first in starts.items():
        if n == 0:
            continue
        idx = (torch.tensor(first)[:, None] + torch.arange(n)[None, :]).to(q.device)
        o = F.scaled_dot_product_attention(*(t[idx].transpose(1, 2) for t in (q, k, v)))
        out[idx] = o.transpose(1, 2)
    return out


class _Attention(nn.Module):
    def __init__(self, spec: QwenTowerSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden)
        self.proj = nn.Linear(spec.hidden, spec.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        o = segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, lengths)
        return self.proj(o.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, spec: QwenTowerSpec) -> None:
        super().__init__()
        self.gated = spec.gated_mlp
        self.act = activation(spec.activation) if spec.activation != "silu" else F.silu
        if self.gated:  # Qwen2.5-VL: SwiGLU with biases
            self.gate_proj = nn.Linear(spec.hidden, spec.intermediate)
            self.up_proj = nn.Linear(spec.hidden, spec.intermediate)
            self.down_proj = nn.Linear(spec.intermediate, spec.hidden)
        else:
            self.fc1 = nn.Linear(spec.hidden, spec.intermediate)
            self.fc2 = nn.Linear(spec.intermediate, spec.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class _RMSNorm(nn.Module):
    """Qwen2.5-VL's: normalized in float32, then scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def _norm(spec: QwenTowerSpec, dim: int) -> nn.Module:
    if spec.norm == "rms":
        return _RMSNorm(dim, spec.norm_eps)
    return nn.LayerNorm(dim, eps=spec.norm_eps)


class _Block(nn.Module):
    def __init__(self, spec: QwenTowerSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(spec, spec.hidden), _norm(spec, spec.hidden)
        self.attn = _Attention(spec)
        self.mlp = _MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """Each merged patch's ``merge^2`` normed patches, concatenated, through an MLP (normed
    after the concatenation: Qwen3-VL's deepstack mergers)."""

    def __init__(self, spec: QwenTowerSpec, after: bool = False) -> None:
        super().__init__()
        self.width = spec.hidden * spec.merge_size**2
        self.after = after
        self.ln_q = _norm(spec, self.width if after else spec.hidden)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, spec.out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.after:
            return self.mlp(self.ln_q(x.reshape(-1, self.width)))
        return self.mlp(self.ln_q(x).view(-1, self.width))


class _PatchEmbed(nn.Module):
    def __init__(self, spec: QwenTowerSpec) -> None:
        super().__init__()
        self.proj = nn.Linear(spec.patch_dim, spec.hidden, bias=spec.patch_bias)


class QwenVisionTower(nn.Module):
    def __init__(self, spec: QwenTowerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.num_layers))
        self.merger = _Merger(spec)
        if spec.position_embeddings:  # Qwen3-VL
            self.pos_embed = nn.Embedding(spec.position_embeddings, spec.hidden)
            self.deepstack_merger_list = nn.ModuleList(_Merger(spec, after=True)
                                                       for _ in spec.deepstack)
        axis = spec.hidden // spec.num_heads // 2  # rows and columns: half a head each
        exponents = torch.arange(0, axis, 2, dtype=torch.float32) / axis
        self.register_buffer("inv_freq", 1.0 / spec.rope_theta**exponents, persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        """All images' patches ``[sum t*h*w, patch_dim]`` -> their merged tokens
        ``[sum t*h*w / merge^2, out_hidden]``, image by image, in each image's order."""
        spec = self.spec
        unit = spec.merge_size**2
        proj = self.patch_embed.proj
        x = F.linear(patches.to(proj.weight.dtype), proj.weight, proj.bias)
        rows, cols = self._coordinates(grids, x.device)
        if spec.position_embeddings:
            x = x + self._learned_positions(rows, cols, grids).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        images = [t * h * w for t, h, w in grids]
        windows, order = images, None
        if spec.window_size is not None:
            order, windows = self._windows(grids)
            order = order.to(x.device)
            x, cos, sin = (a.view(-1, unit, a.shape[-1])[order].flatten(0, 1)
                           for a in (x, cos, sin))
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, head_dim]: every head alike
        deep = []
        for i, block in enumerate(self.blocks):
            full = spec.window_size is None or i in spec.full_attention_layers
            x = block(x, cos, sin, images if full else windows)
            if i in spec.deepstack:
                deep.append(self.deepstack_merger_list[spec.deepstack.index(i)](x))
        out = self.merger(x)
        if deep:
            out = torch.cat([out, *deep], dim=-1)
        if order is not None:  # back to each image's own order
            out = out[torch.argsort(order)]
        return out

    def _coordinates(self, grids: list[tuple[int, int, int]], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's row and column in its image, in the merger's patch order."""
        m = self.spec.merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r = torch.arange(h)[:, None].expand(h, w)
            c = torch.arange(w)[None, :].expand(h, w)
            for a, out in ((r, rows), (c, cols)):
                out.append(a.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        return torch.cat(rows).to(device), torch.cat(cols).to(device)

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, head_dim]`` (float32): a patch's row turns the first quarter of
        each half of a head, its column the second."""
        inv = self.inv_freq.to(rows.device)
        angles = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _learned_positions(self, rows: torch.Tensor, cols: torch.Tensor,
                           grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Qwen3-VL: the square table of positions resampled to each image's grid
        (bilinear, corners aligned), one row per patch."""
        side = int(self.spec.position_embeddings**0.5)
        counts = torch.tensor([t * h * w for t, h, w in grids])
        heights, widths = (torch.repeat_interleave(torch.tensor([g[k] for g in grids]),
                                                   counts).to(rows.device) for k in (1, 2))

        def taps(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
            floor = torch.floor(src)
            offsets = torch.arange(2, device=index.device)
            weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
            return (floor.long()[:, None] + offsets).clamp(0, side - 1), weights

        (hi, hw), (wi, ww) = taps(rows, heights), taps(cols, widths)
        index = (hi[:, :, None] * side + wi[:, None, :]).reshape(-1, 4)
        weight = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merged patches reordered window by window (each image's grid cut
        into squares of ``window_size`` px from its top left, partial at the edges), and
        the windows' lengths in patches."""
        spec = self.spec
        side = spec.window_size // (spec.patch_size * spec.merge_size)  # merged patches
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        base = 0
        for t, h, w in grids:
            mh, mw = h // spec.merge_size, w // spec.merge_size
            index = torch.arange(t * mh * mw).view(t, mh, mw)
            for f in range(t):
                for top in range(0, mh, side):
                    for left in range(0, mw, side):
                        block = index[f, top:top + side, left:left + side].flatten()
                        order.append(block + base)
                        lengths.append(block.numel() * spec.merge_size**2)
            base += t * mh * mw
        return torch.cat(order), lengths

    def load_patch_embed(self, weight: torch.Tensor) -> torch.Tensor:
        """The checkpoint's Conv3d kernel ``[hidden, 3, frames, patch, patch]`` as the
        linear's weight."""
        return weight.reshape(weight.shape[0], -1)
