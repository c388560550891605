"""The device side of multi-LoRA: the slot tables and the hooks that apply them.

Every adaptable projection of the decoder (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` of each layer) gets a :class:`~ops.SlotTable`, ``A`` [S, R, in] and ``B``
[S, R, out] with ``S = --max-loras + 1`` (slot 0 is the base model, always zero) and
``R = --max-lora-rank`` times the shards the projection fuses (3 for q/k/v, 2 for
gate/up). A forward hook on the projection adds the step's batched update after the base
matmul, whatever the base weights are (float, packed int4, int8): the update reads only the
layer's input and output. Outside a step with adapter rows (``step is None``) the hook
returns at once. On CUDA with FlashInfer the tables are in the model's dtype and run on its
segment GEMM (``segment.py``; otherwise float32, see ``ops.py``). The model's C++ decode
stack (``decode_stack.py``), which calls no modules, reads these tables itself and adds the
same updates after its own matmuls.

Everything here runs on the device's worker, in step order: a step's slot writes (an adapter
entering a slot) are applied by that step's ``begin``, after every earlier step has run, so
a slot is never rewritten under a step that still reads it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
from asyncengine.executor.lora.peft import SHARDS, LoRAWeights, dims
from asyncengine.executor.lora.segment import SegmentPlan, make_segment_gemm, warm

logger = logging.getLogger(__name__)


def adaptable_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The projections of the decoder layers an adapter may adapt, by qualified name."""
    found = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in SHARDS and ".layers." in f".{name}":
            try:
                dims(module)
            except (AttributeError, ValueError):
                continue
            found[name] = module
    return found


class LoRATables:
    """The slot tables of every adaptable projection, and the step being run."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.num_slots = max_loras + 1
        self.max_rank = max_rank
        self.tables: dict[str, SlotTable] = {}
        self.step: LoRAStep | None = None
        modules = adaptable_modules(model)
        if not modules:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no projections an "
                             "adapter can adapt")
        shapes = {name: (max_rank * SHARDS[name.rsplit(".", 1)[-1]], *dims(module))
                  for name, module in modules.items()}
        # FlashInfer's segment GEMM where it can run (CUDA), else None: the CPU kernel or the
        # dense path, on float32 tables
        self.gemm = make_segment_gemm(device, dtype, {d for s in shapes.values() for d in s})
        tdtype = dtype if self.gemm is not None else torch.float32
        for name, module in modules.items():
            rank, in_f, out_f = shapes[name]
            table = SlotTable(torch.zeros(self.num_slots, rank, in_f, device=device,
                                          dtype=tdtype),
                              torch.zeros(self.num_slots, rank, out_f, device=device,
                                          dtype=tdtype),
                              torch.zeros(self.num_slots, dtype=torch.int64),
                              torch.zeros(self.num_slots, rank, 2, dtype=torch.int64))
            self.tables[name] = table
            module.register_forward_hook(self._hook(table))
        self.nbytes = sum(t.A.nbytes + t.B.nbytes for t in self.tables.values())
        if self.gemm is not None:  # its kernels are compiled per dtype: one table does
            first = next(iter(self.tables.values()))
            warm(self.gemm, first.A, first.B)
        logger.info("LoRA: %d slots of rank %d over %d projections (%.1f MB)", max_loras,
                    max_rank, len(self.tables), self.nbytes / 2**20)

    def _hook(self, table: SlotTable) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            step = self.step
            if step is not None:
                x = args[0]
                add_lora(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]), table, step)

        return hook

    def write(self, slot: int, weights: LoRAWeights) -> None:
        for name, table in self.tables.items():
            a, b, span = weights.modules.get(name, (None, None, None))
            table.write(slot, a, b, span)

    def begin(self, step: Any) -> None:
        """Before the forward: the step's slot writes, then its slots (None: base rows only)."""
        if step is None:
            self.step = None
            return
        for slot, weights in step.writes:
            self.write(slot, weights)
        if step.slots is None:
            self.step = None
            return
        segments = None
        if step.segments is not None:
            rows, indptr, ids, count = step.segments
            segments = SegmentPlan(rows, indptr, ids, count, self.gemm)
        self.step = LoRAStep(step.slots, self.num_slots, segments)

    def end(self) -> None:
        self.step = None
