"""The small routes: models, health, metrics, version, tokenize, detokenize."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.images import counted_ids
from asyncengine.entrypoints.http.openai.chat import render_chat
from asyncengine.entrypoints.http.protocol import DetokenizeRequest, TokenizeRequest
from asyncengine.entrypoints.http.reasoning import chat_template_kwargs
from asyncengine.entrypoints.http.responses import (
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from asyncengine.entrypoints.http.serving import (
    check_model,
    json_response,
    lora_names,
    read_body,
)
from asyncengine.entrypoints.http.state import ServerState, state_of
from asyncengine.entrypoints.http.tools import template_tools


def _model_card(state: ServerState, name: str) -> ModelCard:
    engine = state.engine
    lora = getattr(engine, "lora", None)
    adapter = None if lora is None or name in state.served_model_names else \
        lora.adapters.get(name)
    if adapter is not None:  # vLLM's card of an adapter: its path, its base model
        return ModelCard(id=name, created=state.created, owned_by="asyncengine",
                         max_model_len=engine.max_model_len, root=adapter.path,
                         parent=adapter.base_model_name or state.served_model_names[0])
    return ModelCard(id=name, created=state.created, owned_by="asyncengine",
                     max_model_len=engine.max_model_len, root=engine.config.model.model)


def _model_names(state: ServerState) -> list[str]:
    return [*state.served_model_names, *lora_names(state.engine)]


async def list_models(request: web.Request) -> web.Response:
    state = state_of(request)
    return json_response(ModelList([_model_card(state, n) for n in _model_names(state)]))


async def retrieve_model(request: web.Request) -> web.Response:
    state = state_of(request)
    name = request.match_info["model"]
    if name not in _model_names(state):
        raise APIError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")
    return json_response(_model_card(state, name))


async def ping(request: web.Request) -> web.Response:
    """GET or POST /ping: 200 while the engine is healthy (vLLM's, for SageMaker)."""
    engine = state_of(request).engine
    if engine.error is not None:
        raise APIError(503, f"The engine stopped after an error: {engine.error}")
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    engine = state_of(request).engine
    if engine.error is not None:
        raise APIError(503, f"The engine stopped after an error: {engine.error}")
    stats = engine.stats()
    return json_response(HealthResponse("ok", stats.num_running, stats.num_waiting,
                                        stats.num_free_blocks, stats.num_total_blocks))


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.metrics is None:
        raise APIError(404, "Metrics are disabled.")
    transfer = getattr(state.engine, "kv_transfer", None)
    state.metrics.set_stats(state.engine.stats(), None if transfer is None
                            else transfer.num_loaded_tokens)
    if getattr(state.engine, "lora", None) is not None:
        state.metrics.set_lora(*lora_adapters_in_use(state.engine.scheduler),
                               state.engine.config.lora.max_loras)
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def lora_adapters_in_use(scheduler) -> tuple[list[str], list[str]]:
    """The adapters of the running and of the waiting requests, by name (at scrape time)."""
    def names(requests) -> list[str]:
        return sorted({r.lora.name for r in requests if r.lora is not None})

    return (names(getattr(scheduler, "running", ())),
            names(getattr(scheduler, "waiting", ())))


def package_version() -> str:
    try:
        return version("asyncengine")
    except PackageNotFoundError:
        return "unknown"


async def get_version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(package_version()))


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    engine = state.engine
    body = await read_body(request, TokenizeRequest)
    check_model(engine, body.model)
    given = [f for f in ("prompt", "messages", "content") if getattr(body, f) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of prompt, messages and content", "prompt")
    if body.content is not None:  # llama-server's form
        ids = engine.tokenizer.encode(body.content, add_special_tokens=bool(body.add_special))
    elif body.messages is not None:
        text = render_chat(engine, body.messages, body.add_generation_prompt is not False,
                           tools=template_tools(body.tools),
                           template_kwargs=chat_template_kwargs(state, body.chat_template_kwargs))
        # (each image counted as its placeholders, as the engine expands it)
        ids = await counted_ids(engine, body.messages, text, bool(body.add_special_tokens))
    else:
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens
                                      is not False)
    strs = None
    if body.return_token_strs:
        strs = engine.tokenizer.hf.convert_ids_to_tokens(ids)
    return json_response(TokenizeResponse(len(ids), engine.max_model_len, ids, strs))


async def detokenize(request: web.Request) -> web.Response:
    engine = state_of(request).engine
    body = await read_body(request, DetokenizeRequest)
    check_model(engine, body.model)
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of vocabulary (0..{vocab - 1})", "tokens")
    text = engine.tokenizer.decode(body.tokens)
    return json_response(DetokenizeResponse(text, text))
