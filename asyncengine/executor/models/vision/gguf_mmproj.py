"""A llama.cpp vision projector file (``--mmproj``, llama-server's ``-mm``): the image side of
a GGUF model, as llama.cpp's converters write it (``convert_hf_to_gguf.py --mmproj``, and the
legacy LLaVA converter).

The file's ``clip.*`` metadata becomes a :class:`~spec.VisionSpec` (projector types ``mlp``:
LLaVA-1.5's CLIP and MLP, LLaVA-NeXT's with its grid pinpoints and newline; ``idefics3``:
SmolVLM's SigLIP tiles and pixel shuffle; ``gemma3``: Gemma 3's SigLIP and pooling
projector; Qwen2-VL's and Qwen2.5-VL's: ``gguf_mmproj_qwen.py``) and its tensors load into
the same :class:`~encoder.ImageEncoder` a safetensors checkpoint builds: on the CPU its quantized
matrices stay in the file's types (``kquants.GGUFLinear``), the rest (and everything on CUDA)
is dequantized to the model's dtype. The placeholder tokens are the tokenizer's (the text
GGUF has no vision config): ``<image>``; Gemma 3's ``<start_of_image>``,
``<image_soft_token>``, ``<end_of_image>``. Image processing is the family's transformers
processing with the file's mean and std, so a GGUF + mmproj pair answers as the safetensors
checkpoint it was converted from.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.models.vision.encoder import ImageEncoder
from asyncengine.executor.models.vision.gguf_mmproj_qwen import PROJECTORS as QWEN_PROJECTORS
from asyncengine.executor.models.vision.gguf_mmproj_qwen import load_qwen_mmproj
from asyncengine.executor.models.vision.spec import ImageProcessing, TowerSpec, VisionSpec

_BLOCK = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
           "v.position_embd": "vision_tower.embeddings.position_embedding",
           "v.pre_ln": "vision_tower.pre_layrnorm", "v.post_ln": "vision_tower.post_layernorm",
           "mm.0": "multi_modal_projector.linear_1", "mm.1": "multi_modal_projector.linear_1",
           "mm.2": "multi_modal_projector.linear_2",
           "mm.model.fc": "multi_modal_projector.modality_projection.proj",
           "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
_BARE = {"v.class_embd": "vision_tower.embeddings.class_embedding",
         "v.image_newline": "image_newline", "model.image_newline": "image_newline",
         "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
PROJECTORS = ("mlp", "idefics3", "gemma3")


def encoder_name(name: str) -> str | None:
    """``v.blk.3.attn_q.weight`` -> ``vision_tower.encoder.layers.3.self_attn.q_proj.weight``
    (None: a tensor the encoder does not use)."""
    if name in _BARE:
        return _BARE[name]
    if m := _BLOCK_RE.match(name):
        part = _BLOCK.get(m.group(2))
        return f"vision_tower.encoder.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    stem, _, suffix = name.rpartition(".")
    part = _GLOBAL.get(stem)
    return f"{part}.{suffix}" if part and suffix in ("weight", "bias") else None


def _token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.hf.convert_tokens_to_ids(text)
    unk = getattr(tokenizer.hf, "unk_token_id", None)
    if ids is None or ids == unk:
        raise ValueError(f"--mmproj: the tokenizer has no {text} token for an image's "
                         "placeholders (give --tokenizer with the model's own)")
    return int(ids)


def mmproj_spec(md: dict[str, Any], names: set[str], tokenizer: Any) -> VisionSpec:
    """The VisionSpec of an mmproj file's metadata and tensor names."""
    proj = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if proj not in PROJECTORS:
        raise ValueError(f"--mmproj: projector type {proj!r} is not supported (supported: "
                         f"{', '.join(PROJECTORS + QWEN_PROJECTORS)})")
    if not md.get("clip.has_vision_encoder", True):
        raise ValueError("--mmproj: the file has no vision encoder")

    def get(key: str) -> Any:
        value = md.get(f"clip.vision.{key}")
        if value is None:
            raise ValueError(f"--mmproj: the file has no clip.vision.{key}")
        return value

    size, patch, blocks = int(get("image_size")), int(get("patch_size")), int(get("block_count"))
    mean = tuple(float(x) for x in get("image_mean"))
    std = tuple(float(x) for x in get("image_std"))
    siglip = proj != "mlp"
    feature = blocks
    if proj == "mlp":  # llama.cpp's LLaVA graph: the file's layers but its last (or the
        layers = md.get("clip.vision.feature_layer")  # deepest feature layer), no post-norm
        feature = max(int(x) for x in layers) if layers else blocks - 1
    tower = TowerSpec(
        hidden=int(get("embedding_length")), intermediate=int(get("feed_forward_length")),
        num_heads=int(get("attention.head_count")), num_layers=blocks, image_size=size,
        patch_size=patch,
        activation="gelu_pytorch_tanh" if siglip else
        ("gelu" if md.get("clip.use_gelu") else "quick_gelu"),
        norm_eps=float(get("attention.layer_norm_epsilon")),
        class_token="v.class_embd" in names, patch_bias="v.patch_embd.bias" in names,
        feature_layers=feature, post_norm="v.post_ln.weight" in names,
        navit_positions=proj == "idefics3")
    side = size // patch
    if proj == "mlp":
        llava = VisionSpec(
            family="llava", tower=tower, connector="llava_mlp", connector_act="gelu",
            processing=ImageProcessing(shortest_edge=size, size=None, crop=(size, size),
                                       resample=3, mean=mean, std=std),
            image_token_id=_token(tokenizer, "<image>"), tokens_per_image=side * side,
            drop_class_token=tower.class_token)
        return _llava_next(llava, md, names) if md.get("clip.vision.image_grid_pinpoints") \
            else llava
    if proj == "idefics3":
        scale = int(md.get("clip.vision.projector.scale_factor", 2))
        return VisionSpec(
            family="idefics3", tower=tower, connector="pixel_shuffle", connector_act="",
            processing=ImageProcessing(
                shortest_edge=None, size=None, crop=None, resample=1, mean=mean, std=std,
                longest_edge=int(md.get("clip.vision.preproc_image_size", 4 * size)),
                tile=size, split=True),
            image_token_id=_token(tokenizer, "<image>"),
            tokens_per_image=(side // scale) ** 2, layout="idefics3", scale_factor=scale)
    scale = int(md.get("clip.vision.projector.scale_factor", 4))
    boi, eoi = _token(tokenizer, "<start_of_image>"), _token(tokenizer, "<end_of_image>")
    return VisionSpec(
        family="gemma3", tower=tower, connector="gemma3", connector_act="",
        processing=ImageProcessing(shortest_edge=None, size=(size, size), crop=None,
                                   resample=2, mean=mean, std=std),
        image_token_id=_token(tokenizer, "<image_soft_token>"),
        tokens_per_image=(side // scale) ** 2, prompt_token_id=boi,
        before=("\n\n", boi), after=(eoi, "\n\n"), bidirectional=True)


def _llava_next(spec: VisionSpec, md: dict[str, Any], names: set[str]) -> VisionSpec:
    """LLaVA-NeXT's file: the grid resolutions, unpadding, the newline embedding."""
    flat = [int(x) for x in md["clip.vision.image_grid_pinpoints"]]
    merge = md.get("clip.vision.mm_patch_merge_type", "flat")
    if merge != "spatial_unpad" or len(flat) % 2 or not spec.tower.class_token \
            or not names & {"v.image_newline", "model.image_newline"}:
        raise ValueError(f"--mmproj: an anyres projector with patch merge {merge!r} is not "
                         "supported (LLaVA-NeXT's spatial_unpad with image_newline is)")
    pins = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
    size = spec.tower.image_size
    if any(h % size or w % size for h, w in pins):
        raise ValueError(f"--mmproj: image_grid_pinpoints {pins} are not multiples of the "
                         f"tower's {size} px")
    return replace(spec, family="llava_next", layout="anyres", image_newline=True,
                   processing=replace(spec.processing, pinpoints=pins))


def _read(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, the tensors as GGUFReader gives them)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--mmproj {path}: not a readable GGUF file ({e})") from None
    md: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                md[key] = f.contents()
            except (ValueError, IndexError):
                continue
    if md.get("general.architecture") != "clip":
        raise ValueError(f"--mmproj {path}: not a vision projector file (architecture "
                         f"{md.get('general.architecture')!r}, not 'clip')")
    return md, {t.name: t for t in reader.tensors}


_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16


def _as_float(t: Any) -> np.ndarray:
    """A tensor dequantized to float32 in transformers' shape."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape))
    data = t.data if t.tensor_type.value in (0, 1) else dequantize(t.data, t.tensor_type)
    return np.array(data, dtype=np.float32).reshape(shape)


def _ffn_unswapped(tensors: dict[str, Any], intermediate: int) -> dict[str, Any]:
    """The legacy LLaVA converter's FFN names (``ffn_down`` for fc1) put right, found by the
    tensors' shapes as llama.cpp finds them."""
    fc = tensors.get("v.blk.0.ffn_up.weight")
    if fc is None or int(fc.shape[-1]) == intermediate:  # (GGUF dims: rows last)
        return tensors
    swap = {".ffn_up.": ".ffn_down.", ".ffn_down.": ".ffn_up."}
    out = {}
    for name, t in tensors.items():
        for a, b in swap.items():
            if a in name:
                name = name.replace(a, b)
                break
        out[name] = t
    return out


def _pack(encoder: ImageEncoder, ours: str, t: Any) -> bool:
    """A quantized matrix kept as the file's blocks (``kquants.GGUFLinear``, the CPU's packed
    kernels) in place of its linear; False where that does not apply."""
    from asyncengine.executor.weights import kquants

    module_name = ours.rpartition(".")[0]
    module = encoder.get_submodule(module_name) if module_name else None
    if not isinstance(module, nn.Linear) or not ours.endswith(".weight") \
            or t.tensor_type.value not in kquants.TYPES:
        return False
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
    bias = None if module.bias is None else module.bias.detach().clone()
    packed = kquants.GGUFLinear(module.in_features, [kquants.Part(raw, t.tensor_type.value)],
                                bias)
    parent, _, leaf = module_name.rpartition(".")
    setattr(encoder.get_submodule(parent) if parent else encoder, leaf, packed)
    return True


def load_mmproj(path: str, text_hidden: int, tokenizer: Any, dtype: torch.dtype,
                device: torch.device, packed: bool | None = None) -> ImageEncoder:
    """The image encoder of an mmproj file, on ``device`` in ``dtype``; ``packed`` (default:
    on the CPU) its quantized matrices stay in the file's types (the packed kernels multiply
    them)."""
    md, tensors = _read(path)
    if (md.get("clip.projector_type") or md.get("clip.vision.projector_type")) \
            in QWEN_PROJECTORS:  # Qwen2-VL, Qwen2.5-VL: their own encoder
        qwen = load_qwen_mmproj(md, tensors, _as_float, text_hidden, tokenizer, _token)
        return qwen.to(device=device, dtype=dtype).eval()  # type: ignore[return-value]
    spec = mmproj_spec(md, set(tensors), tokenizer)
    encoder = ImageEncoder(spec, text_hidden)
    tensors = _ffn_unswapped(tensors, spec.tower.intermediate)
    kept = set()
    if packed if packed is not None else on_host(device):
        for name, t in tensors.items():
            ours = encoder_name(name)
            if ours is not None and t.tensor_type.value not in _FLOAT_TYPES \
                    and _pack(encoder, ours, t):
                kept.add(name)
    for name, t in tensors.items():
        ours = encoder_name(name)
        if ours is None or name in kept:
            continue
        w = _as_float(t)
        if name == "mm.soft_emb_norm.weight":  # stored as 1 + w (Gemma's norms)
            w = w - 1.0
        encoder.load_checkpoint_tensor(ours, torch.from_numpy(w))
    missing = [n for n in encoder.missing_weights()  # (a tower without its final norm)
               if spec.tower.post_norm or not n.startswith("vision_tower.post_layernorm.")]
    if missing:
        raise ValueError(f"--mmproj {path}: missing tensors for {', '.join(missing[:4])}")
    return encoder.to(device=device, dtype=dtype).eval()
