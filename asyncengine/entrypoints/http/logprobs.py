"""Logprobs in OpenAI's two shapes: completions (parallel lists) and chat (a list of entries)."""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.core.request import PositionLogprobs
from asyncengine.entrypoints.http.responses import CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no infinity: clamp as vLLM does.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


TokenTexts = Callable[[list[int]], list[str]]  # Tokenizer.token_texts: ids -> texts


class CompletionLogprobsBuilder:
    """Builds the completions ``logprobs`` object of one choice, chunk by chunk (text offsets
    continue across chunks). ``top_logprobs`` holds the top alternatives and the chosen token."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts = texts
        self.offset = offset

    def build(self, token_ids: list[int], positions: list[PositionLogprobs | None] | None,
              into: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Entries for ``token_ids`` (``positions[i]`` None: no logprob), appended to ``into``
        if given."""
        out = into if into is not None else CompletionLogprobs([], [], [], [])
        needed = list(token_ids)
        for entry in positions or ():
            if entry is not None:
                needed.extend(entry)
        text_of = dict(zip(needed, self.texts(needed), strict=True))
        for i, token_id in enumerate(token_ids):
            text = text_of[token_id]
            entry = positions[i] if positions is not None and i < len(positions) else None
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            chosen = entry.get(token_id)
            out.token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
            out.top_logprobs.append({text_of[t]: _lp(lp.logprob) for t, lp in entry.items()})
        return out


def chat_logprobs(texts: TokenTexts, token_ids: list[int], positions: list[PositionLogprobs],
                  num_top: int) -> list[TokenLogprob]:
    """Chat ``logprobs.content`` entries; ``top_logprobs`` holds exactly the top ``num_top``."""
    needed = list(token_ids)
    for entry in positions:
        needed.extend(entry)
    text_of = dict(zip(needed, texts(needed), strict=True))
    out = []
    for token_id, entry in zip(token_ids, positions, strict=True):
        text = text_of[token_id]
        chosen = entry.get(token_id)
        top = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        out.append(TokenLogprob(
            token=text,
            logprob=_lp(chosen.logprob) if chosen is not None else MIN_LOGPROB,
            bytes=_bytes(text),
            top_logprobs=[TopLogprob(text_of[t], _lp(lp.logprob), _bytes(text_of[t]))
                          for t, lp in top],
        ))
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
