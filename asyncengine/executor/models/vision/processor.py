"""Image processing as transformers' image processors do it (PIL resize, then numpy):
resize, center crop, rescale, normalize -> float32 ``[3, H, W]``. Runs off the loop.
(Idefics3's tiles and LLaVA-NeXT's anyres grid: ``tiling.py``.)"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncengine.executor.models.vision.spec import ImageProcessing


def resized_size(width: int, height: int, p: ImageProcessing) -> tuple[int, int]:
    """(width, height) after the resize step."""
    if p.size is not None:
        return p.size[1], p.size[0]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = p.shortest_edge, int(p.shortest_edge * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def process_image(image: Any, p: ImageProcessing) -> np.ndarray:
    """A PIL RGB image -> pixel values ``[3, H, W]`` (float32)."""
    image = rgb(image)
    size = resized_size(image.width, image.height, p)
    if size != image.size:
        image = image.resize(size, resample=p.resample)
    x = np.asarray(image)  # [H, W, 3] uint8
    if p.crop is not None:
        ch, cw = p.crop
        h, w = x.shape[:2]
        if ch > h or cw > w:  # transformers pads with zeros around the image
            padded = np.zeros((max(h, ch), max(w, cw), 3), dtype=x.dtype)
            top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
            padded[top:top + h, left:left + w] = x
            x, h, w = padded, padded.shape[0], padded.shape[1]
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[top:top + ch, left:left + cw]
    return normalize(x, p)


def rgb(image: Any) -> Any:
    return image.convert("RGB") if image.mode != "RGB" else image


def normalize(x: np.ndarray, p: ImageProcessing) -> np.ndarray:
    """uint8 ``[H, W, 3]`` -> rescaled, normalized float32 ``[3, H, W]``."""
    x = (x.astype(np.float64) * p.rescale).astype(np.float32)
    x = (x - np.asarray(p.mean, dtype=np.float32)) / np.asarray(p.std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))
