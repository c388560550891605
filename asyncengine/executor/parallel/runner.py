"""Rank 0's model runner: the ordinary runner, plus the workers' step message.

``prepare`` (on the loop) does what it always does, then packs what the workers need and
cannot know: the scheduled rows, their starts and lengths, the block-table changes the
persistent batch logged this step, the sampled rows and the prompt-logprob ranges
(``messages.encode_step``). ``_forward`` (on the device's worker thread, in step order) fills
the tokens still in flight, broadcasts the message, and runs rank 0's shard: from there on
every collective pairs with the workers'. Sampling, penalties and grammar masks stay on rank 0.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from asyncengine.core.sched.interface import SchedulerOutput
from asyncengine.executor.parallel.messages import encode_step, stop_header
from asyncengine.executor.parallel.state import TPState
from asyncengine.executor.runner import ModelRunner, StepInputs


class TPModelRunner(ModelRunner):
    def __init__(self, *args: Any, tp: TPState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp
        self.batch.table_log = []
        # Seconds on the device thread broadcasting step messages, and steps sent.
        self.message_s = 0.0
        self.num_messages = 0

    def prepare(self, out: SchedulerOutput, *, with_bitmask: bool = False) -> StepInputs:
        inputs = super().prepare(out, with_bitmask=with_bitmask)
        ib = self.batch
        n = len(out.scheduled)
        row_of = ib.row_of
        rows = np.fromiter((row_of[s.request.request_id] for s in out.scheduled), np.int64, n)
        starts = np.fromiter((s.start for s in out.scheduled), np.int64, n)
        lens = np.fromiter((s.num_new_tokens for s in out.scheduled), np.int64, n)
        deltas, ib.table_log = ib.table_log, []
        ranges = [(t.first, t.last) for t in inputs.prompt_tasks]
        # The host copy: the staged ``sample_indices`` is a view of the device buffer, which
        # its upload (non_blocking, on the device's stream) may not have filled yet; reading it
        # here, on the loop, on another stream, was the read-before-upload race (and a sync).
        inputs.tp_message = encode_step(inputs.num_tokens, rows, starts, lens, deltas,
                                        inputs.sample_indices_host, ranges)
        return inputs

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.resets:
            self.penalty_state.reset(inputs.resets, self.batch.capacity)
        if inputs.from_previous is not None:
            dst, src = inputs.from_previous
            inputs.input_ids[dst] = self._last_sampled[src]
        msg = inputs.tp_message
        start = time.perf_counter()
        self.tp.broadcast(torch.from_numpy(msg.header))
        self.tp.broadcast(msg.body(inputs.input_ids))
        self.message_s += time.perf_counter() - start
        self.num_messages += 1
        self.attn_backend.plan(inputs.attn_metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                          inputs.attn_metadata, self.attn_backend)

    def send_stop(self) -> None:
        """Tell the workers to exit (run on the device's thread, after the last step)."""
        self.tp.broadcast(stop_header())

