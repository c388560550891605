"""What the step loop does for speculative decoding: making the drafting from the config,
filling the grammar bitmask of a step that verifies drafts, and counting acceptance.

A step with drafts has one sampled row per position of each such request (its last token and
each draft). Row i of a constrained request must hold the grammar's mask after the drafts
``d_1 .. d_i``: the grammar accepts them one at a time while its rows are filled, then rolls
back, so its state is again that of the request's known tokens when the results come (the
scheduler then feeds it the tokens actually kept). A draft the grammar refuses is left out of
the row before it, so the target cannot sample it there: it is rejected, and the rows after it
(whose results are dropped) allow every token.
"""

from __future__ import annotations

from typing import Any

from asyncengine.core.sched.interface import ModelRunnerOutput
from asyncengine.core.spec.drafting import Drafting
from asyncengine.core.spec.ngram import NgramProposer


def make_drafting(config: Any) -> Drafting | None:
    settings = getattr(config, "speculative_settings", None)
    if settings is None:
        return None
    if settings.method == "ngram":
        return Drafting(settings, NgramProposer(settings.prompt_lookup_min,
                                                settings.prompt_lookup_max))
    raise ValueError(f"--speculative-config: method {settings.method!r} is not available in "
                     "this build (use \"ngram\")")


def fill_spec_bitmask(loop: Any, step: Any) -> Any:
    """The mask of ``step`` (a ``step_loop.Step`` with drafts) for ``loop`` (its
    ``StepLoop``)."""
    manager = loop.engine.structured
    bitmask = manager.backend.allocate_bitmask(len(step.grammars))
    row = 0
    for s in step.out.scheduled:
        if not s.samples:
            continue
        drafts = s.spec_token_ids
        grammar = s.request.grammar
        first, row = row, row + 1 + len(drafts)
        if grammar is None or s.request.is_finished:
            continue
        num_accepted = 0
        try:
            try:
                for i in range(len(drafts) + 1):
                    if grammar.is_terminated():
                        break
                    grammar.fill_bitmask(bitmask, first + i)
                    if i == len(drafts) or not grammar.accept_token(drafts[i]):
                        break
                    num_accepted += 1
            finally:
                grammar.rollback(num_accepted)
        except Exception as e:
            loop.fail_grammar(s.request, e)
    return bitmask


def record_spec(metrics: Any, groups: list[tuple[str, int, list[int]]],
                result: ModelRunnerOutput) -> int:
    """Count drafts and accepted tokens; returns the accepted drafts (generated tokens that
    ``sampled_token_ids`` does not count)."""
    extra = 0
    tokens_of = result.spec_token_ids
    for rid, _, drafts in groups:
        tokens = tokens_of.get(rid)
        if tokens is None:
            continue
        num_accepted = len(tokens) - 1
        metrics.on_spec(len(drafts), num_accepted)
        extra += num_accepted
    return extra
