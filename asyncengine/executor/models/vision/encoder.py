"""The image encoder of a vision-language model: its tower and its connector, from pixels to
embeddings in the language model's hidden size; and the processor that makes the pixels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
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


class ImageEncoder(nn.Module):
    """Pixels -> one embedding per placeholder token. Parameters as the checkpoint names
    them under ``vision_tower.`` and ``multi_modal_projector.``."""

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.vision_tower = VisionTower(spec.tower)
        if spec.connector != "llava_mlp":
            raise ValueError(f"connector {spec.connector!r} is not supported")
        self.multi_modal_projector = LlavaProjector(spec.tower.hidden, text_hidden,
                                                    spec.connector_act)

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
