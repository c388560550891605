"""llama-server's ``POST /infill``: fill-in-the-middle for editors' code completion
(llama.vim, llama.vscode), on a model with fill-in-the-middle tokens (``text/fim.py``).

The body is /completion's sampling fields plus ``input_prefix`` (the code before the cursor),
``input_suffix`` (after it), ``input_extra`` (other files: ``[{"filename", "text"}]``) and
``prompt`` (the start of the middle, already typed); the answer is /completion's. A prompt
past the context is refused (a 400 naming the length) rather than cut, as llama-server cuts
the prefix and suffix. On a model without the tokens the route answers 404, and
/openapi.json leaves it out.
"""

from __future__ import annotations

from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.llama_native import LlamaSampling, complete
from asyncengine.entrypoints.http.protocol import Body
from asyncengine.entrypoints.http.serving import read_body
from asyncengine.entrypoints.http.state import state_of
from asyncengine.text.fim import FimTokens, fim_prompt, tokenizer_fim_tokens


class InfillChunk(Body, kw_only=True):
    filename: str = ""
    text: str = ""


class LlamaInfillRequest(LlamaSampling, kw_only=True):
    """POST /infill: the code around the cursor."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] | None = None
    prompt: str = ""


def model_fim_tokens(engine) -> FimTokens | None:
    """The served model's fill-in-the-middle tokens, looked up once per tokenizer."""
    return tokenizer_fim_tokens(engine.tokenizer)


def infill_enabled(engine) -> bool:
    """Whether /infill answers (/openapi.json lists it only then)."""
    return getattr(engine, "tokenizer", None) is not None and \
        model_fim_tokens(engine) is not None


async def llama_infill(request: web.Request) -> web.StreamResponse:
    """POST /infill."""
    engine = state_of(request).engine
    tokens = model_fim_tokens(engine)
    if tokens is None:
        raise APIError(404, "This model has no fill-in-the-middle tokens, so /infill is not "
                            "served (a code model such as Qwen2.5-Coder or StarCoder2 has "
                            "them).")
    body = await read_body(request, LlamaInfillRequest)
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    bos = tokenizer.encode("", add_special_tokens=True)
    ids = fim_prompt(tokens, encode, body.input_prefix, body.input_suffix, body.prompt,
                     [(c.filename, c.text) for c in body.input_extra or []], bos=bos)
    return await complete(request, body, ids)
