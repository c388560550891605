"""Vision families as data: what the tower, the connector and the processor of each are.

As ``family.py`` describes a decoder, :func:`describe_vision` reads a multimodal checkpoint's
transformers config (and its ``preprocessor_config.json``, where the processor's numbers
live) into a :class:`VisionSpec`: the tower's sizes and switches (CLIP or SigLIP), which of its
layers feeds the connector, the connector's kind, the image processing, and how an image's
placeholder tokens look in the prompt. A new family is a describer here and its
architecture name in ``registry.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncengine.executor.models.vision.qwen_spec import (
    MAX_PIXELS,
    MIN_PIXELS,
    QwenTowerSpec,
    qwen_processing,
    qwen_tower,
)

#: OpenAI CLIP's normalization (transformers' OPENAI_CLIP_MEAN / _STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class TowerSpec:
    """A ViT over square patches (CLIP's or SigLIP's vision model)."""

    hidden: int
    intermediate: int
    num_heads: int
    num_layers: int  # in the checkpoint
    image_size: int
    patch_size: int
    activation: str  # quick_gelu, gelu, gelu_pytorch_tanh
    norm_eps: float
    class_token: bool  # CLIP: a class embedding before the patches and a pre-norm
    patch_bias: bool  # SigLIP's patch convolution has a bias, CLIP's none
    # The hidden states the connector reads: after this many layers (CLIP's feature layer
    # -2 of 24 is 23); post_norm: then the tower's final norm (SigLIP's last layer).
    feature_layers: int
    post_norm: bool = False
    # Idefics3's SigLIP: positions by bucketing fractional patch coordinates (NaViT), which
    # is not the identity for every grid side.
    navit_positions: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class ImageProcessing:
    """Resize (shortest edge, or both sides), center crop, rescale, normalize."""

    shortest_edge: int | None
    size: tuple[int, int] | None  # (height, width) when resized to a fixed size
    crop: tuple[int, int] | None
    resample: int  # PIL's filter number (3: bicubic)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    # Idefics3: the longest edge resized to this first, then the image cut into ``tile``-px
    # squares (with the whole image at ``tile`` px after them) when ``split``.
    longest_edge: int | None = None
    tile: int | None = None
    split: bool = False
    # LLaVA-NeXT (anyres): the grid resolutions (height, width) an image is fitted to.
    pinpoints: tuple[tuple[int, int], ...] = ()
    # Qwen2-VL: resized to multiples of a merged patch with an area between these.
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class VisionSpec:
    family: str
    tower: TowerSpec | QwenTowerSpec
    # "llava_mlp", "gemma3" (avg-pool, soft-embedding norm, projection), "pixel_shuffle"
    # (Idefics3: space to depth by ``scale_factor``, then a projection) or "qwen_merger"
    connector: str
    connector_act: str
    processing: ImageProcessing
    image_token_id: int  # the placeholder token, repeated once per embedding
    tokens_per_image: int
    drop_class_token: bool = False  # LLaVA's "default" feature strategy
    # The token a prompt (a chat template) holds for one image, and the tokens around the
    # image's placeholders once expanded (as text: the processor expands the text, then
    # tokenizes): LLaVA's ``<image>`` becomes the placeholders alone; Gemma 3's
    # ``<start_of_image>`` becomes ``\n\n<start_of_image>`` + placeholders +
    # ``<end_of_image>\n\n``. Token ids; None: the image token itself, nothing around.
    prompt_token_id: int | None = None
    before: tuple[str | int, ...] = ()
    after: tuple[str | int, ...] = ()
    # Each image's placeholders attend to each other both ways (Gemma 3), so a prefill chunk
    # never ends inside one (``core/multimodal.py``).
    bidirectional: bool = False
    # How an image becomes placeholders: "fixed" (one run of ``tokens_per_image``),
    # "idefics3" (a run of ``tokens_per_image`` per tile, tagged with its row and column)
    # or "anyres" (LLaVA-NeXT: one run whose length follows the image's size), "qwen" (one
    # run of the image's merged patches, whose number follows its size; M-RoPE positions).
    layout: str = "fixed"
    scale_factor: int = 1
    image_newline: bool = False  # LLaVA-NeXT: a learned embedding ends each row of patches
    # The tokens an image of a chat message is written between around the image token
    # (Qwen2-VL's ``<|vision_start|>``, ``<|vision_end|>``: its chat template writes them,
    # its processor expands only the image token between them).
    wrap: tuple[int, int] | None = None


def _clip_tower(vc: Any, feature_layer: int) -> TowerSpec:
    layers = vc.num_hidden_layers
    used = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is outside the tower's "
                         f"{layers} layers")
    return TowerSpec(hidden=vc.hidden_size, intermediate=vc.intermediate_size,
                     num_heads=vc.num_attention_heads, num_layers=layers,
                     image_size=vc.image_size, patch_size=vc.patch_size,
                     activation=vc.hidden_act, norm_eps=float(vc.layer_norm_eps),
                     class_token=True, patch_bias=False, feature_layers=used)


def _llava(config: Any) -> VisionSpec:
    vc = config.vision_config
    if getattr(vc, "model_type", "") != "clip_vision_model":
        raise ValueError(f"{config.model_type}: vision tower {vc.model_type!r} is not "
                         "supported (only CLIP)")
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError("llava: several vision_feature_layer values are not supported")
    strategy = config.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"llava: vision_feature_select_strategy {strategy!r} is not supported")
    tower = _clip_tower(vc, layer)
    size = vc.image_size
    tokens = tower.num_patches + (0 if strategy == "default" else 1)
    return VisionSpec(
        family="llava", tower=tower, connector="llava_mlp",
        connector_act=config.projector_hidden_act,
        processing=ImageProcessing(shortest_edge=size, size=None, crop=(size, size), resample=3,
                                   mean=CLIP_MEAN, std=CLIP_STD),
        image_token_id=config.image_token_index, tokens_per_image=tokens,
        drop_class_token=strategy == "default")


def _gemma3(config: Any) -> VisionSpec:
    vc = config.vision_config
    if getattr(vc, "model_type", "") != "siglip_vision_model":
        raise ValueError(f"gemma3: vision tower {vc.model_type!r} is not supported (SigLIP)")
    tower = TowerSpec(hidden=vc.hidden_size, intermediate=vc.intermediate_size,
                      num_heads=vc.num_attention_heads, num_layers=vc.num_hidden_layers,
                      image_size=vc.image_size, patch_size=vc.patch_size,
                      activation=vc.hidden_act, norm_eps=float(vc.layer_norm_eps),
                      class_token=False, patch_bias=True,
                      feature_layers=vc.num_hidden_layers, post_norm=True)
    tokens = int(config.mm_tokens_per_image)
    side = int(tokens**0.5)
    if side * side != tokens or (vc.image_size // vc.patch_size) % side:
        raise ValueError(f"gemma3: mm_tokens_per_image {tokens} does not pool the tower's "
                         f"{vc.image_size // vc.patch_size}^2 patches evenly")
    size = vc.image_size
    return VisionSpec(
        family="gemma3", tower=tower, connector="gemma3", connector_act="",
        processing=ImageProcessing(shortest_edge=None, size=(size, size), crop=None,
                                   resample=2, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
        image_token_id=config.image_token_index, tokens_per_image=tokens,
        prompt_token_id=config.boi_token_index,
        before=("\n\n", config.boi_token_index), after=(config.eoi_token_index, "\n\n"),
        bidirectional=True)


def _llava_next(config: Any) -> VisionSpec:
    spec = _llava(config)
    if not spec.drop_class_token:
        raise ValueError("llava_next: only vision_feature_select_strategy 'default' is "
                         "supported")
    pinpoints = tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints)
    size = config.vision_config.image_size
    if not pinpoints or any(h % size or w % size for h, w in pinpoints):
        raise ValueError(f"llava_next: image_grid_pinpoints {pinpoints} are not multiples of "
                         f"the tower's {size} px")
    return replace(spec, family="llava_next", layout="anyres", image_newline=True,
                   processing=replace(spec.processing, pinpoints=pinpoints))


def _idefics3(config: Any) -> VisionSpec:
    """Idefics3 and SmolVLM: SigLIP over tiles, the pixel-shuffle connector, Llama."""
    vc = config.vision_config
    tower = TowerSpec(hidden=vc.hidden_size, intermediate=vc.intermediate_size,
                      num_heads=vc.num_attention_heads, num_layers=vc.num_hidden_layers,
                      image_size=vc.image_size, patch_size=vc.patch_size,
                      activation=vc.hidden_act, norm_eps=float(vc.layer_norm_eps),
                      class_token=False, patch_bias=True, feature_layers=vc.num_hidden_layers,
                      post_norm=True, navit_positions=True)
    scale = int(config.scale_factor)
    side = vc.image_size // vc.patch_size
    if side % scale:
        raise ValueError(f"{config.model_type}: scale_factor {scale} does not divide the "
                         f"tower's {side} patches a side")
    size = vc.image_size
    return VisionSpec(
        family=config.model_type, tower=tower, connector="pixel_shuffle", connector_act="",
        processing=ImageProcessing(shortest_edge=None, size=None, crop=None, resample=1,
                                   mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                                   longest_edge=4 * size, tile=size, split=True),
        image_token_id=config.image_token_id, tokens_per_image=(side // scale) ** 2,
        layout="idefics3", scale_factor=scale)


def _qwen_vl(config: Any) -> VisionSpec:
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: dynamic resolution, the patch merger, M-RoPE."""
    mean, std = ((0.5,) * 3,) * 2 if config.model_type == "qwen3_vl" else (CLIP_MEAN, CLIP_STD)
    return VisionSpec(
        family=config.model_type, tower=qwen_tower(config), connector="qwen_merger",
        connector_act="", processing=ImageProcessing(
            shortest_edge=None, size=None, crop=None, resample=3, mean=mean, std=std,
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        image_token_id=config.image_token_id, tokens_per_image=0, layout="qwen",
        wrap=(config.vision_start_token_id, config.vision_end_token_id))


#: model_type -> describer
VISION_FAMILIES: dict[str, Callable[[Any], VisionSpec]] = {
    "llava": _llava, "gemma3": _gemma3, "llava_next": _llava_next,
    "idefics3": _idefics3, "smolvlm": _idefics3, "qwen2_vl": _qwen_vl, "qwen2_5_vl": _qwen_vl,
    "qwen3_vl": _qwen_vl}


def describe_vision(config: Any) -> VisionSpec | None:
    """The image side of a multimodal config (None for a text-only model)."""
    fn = VISION_FAMILIES.get(getattr(config, "model_type", ""))
    return fn(config) if fn is not None else None


def _image_processor_config(model_dir: str | None) -> dict[str, Any] | None:
    """``preprocessor_config.json``, or the ``image_processor`` of ``processor_config.json``
    (where transformers 5 saves it)."""
    if not model_dir:
        return None
    path = Path(model_dir, "preprocessor_config.json")
    if path.is_file():
        return json.loads(path.read_text())
    path = Path(model_dir, "processor_config.json")
    if path.is_file():
        inner = json.loads(path.read_text()).get("image_processor")
        return inner if isinstance(inner, dict) else None
    return None


def with_preprocessor_config(spec: VisionSpec, model_dir: str | None) -> VisionSpec:
    """The processing numbers of the checkpoint's image processor config, if it has one
    (sizes, filter, mean and std, tiling); the tower's defaults otherwise."""
    cfg = _image_processor_config(model_dir)
    if cfg is None:
        return spec
    p = spec.processing
    size = cfg.get("size")
    shortest, fixed = p.shortest_edge, p.size
    longest = p.longest_edge
    if isinstance(size, dict) and "longest_edge" in size:
        longest = int(size["longest_edge"])
    elif isinstance(size, dict) and "shortest_edge" in size:
        shortest, fixed = int(size["shortest_edge"]), None
    elif isinstance(size, dict) and "height" in size:
        shortest, fixed = None, (int(size["height"]), int(size["width"]))
    crop = cfg.get("crop_size")
    if not cfg.get("do_center_crop", p.crop is not None):
        crop = None
    elif isinstance(crop, dict):
        crop = (int(crop["height"]), int(crop["width"]))
    elif isinstance(crop, int):
        crop = (crop, crop)
    else:
        crop = p.crop
    processing = replace(
        p, shortest_edge=shortest, size=fixed, crop=crop,
        resample=int(cfg.get("resample", p.resample)),
        mean=tuple(cfg.get("image_mean", p.mean)), std=tuple(cfg.get("image_std", p.std)),
        rescale=float(cfg.get("rescale_factor", p.rescale)), longest_edge=longest,
        split=bool(cfg.get("do_image_splitting", p.split)))
    if p.tile is not None:  # (the tile stays the tower's size: its position table's)
        tile = (cfg.get("max_image_size") or {}).get("longest_edge", p.tile)
        if int(tile) != p.tile:
            raise ValueError(f"max_image_size {tile} is not the vision tower's {p.tile} px")
    if cfg.get("image_grid_pinpoints"):
        processing = replace(processing, pinpoints=tuple(
            (int(h), int(w)) for h, w in cfg["image_grid_pinpoints"]))
    if isinstance(spec.tower, QwenTowerSpec):
        processing = qwen_processing(cfg, processing, spec.tower)
    return replace(spec, processing=processing)
