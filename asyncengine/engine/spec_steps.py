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
from asyncengine.executor.spec.draft_model import DraftModelProposer


def make_drafting(engine: Any) -> Drafting | None:
    """The engine's drafting from its config's ``speculative_settings`` (None: off)."""
    config = getattr(engine, "config", None)
    settings = getattr(config, "speculative_settings", None)
    if settings is None:
        return None
    if settings.method == "ngram":
        # On the CPU each verification row costs a real part of a step: drafts adapt to the
        # request's last acceptance (core/spec/ngram.py); on a GPU rows are nearly free.
        cpu = getattr(getattr(engine, "device", None), "computes_on_host", True)
        return Drafting(settings, NgramProposer(settings.prompt_lookup_min,
                                                settings.prompt_lookup_max, adaptive=cpu))
    return Drafting(settings, _draft_model(engine, settings))


def _draft_model(engine: Any, settings: Any) -> DraftModelProposer:
    """Load the draft model beside the target: same device queue, its own KV cache with as
    many blocks as the target's, the target's context length."""
    from asyncengine.executor.build import build

    config, parts = engine.config, engine.parts
    try:
        draft_config = config.replace(
            model=settings.model, speculative_config=None, tokenizer=None,
            served_model_name=None, max_model_len=parts.max_model_len,
            num_gpu_blocks_override=parts.num_blocks, load_format="auto")
        draft = build(draft_config)
    except (OSError, ValueError) as e:
        raise ValueError(f"--speculative-config: cannot load the draft model "
                         f"{settings.model!r}: {e}") from e
    if draft.vocab_size != parts.vocab_size:
        raise ValueError(f"--speculative-config: the draft model's vocabulary "
                         f"({draft.vocab_size} tokens) differs from the target's "
                         f"({parts.vocab_size}); use a draft of the same tokenizer")
    return DraftModelProposer(draft.runner, engine.device, draft.num_blocks,
                              config.cache.block_size)


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
