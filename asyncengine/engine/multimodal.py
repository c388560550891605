"""A prompt's images on their way in: checked against the model, processed into the
encoder's pixels off the loop, and their placeholder tokens expanded to one per embedding.

The prompt holds one placeholder token (the model's image token) per image, where the chat
template or the caller put it; each becomes ``tokens_per_image`` copies, which the
:class:`~asyncengine.core.multimodal.MMInput` of the request points at."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from asyncengine.core.multimodal import ImageItem, ImagePrompt, MMInput
from asyncengine.engine.prompts import tokenize_prompt

TEXT_ONLY = "this model takes no images (it is a text-only model)"


def image_encoder(engine: Any) -> Any:
    """The model's image encoder (``executor/models/vision``), None for a text model."""
    return getattr(getattr(engine, "runner", None) and engine.runner.model, "vision", None)


def image_placeholder(engine: Any) -> str | None:
    """The text that stands for one image in a prompt (LLaVA: ``<image>``)."""
    encoder = image_encoder(engine)
    if encoder is None:
        return None
    return engine.tokenizer.hf.convert_ids_to_tokens(encoder.spec.image_token_id)


def expanded_length(engine: Any, ids: list[int]) -> int:
    """How many tokens ``ids`` become once each image placeholder is expanded."""
    encoder = image_encoder(engine)
    if encoder is None:
        return len(ids)
    return len(ids) + ids.count(encoder.spec.image_token_id) * (encoder.tokens_per_image - 1)


def check_images(engine: Any, count: int) -> None:
    """ValueError unless the model takes images and ``count`` is within the limit."""
    if count and image_encoder(engine) is None:
        raise ValueError(TEXT_ONLY)
    limit = engine.config.multimodal.image_limit
    if count > limit:
        raise ValueError(f"{count} images in one prompt: at most {limit} "
                         "(--limit-mm-per-prompt)")


async def prompt_inputs(engine: Any, prompt: Any
                        ) -> tuple[str | None, list[int], list[MMInput] | None]:
    """``(text, token ids, images)`` of a prompt (a string, token ids or an ImagePrompt)."""
    images: list[ImageItem] = []
    if isinstance(prompt, ImagePrompt):
        prompt, images = prompt.prompt, prompt.images
    text, ids = await tokenize_prompt(engine.tokenizer, prompt, engine.vocab_size)
    if not images:
        return text, ids, None
    check_images(engine, len(images))
    encoder = image_encoder(engine)
    pixels = await anyio.to_thread.run_sync(
        lambda: [encoder.process(im.image) for im in images])
    ids, mm = expand(ids, images, pixels, encoder.spec.image_token_id,
                     encoder.tokens_per_image)
    return text, ids, mm


def expand(ids: list[int], images: list[ImageItem], pixels: list[Any], image_token: int,
           per_image: int) -> tuple[list[int], list[MMInput]]:
    """Each placeholder -> ``per_image`` of them, with the images' inputs."""
    found = [i for i, t in enumerate(ids) if t == image_token]
    if len(found) != len(images):
        raise ValueError(f"the prompt has {len(found)} image placeholders for {len(images)} "
                         "images")
    out: list[int] = []
    mm: list[MMInput] = []
    prev = 0
    for pos, image, px in zip(found, images, pixels, strict=True):
        out += ids[prev:pos]
        mm.append(MMInput(image.hash, len(out), per_image, px))
        out += [image_token] * per_image
        prev = pos + 1
    out += ids[prev:]
    return out, mm
