"""A tiny vision-language checkpoint converted to a GGUF pair, as llama.cpp converts one: the
language model as a text GGUF (``tests/utils.make_tiny_gguf``) and the image side as an
mmproj file written with the ``gguf`` package, its tensors named by gguf's own MMPROJ name
map (what ``convert_hf_to_gguf.py --mmproj`` uses) and its metadata as llama.cpp's
``MmprojModel`` writes it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def text_only(vlm_dir: str, out: str | os.PathLike[str], cls_name: str) -> str:
    """The checkpoint's language model saved alone as a causal LM directory (Llama's, or
    Gemma 3's)."""
    import torch
    import transformers

    out = Path(out)
    vlm = getattr(transformers, cls_name).from_pretrained(vlm_dir, dtype=torch.float32)
    causal = transformers.Gemma3ForCausalLM if cls_name.startswith("Gemma3") \
        else transformers.LlamaForCausalLM
    text = causal(vlm.config.text_config).float()
    inner = getattr(vlm.model, "text_model", None) or vlm.model.language_model
    text.model.load_state_dict(inner.state_dict())
    text.lm_head.load_state_dict(vlm.lm_head.state_dict())
    text.save_pretrained(str(out))
    return str(out)


def write_mmproj(vlm_dir: str, path: str | os.PathLike[str], projector: str, *,
                 quant: str | None = None, legacy_llava: bool = False) -> str:
    """The image side of ``vlm_dir`` as an mmproj file. ``projector``: ``mlp`` (LLaVA),
    ``idefics3`` or ``gemma3``. ``legacy_llava``: LLaVA's projector as ``mm.0``/``mm.2`` and
    the FFN names swapped, as the legacy converter writes them. ``quant``: a GGML type for
    the tower's matrices whose rows are whole blocks."""
    import gguf
    import numpy as np
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(vlm_dir)
    vc = config.vision_config
    next_ = projector == "mlp" and config.model_type == "llava_next"
    cls = {"mlp": "LlavaNextForConditionalGeneration" if next_ else
           "LlavaForConditionalGeneration",
           "idefics3": "Idefics3ForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration"}[projector]
    model = getattr(transformers, cls).from_pretrained(vlm_dir, dtype=torch.float32)
    # (a projector's linear_{bid} names count as blocks too: at least 3)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vc.num_hidden_layers, 3))
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(config.text_config.hidden_size)
    w.add_vision_image_size(vc.image_size)
    w.add_vision_patch_size(vc.patch_size)
    w.add_vision_embedding_length(vc.hidden_size)
    w.add_vision_feed_forward_length(vc.intermediate_size)
    w.add_vision_block_count(vc.num_hidden_layers)
    w.add_vision_head_count(vc.num_attention_heads)
    w.add_vision_attention_layernorm_eps(vc.layer_norm_eps)
    w.add_clip_projector_type(projector)
    if projector == "idefics3":
        w.add_vision_image_mean([0.5] * 3)
        w.add_vision_image_std([0.5] * 3)
        w.add_vision_projector_scale_factor(config.scale_factor)
        w.add_vision_use_gelu(True)
        from tests.vision_tiling_utils import IDEFICS3_LONGEST

        w.add_vision_preproc_image_size(IDEFICS3_LONGEST)
    elif projector == "gemma3":
        w.add_vision_image_mean([0.5] * 3)
        w.add_vision_image_std([0.5] * 3)
        w.add_vision_use_gelu(True)
        side = vc.image_size // vc.patch_size
        w.add_vision_projector_scale_factor(side // int(config.mm_tokens_per_image**0.5))
    else:
        from asyncengine.executor.models.vision.spec import CLIP_MEAN, CLIP_STD

        w.add_vision_image_mean(list(CLIP_MEAN))
        w.add_vision_image_std(list(CLIP_STD))
        w.add_vision_use_gelu(vc.hidden_act == "gelu")
        if next_:  # (flattened (height, width) pairs, as the legacy converter writes them)
            w.add_array("clip.vision.image_grid_pinpoints",
                        [int(x) for pin in config.image_grid_pinpoints for x in pin])
            w.add_string("clip.vision.mm_patch_merge_type", "spatial_unpad")
    qtype = gguf.GGMLQuantizationType[quant] if quant else None
    for name, t in model.state_dict().items():
        if "text_model" in name or "language_model" in name or name.startswith("lm_head") \
                or name.endswith("position_ids") or ".head." in name:
            continue
        if projector == "mlp" and "post_layernorm" in name:
            continue  # (LLaVA reads a layer's output unnormed: the converter leaves it out)
        x = np.ascontiguousarray(t.float().numpy())
        if projector == "gemma3" and "soft_emb_norm" in name:
            x = x + 1.0  # llama.cpp stores Gemma's (1 + w)
        full = _mmproj_name(names, name.replace("_weight", ".weight"))
        if legacy_llava:
            full = full.replace("mm.1.", "mm.0.")
            if ".ffn_" in full:
                full = full.replace("ffn_up", "ffn_x").replace("ffn_down", "ffn_up") \
                    .replace("ffn_x", "ffn_down")
        if (qtype is not None and x.ndim == 2 and "blk" in full
                and x.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0):
            w.add_tensor(full, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(full, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _mmproj_name(names: Any, name: str) -> str:
    """gguf's MMPROJ name of a checkpoint tensor (transformers 5's layout and the saved one:
    ``model.`` prefixes and CLIP's ``vision_model`` tried both ways)."""
    bare = name.removeprefix("model.")
    legacy = bare.replace("vision_tower.", "vision_tower.vision_model.", 1)
    for candidate in (name, bare, legacy):
        if not candidate.endswith((".weight", ".bias")):  # a bare parameter (class_embedding)
            found = names.get_name(candidate)
            if found:
                return found
            continue
        stem, _, kind = candidate.rpartition(".")
        found = names.get_name(stem)
        if found:
            return f"{found}.{kind}"
    raise AssertionError(f"gguf has no MMPROJ name for {name}")


def qwen_gguf_pair(vlm_dir: str, root: Any, family: str) -> tuple[str, str]:
    """(the text GGUF, the mmproj file) of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, as
    llama.cpp's converter writes them: the language model as ``qwen2vl`` (``qwen3vl``) with
    M-RoPE's sections; the 3D patch kernel in two 2D ones, Qwen2-VL's ``qkv`` split in
    three, Qwen2.5-VL's full-attention layers as ``n_wa_pattern``, Qwen3-VL's deepstack
    mergers as ``v.deepstack.<layer>.*``."""
    import gguf
    import numpy as np
    import torch
    import transformers

    from tests.utils import make_tiny_gguf
    from tests.vision_qwen_utils import _ARCH

    root = Path(root)
    vlm = getattr(transformers, f"{_ARCH[family]}ForConditionalGeneration").from_pretrained(
        vlm_dir, dtype=torch.float32)
    tc, vc = vlm.config.text_config, vlm.config.vision_config
    rope = dict(tc.rope_parameters)
    section = rope.pop("mrope_section")
    qwen3 = family == "qwen3_vl"
    kind = "Qwen3" if qwen3 else "Qwen2"
    causal = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, vocab_size=tc.vocab_size,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        **({"head_dim": tc.head_dim} if qwen3 else {}))).float()
    causal.model.load_state_dict(vlm.model.language_model.state_dict())
    causal.lm_head.load_state_dict(vlm.lm_head.state_dict())
    causal.save_pretrained(str(root / "text"))
    text = make_tiny_gguf(root / "text", root / "model.gguf", mrope_section=section)

    qwen25 = family == "qwen2_5_vl"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vc.depth, 3))
    w = gguf.GGUFWriter(str(root / "mmproj.gguf"), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type("qwen2.5vl_merger" if qwen25 else
                              "qwen3vl_merger" if qwen3 else "qwen2vl_merger")
    w.add_vision_projection_dim(tc.hidden_size)
    w.add_vision_image_size(560)
    w.add_vision_patch_size(vc.patch_size)
    w.add_vision_embedding_length(vc.hidden_size if qwen25 or qwen3 else vc.embed_dim)
    w.add_vision_feed_forward_length(vc.intermediate_size if qwen25 or qwen3 else
                                     vc.hidden_size)
    w.add_vision_block_count(vc.depth)
    w.add_vision_head_count(vc.num_heads)
    w.add_vision_attention_layernorm_eps(1e-6)
    from asyncengine.executor.models.vision.spec import CLIP_MEAN, CLIP_STD

    w.add_vision_image_mean([0.5] * 3 if qwen3 else list(CLIP_MEAN))
    w.add_vision_image_std([0.5] * 3 if qwen3 else list(CLIP_STD))
    if qwen3:
        w.add_vision_use_gelu(True)
        w.add_vision_spatial_merge_size(vc.spatial_merge_size)
        w.add_vision_is_deepstack_layers([i in vc.deepstack_visual_indexes
                                          for i in range(vc.depth)])
    if qwen25:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(vc.fullatt_block_indexes[0] + 1)
        w.add_vision_window_size(vc.window_size)
    merger = {"norm": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_POST_NORM],
              "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    deep = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    for name, t in vlm.model.visual.state_dict().items():
        x = np.ascontiguousarray(t.float().numpy())
        stem, _, kind = f"visual.{name}".rpartition(".")
        parts = stem.split(".")
        if qwen3 and parts[1] == "merger":
            w.add_tensor(f"{merger[parts[2]]}.{kind}", x)
        elif parts[1] == "deepstack_merger_list":
            layer = vc.deepstack_visual_indexes[int(parts[2])]
            w.add_tensor(f"v.deepstack.{layer}.{deep[parts[3]]}.{kind}", x)
        elif stem.endswith(".qkv") and not qwen3:
            for part, y in zip("qkv", np.split(x, 3), strict=True):
                w.add_tensor(f"{names.get_name(stem[:-3] + part)}.{kind}", y.copy())
        elif stem.endswith("patch_embed.proj") and kind == "weight":
            w.add_tensor(f"{names.get_name(stem)}.weight", x[:, :, 0].copy())
            w.add_tensor(f"{names.get_name(stem)}.weight.1", x[:, :, 1].copy())
        else:
            w.add_tensor(f"{names.get_name(stem)}.{kind}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return text, str(root / "mmproj.gguf")


def gguf_pair(vlm_dir: str, root: Any, projector: str, cls_name: str, **kw: Any
              ) -> tuple[str, str]:
    """(the text GGUF, the mmproj file) of ``vlm_dir``."""
    from tests.utils import make_tiny_gguf

    root = Path(root)
    text = make_tiny_gguf(text_only(vlm_dir, root / "text", cls_name), root / "model.gguf")
    return text, write_mmproj(vlm_dir, root / "mmproj.gguf", projector, **kw)
