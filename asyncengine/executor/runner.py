"""ModelRunner: SchedulerOutput -> tensors -> forward -> sampled tokens.

Split in two so the loop never waits on the device:

* ``prepare(out)`` runs on the event loop. It updates the persistent batch
  (``input_batch.py``: rows join, leave, or get new blocks) and gathers the step's arrays with
  numpy (no torch kernels on the loop's thread: a thread that runs a parallel torch kernel
  keeps its own OpenMP team, and two teams on the cores slow every forward pass). It is the
  only place the runner reads ``Request`` objects.
* ``execute(inputs)`` runs on the device, in step order: the forward pass through the path the
  step's phase gives it (``executor/paths/``: chosen once, at build), then sampling. It
  touches only ``inputs``, the model, the KV cache and the device-side state (the previous
  step's sampled ids, penalty counts), so the loop may go on changing requests (aborts, stop
  strings) and prepare the next step while it runs.

Async scheduling: step N+1 is prepared before step N's tokens reach the host. A request that
sampled in step N decodes that token in N+1: ``prepare`` leaves its input id blank and records
where it is in step N's sampled ids; ``execute`` copies it from there on the device.

A step ends one way on every device: ``execute`` returns a
:class:`~asyncengine.executor.step.output.PendingOutput` without reading anything back, and
it becomes the step's ``ModelRunnerOutput`` (``finish()``, on the loop) once the device says
the sampled ids are in host memory: the CPU's worker thread has finished the step, or, on
CUDA, where ``execute`` only enqueues work on the device's stream, the step's event has
fired. ``prepare`` is the same on both; its tensors come from the device's staging
(``staging.py``: ``torch.from_numpy`` on the CPU, one packed pinned upload on CUDA).

``read_kv_blocks`` / ``write_kv_blocks`` copy whole KV blocks (all layers) out of and into
the cache for a KV connector.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncengine.core.request import PositionLogprobs, Request
from asyncengine.core.sched.interface import SchedulerOutput
from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.kv.blocks import BlockCopy, read_blocks, write_blocks
from asyncengine.executor.mm_step import forward_with_images, step_slices
from asyncengine.executor.paths.base import DECODE, MIXED, PREFILL
from asyncengine.executor.paths.choose import PathPlan, eager_only
from asyncengine.executor.runtime.staging import DirectStaging
from asyncengine.executor.sampler import NO_TOKEN, prompt_logprobs, sample_ids
from asyncengine.executor.sampler.greedy_head import MIN_ROWS as GREEDY_HEAD_MIN_ROWS
from asyncengine.executor.sampler.greedy_head import greedy_from_hidden
from asyncengine.executor.sampler.inputs import gather_sampling_batch
from asyncengine.executor.sampler.penalty_state import PenaltyState
from asyncengine.executor.step.input_batch import InputBatch
from asyncengine.executor.step.inputs import (
    BitmaskSlot,
    PromptLogprobsTask,
    StepAbandoned,
    StepInputs,
)
from asyncengine.executor.step.mrope_rows import MRopeRows
from asyncengine.executor.step.output import PendingOutput, pending_output
from asyncengine.executor.step.step_rows import StepRows, gather_rows
from asyncengine.executor.weights.int4 import step_requests

__all__ = ["BitmaskSlot", "ModelRunner", "PromptLogprobsTask", "StepAbandoned", "StepInputs"]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int],
        *,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        staging: Any = None,
        sampling_method: str | None = None,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = model.vocab_size
        self.batch = InputBatch(max_num_seqs, -(-max_model_len // block_size) + 1,
                                self.vocab_size, eos_token_ids)
        self.staging = staging or DirectStaging()
        self.sampling_method = sampling_method  # None: the device's default
        # The CPU's sliced greedy head (``sampler/greedy_head.py``) for all-greedy steps, and
        # how each phase's steps run (``paths/choose.py``): the per-layer decoder until the
        # chooser has run (``build``).
        self.greedy_head = False
        self.paths: PathPlan = eager_only(self)
        # CUDA graphs for decode steps (``paths/cuda_graphs.CUDAGraphRunner``): ``prepare``
        # pads a decode step to a captured batch size (set by that path).
        self.graphs: Any = None
        # --enable-lora: the adapters' registry and slots (``lora/manager.LoRAManager``).
        self.lora: Any = None
        # The last prepared step's rows (``step/step_rows.py``): where each request's token
        # sits in its sampled ids, and what a steady decode step reuses.
        self._rows: StepRows | None = None
        # Device side (touched by execute only): the last step's sampled ids, penalty state.
        self._last_sampled: torch.Tensor | None = None
        self.penalty_state = PenaltyState(self.vocab_size, device)
        # Images (a vision-language model): the encoder's output cache (set by ``build``) and
        # the requests whose image placeholders are not all computed yet (``mm_step.py``).
        self.encoder_cache: Any = None
        self._mm_pending: dict[str, Request] = {}
        # An M-RoPE decoder (Qwen2-VL): its positions per step (``step/mrope_rows.py``).
        self.mrope = MRopeRows(self.batch.capacity) \
            if getattr(getattr(model, "spec", None), "mrope_section", None) else None

    # -- on the loop -----------------------------------------------------------------------------
    def release(self, out: SchedulerOutput) -> None:
        """Drop the rows of the requests that finished or were preempted since the last step.
        ``prepare`` does it first; the loop calls it alone for a step that scheduled nothing,
        whose leavers must not keep their rows (a re-admitted request would find its old
        block table)."""
        ib = self.batch
        for rid in out.finished_req_ids:
            ib.remove(rid)
        for rid in out.preempted_req_ids:
            ib.remove(rid)
        if self._mm_pending or self.mrope is not None:
            for rid in (*out.finished_req_ids, *out.preempted_req_ids):
                self._mm_pending.pop(rid, None)
                if self.mrope is not None:
                    self.mrope.leave(rid)

    def prepare(self, out: SchedulerOutput, *, with_bitmask: bool = False) -> StepInputs:
        ib = self.batch
        self.release(out)
        rows = self._rows = gather_rows(self._rows, out, ib, self._on_join,
                                        self._prompt_logprobs_task)
        num_reqs = len(rows.rows)  # attention rows: a request's drafts are one row each
        starts, lens, spec = rows.starts, rows.lens, rows.spec
        sample_req_ids = rows.sample_req_ids

        staging = self.staging
        staging.begin()
        put = staging.put
        bs = self.block_size
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        # positions: start_i, start_i + 1, ... for each request's tokens, laid end to end
        positions = np.repeat(starts - cu[:-1], lens) + np.arange(total, dtype=np.int64)
        row_of_token = np.repeat(rows.rows, lens)
        slots = ib.block_table[row_of_token, positions // bs] * bs + positions % bs
        if self.mrope is not None:  # the model's positions are M-RoPE's
            positions = self.mrope.positions(positions, row_of_token, rows.rows, starts, lens,
                                             cu[:-1], ib.row_of)
        seq_lens = starts + lens
        width = int((seq_lens.max() + bs - 1) // bs) if num_reqs else 0
        table = ib.block_table[rows.rows, :width]
        decode_only = total == num_reqs
        phase = DECODE if decode_only else (MIXED if (lens == 1).any() else PREFILL)
        lora_slots, lora_writes = (None, None) if self.lora is None else \
            self.lora.prepare(out.scheduled)
        graph_batch = (self.graphs.bucket_for(num_reqs)
                       if self.graphs is not None and decode_only and num_reqs and not spec
                       and lora_slots is None else None)
        meta = AttentionMetadata(
            query_start_loc=cu.tolist(),
            seq_lens=seq_lens.tolist(),
            block_tables=put(table) if self.attn_backend.needs_block_tables_tensor else None,
            slot_mapping=put(slots),
            block_size=bs,
            block_tables_host=table,
            padded_batch=graph_batch,
            requests=len(out.scheduled) if spec else None,
        )
        self.attn_backend.prepare(meta)
        sample_np = rows.sample_flat
        inputs = StepInputs(
            input_ids=put(rows.input_ids),
            positions=put(positions),
            attn_metadata=meta,
            sample_indices=put(sample_np),
            sample_indices_host=sample_np,
            sample_req_ids=sample_req_ids,
            sampling_batch=None,
            prompt_tasks=rows.prompt_tasks,
            bitmask=BitmaskSlot() if with_bitmask else None,
            num_tokens=total,
            num_prompt_tokens=rows.num_prompt_tokens,
            decode_only=decode_only,
            phase=phase,
            graph_batch=graph_batch,
        )
        if spec:
            inputs.spec = spec
        if self._mm_pending:
            inputs.mm = step_slices(out.scheduled, self._mm_pending, ib, bs) or None
        if lora_slots is not None:  # LoRA: each token's adapter slot
            inputs.lora = self.lora.step_inputs(lora_slots, lora_writes, put)
        if rows.prev_dst is not None:
            inputs.from_previous = (put(rows.prev_dst), put(rows.prev_src))
        if ib.pending_resets:
            inputs.resets, ib.pending_resets = ib.pending_resets, []
            for r in inputs.resets:
                r.staged = (put(np.array(r.prompt_token_ids, dtype=np.int64)),
                            put(np.array(r.output_token_ids, dtype=np.int64))
                            if r.output_token_ids else None)
        if sample_req_ids:
            inputs.sampling_batch, inputs.penalty_rows = gather_sampling_batch(
                ib, rows.sample_rows, rows.counters, self.device, put=put,
                method=self.sampling_method)
        staging.flush()
        return inputs

    def _on_join(self, req: Request) -> None:
        if req.mm_inputs:
            self._mm_pending[req.request_id] = req
        if self.mrope is not None:
            self.mrope.join(req, self.batch.row_of[req.request_id])

    @staticmethod
    def _prompt_logprobs_task(req: Request, start: int, n: int,
                              first: int) -> PromptLogprobsTask | None:
        # Position p predicts prompt token p + 1: this chunk yields tokens start + 1 .. hi.
        hi = min(start + n, req.num_prompt_tokens - 1)
        if hi <= start or len(req.prompt_logprobs or ()) >= req.num_prompt_tokens:
            return None
        nxt = torch.tensor(req.prompt_token_ids[start + 1:hi + 1], dtype=torch.long)
        return PromptLogprobsTask(req.request_id, first, first + hi - start, nxt,
                                  req.sampling_params.prompt_logprobs)

    # -- on the device ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> PendingOutput:
        """Run the step: its forward pass through the path its phase's chain gives it
        (``executor/paths/``), then sampling, on the device and in step order. Nothing here
        reads the results back: the sampled ids (and logprobs) go to host memory on the
        device's own stream, and ``finish()`` reads them once the device says they are
        there (the CPU's worker has finished the step; CUDA's event has fired): the device
        (``runtime/device.py``) decides how that is awaited."""
        # its requests pick the CPU matmul kernels (int4.TILE_REQUESTS), the head's included
        with step_requests(inputs.attn_metadata.num_requests):
            prompt: dict[str, list[PositionLogprobs | None]] = {}
            hidden = self._forward(inputs)
            ids = self._greedy_from_hidden(inputs, hidden, prompt)
            if ids is not None:  # the common all-greedy step on the CPU: no logits at all
                self._last_sampled = ids.clamp(min=0)
                return PendingOutput(req_ids=inputs.sample_req_ids, token_ids=ids,
                                     prompt_logprobs=prompt, spec=inputs.spec)
            logits = self._sampling_logits(inputs, hidden, prompt)
            if logits is None:
                return PendingOutput(prompt_logprobs=prompt)
            batch = inputs.sampling_batch
            ids = sample_ids(logits, batch)
            if batch.penalties is not None:
                self.penalty_state.count_no_sync(inputs.penalty_rows, ids[batch.penalties.rows])
            # Next step's in-flight inputs; a row with no token feeds id 0 to a step whose
            # result is dropped (the request has ended with an error by then).
            self._last_sampled = ids.clamp(min=0)
            out = pending_output(logits, ids, batch, inputs.sample_req_ids, prompt)
            out.spec = inputs.spec
            return out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the step's (real) tokens."""
        if inputs.resets:
            self.penalty_state.reset(inputs.resets, self.batch.capacity)
        if inputs.lora is None:
            return self._path_forward(inputs)
        tables = self.lora.tables
        tables.begin(inputs.lora)
        try:
            return self._path_forward(inputs)
        finally:
            tables.end()

    def _path_forward(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.mm is not None:  # image placeholders: their embeddings spliced in
            return forward_with_images(self, inputs, self._last_sampled)
        return self.paths.forward(inputs, self._last_sampled)

    def _greedy_from_hidden(self, inputs: StepInputs, hidden: torch.Tensor,
                            prompt: dict[str, list[PositionLogprobs | None]]
                            ) -> torch.Tensor | None:
        """A step whose sampled rows are all plain greedy (no logit processing, logprobs or
        grammar) on the CPU: their ids from the head a vocabulary slice at a time
        (``sampler/greedy_head.py``). None: the step takes the general path."""
        batch = inputs.sampling_batch
        if (not self.greedy_head or batch is None or not batch.all_greedy
                or batch.needs_processing or inputs.bitmask is not None
                or len(inputs.sample_req_ids) < GREEDY_HEAD_MIN_ROWS
                or any(k is not None for k in batch.logprobs)):
            return None
        plain_head = getattr(self.model, "plain_head", None)
        head = plain_head() if plain_head is not None else None
        if head is None:
            return None
        self._prompt_logprobs(inputs, hidden, prompt)
        weight, bias = head
        return greedy_from_hidden(hidden[inputs.sample_indices], weight, bias,
                                  no_token=NO_TOKEN)

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor,
                         prompt: dict[str, list[PositionLogprobs | None]]) -> None:
        for task in inputs.prompt_tasks:
            logits = self.model.compute_logits(hidden[task.first:task.last])
            prompt[task.req_id] = list(
                prompt_logprobs(logits, task.next_token_ids.to(logits.device), task.k))

    def _sampling_logits(self, inputs: StepInputs, hidden: torch.Tensor,
                         prompt: dict[str, list[PositionLogprobs | None]]
                         ) -> torch.Tensor | None:
        """Prompt logprobs into ``prompt``; then the sampled rows' logits, with the grammar
        bitmask applied and the penalty state gathered (None when nothing samples)."""
        self._prompt_logprobs(inputs, hidden, prompt)
        batch = inputs.sampling_batch
        if batch is None:
            return None
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        if inputs.bitmask is not None:
            inputs.bitmask.wait()
            if inputs.bitmask.bitmask is not None:
                inputs.bitmask.apply(logits, inputs.bitmask.bitmask)
        if batch.penalties is not None:
            self.penalty_state.gather(batch.penalties, inputs.penalty_rows)
        return logits

    # -- whole KV blocks, between steps (KV connectors) ------------------------------------------
    def read_kv_blocks(self, block_ids: list[int]) -> BlockCopy:
        """A copy of the blocks' K and V, all layers (``.wait()`` gives it, off the loop on
        CUDA): ``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return read_blocks(self.kv_caches, block_ids, self.device, self._stream)

    def write_kv_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite the blocks with ``kv``, shaped as :meth:`read_kv_blocks` returns."""
        write_blocks(self.kv_caches, block_ids, kv, self.device, self._stream)

    @property
    def _stream(self) -> Any:
        return getattr(self.staging, "stream", None)
