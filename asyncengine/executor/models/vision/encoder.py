"""The image encoder of a vision-language model: its tower and its connector, from pixels to
embeddings in the language model's hidden size; and the processor that makes the pixels and
says what each image becomes in the prompt (its layout: ``core/multimodal.ImageLayout``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.core.multimodal import ImageLayout, ImageRun
from asyncengine.executor.models.vision.pan_and_scan import (
    PanAndScan,
    crop_boxes,
    pan_and_scan_layout,
)
from asyncengine.executor.models.vision.processor import process_image, rgb
from asyncengine.executor.models.vision.spec import VisionSpec
from asyncengine.executor.models.vision.tiling import (
    AnyresPixels,
    anyres_grid,
    anyres_pixels,
    anyres_tokens,
    idefics3_grid,
    idefics3_layout,
    idefics3_tiles,
)
from asyncengine.executor.models.vision.tower import VisionTower, activation


class LlavaProjector(nn.Module):
    """LLaVA's connector: linear, activation, linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Gemma3Projector(nn.Module):
    """Gemma 3's connector: the tower's patches average-pooled to ``tokens_per_image``, an
    RMS norm scaled by ``1 + w`` (in float32), then a projection to the text's width."""

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        vh = spec.tower.hidden
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vh, text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vh))
        self.eps = spec.tower.norm_eps
        self.patches = spec.tower.image_size // spec.tower.patch_size
        self.kernel = self.patches // int(spec.tokens_per_image**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(h, self.mm_input_projection_weight)


class PixelShuffleConnector(nn.Module):
    """Idefics3's connector: each ``scale``x``scale`` block of patches folded into one
    token's channels (transformers' ``pixel_shuffle``), then a projection without bias."""

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.scale = spec.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(spec.tower.hidden * self.scale**2,
                                                  text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, d = x.shape
        side, s = int(seq**0.5), self.scale
        x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, seq // (s * s), d * s * s))


class ImageEncoder(nn.Module):
    """Pixels -> one embedding per placeholder token. Parameters as the checkpoint names
    them under ``vision_tower.`` and ``multi_modal_projector.``."""

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.vision_tower = VisionTower(spec.tower)
        if spec.connector == "llava_mlp":
            self.multi_modal_projector: nn.Module = LlavaProjector(
                spec.tower.hidden, text_hidden, spec.connector_act)
        elif spec.connector == "gemma3":
            self.multi_modal_projector = Gemma3Projector(spec, text_hidden)
        elif spec.connector == "pixel_shuffle":
            self.multi_modal_projector = PixelShuffleConnector(spec, text_hidden)
        else:
            raise ValueError(f"connector {spec.connector!r} is not supported")
        if spec.image_newline:
            self.image_newline = nn.Parameter(torch.empty(text_hidden))

    # -- loading (CausalLM.load_weights hands it the names under ``vision.``) ---------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        param = dict(self.named_parameters()).get(name)
        if param is None:
            return  # (a buffer some checkpoints carry, such as position_ids)
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the "
                             f"image encoder expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self._loaded = getattr(self, "_loaded", set()) | {name}

    def missing_weights(self) -> list[str]:
        loaded = getattr(self, "_loaded", set())
        return [n for n, _ in self.named_parameters() if n not in loaded]

    # -- off the loop, before the request is queued --------------------------------------------
    def process(self, image: Any, kwargs: dict[str, Any] | None = None) -> ImageLayout:
        """A PIL image -> its sequence in the prompt, each run holding what ``encode_many``
        takes for it (its own processing; no torch). ``kwargs``: the processor's options
        (``--mm-processor-kwargs``, a request's ``mm_processor_kwargs``)."""
        spec, p = self.spec, self.spec.processing
        pas = PanAndScan.of(kwargs)
        boxes = crop_boxes(*rgb(image).size, pas) if pas is not None else None
        if boxes:  # Gemma 3's pan-and-scan: the whole image, then its crops
            image = rgb(image)
            runs = [ImageRun(spec.tokens_per_image, process_image(im, p))
                    for im in (image, *(image.crop(b) for b in boxes))]
            return pan_and_scan_layout((*spec.before, None, *spec.after), runs)
        if spec.layout == "idefics3":
            tiles, rows, cols = idefics3_tiles(image, p)
            return idefics3_layout(rows, cols, spec.tokens_per_image, tiles)
        if spec.layout == "anyres":
            px = anyres_pixels(image, p)
            return (ImageRun(anyres_tokens(*px.size, p, self._side), px),)
        return spec.before + (ImageRun(spec.tokens_per_image, process_image(image, p)),) + \
            spec.after

    def layout(self, width: int, height: int, kwargs: dict[str, Any] | None = None
               ) -> ImageLayout:
        """The sequence of an image of that size, its runs without data (for counting)."""
        spec, p = self.spec, self.spec.processing
        pas = PanAndScan.of(kwargs)
        boxes = crop_boxes(width, height, pas) if pas is not None else None
        if boxes:
            runs = [ImageRun(spec.tokens_per_image)] * (1 + len(boxes))
            return pan_and_scan_layout((*spec.before, None, *spec.after), runs)
        if spec.layout == "idefics3":
            return idefics3_layout(*idefics3_grid(width, height, p), spec.tokens_per_image,
                                   None)
        if spec.layout == "anyres":
            return (ImageRun(anyres_tokens(height, width, p, self._side)),)
        return spec.before + (ImageRun(spec.tokens_per_image),) + spec.after

    @property
    def tokens_per_image(self) -> int:
        return self.spec.tokens_per_image

    @property
    def _side(self) -> int:
        return self.spec.tower.image_size // self.spec.tower.patch_size

    # -- on the device -------------------------------------------------------------------------
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, text hidden] (one image, tile or patch each)."""
        features = self.vision_tower(pixels)
        if self.spec.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def encode_many(self, items: list[Any], device: torch.device) -> list[torch.Tensor]:
        """Runs' data (what ``process`` put in them) -> each run's embeddings ``[length,
        text hidden]``: the tower over all of them at once, a batch per pixel shape."""
        if self.spec.layout == "anyres":
            return self._encode_anyres(items, device)
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, data in enumerate(items):
            by_shape.setdefault(tuple(np.shape(data)), []).append(i)
        for idx in by_shape.values():
            pixels = torch.from_numpy(np.stack([items[i] for i in idx])).to(device)
            for i, emb in zip(idx, self.encode(pixels), strict=True):
                out[i] = emb
        return out  # type: ignore[return-value]

    def _encode_anyres(self, items: list[AnyresPixels], device: torch.device
                       ) -> list[torch.Tensor]:
        pixels = torch.from_numpy(np.concatenate([it.patches for it in items])).to(device)
        features = self.encode(pixels).split([len(it.patches) for it in items])
        return [self._pack(f, it.size) for f, it in zip(features, items, strict=True)]

    def _pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """LLaVA-NeXT: the base's features, then the grid's rows (padding cut off), each
        followed by the newline embedding."""
        n, p = self._side, self.spec.processing
        rows, cols, fh, fw = anyres_grid(size[0], size[1], p.pinpoints, self.spec.tower.image_size,
                                         n)
        d = features.shape[-1]
        grid = features[1:].view(rows, cols, n, n, d).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(d, rows * n, cols * n)
        top, left = (rows * n - fh) // 2, (cols * n - fw) // 2
        grid = grid[:, top:top + fh, left:left + fw]
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(d, fh, 1)
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([features[0], grid])
