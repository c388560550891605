"""The one place that says which way a step runs: the chooser, called once at build time.

For each phase (decode, prefill, mixed) it keeps, in the order of :data:`CANDIDATES`, the
paths whose ``why_not`` is None for this model on this device, up to the first that takes
every step: that is the phase's chain. A step runs through the first path of its phase's
chain that takes it. The start-up log says, per phase, the chain, and for each path passed
over, why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.executor.paths.base import PHASES, PathContext, StepPath
from asyncengine.executor.paths.compiled import Compiled
from asyncengine.executor.paths.cpu_stack import CpuStack
from asyncengine.executor.paths.cuda_graphs import CUDAGraphs
from asyncengine.executor.paths.eager import Eager
from asyncengine.executor.paths.tensor_parallel import TensorParallel

logger = logging.getLogger("asyncengine")

#: The ways a step can run, the preferred first. Eager and tensor_parallel take every step.
CANDIDATES: tuple[type[StepPath], ...] = (CUDAGraphs, Compiled, CpuStack, TensorParallel,
                                          Eager)


@dataclass
class PathPlan:
    """Per phase, the paths a step of that phase is offered to, in order."""

    chains: dict[str, tuple[StepPath, ...]]
    # Every path passed over, with why (for the log and ``describe``).
    passed_over: dict[str, str] = field(default_factory=dict)

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor:
        for path in self.chains[inputs.phase]:
            hidden = path.forward(inputs, last_sampled)
            if hidden is not None:
                return hidden
        raise RuntimeError(f"no path took a {inputs.phase} step")  # the last one takes all

    def path(self, name: str) -> StepPath | None:
        """The built path of that name, if any phase uses it."""
        for chain in self.chains.values():
            for p in chain:
                if p.name == name:
                    return p
        return None

    def describe(self) -> str:
        """``decode: cpu_stack (...), then eager (...); prefill, mixed: eager (...)`` and the
        paths passed over with why."""
        by_chain: dict[str, list[str]] = {}
        for phase in PHASES:
            text = ", then ".join(p.describe() for p in self.chains[phase])
            by_chain.setdefault(text, []).append(phase)
        out = "; ".join(f"{', '.join(phases)}: {text}" for text, phases in by_chain.items())
        if self.passed_over:
            out += " (passed over: " + "; ".join(
                f"{name}: {why}" for name, why in self.passed_over.items()) + ")"
        return out


def choose(ctx: PathContext, candidates: tuple[type[StepPath], ...] = CANDIDATES) -> PathPlan:
    """Build the paths that apply to ``ctx`` and chain them per phase; log the result."""
    built: dict[type[StepPath], StepPath] = {}
    passed_over: dict[str, str] = {}
    for cls in candidates:
        why = cls.why_not(ctx)
        if why is not None:
            passed_over[cls.name] = why
            if getattr(cls, "requested", None) is not None and cls.requested(ctx):
                logger.warning("%s was asked for but is not used: %s", cls.name, why)
            continue
        built[cls] = cls.make(ctx)
    plan = plan_of(*built.values())
    why = greedy_head_why_not(ctx)
    ctx.runner.greedy_head = why is None
    if why is not None:
        passed_over["greedy_head"] = why
    plan.passed_over = passed_over
    logger.info("step paths: %s", plan.describe())
    return plan


def greedy_head_why_not(ctx: PathContext) -> str | None:
    """The CPU's sliced greedy head (``sampler/greedy_head.py``: all-greedy steps never
    materialize their logits), or why not."""
    if ctx.device_type != "cpu":
        return "not on the CPU"
    spec = getattr(ctx.model, "spec", None)
    lacks = {} if spec is None else spec.lacks()
    return lacks.get("greedy_head")


def plan_of(*paths: StepPath, passed_over: dict[str, str] | None = None) -> PathPlan:
    """The chains of built ``paths`` (preferred first): per phase, those that take it, up to
    the first that takes every step."""
    chains: dict[str, tuple[StepPath, ...]] = {}
    for phase in PHASES:
        chain: list[StepPath] = []
        for path in paths:
            if phase in path.phases:
                chain.append(path)
                if path.total:
                    break
        if not chain or not chain[-1].total:
            raise ValueError(f"no path takes every {phase} step (passed over: {passed_over})")
        chains[phase] = tuple(chain)
    return PathPlan(chains, dict(passed_over or {}))


def eager_only(runner: Any) -> PathPlan:
    """The per-layer decoder for every phase: a runner's plan until the chooser has run (a
    runner made by hand, in tests)."""
    ctx = PathContext(runner=runner, device=None)
    runner.greedy_head = greedy_head_why_not(ctx) is None
    return plan_of(Eager(ctx))
