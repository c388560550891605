"""A vision-language model: the one decoder (``decoder.py``) with an image encoder beside it
(``vision/``: tower, connector, processor): LLaVA-1.5, LLaVA-NeXT, Gemma 3, Idefics3,
SmolVLM, Qwen2-VL and Qwen2.5-VL (whose decoder turns by M-RoPE: ``models/mrope.py``).

The decoder is unchanged: a step whose tokens include image placeholders gets the encoder's
outputs spliced into its input embeddings (``executor/mm_step.py``), and every other step
runs exactly as a text model's does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from asyncengine.executor.models.decoder import CausalLM
from asyncengine.executor.models.vision.encoder import ImageEncoder
from asyncengine.executor.models.vision.qwen_encoder import QwenImageEncoder
from asyncengine.executor.models.vision.spec import describe_vision

#: Checkpoint prefixes -> ours (transformers' legacy and current layouts alike).
_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."),
             ("vision_tower.vision_model.", "vision.vision_tower."),
             ("model.vision_tower.vision_model.", "vision.vision_tower."),
             ("model.vision_tower.", "vision.vision_tower."),
             ("vision_tower.", "vision.vision_tower."),
             ("model.multi_modal_projector.", "vision.multi_modal_projector."),
             ("multi_modal_projector.", "vision.multi_modal_projector."),
             ("model.image_newline", "vision.image_newline"),  # LLaVA-NeXT
             ("image_newline", "vision.image_newline"),
             ("model.text_model.", "model."),  # Idefics3, SmolVLM
             ("model.vision_model.", "vision.vision_tower."),
             ("model.connector.", "vision.multi_modal_projector."),
             ("model.visual.", "vision.visual."), ("visual.", "vision.visual."))  # Qwen2-VL


class VisionLM(CausalLM):
    def __init__(self, config: Any) -> None:
        # A config without its vision side (one converted from a GGUF file): the text alone.
        spec = describe_vision(config) if getattr(config, "vision_config", None) else None
        super().__init__(config)
        if spec is None:
            self.vision = None
        elif spec.layout == "qwen":
            self.vision = QwenImageEncoder(spec, self.hidden_size)
        else:
            self.vision = ImageEncoder(spec, self.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
