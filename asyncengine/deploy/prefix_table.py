"""Which replica last served which prompt prefix: the state of the prefix-affinity router.

Plain Python (no Ray), so that it can be tested alone. A prompt's routing text is cut into
chunks of ``chunk_chars`` characters; chunk ``i`` is keyed by a hash chained over chunks
``0..i`` (as the KV cache chains its block hashes over token ids), so two prompts share the
key of chunk ``i`` exactly when they share their first ``(i + 1) * chunk_chars`` characters.
``record`` adds the replica a prompt went to to the holders of each of its chunk keys (most
recent last); ``match`` walks a new prompt's keys and returns the replica that holds its
longest recorded prefix (the most recent one among the candidates at that depth). Both are
O(len(text) / chunk_chars) dict operations. The table is an LRU bounded by ``max_entries``
keys.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Container
from typing import Any

#: Generation routes and the body field whose text keys the routing.
PROMPT_FIELDS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages",
                 "/v1/responses": "input"}


class PrefixTable:
    def __init__(self, chunk_chars: int = 64, max_entries: int = 1 << 18) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be at least 1, not {chunk_chars}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        # chunk key -> its holders, in the order they last got it (a dict as an ordered set)
        self._holders: OrderedDict[bytes, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def keys(self, text: str) -> list[bytes]:
        """The chained keys of the whole chunks of ``text`` (a shorter tail is left out)."""
        out: list[bytes] = []
        prev = b""
        n = self.chunk_chars
        for start in range(0, len(text) - n + 1, n):
            prev = hashlib.blake2b(prev + text[start:start + n].encode(), digest_size=16).digest()
            out.append(prev)
        return out

    def match(self, text: str, candidates: Container[str]) -> tuple[str | None, int]:
        """The candidate holding the longest recorded prefix of ``text``, and that prefix's
        length in characters; ``(None, 0)`` when no candidate holds any of it."""
        best, best_len = None, 0
        for i, key in enumerate(self.keys(text)):
            holders = self._holders.get(key)
            if holders is None:
                break  # chained keys: no longer prefix can be recorded
            for replica in reversed(holders):
                if replica in candidates:
                    best, best_len = replica, (i + 1) * self.chunk_chars
                    break
        return best, best_len

    def record(self, text: str, replica: str) -> None:
        """``replica`` now holds every prefix of ``text``."""
        for key in self.keys(text):
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {replica: None}
            else:
                holders.pop(replica, None)
                holders[replica] = None
                self._holders.move_to_end(key)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop a replica that is gone."""
        for key in list(self._holders):
            holders = self._holders[key]
            holders.pop(replica, None)
            if not holders:
                del self._holders[key]


def routing_text(path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: the prompt of a completion, the messages
    of a chat (role and content, in order), the input of a response; "" for anything else
    or a body that is not JSON (the engine replica answers that with its 400)."""
    field = PROMPT_FIELDS.get(path.split("?", 1)[0].rstrip("/"))
    if field is None or not body:
        return ""
    try:
        value = json.loads(body).get(field)
    except (ValueError, AttributeError):
        return ""
    return _text_of(value)


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\x1e".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        if "content" in value:  # a chat message
            return f"{value.get('role', '')}\x1f{_text_of(value['content'])}"
        if isinstance(value.get("text"), str):  # a content part
            return value["text"]
    if isinstance(value, int) and not isinstance(value, bool):  # a token id prompt
        return f"{value},"
    return ""
