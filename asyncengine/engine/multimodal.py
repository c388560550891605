"""A prompt's images on their way in: checked against the model, processed into the
encoder's pixels off the loop, and their placeholder tokens expanded to one per embedding.

The prompt holds one placeholder token (the model's image token) per image, where the chat
template or the caller put it; each becomes the image's sequence as its family's processor
writes it (``ImageLayout``: text, and runs of image tokens, one per encoder output), and
each run becomes an :class:`~asyncengine.core.multimodal.MMInput` of the request."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from asyncengine.core.encoder_budget import EncoderBudget
from asyncengine.core.multimodal import (
    ImageItem,
    ImageLayout,
    ImagePrompt,
    ImageRun,
    MMInput,
    run_hash,
)
from asyncengine.engine.prompts import tokenize_prompt

TEXT_ONLY = "this model takes no images (it is a text-only model)"


def image_encoder(engine: Any) -> Any:
    """The model's image encoder (``executor/models/vision``), None for a text model."""
    return getattr(getattr(engine, "runner", None) and engine.runner.model, "vision", None)


def make_encoder_budget(engine: Any) -> EncoderBudget | None:
    """The encoder's per-step budget and cache bookkeeping (None: no image encoder)."""
    if image_encoder(engine) is None or getattr(engine.runner, "encoder_cache", None) is None:
        return None
    config = engine.config
    compute = config.multimodal.max_num_encoder_input_tokens
    return EncoderBudget(compute or config.scheduler.max_num_batched_tokens,
                         engine.runner.encoder_cache.budget)


def image_placeholder(engine: Any) -> str | None:
    """The text that stands for one image in a chat message or a llama-server prompt
    (LLaVA: ``<image>``, Gemma 3: ``<start_of_image>``, Qwen2-VL:
    ``<|vision_start|><|image_pad|><|vision_end|>``)."""
    marker = _marker(engine)
    wrap = image_encoder(engine).spec.wrap if marker is not None else None
    if wrap is None:
        return marker
    start, end = engine.tokenizer.hf.convert_ids_to_tokens(list(wrap))
    return start + marker + end


def _marker(engine: Any) -> str | None:
    """The token that marks one image in a prompt, which the image's sequence replaces."""
    encoder = image_encoder(engine)
    if encoder is None:
        return None
    spec = encoder.spec
    token = spec.prompt_token_id if spec.prompt_token_id is not None else spec.image_token_id
    return engine.tokenizer.hf.convert_ids_to_tokens(token)


def processor_kwargs(engine: Any, own: dict[str, Any] | None) -> dict[str, Any] | None:
    """The image processor's options of a request: the server's, then its own on top."""
    server = engine.config.multimodal.mm_processor_kwargs
    return {**server, **own} if server and own else own or server


def expanded_ids(engine: Any, text: str, sizes: list[tuple[int, int]],
                 add_special_tokens: bool, kwargs: dict[str, Any] | None = None
                 ) -> list[int]:
    """The token ids of ``text`` with each image placeholder expanded as the engine expands
    it, for images of ``sizes`` ((width, height) each, in order; tiling families' and
    pan-and-scan's counts follow the size): what /tokenize and count_tokens count."""
    encoder = image_encoder(engine)
    if encoder is None:
        raise ValueError(TEXT_ONLY)
    kwargs = processor_kwargs(engine, kwargs)
    layouts = [encoder.layout(w, h, kwargs) for w, h in sizes]
    expanded = expand_text(text, layouts, encoder.spec, engine.tokenizer, _marker(engine) or "")
    return engine.tokenizer.encode(expanded, add_special_tokens)


def check_images(engine: Any, count: int) -> None:
    """ValueError unless the model takes images and ``count`` is within the limit."""
    if count and image_encoder(engine) is None:
        raise ValueError(TEXT_ONLY)
    limit = engine.config.multimodal.image_limit
    if count > limit:
        raise ValueError(f"{count} images in one prompt: at most {limit} "
                         "(--limit-mm-per-prompt)")


