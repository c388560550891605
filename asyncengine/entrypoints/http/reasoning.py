"""Reasoning models over HTTP (``--reasoning-parser``), shared by chat completions, the
Responses API and the Messages API: which parser reads a request's outputs, where structured
outputs start, the thinking budget, and the reasoning-token count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncengine.core.sampling_params import SamplingParams
from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.state import ServerState
from asyncengine.text.reasoning_parsers import ReasoningParser


def chat_template_kwargs(state: ServerState, given: dict[str, Any] | None) -> dict[str, Any]:
    """--default-chat-template-kwargs, overridden key by key by the request's own."""
    return {**state.settings.default_chat_template_kwargs, **(given or {})}


@dataclass
class ReasoningPlan:
    """One request's reasoning: ``parser`` is None when outputs are not split (no
    --reasoning-parser, or the prompt already closed the reasoning: thinking off)."""

    parser: type[ReasoningParser] | None = None
    prompt: str = ""
    start_ids: list[int] = field(default_factory=list)
    end_ids: list[int] = field(default_factory=list)
    configured: bool = False  # --reasoning-parser is set (usage reports reasoning tokens)

    @property
    def active(self) -> bool:
        return self.parser is not None

    def make(self) -> ReasoningParser | None:
        return None if self.parser is None else self.parser(self.prompt)

    def count(self, token_ids: list[int]) -> int:
        if self.parser is None:
            return 0
        return self.parser.count_reasoning_tokens(self.prompt, token_ids, self.start_ids,
                                                  self.end_ids)

    def apply(self, params: SamplingParams, budget: int | None, param: str) -> None:
        """Gate the request's structured outputs behind the reasoning; set its budget.
        Raise APIError (400) naming ``param`` for a budget the server cannot honour."""
        if budget is not None:
            if not self.configured:
                raise bad_request(f"{param} needs a reasoning parser on the server "
                                  "(--reasoning-parser)", param)
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise bad_request(f"{param} must be a non-negative integer, got {budget!r}",
                                  param)
        if self.parser is None:
            return
        if params.structured_outputs is not None or budget is not None:
            params.reasoning_end_token_ids = list(self.end_ids)
            params.thinking_token_budget = budget


def plan_reasoning(state: ServerState, prompt: str) -> ReasoningPlan:
    cls = state.reasoning_parser
    if cls is None:
        return ReasoningPlan()
    if cls.reasoning_ended_in_prompt(prompt):
        return ReasoningPlan(configured=True)
    tok = state.engine.tokenizer
    return ReasoningPlan(cls, prompt, tok.encode(cls.start_tag, add_special_tokens=False),
                         tok.encode(cls.end_tag, add_special_tokens=False), configured=True)
