"""Prompt lookup (vLLM's ``ngram`` method): the draft continues the latest earlier occurrence
of the sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max]
that occurs.

Each request keeps an index, ``n-gram -> position of the token after its latest occurrence``,
updated with the tokens appended since the last proposal only: a proposal costs
O(new tokens x window sizes) plus one lookup per window size, never a rescan of the history.
"""

from __future__ import annotations

from asyncengine.core.request import Request


class NgramIndex:
    """The index of one sequence. ``upto``: continuation positions ``< upto`` are indexed."""

    __slots__ = ("lo", "hi", "table", "upto")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.table: dict[tuple[int, ...], int] = {}
        self.upto = 1

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram that has a known next token: those ending before the last."""
        table, lo, hi = self.table, self.lo, self.hi
        end = len(tokens)
        for c in range(self.upto, end):  # c: the continuation's position
            for n in range(lo, min(hi, c) + 1):
                table[tuple(tokens[c - n:c])] = c
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``tokens`` (indexed up to their end), or []."""
        self.update(tokens)
        end = len(tokens)
        table = self.table
        for n in range(min(self.hi, end), self.lo - 1, -1):
            c = table.get(tuple(tokens[end - n:end]))
            if c is not None:
                out: list[int] = []
                for i in range(k):  # past the end, the copy continues from its own start
                    j = c + i
                    out.append(tokens[j] if j < end else out[j - end])
                return out
        return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max

    def propose(self, request: Request, k: int) -> list[int]:
        index = request.spec_state
        if index is None:
            index = request.spec_state = NgramIndex(self.lo, self.hi)
        return index.propose(request.all_token_ids, k)
