"""Prompt lookup (vLLM's ``ngram`` method): the draft continues the latest earlier occurrence
of the sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max]
that occurs.

Each request keeps an index, ``n-gram -> position of the token after its latest occurrence``,
updated with the tokens appended since the last proposal only: a proposal costs
O(new tokens x window sizes) plus one lookup per window size, never a rescan of the history.

k adapts per request to what its last drafts earned (a verification row costs a good part of
a decode step on the CPU: ``docs/speculative.md``): all accepted doubles it (up to the
configured k), a rejection sets it to one more than the drafts accepted. Two verifications in
a row that accept nothing stop the proposals for a while (``probe`` says no), so a request
whose output stops copying its context decodes as without speculation, its steps overlapped.
"""

from __future__ import annotations

from asyncengine.core.request import Request


class NgramIndex:
    """The index of one sequence. ``upto``: continuation positions ``< upto`` are indexed."""

    __slots__ = ("lo", "hi", "table", "upto", "k", "drafted", "base", "misses", "resume")

    def __init__(self, lo: int, hi: int, k: int = 32) -> None:
        self.lo, self.hi = lo, hi
        self.table: dict[tuple[int, ...], int] = {}
        self.upto = 1
        self.k = k  # drafts the next proposal may have (adapted by ``learn``)
        self.drafted = 0  # the last proposal's drafts (0: none pending)
        self.base = 0  # the sequence's length when they were proposed
        self.misses = 0  # verifications in a row that accepted nothing
        self.resume = 0  # no proposals before the sequence has this many tokens

    def learn(self, length: int, k_max: int) -> None:
        """Adapt ``k`` to the last proposal's outcome, the sequence now ``length`` tokens
        long: its accepted drafts are ``length - base - 1``."""
        drafted, self.drafted = self.drafted, 0
        if not drafted:
            return
        accepted = length - self.base - 1
        if accepted >= drafted:
            self.k = min(2 * self.k, k_max)
            self.misses = 0
        elif accepted > 0:
            self.k = accepted + 1
            self.misses = 0
        else:
            self.k = 1
            self.misses += 1
            if self.misses >= 2:  # not copying any more: plain steps for a while
                self.resume = length + 4 * self.misses

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
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 adaptive: bool = True) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self.adaptive = adaptive

    def _index(self, request: Request, k: int) -> NgramIndex:
        index = request.spec_state
        if index is None:
            index = request.spec_state = NgramIndex(self.lo, self.hi, k)
        return index

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` drafts (fewer where its acceptance history says so)."""
        index = self._index(request, k)
        tokens = request.all_token_ids
        if not self.adaptive:
            return index.propose(tokens, k)
        index.learn(len(tokens), k)
        if len(tokens) < index.resume:
            return []
        drafts = index.propose(tokens, min(k, index.k))
        if drafts:
            index.drafted, index.base = len(drafts), len(tokens)
        return drafts

    def probe(self, request: Request) -> bool:
        """Whether drafts are likely once the request's in-flight token is known: its known
        tokens end with an n-gram that occurred before (and it is not pausing). While it says
        no, the request's steps overlap the loop's host work as without speculation."""
        index = self._index(request, 32)
        tokens = request.all_token_ids
        return len(tokens) >= index.resume and bool(index.propose(tokens, 1))
