"""Images cut into tiles, as transformers' processors cut them (PIL resizes, numpy crops), and
what each image becomes in the prompt. Runs off the loop; no torch.

- Idefics3 / SmolVLM: the longest edge resized to ``longest_edge``, the image resized up to
  whole ``tile``-px squares and cut into them, row by row, then the whole image at ``tile``
  px (the global image). Each tile is a run of placeholders after
  ``<fake_token_around_image><row_R_col_C>``, each row ends with a newline, and the global
  image's run sits between ``<fake_token_around_image><global-img>`` and
  ``<fake_token_around_image>``.
- LLaVA-NeXT (anyres): the grid resolution that keeps the most of the image and wastes the
  least, the image fitted into it and padded to its center, cut into ``tile``-px patches,
  after the whole image squeezed to one patch (the base). The encoder's output (the base's
  features, then the grid's with the padding cut off and a newline embedding after each row)
  is one run whose length follows the image's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncengine.core.multimodal import ImageLayout, ImageRun
from asyncengine.executor.models.vision.processor import normalize, process_image, rgb
from asyncengine.executor.models.vision.spec import ImageProcessing

#: Idefics3's absolute upper bound on a resized side.
MAX_IMAGE_SIZE = 4096
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


def _resize(image: Any, width: int, height: int, resample: int) -> Any:
    return image if image.size == (width, height) else image.resize((width, height), resample)


# -- Idefics3 / SmolVLM --------------------------------------------------------------------------
def _longest_to(h: int, w: int, max_len: int) -> tuple[int, int]:
    ratio = w / h
    if w >= h:
        w, h = max_len, int(max_len / ratio)
        h += h % 2
    else:
        h, w = max_len, int(max_len * ratio)
        w += w % 2
    return max(h, 1), max(w, 1)


def _below(h: int, w: int, max_len: int) -> tuple[int, int]:
    ratio = w / h
    if w >= h and w > max_len:
        w, h = max_len, int(max_len / ratio)
    elif h > w and h > max_len:
        h, w = max_len, int(max_len * ratio)
    return max(h, 1), max(w, 1)


def _whole_tiles(h: int, w: int, m: int) -> tuple[int, int]:
    ratio = w / h
    if w >= h:
        w = math.ceil(w / m) * m
        h = math.ceil(int(w / ratio) / m) * m
    else:
        h = math.ceil(h / m) * m
        w = math.ceil(int(h * ratio) / m) * m
    return h, w


def _idefics3_sizes(width: int, height: int, p: ImageProcessing
                    ) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """((width, height) after the first resize, (width, height) cut into tiles or None)."""
    h, w = height, width
    if p.longest_edge:
        h, w = _below(*_longest_to(h, w, p.longest_edge), MAX_IMAGE_SIZE)
    if not p.split:
        return (w, h), None
    th, tw = _whole_tiles(h, w, p.tile)
    return (w, h), (tw, th)


def _grid(tiled: tuple[int, int] | None, m: int) -> tuple[int, int]:
    if tiled is None or (tiled[0] <= m and tiled[1] <= m):
        return 0, 0
    return tiled[1] // m, tiled[0] // m


def idefics3_grid(width: int, height: int, p: ImageProcessing) -> tuple[int, int]:
    """(rows, columns) of tiles (0, 0: the global image alone)."""
    return _grid(_idefics3_sizes(width, height, p)[1], p.tile)


def idefics3_tiles(image: Any, p: ImageProcessing) -> tuple[list[np.ndarray], int, int]:
    """An image -> its tiles' pixels (row by row, the global image last), rows, columns."""
    image = rgb(image)
    first, tiled = _idefics3_sizes(image.width, image.height, p)
    image = _resize(image, *first, p.resample)
    m = p.tile
    if tiled is None:
        return [normalize(np.asarray(_resize(image, m, m, p.resample)), p)], 0, 0
    image = _resize(image, *tiled, p.resample)
    rows, cols = _grid(tiled, m)
    if not rows:
        return [normalize(np.asarray(image), p)], 0, 0
    x = np.asarray(image)
    tiles = [normalize(x[r * m:(r + 1) * m, c * m:(c + 1) * m], p)
             for r in range(rows) for c in range(cols)]
    tiles.append(normalize(np.asarray(_resize(image, m, m, p.resample)), p))
    return tiles, rows, cols


