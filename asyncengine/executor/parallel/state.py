"""The tensor-parallel process group: who this process is, and the collectives the model uses.

Two torch.distributed groups join the same ranks:

* the *control* group (the default one, gloo) carries rank 0's step messages to the workers.
  A worker waits on it while the server is idle, so its timeout is long; a worker learns that
  rank 0 has gone from the broken connection, or from its parent's sentinel (``worker.py``).
* the *model* group carries the forward pass's all-reduces and the logits gather: gloo on
  the CPU, NCCL on CUDA. Peers compute the same work between two of its collectives, so its
  timeout is short (``ASYNCENGINE_TP_TIMEOUT``, seconds): a peer that stops answering fails
  the step within it, and the engine with it, never a hang.

Collective calls of rank 0 run on the device's worker thread (the forward pass) and, at
start-up, on the loading thread; never on the event loop.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncengine.config import environment

#: Seconds a model-group collective may wait for a peer before the step fails.
TIMEOUT_ENV = "ASYNCENGINE_TP_TIMEOUT"
#: How long the control group waits (an idle server sends nothing).
CONTROL_TIMEOUT = timedelta(days=7)
#: How long the ranks wait for each other at start-up.
INIT_TIMEOUT = timedelta(seconds=120)


def free_init_method() -> str:
    """A ``tcp://`` rendezvous on a free port of 127.0.0.1 (one node)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def model_timeout() -> timedelta:
    raw = environment.get(TIMEOUT_ENV)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: must be a number of seconds") from None
    return timedelta(seconds=seconds)


@dataclass
class TPState:
    """This process's place in the tensor-parallel group, and its collectives."""

    rank: int
    world_size: int
    model_group: object = None
    control_group: object = None
    # Seconds this process spent in model-group collectives (all-reduce, gather), and how
    # many it made: the communication cost of the forward passes (benchmarks/tp.py).
    comm_s: float = 0.0
    num_collectives: int = 0
    timed: bool = field(default=True, repr=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the row-split linears, the embedding)."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.model_group)
        self.comm_s += time.perf_counter() - start
        self.num_collectives += 1
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` concatenated along the last dimension (vocabulary shards of
        the logits); other ranks send theirs and get None."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 \
            else None
        dist.gather(x, parts, dst=0, group=self.model_group)
        self.comm_s += time.perf_counter() - start
        self.num_collectives += 1
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (control group: step messages)."""
        dist.broadcast(x, src=0, group=self.control_group)
        return x


def init_distributed(rank: int, world_size: int, init_method: str,
                     device_type: str = "cpu") -> TPState:
    """Join the group (blocks until every rank has joined, up to ``INIT_TIMEOUT``)."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=INIT_TIMEOUT)
    control = dist.new_group(list(range(world_size)), timeout=CONTROL_TIMEOUT, backend="gloo")
    backend = "nccl" if device_type == "cuda" else "gloo"  # NCCL: written, not run here
    model = dist.new_group(list(range(world_size)), timeout=model_timeout(), backend=backend)
    return TPState(rank, world_size, model_group=model, control_group=control)
