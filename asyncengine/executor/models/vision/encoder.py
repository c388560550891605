"""The image encoder of a vision-language model: its tower and its connector, from pixels to
embeddings in the language model's hidden size; and the processor that makes the pixels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.models.vision.processor import process_image
from asyncengine.executor.models.vision.spec import VisionSpec
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
        else:
            raise ValueError(f"connector {spec.connector!r} is not supported")

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
    def process(self, image: Any) -> np.ndarray:
        """A PIL image -> the pixels ``encode`` takes (its own processing; no torch)."""
        return process_image(image, self.spec.processing)

    @property
    def tokens_per_image(self) -> int:
        return self.spec.tokens_per_image

    # -- on the device -------------------------------------------------------------------------
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, text hidden]."""
        features = self.vision_tower(pixels)
        if self.spec.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)
