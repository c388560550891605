"""POST /v1/embeddings: OpenAI's embeddings API over the served model's hidden states.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists;
each becomes one vector: the final hidden states pooled (``--pooling-type``: last token or
mean) and L2-normalized. ``encoding_format: "base64"`` (what the openai client asks for by
default) sends each vector as the base64 of its little-endian float32 bytes.
"""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from aiohttp import web
from msgspec import Struct

from asyncengine.engine.embedding import embedding_size
from asyncengine.engine.errors import EngineDeadError
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.openai.completions import completion_prompts
from asyncengine.entrypoints.http.protocol import Body, PositiveCount, Prompt
from asyncengine.entrypoints.http.responses import Usage
from asyncengine.entrypoints.http.serving import (
    check_model,
    json_response,
    read_body,
    request_id,
    to_api_error,
)
from asyncengine.entrypoints.http.state import ServerState, state_of


class EmbeddingRequest(Body, kw_only=True):
    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveCount | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: PositiveCount | None = None
    normalize: bool | None = None


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: Usage
    object: str = "list"


async def create_embeddings(request: web.Request) -> web.Response:
    body = await read_body(request, EmbeddingRequest)
    return json_response(await embeddings(state_of(request), body,
                                          request_id(request, "embd")))


async def embeddings(state: ServerState, body: EmbeddingRequest, call_id: str) -> \
        EmbeddingResponse:
    """The route's response: also a batch line's."""
    engine = state.engine
    check_model(engine, body.model, lora=False)
    size = embedding_size(engine)
    if body.dimensions is not None and body.dimensions != size:
        raise bad_request(f"dimensions: this model's embeddings have {size} dimensions "
                          "(shortening them is not supported)", "dimensions")
    try:
        inputs = completion_prompts(body.input)
    except APIError as e:  # its message names ``prompt``: this route calls it ``input``
        raise bad_request(e.message.replace("prompt", "input"), "input") from None
    prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in inputs]
    vocab = engine.tokenizer.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (0..{vocab - 1})", "input")
    k = body.truncate_prompt_tokens
    if k is not None:
        if k < 1:
            raise bad_request("truncate_prompt_tokens must be at least 1",
                              "truncate_prompt_tokens")
        prompts = [p[-k:] for p in prompts]
    try:
        vectors = await engine.embed(prompts, normalize=body.normalize is not False)
    except ValueError as e:  # an empty or too long input
        raise bad_request(str(e), "input") from None
    except EngineDeadError as e:
        raise to_api_error(e) from None
    as_base64 = body.encoding_format == "base64"
    data = [Embedding(i, _b64(v) if as_base64 else v.tolist()) for i, v in enumerate(vectors)]
    n = sum(len(p) for p in prompts)
    return EmbeddingResponse(call_id, int(time.time()), engine.model_name, data, Usage(n, 0, n))


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()
