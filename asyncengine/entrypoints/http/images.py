"""The images of an API call: checked against the model and the flags before anything is
fetched, then fetched and decoded off the loop (``media.py``) and handed to the engine with
the prompt (an ``ImagePrompt``). Any refusal is a 400 naming the field (Anthropic's shape on
``/v1/messages``: the error middleware picks it by route)."""

from __future__ import annotations

from typing import Any

from asyncengine.config.multimodal import check_processor_kwargs
from asyncengine.core.multimodal import ImagePrompt
from asyncengine.engine.multimodal import (
    TEXT_ONLY,
    check_images,
    expanded_ids,
    image_encoder,
    image_placeholder,
)
from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.media import MediaError, MediaPolicy, load_images
from asyncengine.entrypoints.http.protocol import ChatMessage, ImageURLPart, image_urls
from asyncengine.executor.models.vision.pan_and_scan import check_family_kwargs


def placeholder_for(engine: Any, messages: list[ChatMessage], param: str = "messages") -> str:
    """The text an image part renders as (400 when the messages' images cannot be taken:
    a text-only model, more than --limit-mm-per-prompt)."""
    count = len(image_urls(messages))
    if not count:
        return ""
    if image_encoder(engine) is None:  # the first image part is what the model cannot take
        i, j = next((i, j) for i, m in enumerate(messages) if isinstance(m.content, list)
                    for j, p in enumerate(m.content) if isinstance(p, ImageURLPart))
        raise bad_request(TEXT_ONLY, f"{param}[{i}].content[{j}].type")
    try:
        check_images(engine, count)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return image_placeholder(engine) or ""


async def with_images(engine: Any, urls: list[str], prompt: str | list[int],
                      param: str = "messages", *, add_special_tokens: bool = True,
                      processor_kwargs: dict[str, Any] | None = None
                      ) -> str | list[int] | ImagePrompt:
    """``prompt`` with the images behind ``urls`` (itself when there are none)."""
    if not urls:
        return prompt
    try:
        check_images(engine, len(urls))
        images = await load_images(urls, MediaPolicy.of(engine.config.multimodal))
    except (MediaError, ValueError) as e:
        raise bad_request(str(e), param) from None
    return ImagePrompt(prompt, images, add_special_tokens, processor_kwargs)


def processor_options(engine: Any, value: dict[str, Any] | None,
                      param: str = "mm_processor_kwargs") -> dict[str, Any] | None:
    """A request's ``mm_processor_kwargs``, checked (400 naming the field and the key)."""
    if value is None:
        return None
    encoder = image_encoder(engine)
    try:
        value = check_processor_kwargs(value, param)
        if encoder is not None:
            check_family_kwargs(encoder.spec.family, value, param)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return value


async def chat_prompt(engine: Any, messages: list[ChatMessage], prompt: list[int], text: str,
                      processor_kwargs: dict[str, Any] | None = None
                      ) -> list[int] | ImagePrompt:
    """The prompt of a conversation: its token ids, or with its messages' images its
    rendered text (the engine expands each image in the text, then tokenizes it: the
    template's special tokens are in the text already)."""
    urls = image_urls(messages)
    if not urls:
        return prompt
    return await with_images(engine, urls, text, add_special_tokens=False,  # type: ignore
                             processor_kwargs=processor_kwargs)


async def counted_ids(engine: Any, messages: list[ChatMessage], text: str,
                      add_special_tokens: bool = False, param: str = "messages") -> list[int]:
    """The token ids of a conversation's rendered ``text`` as the engine will see them: each
    image counted as its placeholders. The images are fetched and decoded as for a request
    (their sizes decide the count for the tiling families), each refusal a 400."""
    urls = image_urls(messages)
    if not urls:
        return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    prompt = await with_images(engine, urls, text, param)
    sizes = [(im.image.width, im.image.height) for im in prompt.images]
    try:
        return expanded_ids(engine, text, sizes, add_special_tokens)
    except ValueError as e:
        raise bad_request(str(e), param) from None


#: The components of /openapi.json that carry an image (dropped for a text-only model).
IMAGE_COMPONENTS = frozenset({"ImageURLPart", "InputImage", "ImageBlockIn", "MultimodalPrompt"})


def drop_image_parts(node: Any) -> None:
    """/openapi.json for a model that takes no images: every union loses its image options
    (the document says what this server accepts)."""
    if isinstance(node, list):
        for item in node:
            drop_image_parts(item)
        return
    if not isinstance(node, dict):
        return
    options = node.get("anyOf")
    if isinstance(options, list):
        node["anyOf"] = [o for o in options if not (
            isinstance(o, dict) and o.get("$ref", "").rsplit("/", 1)[-1] in IMAGE_COMPONENTS)]
        mapping = node.get("discriminator", {}).get("mapping", {})
        for tag in [t for t, r in mapping.items() if r.rsplit("/", 1)[-1] in IMAGE_COMPONENTS]:
            del mapping[tag]
    for value in node.values():
        drop_image_parts(value)
