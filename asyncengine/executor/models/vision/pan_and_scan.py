"""Gemma 3's pan-and-scan (off by default, as in transformers): an image much wider than tall
(or taller than wide) is also cut into 2..``max_num_crops`` crops along its long side, each
encoded as an image of its own after the whole image, as ``Gemma3ImageProcessor`` cuts them
(``do_pan_and_scan``) and ``Gemma3Processor`` writes them in the prompt ("Here is the
original image ... and here are some crops to help you see better ...").

Turned on by ``--mm-processor-kwargs '{"do_pan_and_scan": true}'`` or a request's
``mm_processor_kwargs`` (vLLM's names); the other keys tune it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The processor options each family takes (``config.multimodal.MM_PROCESSOR_KWARGS``
#: names them all).
FAMILY_KWARGS: dict[str, frozenset[str]] = {
    "gemma3": frozenset({"do_pan_and_scan", "pan_and_scan_min_crop_size",
                         "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate"}),
}

ORIGINAL = "Here is the original image "
CROPS = " and here are some crops to help you see better "


def check_family_kwargs(family: str, kwargs: dict[str, Any] | None, name: str) -> None:
    """ValueError naming ``name`` for an option the family's processor does not have."""
    other = set(kwargs or ()) - FAMILY_KWARGS.get(family, frozenset())
    if other:
        raise ValueError(f"{name}: {', '.join(sorted(other))}: not an option of {family}'s "
                         f"image processor (it takes: "
                         f"{', '.join(sorted(FAMILY_KWARGS.get(family, ()))) or 'none'})")


@dataclass(frozen=True)
class PanAndScan:
    """Gemma3Processor's defaults."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    @classmethod
    def of(cls, kwargs: dict[str, Any] | None) -> PanAndScan | None:
        """The options, None when pan-and-scan is off."""
        kwargs = kwargs or {}
        if not kwargs.get("do_pan_and_scan"):
            return None
        d = cls()
        return cls(kwargs.get("pan_and_scan_min_crop_size", d.min_crop_size),
                   kwargs.get("pan_and_scan_max_num_crops", d.max_num_crops),
                   kwargs.get("pan_and_scan_min_ratio_to_activate", d.min_ratio_to_activate))


def crop_boxes(width: int, height: int, pas: PanAndScan) -> list[tuple[int, int, int, int]]:
    """The crops of a ``width`` x ``height`` image, as PIL boxes (left, top, right, bottom),
    row by row; none when the image is not elongated enough or the crops would be too
    small."""
    long, short = (width, height) if width >= height else (height, width)
    if long / short < pas.min_ratio_to_activate:
        return []
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / pas.min_crop_size)))
    n = min(pas.max_num_crops, max(2, n))
    cols, rows = (n, 1) if width >= height else (1, n)
    cw, ch = math.ceil(width / cols), math.ceil(height / rows)
    if min(cw, ch) < pas.min_crop_size:
        return []
    return [(c * cw, r * ch, min(width, c * cw + cw), min(height, r * ch + ch))
            for r in range(rows) for c in range(cols)]


def pan_and_scan_layout(image_sequence: tuple[Any, ...], runs: list[Any]) -> tuple[Any, ...]:
    """The prompt's sequence for an image and its crops: ``image_sequence`` is one image's
    (``before``, a marker for the run, ``after``), repeated with each of ``runs`` (the whole
    image's first)."""
    def one(run: Any) -> tuple[Any, ...]:
        return tuple(run if p is None else p for p in image_sequence)

    out: tuple[Any, ...] = (ORIGINAL, *one(runs[0]), CROPS)
    for i, run in enumerate(runs[1:]):
        out += (" ",) * (i > 0) + one(run)
    return out
