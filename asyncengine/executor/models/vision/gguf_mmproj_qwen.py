"""A llama.cpp vision projector file of Qwen2-VL, Qwen2.5-VL or Qwen3-VL (``--mmproj``;
projector types ``qwen2vl_merger``, ``qwen2.5vl_merger``, ``qwen3vl_merger``, as
``convert_hf_to_gguf.py --mmproj`` writes them) as a :class:`~qwen_encoder.QwenImageEncoder`,
beside a ``qwen2vl`` / ``qwen3vl`` GGUF decoder.

The converter splits the 3D patch kernel into one 2D kernel per frame (``v.patch_embd.weight``,
``.weight.1``) and Qwen2-VL's fused ``qkv`` into ``attn_q`` / ``attn_k`` / ``attn_v`` (Qwen3-VL
keeps ``attn_qkv``); they are joined again here. Qwen2.5-VL's full-attention layers are every
``clip.vision.n_wa_pattern``-th; its window is ``clip.vision.window_size`` px (112, llama.cpp's
default, when absent). Qwen3-VL's deepstack mergers are ``v.deepstack.<layer>.*``, its layers
``clip.vision.is_deepstack_layers``. The merge is ``clip.vision.spatial_merge_size`` (2), the
pixel bounds ``clip.vision.image_min_pixels`` / ``image_max_pixels`` (transformers' Qwen2-VL
defaults when absent). Every tensor is dequantized to the model's dtype (the tower's matrices
are not kept packed)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from asyncengine.executor.models.vision.qwen_encoder import QwenImageEncoder
from asyncengine.executor.models.vision.qwen_spec import MAX_PIXELS, MIN_PIXELS, QwenTowerSpec
from asyncengine.executor.models.vision.spec import ImageProcessing, VisionSpec

PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj",
          "attn_qkv": "attn.qkv"}
_GLOBAL = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2",
           "v.position_embd": "pos_embed"}
_DEEPSTACK_RE = re.compile(r"^v\.deepstack\.(\d+)\.(norm|fc1|fc2)\.(weight|bias)$")


def qwen_mmproj_spec(md: dict[str, Any], intermediate: int, positions: int, tokenizer: Any,
                     token: Any) -> VisionSpec:
    """The VisionSpec of a Qwen-VL mmproj file's metadata (``intermediate``: the tower's MLP
    width, from its tensors: Qwen2-VL's files say the merger's there; ``positions``: the
    rows of Qwen3-VL's table of learned positions; ``token(tokenizer, text)``: a placeholder
    token's id)."""
    proj = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    qwen25, qwen3 = proj == "qwen2.5vl_merger", proj == "qwen3vl_merger"

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"--mmproj: the file has no clip.vision.{key}")
        return value

    depth = int(get("block_count"))
    tower = QwenTowerSpec(
        hidden=int(get("embedding_length")), intermediate=intermediate,
        num_heads=int(get("attention.head_count")), num_layers=depth,
        patch_size=int(get("patch_size")), temporal_patch_size=2,
        merge_size=int(get("spatial_merge_size", 2)), out_hidden=int(get("projection_dim")),
        activation="silu" if qwen25 else "gelu_pytorch_tanh" if qwen3 else "quick_gelu",
        norm="rms" if qwen25 else "layer",
        gated_mlp=qwen25, rope_theta=10000.0,
        norm_eps=float(get("attention.layer_norm_epsilon", 1e-6)))
    if qwen25:
        every = int(get("n_wa_pattern"))
        tower = replace(tower, window_size=int(get("window_size", 112)),
                        full_attention_layers=tuple(i for i in range(depth)
                                                    if (i + 1) % every == 0))
    if qwen3:
        deep = tuple(i for i, f in enumerate(get("is_deepstack_layers", ())) if f)
        tower = replace(tower, patch_bias=True, position_embeddings=positions, deepstack=deep)
    processing = ImageProcessing(
        shortest_edge=None, size=None, crop=None, resample=3,
        mean=tuple(float(x) for x in get("image_mean")),
        std=tuple(float(x) for x in get("image_std")),
        min_pixels=int(get("image_min_pixels", MIN_PIXELS)),
        max_pixels=int(get("image_max_pixels", MAX_PIXELS)))
    return VisionSpec(
        family="qwen2_5_vl" if qwen25 else "qwen3_vl" if qwen3 else "qwen2_vl", tower=tower,
        connector="qwen_merger",
        connector_act="", processing=processing,
        image_token_id=token(tokenizer, "<|image_pad|>"), tokens_per_image=0, layout="qwen",
        wrap=(token(tokenizer, "<|vision_start|>"), token(tokenizer, "<|vision_end|>")))


