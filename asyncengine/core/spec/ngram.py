"""Prompt lookup (vLLM's ``ngram`` method): the draft continues the latest earlier occurrence
of the sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max]
that occurs.

Each request keeps an index, ``n-gram -> position of the token after its latest occurrence``,
updated with the tokens appended since the last proposal only: a proposal costs
O(new tokens x window sizes) plus one lookup per window size, never a rescan of the history.

Three verifications in a row that accept nothing pause a request's proposals for a while
(``probe`` says no meanwhile), so a request whose output stopped copying its context decodes as
without speculation, its steps overlapped.

With ``adaptive`` (where a verification row costs a real part of a step: the CPU), a request's
drafts follow its last verification: after a partial acceptance of ``a`` drafts the next
proposal has at most ``max(2, a + 1)``; after a full one, twice as many as that one had (up to
k). A copy that diverged is likely to diverge again soon, while a copy that holds keeps
growing. Replaying the grounded benchmark's greedy outputs against the measured cost of a
row (2 threads: a 1 + k row step costs ~1 + 0.32 k plain steps), this made ~8% more output
per second than always drafting k, with k 8; where a row costs ~2% of a step (a GPU) it
loses ~2%, so it is the CPU's default only.

Adaptive requests also draft nothing after an ambiguous match: a longest matching n-gram that
has been followed by different tokens (``", the"``, ``"append("`` in code with two lists). In
the grounded benchmark's greedy outputs (32 requests) the first draft of such a match was
right 0-50% of the time, of an unambiguous one 57-94%; replayed at a row cost of 0.15 steps,
skipping them made 1.7% more output per second. The index marks a key ambiguous when a new
occurrence's next token differs from the last one's (its position then stored negated).
"""

from __future__ import annotations

from asyncengine.core.request import Request

#: Verifications in a row that accept nothing before a request's proposals pause.
PAUSE_AFTER = 3
#: The fewest drafts an adaptive request proposes after a partial acceptance.
MIN_ADAPTIVE = 2


class NgramIndex:
    """The index of one sequence. ``upto``: continuation positions ``< upto`` are indexed."""

    __slots__ = ("lo", "hi", "table", "upto", "drafted", "base", "misses", "resume", "cap",
                 "skip_ambiguous")

    def __init__(self, lo: int, hi: int, skip_ambiguous: bool = False) -> None:
        self.lo, self.hi = lo, hi
        self.skip_ambiguous = skip_ambiguous
        # n-gram -> the position after its latest occurrence; negated once the n-gram has been
        # followed by two different tokens
        self.table: dict[tuple[int, ...], int] = {}
        self.upto = 1
        self.drafted = 0  # the last proposal's drafts (0: none pending)
        self.base = 0  # the sequence's length when they were proposed
        self.misses = 0  # verifications in a row that accepted nothing
        self.resume = 0  # no proposals before the sequence has this many tokens
        self.cap = 0  # adaptive: the most drafts the next proposal has (0: no cap)

    def learn(self, length: int) -> None:
        """Take in the last proposal's outcome, the sequence now ``length`` tokens long (its
        accepted drafts: ``length - base - 1``)."""
        drafted, self.drafted = self.drafted, 0
        if not drafted:
            return
        accepted = length - self.base - 1
        # (the cap is used by adaptive proposers only)
        self.cap = 2 * drafted if accepted >= drafted else max(MIN_ADAPTIVE, accepted + 1)
        if accepted > 0:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= PAUSE_AFTER:  # not copying any more: plain steps for a while
            self.resume = length + 4 * self.misses

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram that has a known next token: those ending before the last."""
        table, lo, hi = self.table, self.lo, self.hi
        end = len(tokens)
        for c in range(self.upto, end):  # c: the continuation's position
            nxt = tokens[c]
            for n in range(lo, min(hi, c) + 1):
                key = tuple(tokens[c - n:c])
                last = table.get(key)
                # ambiguous (negated) once followed by another token than last time
                table[key] = c if last is None or (last > 0 and tokens[last] == nxt) else -c
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``tokens`` (indexed up to their end), or []."""
        self.update(tokens)
        end = len(tokens)
        table = self.table
        for n in range(min(self.hi, end), self.lo - 1, -1):
            c = table.get(tuple(tokens[end - n:end]))
            if c is not None:
                if c < 0:
                    if self.skip_ambiguous:
                        return []
                    c = -c  # the latest occurrence's continuation
                out: list[int] = []
                for i in range(k):  # past the end, the copy continues from its own start
                    j = c + i
                    out.append(tokens[j] if j < end else out[j - end])
                return out
        return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 adaptive: bool = False) -> None:
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self.adaptive = adaptive

    def _index(self, request: Request) -> NgramIndex:
        index = request.spec_state
        if index is None:
            index = request.spec_state = NgramIndex(self.lo, self.hi,
                                                    skip_ambiguous=self.adaptive)
        return index

    def propose(self, request: Request, k: int) -> list[int]:
        index = self._index(request)
        tokens = request.all_token_ids
        index.learn(len(tokens))
        if len(tokens) < index.resume:
            return []
        if self.adaptive and index.cap:
            k = min(k, index.cap)
        drafts = index.propose(tokens, k)
        if drafts:
            index.drafted, index.base = len(drafts), len(tokens)
        return drafts

    def probe(self, request: Request) -> bool:
        """Whether drafts are likely once the request's in-flight token is known: its known
        tokens end with an n-gram that occurred before (and it is not pausing). While it says
        no, the request's steps overlap the loop's host work as without speculation."""
        index = self._index(request)
        tokens = request.all_token_ids
        return len(tokens) >= index.resume and bool(index.propose(tokens, 1))
