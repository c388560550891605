"""A llama.cpp vision projector file (``--mmproj``, llama-server's ``-mm``): the image side of
a GGUF model, as llama.cpp's converters write it (``convert_hf_to_gguf.py --mmproj``, and the
legacy LLaVA converter).

The file's ``clip.*`` metadata becomes a :class:`~spec.VisionSpec` (projector types ``mlp``:
LLaVA-1.5's CLIP and MLP; ``idefics3``: SmolVLM's SigLIP tiles and pixel shuffle; ``gemma3``:
Gemma 3's SigLIP and pooling projector) and its tensors load into the same
:class:`~encoder.ImageEncoder` a safetensors checkpoint builds, dequantized to the model's
dtype. The placeholder tokens are the tokenizer's (the text GGUF has no vision config):
``<image>``; Gemma 3's ``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``.
Image processing is the family's transformers processing with the file's mean and std, so a
GGUF + mmproj pair answers as the safetensors checkpoint it was converted from.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from asyncengine.executor.models.vision.encoder import ImageEncoder
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
                         f"{', '.join(PROJECTORS)})")
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
        return VisionSpec(
            family="llava", tower=tower, connector="llava_mlp", connector_act="gelu",
            processing=ImageProcessing(shortest_edge=size, size=None, crop=(size, size),
                                       resample=3, mean=mean, std=std),
            image_token_id=_token(tokenizer, "<image>"), tokens_per_image=side * side,
            drop_class_token=tower.class_token)
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


def _read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors dequantized to float32 in transformers' shapes)."""
    import gguf
    from gguf.quants import dequantize

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
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = dequantize(t.data, t.tensor_type) if t.tensor_type.value > 1 else t.data
        tensors[t.name] = np.asarray(data, dtype=np.float32).reshape(shape)
    return md, tensors


def load_mmproj(path: str, text_hidden: int, tokenizer: Any, dtype: torch.dtype,
                device: torch.device) -> ImageEncoder:
    """The image encoder of an mmproj file, on ``device`` in ``dtype``."""
    md, tensors = _read(path)
    spec = mmproj_spec(md, set(tensors), tokenizer)
    encoder = ImageEncoder(spec, text_hidden)
    fc = tensors.get("v.blk.0.ffn_up.weight")
    swapped = fc is not None and fc.shape[0] != spec.tower.intermediate  # the legacy converter
    for name, w in tensors.items():
        if swapped and ".ffn_" in name:
            name = name.replace(".ffn_up.", ".ffn_x.").replace(".ffn_down.", ".ffn_up.") \
                .replace(".ffn_x.", ".ffn_down.")
        ours = encoder_name(name)
        if ours is None:
            continue
        if name == "mm.soft_emb_norm.weight":  # stored as 1 + w (Gemma's norms)
            w = w - 1.0
        if ours.endswith("class_embedding") or ours.endswith("position_embedding.weight"):
            w = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w
        encoder.load_checkpoint_tensor(ours, torch.from_numpy(np.array(w, dtype=np.float32)))
    missing = [n for n in encoder.missing_weights()  # (a tower without its final norm)
               if spec.tower.post_norm or not n.startswith("vision_tower.post_layernorm.")]
    if missing:
        raise ValueError(f"--mmproj {path}: missing tensors for {', '.join(missing[:4])}")
    return encoder.to(device=device, dtype=dtype).eval()
