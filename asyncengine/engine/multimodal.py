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
    """The text that stands for one image in a prompt (LLaVA: ``<image>``, Gemma 3:
    ``<start_of_image>``)."""
    encoder = image_encoder(engine)
    if encoder is None:
        return None
    spec = encoder.spec
    token = spec.prompt_token_id if spec.prompt_token_id is not None else spec.image_token_id
    return engine.tokenizer.hf.convert_ids_to_tokens(token)


def expanded_length(engine: Any, ids: list[int]) -> int:
    """How many tokens ``ids`` become once each image placeholder is expanded."""
    encoder = image_encoder(engine)
    if encoder is None:
        return len(ids)
    return len(expand_ids(ids, encoder.spec, engine.tokenizer))


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
    if not isinstance(prompt, ImagePrompt) or not prompt.images:
        if isinstance(prompt, ImagePrompt):
            prompt = prompt.prompt
        text, ids = await tokenize_prompt(engine.tokenizer, prompt, engine.vocab_size)
        return text, ids, None
    images = prompt.images
    check_images(engine, len(images))
    encoder = image_encoder(engine)
    spec = encoder.spec
    tokenizer = engine.tokenizer
    if isinstance(prompt.prompt, str):  # expanded as text, then tokenized (as processors do)
        text: str | None = prompt.prompt  # (outputs echo it as sent, one placeholder each)
        expanded = expand_text(prompt.prompt, len(images), spec, tokenizer,
                               image_placeholder(engine) or "")
        tokenize = (tokenizer.encode, expanded, prompt.add_special_tokens)
    else:
        text, ids = await tokenize_prompt(tokenizer, prompt.prompt, engine.vocab_size)
        tokenize = (expand_ids, ids, spec, tokenizer)

    def work() -> tuple[list[int], list[Any]]:
        return tokenize[0](*tokenize[1:]), [encoder.process(im.image) for im in images]

    ids, pixels = await anyio.to_thread.run_sync(work)
    return text, ids, locate(ids, images, pixels, spec)


def _piece(piece: str | int, tokenizer: Any) -> str:
    return piece if isinstance(piece, str) else tokenizer.hf.convert_ids_to_tokens(piece)


def expand_text(text: str, count: int, spec: Any, tokenizer: Any, placeholder: str) -> str:
    """Each ``placeholder`` in ``text`` -> the image's whole sequence (its placeholders and
    the tokens around them), as the family's processor writes it."""
    found = text.count(placeholder)
    if found != count:
        raise ValueError(f"the prompt has {found} image placeholders ({placeholder}) for "
                         f"{count} images")
    image = _piece(spec.image_token_id, tokenizer)
    full = ("".join(_piece(p, tokenizer) for p in spec.before) + image * spec.tokens_per_image
            + "".join(_piece(p, tokenizer) for p in spec.after))
    return text.replace(placeholder, full)


def expand_ids(ids: list[int], spec: Any, tokenizer: Any) -> list[int]:
    """The same, for a prompt given as token ids (each piece of text tokenized alone)."""
    prompt_token = spec.prompt_token_id if spec.prompt_token_id is not None \
        else spec.image_token_id

    def pieces(parts: tuple[str | int, ...]) -> list[int]:
        out: list[int] = []
        for p in parts:
            out += tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else [p]
        return out

    full = pieces(spec.before) + [spec.image_token_id] * spec.tokens_per_image + \
        pieces(spec.after)
    out: list[int] = []
    for t in ids:
        out += full if t == prompt_token else [t]
    return out


def locate(ids: list[int], images: list[ImageItem], pixels: list[Any], spec: Any
           ) -> list[MMInput]:
    """The images' placeholders in an expanded prompt: ``tokens_per_image`` image tokens
    each, in order (adjacent images' runs split)."""
    n = spec.tokens_per_image
    found = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(found) != n * len(images):
        raise ValueError(f"the prompt has {len(found)} image tokens; {len(images)} images "
                         f"need {n * len(images)}")
    mm = []
    for k, (image, px) in enumerate(zip(images, pixels, strict=True)):
        first = found[k * n]
        if found[k * n + n - 1] != first + n - 1:
            raise ValueError("an image's placeholder tokens are not consecutive")
        mm.append(MMInput(image.hash, first, n, px, whole=spec.bidirectional))
    return mm
