"""Qwen2-VL's image processing, as transformers' ``Qwen2VLImageProcessor`` does it: the image
resized (bicubic) to the nearest multiples of a merged patch whose area is within
``[min_pixels, max_pixels]`` (``smart_resize``), rescaled and normalized, then cut into
patches: each a flat ``3 x temporal_patch_size x patch x patch`` vector (the image repeated
as every frame), in the order the merger reads them (each ``merge x merge`` block of
neighbours together, blocks row by row). Runs off the loop; numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncengine.executor.models.vision.processor import normalize, rgb


@dataclass(frozen=True, eq=False)
class QwenPixels:
    """One image for the tower: its patches ``[t * h * w, patch_dim]`` (float32) and its
    grid ``(t, h, w)`` in patches."""

    patches: np.ndarray
    grid: tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """(height, width) as multiples of ``factor``, near the image's own, with an area in
    ``[min_pixels, max_pixels]`` (the aspect ratio kept as far as it goes)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be below 200, got "
                         f"{max(height, width) / min(height, width):.0f} ({width}x{height})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def qwen_grid(width: int, height: int, p: Any, tower: Any) -> tuple[int, int, int]:
    """The patch grid ``(t, h, w)`` of an image of that size (no pixels needed)."""
    h, w = smart_resize(height, width, tower.patch_size * tower.merge_size, p.min_pixels,
                        p.max_pixels)
    return 1, h // tower.patch_size, w // tower.patch_size


def qwen_pixels(image: Any, p: Any, tower: Any) -> QwenPixels:
    """A PIL image -> its patches and grid (``p``: the spec's ``ImageProcessing``)."""
    image = rgb(image)
    _, gh, gw = qwen_grid(image.width, image.height, p, tower)
    size = (gw * tower.patch_size, gh * tower.patch_size)
    if size != image.size:
        image = image.resize(size, resample=p.resample)
    x = normalize(np.asarray(image), p)  # [3, H, W]
    ps, m, frames = tower.patch_size, tower.merge_size, tower.temporal_patch_size
    x = x.reshape(3, gh // m, m, ps, gw // m, m, ps)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (blocks h, blocks w, m, m, C, ps, ps)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], frames, ps, ps))
    return QwenPixels(np.ascontiguousarray(x.reshape(gh * gw, tower.patch_dim)), (1, gh, gw))
