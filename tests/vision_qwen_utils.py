"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models made at test time, their image
processor and their transformers references (``vision_utils.py`` has the fixed-size
families)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.vision_utils import _reference_model

#: The tiny Qwen2.5-VL / Qwen2-VL: 14 px patches merged 2 x 2 (a token per 28 x 28 px),
#: images resized to at least 56 x 56 and at most 140 x 140 px (4 to 25 tokens); a
#: 2-layer Qwen2 decoder, head 16 split by M-RoPE into 2 + 3 + 3 frequencies; Qwen2.5-VL's
#: tower windows of 56 px (2 x 2 tokens) in its first layer, full attention in its second.
#: The tiny Qwen3-VL: 16 px patches (a token per 32 x 32 px), a 4 x 4 table of learned
#: positions, its first layer's output merged for the decoder's first layer (deepstack); a
#: 2-layer Qwen3 decoder with interleaved M-RoPE.
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 140 * 140
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_ARCH = {"qwen2_5_vl": "Qwen2_5_VL", "qwen2_vl": "Qwen2VL", "qwen3_vl": "Qwen3VL"}
QK_SCALE = 8.0


def _tokenizer() -> Any:
    import transformers

    from tests.utils import embedded_tokenizer_dir

    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    return tok


def make_tiny_qwen_vl(directory: str | os.PathLike[str], family: str = "qwen2_5_vl") -> str:
    """Save a tiny random ``Qwen2_5_VLForConditionalGeneration`` (``family`` "qwen2_vl":
    ``Qwen2VLForConditionalGeneration``) (float32, seed 0), the embedded tokenizer plus
    Qwen's vision tokens, and its image processor. Returns the directory."""
    import torch
    import transformers

    directory = Path(directory)
    tok = _tokenizer()
    start, pad, end, video = (tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok) + 64,
                max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})
    if family == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                      out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    elif family == "qwen3_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                      out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])
        text.update(head_dim=16)
    else:
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    arch = _ARCH[family]
    config = getattr(transformers, f"{arch}Config")(
        text_config=text, vision_config=vision, image_token_id=pad, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config).float()
    visual = model.model.visual
    with torch.no_grad():  # image embeddings of the text's scale, so that they matter;
        for merger in (visual.merger, *getattr(visual, "deepstack_merger_list", ())):
            (merger.mlp[2] if hasattr(merger, "mlp") else merger.linear_fc2).weight.mul_(20.0)
        for layer in model.model.language_model.layers:  # sharp attention: positions
            attn = layer.self_attn  # (and the tower's windows) matter
            for w in ((attn.q_norm.weight, attn.k_norm.weight) if family == "qwen3_vl" else
                      (attn.q_proj.weight, attn.k_proj.weight)):
                w.mul_(QK_SCALE if family != "qwen3_vl" else QK_SCALE**0.5)
        for block in visual.blocks:
            block.attn.qkv.weight[:64].mul_(QK_SCALE)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    qwen_image_processor(family).save_pretrained(str(directory))
    return str(directory)


def qwen_image_processor(family: str = "qwen2_5_vl") -> Any:
    """transformers' ``Qwen2VLImageProcessor`` (its PIL backend: no torchvision here), with
    Qwen3-VL's 16 px patches and mean and std for ``qwen3_vl``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    kw: dict[str, Any] = {}
    if family == "qwen3_vl":
        kw = dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen2VLImageProcessorPil(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS,
                                    **kw)


def qwen_inputs(directory: str, prompt: str, images: list[Any], family: str = "qwen2_5_vl"
                ) -> tuple[Any, dict[str, Any]]:
    """transformers' inputs: the prompt's ids ``[1, L]``, each ``<|image_pad|>`` expanded to
    its image's ``t * h * w / merge^2`` tokens as Qwen2VLProcessor does, and the images'
    ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    text, kwargs = prompt, {}
    if images:
        px = qwen_image_processor(family)(images=images, return_tensors="pt")
        parts = prompt.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        counts = (px["image_grid_thw"].prod(-1) // 4).tolist()
        text = parts[0] + "".join("<|image_pad|>" * n + p
                                  for n, p in zip(counts, parts[1:], strict=True))
    ids = tok(text, return_tensors="pt")["input_ids"]
    if images:
        pad = tok.convert_tokens_to_ids("<|image_pad|>")
        kwargs = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"],
                  "mm_token_type_ids": (ids == pad).int()}
    return ids, kwargs


def qwen_reference(family: str, directory: str, prompt: str, images: list[Any],
                   max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy new tokens)."""
    import torch

    ids, kwargs = qwen_inputs(directory, prompt, images, family)
    model = _reference_model(directory, f"{_ARCH[family]}ForConditionalGeneration")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()
