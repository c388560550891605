"""What ``runner.prepare`` hands the device for one step: ``StepInputs`` and its parts."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncengine.executor.attention.base import AttentionMetadata
from asyncengine.executor.sampler import SamplingBatch
from asyncengine.executor.step.input_batch import RowReset

#: Seconds between checks of an abandoned step while the sampler waits for a bitmask.
_BITMASK_POLL_S = 0.05


class StepAbandoned(RuntimeError):
    """The engine stopped while this step waited for its grammar bitmask."""


@dataclass
class PromptLogprobsTask:
    """Prompt logprobs for the query tokens ``[first, last)`` of one request in this step."""

    req_id: str
    first: int  # index into the step's flattened tokens
    last: int
    next_token_ids: torch.Tensor  # the prompt tokens these positions predict
    k: int


class BitmaskSlot:
    """A grammar bitmask the loop fills while the device runs the forward pass. The device
    waits for it before sampling; ``abandon()`` (the engine stopping) ends that wait."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.abandoned = False
        self.bitmask: torch.Tensor | None = None
        self.apply = None  # callable(logits, bitmask) from the structured-output manager

    def set(self, bitmask: torch.Tensor | None, apply) -> None:
        self.bitmask, self.apply = bitmask, apply
        self.ready.set()

    def abandon(self) -> None:
        self.abandoned = True
        self.ready.set()

    def wait(self) -> None:
        while not self.ready.wait(_BITMASK_POLL_S):
            pass
        if self.abandoned:
            raise StepAbandoned("the engine stopped before this step's grammar mask was ready")


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] (padded to the CUDA graph's batch when graph_batch is set)
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the flattened step to sample from
    sample_req_ids: list[str]
    sampling_batch: SamplingBatch | None
    # The same rows on the host (numpy): for the loop's own use; on CUDA the staged tensor is
    # valid only for work enqueued on the device's stream after the upload.
    sample_indices_host: np.ndarray | None = None
    # Penalty state: persistent rows of the sampled rows that have penalties ([P]), and the
    # rows (re)joined this step whose state the device resets first.
    penalty_rows: torch.Tensor | None = None
    resets: list[RowReset] = field(default_factory=list)
    # Input tokens still in flight: input_ids[dst] = previous step's sampled ids[src].
    from_previous: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt_tasks: list[PromptLogprobsTask] = field(default_factory=list)
    bitmask: BitmaskSlot | None = None
    num_tokens: int = 0  # real tokens (before any padding)
    num_prompt_tokens: int = 0  # of which prompt tokens (the rest: outputs, drafts)
    decode_only: bool = False  # every request computes one token
    # decode (every request one token), prefill (prompt chunks only) or mixed: which chain of
    # paths runs the step (``executor/paths/choose.py``).
    phase: str = "mixed"
    # The in-flight ids are in and the attention backend planned (``paths/base.begin``).
    begun: bool = False
    # CUDA: the decode step replays the CUDA graph captured for this many rows (padded).
    graph_batch: int | None = None
    # Speculative decoding: per request with drafts, (request id, index of its first sampled
    # row, its drafts); its rows are that index .. index + len(drafts).
    spec: list[tuple[str, int, list[int]]] | None = None
    # Tensor parallelism: the workers' step message (``parallel/messages.StepMessage``).
    tp_message: Any = None
    # LoRA: the step's per-token slots and slot writes (``lora/manager.LoRAStepInputs``).
    lora: Any = None
    # Images: the placeholder slices this step computes (``executor/mm_step.MMSlice``).
    mm: Any = None
    # ... and what the encoder does in this step (``core.encoder_budget.EncoderPlan``).
    mm_plan: Any = None

    @property
    def blocks_host(self) -> bool:
        """The step waits on the host before it can finish enqueueing its work (a grammar
        bitmask the loop fills later, prompt logprobs read back mid-step): on CUDA it is
        launched from the launcher thread, never from the event loop."""
        return self.bitmask is not None or bool(self.prompt_tasks)
