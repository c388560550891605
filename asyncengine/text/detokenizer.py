"""Incremental detokenization with stop strings.

Runs on the event loop for every token of every request, so each step costs O(1) in the
length of the sequence: ``tokenizers``' ``DecodeStream`` decodes a small window of recent
tokens, and stop strings are searched only in the text not yet emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from asyncengine.core.sampling_params import SamplingParams
    from asyncengine.text.tokenizer import Tokenizer

# Prompt tokens given to the stream as context: enough for the decoder to place the first
# output token's leading space (e.g. " Paris" after "... France is") and to finish a
# multi-byte character, never the whole prompt.
_PREFILL_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive.

    ``update(ids)`` returns the new text that is safe to emit: text that could be the start
    of a stop string is held back until it is known not to be one. When a stop string appears,
    ``stop_reason`` is set to it, the text is cut just before it (just after it with
    ``include_stop_str_in_output``) and ``finished`` becomes True; later updates return "".
    ``flush()`` returns the held-back text (and any incomplete character, as U+FFFD) when the
    request ends for another reason. ``text`` is everything emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._stop_starts = frozenset(s[0] for s in self._stops)
        # Byte-level tokenizers: each token's bytes (byte_pieces.py), and the bytes held
        # because they do not form a complete character yet. Else a DecodeStream.
        pieces = getattr(tokenizer, "byte_pieces", None)
        self._pieces: list[bytes] | None = pieces(skip_special_tokens) if pieces else None
        # The same, decoded (None: not whole characters), for update's one-token fast path.
        texts = getattr(tokenizer, "byte_texts", None) if self._pieces is not None else None
        self._texts: list[str | None] | None = texts(skip_special_tokens) if texts else None
        self._held = b""
        # The last decoded tokens (context for flush) and the tokens the stream holds because
        # they do not yet form complete characters (DecodeStream only).
        self._undecoded: list[int] = []
        if self._pieces is None:
            window = self._clean_window(list(prompt_token_ids[-_PREFILL_TOKENS:]))
            self._stream = self._new_stream(window)
            self._context = window[-4:]
        self._pending = ""
        self._chunks: list[str] = []
        self._text: str | None = ""
        self.finished = False
        self.stop_reason: str | None = None

    @classmethod
    def from_params(cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

    @property
    def chunks(self) -> list[str]:
        """The emitted text, in the pieces ``update``/``flush`` returned (grows in place)."""
        return self._chunks

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(self._chunks)
        return self._text

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str:
        """Feed new output tokens; return the text they add that is safe to emit.

        ``stop_terminated``: the last token ended the request (eos or a stop token id); as in
        vLLM, its text is left out unless ``include_stop_str_in_output``. Call ``flush()``
        after it."""
        if self.finished:
            return ""
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        texts = self._texts
        if texts is not None and len(new_token_ids) == 1 and not self._held and \
                not self._stops:
            # The usual step: one token of whole characters, no stop strings to watch.
            token_id = new_token_ids[0]
            text = texts[token_id] if 0 <= token_id < len(texts) else ""
            if text:
                self._chunks.append(text)
                self._text = None
                return text
            if text is not None:
                return ""  # a token with no text (a skipped special token)
        step = self._step_bytes if self._pieces is not None else self._step
        parts = []
        for token_id in new_token_ids:
            piece = step(token_id)
            if piece:
                parts.append(piece)
        if not parts:
            return ""
        new = parts[0] if len(parts) == 1 else "".join(parts)
        if self._stops:
            new = self._check_stops(new)
        return self._emit(new)

    def push_plain(self, token_id: int) -> bool:
        """``update((token_id,))`` for the usual step, when it needs none of the general
        case: a token of whole characters (or a skipped special token), nothing held back, no
        stop strings to watch. Returns False, having changed nothing, when ``update`` is
        needed instead."""
        texts = self._texts
        if texts is None or self._held or self._stops or self.finished or \
                not 0 <= token_id < len(texts):
            return False
        text = texts[token_id]
        if text is None:
            return False
        if text:
            self._chunks.append(text)
            self._text = None
        return True

    def flush(self) -> str:
        """The text still held back, for a request that ends without a stop string."""
        if self.finished:
            return ""
        tail = self._pending
        if self._held:
            tail += self._held.decode("utf-8", "replace")
            self._held = b""
        if self._undecoded:
            tail += self._decode_tail(self._undecoded)
            self._context = (self._context + self._undecoded)[-4:]
            self._undecoded = []
        self._pending = ""
        return self._emit(tail)

    # -- internals -----------------------------------------------------------------------------
    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text = None
        return text

    def _step_bytes(self, token_id: int) -> str | None:
        """As ``DecodeStream.step``, from the token's bytes: the new text, or None while it
        ends in an incomplete (or invalid) character, whose bytes are held."""
        pieces = self._pieces
        piece = pieces[token_id] if 0 <= token_id < len(pieces) else b""
        if not piece:
            return None
        buf = self._held + piece if self._held else piece
        text = buf.decode("utf-8", "replace")
        if text.endswith(_REPLACEMENT):
            self._held = buf
            return None
        self._held = b""
        return text

    def _step(self, token_id: int) -> str | None:
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # the stream lost track of its prefix (exotic decoders)
            return self._restart(token_id)
        return self._account(token_id, piece)

    def _account(self, token_id: int, piece: str | None) -> str | None:
        if piece is None:
            self._undecoded.append(token_id)
            return None
        if self._undecoded:
            self._context = (self._context + self._undecoded + [token_id])[-4:]
            self._undecoded = []
        else:
            ctx = self._context
            ctx.append(token_id)
            if len(ctx) > 4:
                del ctx[0]
        return piece

    def _restart(self, token_id: int) -> str | None:
        """A fresh stream primed with the decoded context, fed the undecoded tokens again."""
        replay, self._undecoded = self._undecoded + [token_id], []
        self._stream = self._new_stream(self._clean_window(list(self._context)))
        out = []
        for t in replay:
            try:
                piece = self._stream.step(self._backend, t)
            except Exception:
                piece = self._decode_tail(self._undecoded + [t])
            piece = self._account(t, piece)
            if piece:
                out.append(piece)
        return "".join(out) or None

    def _new_stream(self, window: list[int]) -> DecodeStream:
        try:
            return DecodeStream(window, skip_special_tokens=self._skip)
        except TypeError:  # tokenizers without the prefill argument: step through the window
            stream = DecodeStream(skip_special_tokens=self._skip)
            for token_id in window:
                stream.step(self._backend, token_id)
            return stream

    def _decode_tail(self, ids: list[int]) -> str:
        """The text ``ids`` add after the current context."""
        decode = self._backend.decode
        prefix = decode(self._context, skip_special_tokens=self._skip)
        full = decode(self._context + ids, skip_special_tokens=self._skip)
        if full.startswith(prefix):
            return full[len(prefix):]
        return decode(ids, skip_special_tokens=self._skip)

    def _clean_window(self, window: list[int]) -> list[int]:
        # A window that decodes to a string ending in an incomplete character would make the
        # stream emit the whole window as new text; such trailing tokens are dropped.
        decode = self._backend.decode
        while window and decode(window, skip_special_tokens=self._skip).endswith(_REPLACEMENT):
            window.pop()
        return window

    def _check_stops(self, new: str) -> str:
        """Search stop strings in the held-back text plus ``new``; return what may be emitted
        and hold back the longest suffix that is a proper prefix of some stop string."""
        buf = self._pending + new
        hit, hit_at = None, len(buf)
        for s in self._stops:
            i = buf.find(s, 0, hit_at + len(s) - 1)
            if i != -1 and i < hit_at:
                hit, hit_at = s, i
        if hit is not None:
            self.finished = True
            self.stop_reason = hit
            self._pending = ""
            return buf[:hit_at + len(hit)] if self._include_stop else buf[:hit_at]
        hold = 0
        tail = buf[-self._max_hold:] if self._max_hold else ""
        if tail and not self._stop_starts.isdisjoint(tail):
            for n in range(len(tail), 0, -1):
                suffix = buf[-n:]
                if any(s.startswith(suffix) for s in self._stops):
                    hold = n
                    break
        if hold:
            self._pending = buf[-hold:]
            return buf[:-hold]
        self._pending = ""
        return buf
