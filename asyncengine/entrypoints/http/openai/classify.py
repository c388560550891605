"""vLLM's ``POST /classify``: a sequence classifier's labels for each input.

``input`` takes /v1/completions' four prompt forms; each input is one prompt, read at its last
token, and answers ``{index, label, probs, num_classes}``: the probabilities of every label
(softmax; sigmoid for one label or a multi-label model; the raw logits with
``use_activation: false``) and the most probable label's name (``id2label``). Only a
classifier answers (``engine/scoring.py``); elsewhere the route is a 404 and /openapi.json
leaves it out.
"""

from __future__ import annotations

import time

import numpy as np
from aiohttp import web
from msgspec import Struct

from asyncengine.engine.errors import EngineDeadError
from asyncengine.engine.scoring import classify
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.openai.completions import completion_prompts
from asyncengine.entrypoints.http.openai.score import TruncateTokens
from asyncengine.entrypoints.http.protocol import Body, Prompt
from asyncengine.entrypoints.http.responses import Usage
from asyncengine.entrypoints.http.serving import (
    check_model,
    json_response,
    read_body,
    request_id,
    to_api_error,
)
from asyncengine.entrypoints.http.state import state_of


class ClassificationRequest(Body, kw_only=True):
    input: Prompt
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    add_special_tokens: bool | None = None
    use_activation: bool | None = None


class ClassificationData(Struct):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage
    object: str = "list"


def classify_enabled(engine) -> bool:
    """Whether /classify answers (/openapi.json lists it only then)."""
    kind = getattr(engine, "model_kind", None)
    return kind is not None and kind.classifies


async def create_classify(request: web.Request) -> web.Response:
    """POST /classify."""
    engine = state_of(request).engine
    if not classify_enabled(engine):
        kind = getattr(engine, "model_kind", None)
        raise APIError(404, kind.refusal("classification") if kind is not None else
                       "This server does not classify.")
    body = await read_body(request, ClassificationRequest)
    check_model(engine, body.model, lora=False)
    try:
        inputs = completion_prompts(body.input)
    except APIError as e:  # its message names ``prompt``: this route calls it ``input``
        raise bad_request(e.message.replace("prompt", "input"), "input") from None
    special = body.add_special_tokens is not False
    prompts = [engine.tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str)
               else p for p in inputs]
    vocab = engine.tokenizer.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of vocabulary (0..{vocab - 1})", "input")
    k = body.truncate_prompt_tokens
    if k == 0:
        raise bad_request("truncate_prompt_tokens must be -1 (the context length) or at least "
                          "1", "truncate_prompt_tokens")
    if k is not None:
        prompts = [p[-(engine.max_model_len if k == -1 else k):] for p in prompts]
    try:
        probs = await classify(engine, prompts, activation=body.use_activation is not False)
    except EngineDeadError as e:
        raise to_api_error(e) from None
    except ValueError as e:  # an empty or too long input
        raise bad_request(str(e), "input") from None
    labels = engine.model_kind.classifier.labels
    data = [ClassificationData(i, labels[int(np.argmax(row))], row.tolist(), len(row))
            for i, row in enumerate(probs)]
    n = sum(len(p) for p in prompts)
    return json_response(ClassificationResponse(request_id(request, "classify"),
                                                int(time.time()), engine.model_name, data,
                                                Usage(n, 0, n)))