async def prompt_inputs(engine: Any, prompt: Any
                        ) -> tuple[str | None, list[int], list[MMInput] | None, Any]:
    """``(text, token ids, images, M-RoPE positions)`` of a prompt (a string, token ids or an
    ImagePrompt); the positions (``executor/models/mrope_positions.py``) only for a prompt
    with images to an M-RoPE model (Qwen2-VL), None otherwise."""
    if not isinstance(prompt, ImagePrompt) or not prompt.images:
        if isinstance(prompt, ImagePrompt):
            prompt = prompt.prompt
        text, ids = await tokenize_prompt(engine.tokenizer, prompt, engine.vocab_size)
        return text, ids, None, None
    images = prompt.images
    check_images(engine, len(images))
    encoder = image_encoder(engine)
    spec = encoder.spec
    tokenizer = engine.tokenizer
    source: list[int] | None = None
    if isinstance(prompt.prompt, str):  # expanded as text, then tokenized (as processors do)
        text: str | None = prompt.prompt  # (outputs echo it as sent, one placeholder each)
    else:
        text, source = await tokenize_prompt(tokenizer, prompt.prompt, engine.vocab_size)
    placeholder = _marker(engine) or ""

    kwargs = processor_kwargs(engine, prompt.processor_kwargs)

    def work() -> tuple[list[int], list[MMInput], Any]:
        layouts = [encoder.process(im.image, kwargs) for im in images]
        if source is not None:
            ids = expand_ids(source, layouts, spec, tokenizer)
        else:
            expanded = expand_text(prompt.prompt, layouts, spec, tokenizer, placeholder)
            ids = tokenizer.encode(expanded, prompt.add_special_tokens)
        mm = locate(ids, images, layouts, spec)
        rope = encoder.rope_positions(len(ids), mm) if hasattr(encoder, "rope_positions") \
            else None
        return ids, mm, rope

    ids, mm, rope = await anyio.to_thread.run_sync(work)
    return text, ids, mm, rope


def _piece(piece: str | int, tokenizer: Any) -> str:
    return piece if isinstance(piece, str) else tokenizer.hf.convert_ids_to_tokens(piece)


def _text(layout: ImageLayout, spec: Any, tokenizer: Any) -> str:
    image = _piece(spec.image_token_id, tokenizer)
    return "".join(image * p.length if isinstance(p, ImageRun) else _piece(p, tokenizer)
                   for p in layout)


def expand_text(text: str, layouts: list[ImageLayout], spec: Any, tokenizer: Any,
                placeholder: str) -> str:
    """Each ``placeholder`` in ``text`` -> its image's whole sequence (its placeholders and
    the tokens around them), as the family's processor writes it."""
    parts = text.split(placeholder)
    if len(parts) - 1 != len(layouts):
        raise ValueError(f"the prompt has {len(parts) - 1} image placeholders ({placeholder}) "
                         f"for {len(layouts)} images")
    out = [parts[0]]
    for layout, part in zip(layouts, parts[1:], strict=True):
        out += [_text(layout, spec, tokenizer), part]
    return "".join(out)


def expand_ids(ids: list[int], layouts: list[ImageLayout], spec: Any, tokenizer: Any
               ) -> list[int]:
    """The same, for a prompt given as token ids (each piece of text tokenized alone)."""
    prompt_token = spec.prompt_token_id if spec.prompt_token_id is not None \
        else spec.image_token_id
    found = sum(1 for t in ids if t == prompt_token)
    if found != len(layouts):
        raise ValueError(f"the prompt has {found} image placeholders (token {prompt_token}) "
                         f"for {len(layouts)} images")

    def piece(p: str | int | ImageRun) -> list[int]:
        if isinstance(p, ImageRun):
            return [spec.image_token_id] * p.length
        return tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else [p]

    pending = iter(layouts)
    out: list[int] = []
    for t in ids:
        out += [i for p in next(pending) for i in piece(p)] if t == prompt_token else [t]
    return out


def locate(ids: list[int], images: list[ImageItem], layouts: list[ImageLayout], spec: Any
           ) -> list[MMInput]:
    """The images' runs of placeholders in an expanded prompt, in order (adjacent runs of
    image tokens split by their lengths): one MMInput each."""
    runs = [[p for p in layout if isinstance(p, ImageRun)] for layout in layouts]
    found = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    need = sum(r.length for rs in runs for r in rs)
    if len(found) != need:
        raise ValueError(f"the prompt has {len(found)} image tokens; its {len(images)} images "
                         f"need {need}")
    mm = []
    k = 0
    for image, rs in zip(images, runs, strict=True):
        for j, run in enumerate(rs):
            first = found[k]
            if found[k + run.length - 1] != first + run.length - 1:
                raise ValueError("an image's placeholder tokens are not consecutive")
            mm.append(MMInput(run_hash(image.hash, j, len(rs)), first, run.length, run.data,
                              whole=spec.bidirectional))
            k += run.length
    return mm
