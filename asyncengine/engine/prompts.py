"""A request's prompt, checked on its way in: tokenized (long texts off the loop), every
token id in the vocabulary, and the whole request within the model's context."""

from __future__ import annotations

import anyio
import anyio.to_thread

from asyncengine.core.limits import show
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.text.tokenizer import Tokenizer

#: Prompts longer than this (characters) are tokenized in a worker thread, off the loop.
OFF_LOOP_TOKENIZE_CHARS = 4096


async def tokenize_prompt(tokenizer: Tokenizer, prompt: str | list[int],
                          vocab_size: int) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)``; ValueError for an empty or malformed prompt."""
    if isinstance(prompt, str):
        if len(prompt) > OFF_LOOP_TOKENIZE_CHARS:  # keep the streams flowing meanwhile
            ids = await anyio.to_thread.run_sync(tokenizer.encode, prompt)
        else:
            ids = tokenizer.encode(prompt)
        text: str | None = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids, text = list(prompt), None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (0..{vocab_size - 1})")
    else:
        raise ValueError("prompt must be a string or a list of token ids")
    if not ids:
        raise ValueError("the prompt is empty")
    return text, ids


def check_length(ids: list[int], params: SamplingParams, limit: int) -> None:
    """ValueError, naming both numbers, when the prompt (and max_tokens) exceed the context,
    or when ``min_tokens`` could not fit in it with any prompt."""
    for name in ("max_tokens", "min_tokens"):
        value = getattr(params, name)
        if value is not None and value > limit - 1:
            raise ValueError(f"{name} must be at most {limit - 1} (this model's maximum context "
                             f"length is {limit} tokens, one at least for the prompt), got "
                             f"{show(value)}")
    if len(ids) >= limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {len(ids)} tokens; shorten it to fewer than {limit} tokens.")
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
            f"{params.max_tokens} in the completion). Reduce the prompt or max_tokens.")
