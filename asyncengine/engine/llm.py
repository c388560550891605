"""LLM: the offline API on top of the same AsyncEngine.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import anyio

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import AsyncEngine
from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.stream_group import StreamGroup

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

Prompt = str | list[int]


class LLM:
    """Batch generation without a server. ``kwargs`` are config fields by flag name
    (``max_num_seqs=8``, ``dtype="float32"``, ``num_gpu_blocks_override=64``, ...)."""

    def __init__(self, model: str | None = None, *, plugin_manager: Any = None,
                 **kwargs: Any) -> None:
        config = EngineConfig.from_dict({"model": model, **kwargs})
        self.engine = AsyncEngine(config, plugin_manager=plugin_manager)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig, *, plugin_manager: Any = None) -> LLM:
        """An LLM of a whole configuration (``LLMs`` makes each of its models so)."""
        llm = cls.__new__(cls)
        llm.engine = AsyncEngine(config, plugin_manager=plugin_manager)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run all prompts concurrently (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        try:
            return anyio.run(self._run, prompts, params, prios)
        except BaseExceptionGroup as group:  # the task groups wrap what a request raised
            raise _first_leaf(group) from None

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template applies."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params)

    async def _run(self, prompts: list[Prompt], params: list[SamplingParams],
                   prios: list[int]) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        async with self.engine:
            streams = [await self.engine.add_request(p, sp, priority=pr)
                       for p, sp, pr in zip(prompts, params, prios, strict=True)]
            index = {s.request_id: i for i, s in enumerate(streams)}
            group = StreamGroup(streams, final_only=True)  # one wake-up per step at most
            try:
                async for outputs in group:
                    if group.errors:  # what the request raised, as its own stream would
                        raise next(iter(group.errors.values()))
                    for out in outputs:
                        results[index[out.request_id]] = out
            finally:
                group.close()
        return results  # type: ignore[return-value]


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The exception a caller should see: the first one inside nested groups (a request's
    ValueError, say), not the task groups' wrapper."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
