"""The loop side of multi-LoRA: which adapters exist, which are in CPU memory, which slot
each one has in the device's tables (``tables.py``).

- **Registry**: adapter name -> :class:`AdapterInfo` (its path, its identity key: a digest of
  its files, which roots its requests' block hashes, so the prefix cache is keyed by
  adapter). Adapters come from ``--lora-modules`` and, when runtime updating is on, from
  ``/v1/load_lora_adapter``; unloading removes the name (requests already queued keep their
  :class:`~asyncengine.core.request.LoRARequest` and finish with that adapter).
- **CPU LRU** (``--max-cpu-loras``): the adapters' weights in the model's layout; one that
  falls out is read again from its path when a step needs it.
- **Slots** (``--max-loras``): ``prepare`` gives each adapter of a step a slot, the least
  recently used one not taken by the step when it is not in one yet, and queues the slot
  write for the device (applied before that step's forward, in step order). The scheduler
  keeps the distinct adapters of a step within ``--max-loras``. Per step the cost is O(1)
  per request with an adapter.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncengine.config import LoRAConfig
from asyncengine.config.sections import parse_lora_module
from asyncengine.core.request import LoRARequest
from asyncengine.executor.lora.peft import LoRAWeights, adapter_digest, load_adapter
from asyncengine.executor.lora.segment import plan_segments
from asyncengine.executor.lora.tables import LoRATables

logger = logging.getLogger(__name__)


class LoRANotFound(ValueError):
    """A request named an adapter this engine does not serve (HTTP: 404 model_not_found)."""


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    key: bytes
    base_model_name: str | None = None
    rank: int = 0

    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.key, self.path)


@dataclass
class LoRAStepInputs:
    """What ``prepare`` hands the device for one step: per-token slots ([T], None when no row
    has an adapter), the slot writes to apply first, and under FlashInfer's segment GEMM the
    step's segments (``segment.plan_segments``: rows, seg_indptr, weight_indices on the
    device, and their number)."""

    slots: torch.Tensor | None
    writes: list[tuple[int, LoRAWeights]] = field(default_factory=list)
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.renames = tuple(getattr(getattr(model, "spec", None), "renames", ()) or ())
        self.tables = LoRATables(model, config.max_loras, config.max_lora_rank, device, dtype)
        model.lora = self.tables  # the decoder asks it whether to bypass its decode stack
        self.adapters: dict[str, AdapterInfo] = {}
        self._cpu: OrderedDict[bytes, LoRAWeights] = OrderedDict()
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(config.max_loras, 0, -1))
        self.num_loads = 0  # adapters read from disk (registration or after CPU eviction)
        for entry in config.lora_modules or ():
            name, path, base = parse_lora_module(entry)
            try:
                weights, key = self.read(path)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}: {e}") from None
            self.register(name, path, weights, key, base)

    # -- the registry (on the loop; reading files may run in a thread) -----------------------
    def read(self, path: str) -> tuple[LoRAWeights, bytes]:
        """Read and check the adapter at ``path`` (ValueError naming what is wrong). Touches
        no shared state: a runtime load calls it off the loop."""
        weights = load_adapter(path, self.model, self.max_rank, self.renames)
        return weights, adapter_digest(path)

    def register(self, name: str, path: str, weights: LoRAWeights, key: bytes,
                 base_model_name: str | None = None) -> AdapterInfo:
        if name in self.adapters:
            raise ValueError(f"The LoRA adapter `{name}` is already loaded.")
        info = AdapterInfo(name, path, key, base_model_name, weights.rank)
        self.adapters[name] = info
        self._remember(key, weights)
        self.num_loads += 1
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d projections)", name, path,
                    weights.rank, len(weights.modules))
        return info

    def unregister(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        logger.info("LoRA adapter %s unloaded", name)

    def request(self, name: str) -> LoRARequest:
        info = self.adapters.get(name)
        if info is None:
            raise LoRANotFound(f"The model `{name}` does not exist (no such LoRA adapter).")
        return info.request()

    def _remember(self, key: bytes, weights: LoRAWeights) -> None:
        self._cpu[key] = weights
        self._cpu.move_to_end(key)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _weights(self, lora: LoRARequest) -> LoRAWeights:
        weights = self._cpu.get(lora.key)
        if weights is None:  # fell out of the CPU LRU: read it again
            weights = load_adapter(lora.path, self.model, self.max_rank, self.renames)
            self.num_loads += 1
            self._remember(lora.key, weights)
        else:
            self._cpu.move_to_end(lora.key)
        return weights

    @property
    def cpu_adapters(self) -> int:
        return len(self._cpu)

    # -- one step (on the loop) --------------------------------------------------------------
    def prepare(self, scheduled: list[Any]) -> tuple[np.ndarray | None,
                                                     list[tuple[int, LoRAWeights]]]:
        """Each token's slot ([T] int64, in the step's token order; None when no request has
        an adapter) and the slot writes this step needs."""
        slots: np.ndarray | None = None
        taken: dict[bytes, int] = {}
        writes: list[tuple[int, LoRAWeights]] = []
        for i, s in enumerate(scheduled):
            lora = s.request.lora
            if lora is None:
                continue
            if slots is None:
                slots = np.zeros(len(scheduled), dtype=np.int64)
            slot = taken.get(lora.key)
            if slot is None:
                slot = taken[lora.key] = self._slot_for(lora, taken, writes)
            slots[i] = slot
        if slots is not None:  # per token: a request's new tokens, or its last + its drafts
            counts = [len(s.spec_token_ids) + 1 if getattr(s, "spec_token_ids", None)
                      else s.num_new_tokens for s in scheduled]
            slots = np.repeat(slots, counts)
        return slots, writes

    def step_inputs(self, slots: np.ndarray, writes: list[tuple[int, LoRAWeights]],
                    put: Callable[[np.ndarray], torch.Tensor]) -> LoRAStepInputs:
        """The step's LoRA inputs, staged for the device by ``put`` (host arrays only)."""
        segments = None
        if self.tables.gemm is not None:
            rows, indptr, ids = plan_segments(slots)
            segments = (put(rows), put(indptr), put(ids), len(ids))
        return LoRAStepInputs(put(slots), writes, segments)

    def _slot_for(self, lora: LoRARequest, taken: dict[bytes, int],
                  writes: list[tuple[int, LoRAWeights]]) -> int:
        slot = self._slot_of.get(lora.key)
        if slot is not None:
            self._slot_of.move_to_end(lora.key)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            used = set(taken.values())
            victim = next((k for k, s in self._slot_of.items() if s not in used), None)
            if victim is None:
                raise RuntimeError(f"a step has more distinct LoRA adapters than --max-loras "
                                   f"({self.max_loras}): the scheduler must keep them within it")
            slot = self._slot_of.pop(victim)
        self._slot_of[lora.key] = slot
        writes.append((slot, self._weights(lora)))
        return slot