def _name(name: str, gated: bool, deepstack: tuple[int, ...]) -> str | None:
    """A file tensor's name under the encoder (None: one it does not use)."""
    if (m := _DEEPSTACK_RE.match(name)) and int(m.group(1)) in deepstack:
        part = {"norm": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}[m.group(2)]
        k = deepstack.index(int(m.group(1)))
        return f"visual.deepstack_merger_list.{k}.{part}.{m.group(3)}"
    if m := _BLOCK_RE.match(name):
        part = m.group(2)
        ours = _BLOCK.get(part) or {"ffn_up": "mlp.up_proj" if gated else "mlp.fc1",
                                    "ffn_down": "mlp.down_proj" if gated else "mlp.fc2"}.get(part)
        return f"visual.blocks.{m.group(1)}.{ours}.{m.group(3)}" if ours else None
    stem, _, suffix = name.rpartition(".")
    part = _GLOBAL.get(stem)
    return f"visual.{part}.{suffix}" if part else None


def load_qwen_mmproj(md: dict[str, Any], tensors: dict[str, Any], as_float: Any,
                     text_hidden: int, tokenizer: Any, token: Any) -> QwenImageEncoder:
    """The encoder of a Qwen-VL mmproj file (``tensors`` by name,
    ``as_float(t)``: a tensor as float32 numpy in transformers' shape)."""
    up = tensors.get("v.blk.0.ffn_up.weight")
    if up is None:
        raise ValueError("--mmproj: the file has no v.blk.0.ffn_up.weight")
    table = tensors.get("v.position_embd.weight")
    spec = qwen_mmproj_spec(md, int(up.shape[-1]),  # (GGUF dims: rows last)
                            0 if table is None else int(table.shape[-1]), tokenizer, token)
    encoder = QwenImageEncoder(spec, text_hidden)
    tower = spec.tower
    assert isinstance(tower, QwenTowerSpec)

    def load(name: str, w: np.ndarray) -> None:
        encoder.load_checkpoint_tensor(name, torch.from_numpy(np.ascontiguousarray(w)))

    frames = [tensors.get(n) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
    if any(f is None for f in frames):
        raise ValueError("--mmproj: the file has no v.patch_embd.weight / .weight.1 (the "
                         "patch kernel's two frames)")
    load("visual.patch_embed.proj.weight", np.stack([as_float(f) for f in frames], axis=2))
    if "v.patch_embd.bias" in tensors:  # Qwen3-VL
        load("visual.patch_embed.proj.bias", as_float(tensors["v.patch_embd.bias"]))
    for i in range(spec.tower.num_layers):
        for kind in ("weight", "bias"):
            parts = [tensors.get(f"v.blk.{i}.attn_{x}.{kind}") for x in "qkv"]
            if all(p is not None for p in parts):
                load(f"visual.blocks.{i}.attn.qkv.{kind}",
                     np.concatenate([as_float(p) for p in parts]))
    for name, t in tensors.items():
        ours = _name(name, tower.gated_mlp, tower.deepstack)
        if ours is not None:
            load(ours, as_float(t))
    missing = encoder.missing_weights()
    if missing:
        raise ValueError(f"--mmproj: missing tensors for {', '.join(missing[:4])}")
    return encoder
