"""A vision transformer over square patches: CLIP's vision model (class token, pre-norm,
quick GELU) and SigLIP's (no class token, a bias on the patch convolution), by switches of
:class:`~spec.TowerSpec`. Parameter names are transformers' (``embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj``...), so a checkpoint loads by name.

Each image attends to itself only (full, non-causal attention over its patches)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.models.vision.spec import TowerSpec


def activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not supported in a vision tower")


class _Embeddings(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, spec.hidden, spec.patch_size, spec.patch_size,
                                         bias=spec.patch_bias)
        positions = spec.num_patches + (1 if spec.class_token else 0)
        self.position_embedding = nn.Embedding(positions, spec.hidden)
        if spec.class_token:
            self.class_embedding = nn.Parameter(torch.empty(spec.hidden))
        self.class_token = spec.class_token
        self.positions = _navit_positions(spec) if spec.navit_positions else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        if self.class_token:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        table = self.position_embedding.weight
        if self.positions is not None:
            table = table[self.positions.to(table.device)]
        return x + table


def _navit_positions(spec: TowerSpec) -> torch.Tensor:
    """Idefics3's position ids of a whole tile: fractional coordinates bucketed in float32,
    as transformers computes them (not the identity for every side)."""
    n = spec.image_size // spec.patch_size
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * n + buckets[None, :]).reshape(-1)


class _Attention(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        d = spec.hidden
        self.num_heads = spec.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        h = self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, h, d // h).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(n, s, d))


class _MLP(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden, spec.intermediate)
        self.fc2 = nn.Linear(spec.intermediate, spec.hidden)
        self.act = activation(spec.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.self_attn = _Attention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.mlp = _MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))


class VisionTower(nn.Module):
    def __init__(self, spec: TowerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = _Embeddings(spec)
        if spec.class_token:
            self.pre_layrnorm = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)  # (sic: CLIP's name)
        self.encoder = _Encoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> the feature layer's hidden states [N, positions, hidden]."""
        x = self.embeddings(pixels)
        if self.spec.class_token:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:self.spec.feature_layers]:
            x = layer(x)
        return self.post_layernorm(x) if self.spec.post_norm else x
