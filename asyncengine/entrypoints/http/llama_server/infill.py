"""llama-server's ``POST /infill``: fill-in-the-middle for editors' code completion
(llama.vim, llama.vscode), on a model with fill-in-the-middle tokens (``text/fim.py``).

The body is /completion's sampling fields plus ``input_prefix`` (the code before the cursor's
line), ``input_suffix`` (from the cursor on), ``input_extra`` (other files: ``[{"filename",
"text"}]``) and ``prompt`` (the cursor's line up to the cursor); the answer is /completion's.
The prompt is the tokens llama-server builds (``fim.infill_prompt``), fitted to the context as
it fits them: a batch of ``--max-num-batched-tokens`` (llama-server's ``-b``, at most the
context, less the answer's ``n_predict``) holds the end of the prefix (3/4) and the start of
the suffix (1/4), and the context left past that batch the end of the other files. On a
model without the tokens the route answers 404, and /openapi.json leaves it out.
"""

from __future__ import annotations

from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.llama_server.completion import LlamaSampling, complete
from asyncengine.entrypoints.http.protocol import Body
from asyncengine.entrypoints.http.serving import read_body
from asyncengine.entrypoints.http.state import state_of
from asyncengine.text.fim import FimTokens, infill_prompt, tokenizer_fim_tokens


class InfillChunk(Body, kw_only=True):
    filename: str = "tmp"
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
    n_ctx = engine.max_model_len
    n_predict = -1 if body.n_predict is None else body.n_predict
    # the batch that holds the prefix and suffix: llama-server's -b, within the context and
    # leaving room for the answer and the four special tokens
    n_batch = max(0, min(engine.config.scheduler.max_num_batched_tokens,
                         n_ctx - max(n_predict, 1) - len(bos) - 3))
    ids = infill_prompt(tokens, encode, body.input_prefix, body.input_suffix, body.prompt,
                        [(c.filename, c.text) for c in body.input_extra or []], bos,
                        # (at least 2 to come: the unbounded answer's room, and the prompt
                        # within the context whatever the batch)
                        n_batch=n_batch, n_ctx=n_ctx, n_predict=max(n_predict, 2))
    return await complete(request, body, ids)
