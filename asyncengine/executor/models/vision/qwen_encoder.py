"""The image encoder of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the processor
(``qwen_processor.py``), the tower with its merger (``qwen_tower.py``), and the prompt's M-RoPE
positions, which follow the images' grids (``executor/models/mrope_positions.py``). The same
interface as :class:`~asyncengine.executor.models.vision.encoder.ImageEncoder`: ``process``
and ``layout`` off the loop, ``encode_many`` on the device, loading by the checkpoint's names
under ``visual.``."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncengine.core.multimodal import ImageLayout, ImageRun, MMInput
from asyncengine.executor.models.mrope_positions import RopePositions, rope_positions
from asyncengine.executor.models.vision.encoder import ImageEncoder
from asyncengine.executor.models.vision.qwen_processor import QwenPixels, qwen_grid, qwen_pixels
from asyncengine.executor.models.vision.qwen_spec import QwenTowerSpec
from asyncengine.executor.models.vision.qwen_tower import QWEN3_NAMES, QwenVisionTower
from asyncengine.executor.models.vision.spec import VisionSpec


class QwenImageEncoder(nn.Module):
    """Pixels -> one embedding per ``<|image_pad|>``: an image of ``t x h x w`` patches is
    ``t * h * w / merge^2`` of them, between ``<|vision_start|>`` and ``<|vision_end|>``."""

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        tower = spec.tower
        if not isinstance(tower, QwenTowerSpec):
            raise ValueError(f"{spec.family}: not a Qwen2-VL vision tower")
        if tower.out_hidden != text_hidden:
            raise ValueError(f"{spec.family}: the merger's output ({tower.out_hidden}) is not "
                             f"the language model's width ({text_hidden})")
        self.spec = spec
        self.visual = QwenVisionTower(tower)
        # Qwen3-VL: deepstack features beside each embedding, one per decoder layer from the
        # first (``encode_many``'s rows are ``(1 + deepstack) * hidden`` wide)
        self.deepstack = len(tower.deepstack)

    # -- loading ---------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        for old, new in QWEN3_NAMES:
            name = re.sub(old, new, name)
        if name == "visual.patch_embed.proj.weight" and tensor.dim() == 5:
            tensor = self.visual.load_patch_embed(tensor)
        ImageEncoder.load_checkpoint_tensor(self, name, tensor)  # type: ignore[arg-type]

    missing_weights = ImageEncoder.missing_weights

    # -- off the loop ------------------------------------------------------------------------
    def process(self, image: Any, kwargs: dict[str, Any] | None = None) -> ImageLayout:
        """``kwargs``: the processor's options (the Qwen families take none: refused before,
        ``vision/pan_and_scan.check_family_kwargs``)."""
        px = qwen_pixels(image, self.spec.processing, self.spec.tower)
        return (ImageRun(self._tokens(px.grid), px),)

    def layout(self, width: int, height: int, kwargs: dict[str, Any] | None = None
               ) -> ImageLayout:
        return (ImageRun(self._tokens(qwen_grid(width, height, self.spec.processing,
                                                self.spec.tower))),)

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.spec.tower.merge_size**2

    @property
    def tokens_per_image(self) -> int:
        return self.spec.tokens_per_image

    def rope_positions(self, length: int, mm: list[MMInput]) -> RopePositions:
        """The M-RoPE positions of an expanded prompt of ``length`` tokens with images
        ``mm`` (what ``process`` made)."""
        m = self.spec.tower.merge_size
        return rope_positions(length, [(it.offset, it.data.grid[0], it.data.grid[1] // m,
                                        it.data.grid[2] // m) for it in mm])

    # -- on the device -----------------------------------------------------------------------
    def encode_many(self, items: list[QwenPixels], device: torch.device) -> list[torch.Tensor]:
        """Each image's embeddings ``[tokens, text hidden]`` (Qwen3-VL: its deepstack
        features after them on each row): the tower over all of them at once (each image,
        and each window, attending to itself only)."""
        patches = items[0].patches if len(items) == 1 else np.concatenate(
            [it.patches for it in items])
        patches = torch.from_numpy(patches).to(device)
        grids = [it.grid for it in items]
        out = self.visual(patches, grids)
        return list(out.split([self._tokens(g) for g in grids]))
