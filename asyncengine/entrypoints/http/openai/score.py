"""vLLM's scoring routes: ``POST /score`` (``/v1/score``) and ``POST /rerank`` (``/v1/rerank``,
Jina's shape; ``/v2/rerank``, Cohere's), over ``engine/scoring.py``.

/score pairs ``text_1`` with ``text_2`` (each a string or a list: 1:1, 1:N or N:N) and answers
``data: [{index, object: "score", score}]`` in pair order. /rerank scores ``query`` against each
of ``documents`` (strings, or objects with a ``text``) and answers the documents by relevance,
``results: [{index, relevance_score, document: {text}}]``, the first ``top_n`` of them (0 or
absent: all). A cross-encoder reads each pair as one prompt; any other model compares the two
texts' embeddings. Both routes answer 404 on a classifier of several labels, and
/openapi.json lists them only where they answer.
"""

from __future__ import annotations

import time
from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from asyncengine.core.limits import INT64_MAX
from asyncengine.engine.errors import EngineDeadError
from asyncengine.engine.scoring import Scores, score
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.protocol import Body, Count, NonEmptyStr, PositiveCount
from asyncengine.entrypoints.http.responses import Usage
from asyncengine.entrypoints.http.serving import (
    check_model,
    json_response,
    read_body,
    request_id,
    to_api_error,
)
from asyncengine.entrypoints.http.state import state_of

#: The most documents of one /rerank call, and texts on each side of one /score call.
MAX_DOCUMENTS = 1000

#: vLLM's ``truncate_prompt_tokens``: -1 (the context length) or a positive count.
#: /openapi.json says "not 0" (``openapi_ranges.publish_served``).
TruncateTokens = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
Texts = NonEmptyStr | Annotated[list[NonEmptyStr], Meta(min_length=1, max_length=MAX_DOCUMENTS)]


class ScoreRequest(Body, kw_only=True):
    text_1: Texts
    text_2: Texts
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    use_activation: bool | None = None  # false: a cross-encoder's raw logit
    instruction: str | None = None  # Qwen3-Reranker's <Instruct> (default: its model card's)


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage
    object: str = "list"


class RerankDocument(Body, kw_only=True):
    """A document as an object (Jina's and Cohere's other form)."""

    text: NonEmptyStr


class RerankRequest(Body, kw_only=True):
    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr | RerankDocument],
                         Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    model: str | None = None
    top_n: Count | None = None  # 0 or absent: every document
    return_documents: bool | None = None  # default true
    max_tokens_per_doc: PositiveCount | None = None  # Cohere's: each document's first N tokens
    truncate_prompt_tokens: TruncateTokens | None = None
    use_activation: bool | None = None
    instruction: str | None = None


class RerankedDocument(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankedDocument | None = None


class RerankUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def scoring_enabled(engine) -> bool:
    """Whether /score and /rerank answer (/openapi.json lists them only then)."""
    kind = getattr(engine, "model_kind", None)
    return kind is not None and kind.scores


def _check_served(engine) -> None:
    if not scoring_enabled(engine):
        kind = getattr(engine, "model_kind", None)
        raise APIError(404, kind.refusal("scoring") if kind is not None else
                       "This server does not score.")


async def _score(engine, text_1: list[str], text_2: list[str], truncate: int | None,
                 use_activation: bool | None, instruction: str | None,
                 params: tuple[str, str], names: tuple[str, str]) -> Scores:
    """``params``: the fields of ``text_1`` and ``text_2``; ``names``: one text of each, as
    errors call them."""
    if truncate == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the context length) or at least "
                          "1", "truncate_prompt_tokens")
    try:
        return await score(engine, text_1, text_2, instruction=instruction,
                           activation=use_activation is not False, truncate=truncate,
                           names=names)
    except EngineDeadError as e:
        raise to_api_error(e) from None
    except ValueError as e:  # unpaired lists, a text or pair past the context
        first = f"{names[0]} " in str(e)
        raise bad_request(str(e), params[0] if first else params[1]) from None


async def create_score(request: web.Request) -> web.Response:
    """POST /score, /v1/score."""
    engine = state_of(request).engine
    _check_served(engine)
    body = await read_body(request, ScoreRequest)
    check_model(engine, body.model, lora=False)
    text_1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    text_2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    scored = await _score(engine, text_1, text_2, body.truncate_prompt_tokens,
                          body.use_activation, body.instruction, ("text_1", "text_2"),
                          ("text_1 item", "text_2 item"))
    n = sum(scored.prompt_tokens)
    data = [ScoreData(i, s) for i, s in enumerate(scored.scores)]
    return json_response(ScoreResponse(request_id(request, "score"), int(time.time()),
                                       engine.model_name, data, Usage(n, 0, n)))


async def create_rerank(request: web.Request) -> web.Response:
    """POST /rerank, /v1/rerank, /v2/rerank."""
    engine = state_of(request).engine
    _check_served(engine)
    body = await read_body(request, RerankRequest)
    check_model(engine, body.model, lora=False)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scored_texts = texts
    if body.max_tokens_per_doc is not None:
        tokenizer, limit = engine.tokenizer, body.max_tokens_per_doc
        scored_texts = [tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)[:limit],
                                         skip_special_tokens=False) for t in texts]
    scored = await _score(engine, [body.query], scored_texts, body.truncate_prompt_tokens,
                          body.use_activation, body.instruction, ("query", "documents"),
                          ("query", "document"))
    scores = scored.scores
    order = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties by index
    if body.top_n:
        order = order[:body.top_n]
    with_text = body.return_documents is not False
    results = [RerankResult(i, scores[i], RerankedDocument(texts[i]) if with_text else None)
               for i in order]
    n = sum(scored.prompt_tokens)
    return json_response(RerankResponse(request_id(request, "rerank"), engine.model_name,
                                        RerankUsage(n, n), results))


# One handler per path, so that each operation of /openapi.json has its own operationId.
async def create_score_v1(request: web.Request) -> web.Response:
    """POST /v1/score."""
    return await create_score(request)


async def create_rerank_v1(request: web.Request) -> web.Response:
    """POST /v1/rerank (Jina's shape)."""
    return await create_rerank(request)


async def create_rerank_v2(request: web.Request) -> web.Response:
    """POST /v2/rerank (Cohere's shape)."""
    return await create_rerank(request)
