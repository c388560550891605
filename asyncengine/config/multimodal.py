"""Images in: vLLM's multimodal flags (``--allowed-media-domains``,
``--allowed-local-media-path``, ``--limit-mm-per-prompt``) and the limits that keep fetching
and decoding safe (``entrypoints/http/media.py`` applies them; the engine the per-prompt limit
and the encoder cache's budget)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Modalities a ``--limit-mm-per-prompt`` may name (only images are read today).
MODALITIES = ("image",)

#: The image processors' options ``--mm-processor-kwargs`` and a request's
#: ``mm_processor_kwargs`` may set (transformers' names), with their types; each family
#: takes those its processor has (``executor/models/vision/spec.py``).
MM_PROCESSOR_KWARGS: dict[str, type] = {
    "do_pan_and_scan": bool, "pan_and_scan_min_crop_size": int,
    "pan_and_scan_max_num_crops": int, "pan_and_scan_min_ratio_to_activate": float}


def json_object(value: Any, name: str, example: str) -> dict[str, Any]:
    """``value`` (a dict, or its JSON) as a dict; ValueError naming ``name`` otherwise."""
    given = value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object such as '{example}', got {given!r}")
    return value


def check_processor_kwargs(value: Any, name: str) -> dict[str, Any]:
    """``value`` (a dict, or its JSON) as processor options; ValueError naming ``name`` on
    an unknown key or a value of the wrong type."""
    value = json_object(value, name, '{"do_pan_and_scan": true}')
    out: dict[str, Any] = {}
    for key, v in value.items():
        kind = MM_PROCESSOR_KWARGS.get(key)
        if kind is None:
            raise ValueError(f"{name}: unknown key {key!r} (known: "
                             f"{', '.join(MM_PROCESSOR_KWARGS)})")
        ok = isinstance(v, bool) if kind is bool else (
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0
            and (kind is float or float(v).is_integer()))
        if not ok:
            what = "true or false" if kind is bool else f"a positive {kind.__name__}"
            raise ValueError(f"{name}: {key} must be {what}, got {v!r}")
        out[key] = kind(v)
    return out


@dataclass
class MultiModalConfig:
    allowed_media_domains: list[str] | None = field(default=None, metadata={
        "help": "host names the server may fetch http(s) image URLs from (exact names; "
                "default: any host whose addresses are all public: loopback, private, "
                "link-local and reserved addresses are never fetched unless their name is "
                "listed here)", "nargs": "+"})
    allowed_local_media_path: str | None = field(default=None, metadata={
        "help": "a directory file:// image URLs may be read from (default: none: file URLs "
                "are refused)"})
    limit_mm_per_prompt: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "most items of each modality in one prompt, a JSON object, e.g. "
                "'{\"image\": 4}' (default: 8 images)"})
    media_fetch_timeout: float = field(default=5.0, metadata={
        "help": "seconds a fetch of one image URL may take, redirects included"})
    max_media_bytes: str = field(default="20MiB", metadata={
        "help": "largest image, fetched or inline, in bytes before decoding (e.g. 20MiB)"})
    max_image_pixels: int = field(default=40_000_000, metadata={
        "help": "largest image in pixels (width x height), checked before decoding: "
                "decompression bombs are refused"})
    mm_encoder_cache: int = field(default=16384, metadata={
        "help": "the vision encoder's outputs kept for reuse, in image tokens (least "
                "recently used first out); an image is encoded once while it stays"})
    mm_processor_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "options of the image processor every request starts from, a JSON object "
                "(transformers' names), e.g. '{\"do_pan_and_scan\": true}' for Gemma 3; a "
                "request's own mm_processor_kwargs override them key by key"})
    max_num_encoder_input_tokens: int | None = field(default=None, metadata={
        "help": "the image tokens the vision encoder may compute in one step (vLLM's "
                "max_num_encoder_input_tokens; default: --max-num-batched-tokens); a prefill "
                "chunk ends before an image that is neither cached nor within what is left, "
                "and the image is encoded in a later step (the first image of a step always "
                "is)"})

    @property
    def image_limit(self) -> int:
        limits = self.limit_mm_per_prompt
        return 8 if limits is None else int(limits.get("image", 8))  # type: ignore[union-attr]


def validate_multimodal(mc: MultiModalConfig) -> None:
    """Normalize the flags; raise ValueError naming the flag on a bad value
    (``--max-media-bytes`` is read by ``EngineConfig.validate``, with the other sizes)."""
    limits = mc.limit_mm_per_prompt
    if isinstance(limits, str):
        limits = json_object(limits, "--limit-mm-per-prompt", '{"image": 4}')
    for key, value in (limits or {}).items():
        if key not in MODALITIES and key not in ("video", "audio"):
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {key!r} (known: "
                             f"{', '.join(MODALITIES)})")
        if isinstance(value, dict):  # vLLM's {"image": {"count": 4, ...}}
            value = value.get("count")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--limit-mm-per-prompt: {key} must be a count >= 0, got "
                             f"{value!r}")
        limits[key] = value
    mc.limit_mm_per_prompt = limits
    if mc.mm_processor_kwargs is not None:
        mc.mm_processor_kwargs = check_processor_kwargs(mc.mm_processor_kwargs,
                                                        "--mm-processor-kwargs")
    if isinstance(mc.allowed_media_domains, str):
        mc.allowed_media_domains = [mc.allowed_media_domains]
    if mc.allowed_media_domains is not None:
        domains = [d.strip().lower().rstrip(".") for item in mc.allowed_media_domains
                   for d in str(item).split(",") if d.strip()]
        if not domains:
            raise ValueError("--allowed-media-domains: give one or more host names")
        mc.allowed_media_domains = domains
    path = mc.allowed_local_media_path
    if path is not None and not Path(path).is_dir():
        raise ValueError(f"--allowed-local-media-path: {path!r} is not a directory")
    if not mc.media_fetch_timeout > 0:
        raise ValueError(f"--media-fetch-timeout: must be positive, got "
                         f"{mc.media_fetch_timeout!r}")
    for name in ("max_image_pixels", "mm_encoder_cache", "max_num_encoder_input_tokens"):
        value = getattr(mc, name)
        if value is None and name == "max_num_encoder_input_tokens":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer, got "
                             f"{value!r}")
