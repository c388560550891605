"""Structured outputs and thinking budgets for reasoning models.

``ReasoningGate`` wraps a request's grammar (or none) and is itself a ``Grammar``: while the
model reasons it allows every token, and the inner grammar starts only after the tokens that
end the reasoning (``</think>``), as vLLM does: the constraint applies to the answer, never
to the thinking. With a thinking budget, once that many reasoning tokens were sampled the
gate allows only the end tag's tokens, one after the other, so the reasoning ends there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncengine.ext.contracts.structured_output import Grammar

if TYPE_CHECKING:
    import torch


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Make ``bitmask[row]`` allow ``token_id`` alone (bit ``t % 32`` of 32-bit word ``t // 32``,
    the layout of the backends' bitmasks)."""
    bitmask[row].fill_(0)
    bit = token_id % 32
    bitmask[row, token_id // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)


class ReasoningGate(Grammar):
    """``inner`` (None: no constraint) applies after ``end_ids``; ``budget`` reasoning tokens
    at most (None: no limit)."""

    def __init__(self, inner: Grammar | None, end_ids: list[int],
                 budget: int | None = None) -> None:
        if not end_ids:
            raise ValueError("the reasoning end tag has no tokens")
        self.inner = inner
        self.end_ids = list(end_ids)
        self.budget = budget
        self._history: list[int] = []  # every token accepted, for rollback
        self._reset_state()

    def _reset_state(self) -> None:
        self.reasoning = True
        self.num_reasoning = 0  # tokens accepted while reasoning (end tag excluded)
        self._matched = 0  # end-tag tokens matched so far
        self._forcing = self.budget is not None and self.budget <= 0

    def _advance(self, token_id: int) -> None:
        """The reasoning-phase state after one more token."""
        if self._matched < len(self.end_ids) and token_id == self.end_ids[self._matched]:
            self._matched += 1
        else:
            if self._forcing:  # cannot happen: the mask allowed nothing else
                self._forcing = False
            self.num_reasoning += self._matched + 1
            self._matched = 1 if token_id == self.end_ids[0] else 0
            if self._matched:
                self.num_reasoning -= 1
        if self._matched == len(self.end_ids):
            self.reasoning = False
            self._forcing = False
        elif self.budget is not None and self.num_reasoning >= self.budget:
            self._forcing = True

    # -- Grammar ----------------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        if self.reasoning:
            if self._forcing and token_id != self.end_ids[self._matched]:
                return False
            self._advance(token_id)
        elif self.inner is not None and not self.inner.accept_token(token_id):
            return False
        self._history.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.reasoning:
            if self._forcing:
                allow_only(bitmask, row, self.end_ids[self._matched])
            return  # the row keeps allowing every token
        if self.inner is not None and not self.inner.is_terminated():
            self.inner.fill_bitmask(bitmask, row)

    def unwrap(self) -> Grammar | None:
        """The grammar that fills this row now: the inner one once the reasoning ended; None
        while reasoning, or with no inner grammar (then :meth:`fill_bitmask` keeps the row
        open or forces the tag). A backend filling rows in a batch fills the inner one with
        its own (``builtins/xgrammar.py``)."""
        return None if self.reasoning else self.inner

    def is_terminated(self) -> bool:
        return not self.reasoning and self.inner is not None and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} "
                             "were accepted")
        if not num_tokens:
            return
        kept = self._history[:len(self._history) - num_tokens]
        self._reset_state()
        n_reasoning = 0
        for t in kept:  # replay the reasoning phase
            if not self.reasoning:
                break
            self._advance(t)
            n_reasoning += 1
        inner_before = len(self._history) - self._phase_len()
        inner_after = len(kept) - n_reasoning
        if self.inner is not None and inner_before > inner_after:
            self.inner.rollback(inner_before - inner_after)
        self._history = kept

    def _phase_len(self) -> int:
        """How many tokens of the history were the reasoning phase's (before the rollback)."""
        probe = ReasoningGate(None, self.end_ids, self.budget)
        n = 0
        for t in self._history:
            if not probe.reasoning:
                break
            probe._advance(t)
            n += 1
        return n

    def reset(self) -> None:
        self._history.clear()
        self._reset_state()
        if self.inner is not None:
            self.inner.reset()

    def fresh(self) -> ReasoningGate:
        return ReasoningGate(None if self.inner is None else self.inner.fresh(), self.end_ids,
                             self.budget)
