"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision tower as data (``spec.py`` makes the rest
of their :class:`~spec.VisionSpec`): a ViT over 3D patches (``temporal_patch_size`` frames
of ``patch_size`` px squares) with 2D rotary positions, whose ``merge_size`` x
``merge_size`` neighbouring patches the merger folds into one token. Qwen2-VL's blocks are
LayerNorm and a GELU MLP; Qwen2.5-VL's RMSNorm and SwiGLU with attention inside windows of
``window_size`` px, except in its ``fullatt_block_indexes`` layers; Qwen3-VL's LayerNorm
and a GELU MLP, with learned positions resampled to each image's grid and deepstack: the
outputs of some layers merged too, added to the decoder's first layers' outputs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class QwenTowerSpec:
    hidden: int  # the tower's width (embed_dim)
    intermediate: int
    num_heads: int
    num_layers: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden: int  # the merger's output: the language model's width
    activation: str
    norm: str  # "layer" (Qwen2-VL) or "rms" (Qwen2.5-VL)
    gated_mlp: bool  # SwiGLU (gate_proj, up_proj, down_proj) or fc1, fc2
    rope_theta: float
    window_size: int | None = None  # px; None: every layer attends the whole image
    full_attention_layers: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    patch_bias: bool = False
    # Qwen3-VL: a learned square table of positions, bilinearly resampled to each grid; the
    # layers whose outputs are merged for the decoder's first layers (deepstack).
    position_embeddings: int = 0
    deepstack: tuple[int, ...] = ()

    @property
    def patch_dim(self) -> int:
        """One flattened patch: channels x frames x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size**2


def qwen_tower(config: Any) -> QwenTowerSpec:
    """The tower of a ``qwen2_vl`` / ``qwen2_5_vl`` config (ValueError when it cannot be)."""
    vc = config.vision_config
    qwen25, qwen3 = config.model_type == "qwen2_5_vl", config.model_type == "qwen3_vl"
    if qwen25 or qwen3:
        width, inner, out = vc.hidden_size, vc.intermediate_size, vc.out_hidden_size
    else:
        width, out = vc.embed_dim, vc.hidden_size
        inner = int(width * vc.mlp_ratio)
    if width % vc.num_heads or (width // vc.num_heads) % 4:
        raise ValueError(f"{config.model_type}: the vision heads ({width} / {vc.num_heads}) "
                         "are not a multiple of 4 wide (two rotary axes, two halves)")
    theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    tower = QwenTowerSpec(
        hidden=width, intermediate=inner, num_heads=vc.num_heads, num_layers=vc.depth,
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
        merge_size=vc.spatial_merge_size, out_hidden=out, activation=vc.hidden_act,
        norm="rms" if qwen25 else "layer", gated_mlp=qwen25, rope_theta=theta)
    if qwen25:
        window = int(vc.window_size)
        if window % (vc.patch_size * vc.spatial_merge_size):
            raise ValueError(f"qwen2_5_vl: window_size {window} is not a multiple of a merged "
                             f"patch ({vc.patch_size * vc.spatial_merge_size} px)")
        full = tuple(int(i) for i in vc.fullatt_block_indexes)
        if any(not 0 <= i < vc.depth for i in full):
            raise ValueError(f"qwen2_5_vl: fullatt_block_indexes {list(full)} are outside the "
                             f"tower's {vc.depth} layers")
        tower = replace(tower, window_size=window, full_attention_layers=full)
    if qwen3:
        table = int(vc.num_position_embeddings)
        deep = tuple(int(i) for i in vc.deepstack_visual_indexes)
        if int(table**0.5) ** 2 != table:
            raise ValueError(f"qwen3_vl: num_position_embeddings {table} is not a square")
        if any(not 0 <= i < vc.depth for i in deep):
            raise ValueError(f"qwen3_vl: deepstack_visual_indexes {list(deep)} are outside "
                             f"the tower's {vc.depth} layers")
        tower = replace(tower, patch_bias=True, position_embeddings=table, deepstack=deep)
    return tower


#: transformers' Qwen2VLImageProcessor defaults.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def qwen_processing(cfg: dict[str, Any], processing: Any, tower: QwenTowerSpec) -> Any:
    """``processing`` with the pixel bounds of a Qwen2-VL ``preprocessor_config.json``
    (``min_pixels`` / ``max_pixels``, at its top or in ``size``, or ``size``'s
    ``shortest_edge`` / ``longest_edge`` as transformers 5 writes them); ValueError when
    its patches are not the tower's."""
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    low = cfg.get("min_pixels") or size.get("min_pixels") or size.get("shortest_edge")
    high = cfg.get("max_pixels") or size.get("max_pixels") or size.get("longest_edge")
    for key, want in (("patch_size", tower.patch_size), ("merge_size", tower.merge_size),
                      ("temporal_patch_size", tower.temporal_patch_size)):
        if int(cfg.get(key, want)) != want:
            raise ValueError(f"the image processor's {key} {cfg[key]} is not the vision "
                             f"tower's {want}")
    low = int(low or processing.min_pixels)
    high = int(high or processing.max_pixels)
    if not 0 < low <= high:
        raise ValueError(f"the image processor's min_pixels {low} / max_pixels {high} are "
                         "not a range")
    return replace(processing, min_pixels=low, max_pixels=high)
