"""The tail of every step: its results on their way to the host, read once they are there.

``runner.execute`` samples on the device and, instead of reading the ids back (a host sync),
copies them, and the logprob tensors of the rows that asked for logprobs, into pinned host
memory with ``non_blocking`` copies on the same stream. The device records its event after
those copies, so once the event has completed ``PendingOutput.finish()`` (on the loop) reads
plain host memory and builds the ``ModelRunnerOutput``; nothing here waits for the device.
On the CPU the "copies" are the tensors themselves, complete once the device's worker has
run the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncengine.core.request import PositionLogprobs
from asyncengine.core.sched.interface import ModelRunnerOutput
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.runtime.device import HostResult
from asyncengine.executor.runtime.staging import pinned
from asyncengine.executor.sampler import NO_TOKEN, SamplingBatch
from asyncengine.executor.sampler.logprobs import logprob_entries, logprob_tensors
from asyncengine.executor.spec.accept import SpecGroup, accept_into


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``t``, enqueued on the current stream (valid once
    the stream has passed this point); ``t`` itself when it is on the CPU."""
    if on_host(t):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


@dataclass
class PendingOutput(HostResult):
    """A step's results on their way to the host."""

    req_ids: list[str] = field(default_factory=list)  # the sampled rows' requests
    token_ids: torch.Tensor | None = None  # [S] host
    # Rows that asked for logprobs, their numbers of top alternatives, and (host) the chosen
    # tokens' logprobs [R, 1], ranks [R], top logprobs and ids [R, k] (None when k is 0).
    logprob_rows: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    logprobs: tuple[torch.Tensor, ...] | None = None
    # Prompt logprobs are computed (and read back) by the launcher thread: already on the host.
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # Speculative decoding: the step's requests with drafts (``StepInputs.spec``).
    spec: list[SpecGroup] | None = None

    def finish(self) -> ModelRunnerOutput:
        result = ModelRunnerOutput(prompt_logprobs=self.prompt_logprobs)
        if self.token_ids is None:
            return result
        ids = self.token_ids.tolist()
        result.sampled_token_ids = dict(zip(self.req_ids, ids, strict=True))
        row_lps: list[PositionLogprobs | None] | None = None
        if self.spec and self.logprobs is not None:
            row_lps = [None] * len(ids)
        if self.logprobs is not None:
            chosen, ranks, top_vals, top_ids = self.logprobs
            rows = self.logprob_rows
            entries = logprob_entries(
                [max(ids[i], 0) for i in rows], chosen.view(-1).tolist(), ranks.tolist(),
                None if top_vals is None else top_vals.tolist(),
                None if top_ids is None else top_ids.tolist(), self.num_top)
            for i, entry in zip(rows, entries, strict=True):
                if ids[i] != NO_TOKEN:
                    result.logprobs[self.req_ids[i]] = entry
                    if row_lps is not None:
                        row_lps[i] = entry
        if self.spec:
            accept_into(result, self.spec, ids, row_lps)
        return result


def pending_output(logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch,
                   req_ids: list[str],
                   prompt: dict[str, list[PositionLogprobs | None]]) -> PendingOutput:
    """Enqueue the copies of the sampled ids (and logprobs) to the host."""
    out = PendingOutput(req_ids=req_ids, token_ids=to_host(token_ids), prompt_logprobs=prompt)
    want = [i for i, k in enumerate(batch.logprobs) if k is not None]
    if not want:
        return out
    if len(want) == len(req_ids):
        sub, chosen = logits, token_ids.clamp(min=0)
    else:
        rows = pinned(np.array(want, dtype=np.int64), pin=not on_host(logits)).to(logits.device,
                                                                    non_blocking=True)
        sub, chosen = logits[rows], token_ids[rows].clamp(min=0)
    out.logprob_rows = want
    out.num_top = [batch.logprobs[i] or 0 for i in want]
    tensors = logprob_tensors(sub, chosen, max(out.num_top))
    out.logprobs = tuple(None if t is None else to_host(t) for t in tensors)
    return out