def idefics3_layout(rows: int, cols: int, tokens: int, tiles: list[Any] | None
                    ) -> ImageLayout:
    """The image's sequence: each tile's run behind its tag, the global image's last."""
    data = iter(tiles) if tiles is not None else None

    def run() -> ImageRun:
        return ImageRun(tokens, next(data) if data is not None else None)

    pieces: list[str | int | ImageRun] = []
    for r in range(rows):
        for c in range(cols):
            pieces += [f"{FAKE}<row_{r + 1}_col_{c + 1}>", run()]
        pieces.append("\n")
    pieces += [("\n" if rows else "") + FAKE + GLOBAL, run(), FAKE]
    return _joined(pieces)


def _joined(pieces: list[str | int | ImageRun]) -> ImageLayout:
    out: list[str | int | ImageRun] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return tuple(out)


# -- LLaVA-NeXT (anyres) -------------------------------------------------------------------------
@dataclass(frozen=True)
class AnyresPixels:
    """The encoder's input for one image: the base and the grid's patches ``[1 + rows *
    cols, 3, tile, tile]``, and the image's original (height, width)."""

    patches: np.ndarray
    size: tuple[int, int]


def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]
                    ) -> tuple[int, int]:
    """The grid resolution (height, width) keeping the most of the image, then wasting the
    least (transformers' ``select_best_resolution``)."""
    best, most, least = pinpoints[0], 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (h, w), effective, wasted
    return best


def _fitted(height: int, width: int, bh: int, bw: int) -> tuple[int, int]:
    if bw / width < bh / height:
        return min(math.ceil(height * (bw / width)), bh), bw
    return bh, min(math.ceil(width * (bh / height)), bw)


def anyres_grid(height: int, width: int, pinpoints: tuple[tuple[int, int], ...], tile: int,
                side: int) -> tuple[int, int, int, int]:
    """(rows, columns) of patches and the (height, width) in features of the grid once its
    padding is cut off; ``side``: features a patch side."""
    bh, bw = best_resolution(height, width, pinpoints)
    rows, cols = bh // tile, bw // tile
    fh, fw = rows * side, cols * side
    if width / height > fw / fh:
        pad = (fh - int(round(height * (fw / width), 7))) // 2
        fh -= 2 * pad
    else:
        pad = (fw - int(round(width * (fh / height), 7))) // 2
        fw -= 2 * pad
    return rows, cols, fh, fw


def anyres_tokens(height: int, width: int, p: ImageProcessing, side: int) -> int:
    """An image's placeholders: the base patch's features, then each grid row's and its
    newline."""
    _, _, fh, fw = anyres_grid(height, width, p.pinpoints, _tile(p), side)
    return side * side + fh * (fw + 1)


def _tile(p: ImageProcessing) -> int:
    if p.crop is not None:
        return p.crop[0]
    return p.size[0] if p.size is not None else p.shortest_edge


def anyres_pixels(image: Any, p: ImageProcessing) -> AnyresPixels:
    from PIL import Image

    image = rgb(image)
    h, w = image.height, image.width
    bh, bw = best_resolution(h, w, p.pinpoints)
    nh, nw = _fitted(h, w, bh, bw)
    canvas = np.zeros((bh, bw, 3), dtype=np.uint8)
    top, left = (bh - nh) // 2, (bw - nw) // 2
    canvas[top:top + nh, left:left + nw] = np.asarray(_resize(image, nw, nh, p.resample))
    s = _tile(p)
    base_h, base_w = p.size if p.size is not None else (p.shortest_edge, p.shortest_edge)
    patches = [process_image(_resize(image, base_w, base_h, p.resample), p)]
    patches += [process_image(Image.fromarray(canvas[i:i + s, j:j + s]), p)
                for i in range(0, bh, s) for j in range(0, bw, s)]
    return AnyresPixels(np.stack(patches), (h, w))
