"""ModelRunner: SchedulerOutput → tensors → forward → sampled tokens.

Split in two so the loop never waits on the device:

* ``prepare(out)`` runs on the event loop. It reads the scheduled requests (the only place the
  runner touches ``Request`` objects) and builds plain tensors: flattened input ids and
  positions, the slot mapping, attention metadata, the rows to sample and their parameters.
* ``execute(inputs)`` runs on the device (the CPU worker thread, or enqueued on a CUDA stream).
  It touches only ``inputs``, the model and the KV cache, so the loop may go on changing
  requests (aborts, stop strings) while it runs.

``read_kv_blocks`` / ``write_kv_blocks`` copy whole KV blocks (all layers) out of and into
the cache for a KV connector; they are called between steps, never while one runs.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from asyncengine.core.request import PositionLogprobs
from asyncengine.core.sched.interface import ModelRunnerOutput, SchedulerOutput
from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.sampler import SamplingBatch, make_generator, prompt_logprobs, sample


@dataclass
class PromptLogprobsTask:
    """Prompt logprobs for the query tokens ``[first, last)`` of one request in this step."""

    req_id: str
    first: int  # index into the step's flattened tokens
    last: int
    next_token_ids: torch.Tensor  # the prompt tokens these positions predict
    k: int


class BitmaskSlot:
    """A grammar bitmask the loop fills while the device runs the forward pass."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.bitmask: torch.Tensor | None = None
        self.apply = None  # callable(logits, bitmask) from the structured-output manager

    def set(self, bitmask: torch.Tensor | None, apply) -> None:
        self.bitmask, self.apply = bitmask, apply
        self.ready.set()


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] rows of the flattened step to sample from
    sample_req_ids: list[str]
    sampling_batch: SamplingBatch | None
    prompt_tasks: list[PromptLogprobsTask] = field(default_factory=list)
    bitmask: BitmaskSlot | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = model.vocab_size
        self._generators: dict[str, torch.Generator | None] = {}

    # -- on the loop -----------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, *, with_bitmask: bool = False) -> StepInputs:
        for rid in out.finished_req_ids:
            self._generators.pop(rid, None)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        sampling_rows = []
        prompt_tasks: list[PromptLogprobsTask] = []
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            first = len(input_ids)
            input_ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_start_loc.append(first + n)
            seq_lens.append(start + n)
            block_tables.append(s.block_ids)
            sp = req.sampling_params
            if sp.prompt_logprobs is not None:
                task = self._prompt_logprobs_task(req, start, n, first)
                if task is not None:
                    prompt_tasks.append(task)
            if s.samples:
                sample_rows.append(first + n - 1)
                sample_req_ids.append(req.request_id)
                if req.request_id not in self._generators:
                    self._generators[req.request_id] = make_generator(sp.seed, self.device)
                if req.grammar is not None and sp.min_tokens:
                    # The grammar decides when output may end; holding EOS back for min_tokens
                    # could leave a complete grammar with no allowed token at all.
                    sp = dataclasses.replace(sp, min_tokens=0)
                sampling_rows.append((sp, req.prompt_token_ids, req.output_token_ids,
                                      self._generators[req.request_id]))
        pos = torch.tensor(positions, dtype=torch.long)
        # slot = block_table[req][pos // bs] * bs + pos % bs, vectorized over the step's tokens.
        query_lens = torch.tensor([query_start_loc[i + 1] - query_start_loc[i]
                                   for i in range(len(seq_lens))], dtype=torch.long)
        width = max(len(b) for b in block_tables)
        table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.long)
        row_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens)
        slots = table[row_of_token, pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slots.to(self.device),
            block_size=bs,
        )
        self.attn_backend.prepare(meta)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=pos.to(self.device),
            attn_metadata=meta,
            sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sample_req_ids=sample_req_ids,
            sampling_batch=(SamplingBatch.build(sampling_rows, device=self.device,
                                                eos_token_ids=self.eos_token_ids,
                                                vocab_size=self.vocab_size)
                            if sampling_rows else None),
            prompt_tasks=prompt_tasks,
            bitmask=BitmaskSlot() if with_bitmask else None,
        )

    @staticmethod
    def _prompt_logprobs_task(req, start: int, n: int, first: int) -> PromptLogprobsTask | None:
        # Position p predicts prompt token p + 1: this chunk yields tokens start + 1 .. hi.
        hi = min(start + n, req.num_prompt_tokens - 1)
        if hi <= start or len(req.prompt_logprobs or ()) >= req.num_prompt_tokens:
            return None
        nxt = torch.tensor(req.prompt_token_ids[start + 1:hi + 1], dtype=torch.long)
        return PromptLogprobsTask(req.request_id, first, first + hi - start, nxt,
                                  req.sampling_params.prompt_logprobs)

    # -- on the device ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> ModelRunnerOutput:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                            inputs.attn_metadata, self.attn_backend)
        result = ModelRunnerOutput()
        for task in inputs.prompt_tasks:
            logits = self.model.compute_logits(hidden[task.first:task.last])
            entries: list[PositionLogprobs | None] = list(
                prompt_logprobs(logits, task.next_token_ids.to(logits.device), task.k))
            result.prompt_logprobs[task.req_id] = entries
        if inputs.sampling_batch is None:
            return result
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        if inputs.bitmask is not None:
            inputs.bitmask.ready.wait()
            if inputs.bitmask.bitmask is not None:
                inputs.bitmask.apply(logits, inputs.bitmask.bitmask)
        sampled = sample(logits, inputs.sampling_batch)
        for i, rid in enumerate(inputs.sample_req_ids):
            result.sampled_token_ids[rid] = sampled.token_ids[i]
            lp = sampled.logprobs[i]
            if lp is not None:
                result.logprobs[rid] = lp
        return result

    # -- whole KV blocks, between steps (KV connectors) ------------------------------------------
    @torch.no_grad()
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K and V, all layers, on the cache's device:
        ``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        # cache: [2, num_blocks, block_size, kv_heads, head_dim] -> [n, 2, ...] per layer
        return torch.stack([c.index_select(1, idx).transpose(0, 1) for c in self.kv_caches],
                           dim=1)

    @torch.no_grad()
    def write_kv_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite the blocks with ``kv``, shaped as :meth:`read_kv_blocks` returns."""
        cache = self.kv_caches[0]
        expected = (len(block_ids), len(self.kv_caches), 2, *cache.shape[2:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not fit this cache "
                             f"(expected {expected})")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, kv[:, layer].transpose(0, 1).to(cache.device, cache.dtype))
