"""The one interface every way of running a step's forward pass implements.

A :class:`StepPath` takes a prepared step (``StepInputs``) and returns the final hidden states
of its real tokens, ``[T, hidden]``, normed; sampling is the runner's, the same whichever path
ran. A path may decline a step it cannot take (too many rows for its kernels, a shape it was
not captured for): it returns None before touching anything, and the next path of the
phase's chain (``choose.py``) runs it. The last path of every chain takes every step.

Whether a path applies to a model at all is decided once, at build time, by its
:meth:`StepPath.why_not`: None, or the reason in a few words, which the chooser logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from asyncengine.config import EngineConfig

#: A step's phase (``StepInputs.phase``): every request one token, only prompt chunks, or both.
DECODE, PREFILL, MIXED = "decode", "prefill", "mixed"
PHASES = (DECODE, PREFILL, MIXED)


@dataclass
class PathContext:
    """What a path is chosen from and built over: the model behind its runner, the device,
    the configuration. ``runner`` gives the attention backend and the KV caches."""

    runner: Any  # executor.runner.ModelRunner
    device: Any  # executor.runtime.device.Device
    config: EngineConfig | None = None
    # --tensor-parallel-size > 1: rank 0's group (``parallel/state.TPState``).
    tp: Any = None

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def device_type(self) -> str:
        return self.device.type if self.device is not None else self.runner.device.type


class StepPath:
    """A way to run a step's forward pass (one module of ``executor/paths/`` each)."""

    #: The name logged and reported (``/metrics``' and the bench's ``path`` labels).
    name: ClassVar[str] = "?"
    #: The phases it may take; a path that takes every step of a phase ends its chain.
    phases: ClassVar[tuple[str, ...]] = PHASES
    #: Never declines a step of its phases.
    total: ClassVar[bool] = False

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        """None when this path can run ``ctx``'s model on its device, else why not."""
        return None

    @classmethod
    def make(cls, ctx: PathContext) -> StepPath:
        """The path, built over ``ctx`` (start-up: compiling, capturing happen here)."""
        return cls(ctx)

    def __init__(self, ctx: PathContext) -> None:
        self.runner = ctx.runner

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
        """The step's final hidden states ``[T, hidden]``, or None: not a step it takes.
        ``last_sampled``: the previous step's sampled ids on the device, which the step's
        in-flight input tokens (``inputs.from_previous``) are read from."""
        raise NotImplementedError

    def describe(self) -> str:
        """A few words for the start-up log (what this path runs with)."""
        return self.name


def begin(inputs: Any, last_sampled: torch.Tensor | None, backend: Any) -> None:
    """Before an eager forward (once per step, whichever path gets it): the in-flight input
    tokens copied in from the previous step's sampled ids, and the attention backend's plan.
    A path that declines the step after calling this leaves nothing to redo."""
    if inputs.begun:
        return
    inputs.begun = True
    if inputs.from_previous is not None:
        dst, src = inputs.from_previous
        inputs.input_ids[dst] = last_sampled[src]
    backend.plan(inputs.attn_metadata)
