"""Images given by file id in /v1/responses' input: ``{"type": "input_image", "file_id":
"file-..."}``, a file uploaded to ``POST /v1/files`` with purpose ``vision`` or
``user_data`` (as OpenAI takes them). Each is read from the file store and handed on as the
inline image it holds, before the input is converted; from there on it is any image
(``--max-media-bytes``, ``--limit-mm-per-prompt``, decoding: ``media.py``). An unknown file,
one of another purpose, or a server without the Files API is a 400 naming the part."""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from asyncengine.entrypoints.batch.service import batches_of
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.media import MediaPolicy

#: The purposes of a file an image may be read from.
IMAGE_PURPOSES = ("vision", "user_data")

_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp"),
          (b"RIFF", "webp"))


def _parts(items: Any) -> list[tuple[str, list[Any], int, dict[str, Any]]]:
    """(param, content list, index, part) of every ``input_image`` part with a file id."""
    found = []
    for i, item in enumerate(items):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_image" \
                    and part.get("file_id") is not None:
                found.append((f"input[{i}].content[{j}]", content, j, part))
    return found


async def resolve_file_images(request: web.Request, items: Any, engine: Any) -> None:
    """Replace, in the raw input items, each image given by file id with the image itself
    (a ``data:`` URL)."""
    if not isinstance(items, list):
        return
    parts = _parts(items)
    if not parts:
        return
    policy = MediaPolicy.of(engine.config.multimodal)
    for param, content, j, part in parts:
        file_id = part["file_id"]
        if not isinstance(file_id, str):
            raise bad_request("file_id must be a string", f"{param}.file_id")
        if part.get("image_url") is not None:
            raise bad_request("give an input_image's image_url or its file_id, not both", param)
        try:
            store, _ = batches_of(request)
        except APIError:
            raise bad_request("images by file id need the Files API, which this server does "
                              "not run", f"{param}.file_id") from None
        f = store.files.get(file_id)
        if f is None:
            raise APIError(400, f"No such file: {file_id!r}.", param=f"{param}.file_id",
                           code="file_not_found")
        if f.purpose not in IMAGE_PURPOSES:
            raise bad_request(f"The file {file_id!r} has purpose {f.purpose!r}; an image's "
                              f"file is uploaded with purpose 'vision' or 'user_data'.",
                              f"{param}.file_id")
        if f.bytes > policy.max_bytes:
            raise bad_request(f"the image is larger than {policy.max_bytes} bytes "
                              "(--max-media-bytes)", f"{param}.file_id")
        data = b"".join([chunk async for chunk in store.read_content(f.id)])
        kind = next((k for magic, k in _MAGIC if data.startswith(magic)), "unknown")
        content[j] = {"type": "input_image", "detail": part.get("detail"),
                      "image_url": f"data:image/{kind};base64,"
                                   + base64.b64encode(data).decode()}
