"""Whole KV blocks (all layers) copied out of and into the cache, for KV connectors.

On the CPU the copies are plain gathers and scatters. On CUDA they run on a **side stream**,
ordered with the device's stream (where the steps run) by events, never by a host wait on
the loop and never with pageable (blocking) copies:

* read (save after a step; called on the loop): the side stream waits for an event recorded
  on the device stream (the step that computed the blocks), gathers the blocks into a fresh
  device buffer, and the device stream waits for the gather's event before any later step (a
  later step may overwrite a block that was freed meanwhile). The gathered blocks are copied
  to pinned host memory on the side stream; the result is a :class:`BlockCopy` whose
  ``wait()`` (off the loop: the connector's writer thread) synchronizes that copy's event.
* write (load before a step; called in a worker thread): the blocks go to pinned memory and
  to the device on the side stream, overlapping the step in flight; only the scatter into the
  cache waits for the device stream's tail (a block just allocated may still be read or
  written by a step in flight), and the device stream waits for the scatter before the next
  step. The worker thread then waits for the copy (its pinned source must outlive it): a
  block loaded before a step is launched is in place when the step reads it.

Never run on a GPU yet (issue 25): the CUDA branch is tested with a stand-in for torch.cuda.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.executor.kv.dtype import index_copy, to_cache


@dataclass
class BlockCopy:
    """Blocks read out of the cache: ``kv`` is valid once ``wait()`` returned (a CUDA copy
    still in flight until then; on the CPU, at once)."""

    kv: torch.Tensor
    event: Any = None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.kv


#: torch.cuda, or a stand-in with ``Stream``, ``Event``, ``stream`` (tests).
_cuda: Any = torch.cuda
_side_streams: dict[Any, Any] = {}
_side_lock = threading.Lock()


def side_stream(device_stream: Any) -> Any:
    """The copy stream paired with ``device_stream`` (one per device stream, made once)."""
    with _side_lock:
        stream = _side_streams.get(device_stream)
        if stream is None:
            stream = _side_streams[device_stream] = _cuda.Stream(
                device=getattr(device_stream, "device", None))
        return stream


def _record(stream: Any) -> Any:
    event = _cuda.Event()
    event.record(stream)
    return event


def _pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


def _pinned_ids(block_ids: list[int]) -> torch.Tensor:
    return _pin(torch.tensor(block_ids, dtype=torch.long))


@torch.no_grad()
def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], device: torch.device,
                stream: Any = None) -> BlockCopy:
    """The blocks, ``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``
    (a copy on the host once ``wait()`` returns)."""
    if stream is None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        return BlockCopy(_gather(kv_caches, idx))
    side = side_stream(stream)
    side.wait_event(_record(stream))  # after the step that computed the blocks
    with _cuda.stream(side):
        idx = _pinned_ids(block_ids).to(device, non_blocking=True)
        gathered = _gather(kv_caches, idx)
        stream.wait_event(_record(side))  # later steps may overwrite freed blocks
        host = _pin(torch.empty(gathered.shape, dtype=gathered.dtype))
        host.copy_(gathered, non_blocking=True)
        return BlockCopy(host, _record(side))


def _gather(kv_caches: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    # cache: [2, num_blocks, block_size, kv_heads, head_dim] -> [n, 2, ...] per layer
    return torch.stack([c.index_select(1, idx).transpose(0, 1) for c in kv_caches], dim=1)


@torch.no_grad()
def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor,
                 device: torch.device, stream: Any = None) -> None:
    """Overwrite the blocks with ``kv``, shaped as :func:`read_blocks` returns. On CUDA, call
    off the event loop: it returns once the copy is done."""
    cache = kv_caches[0]
    expected = (len(block_ids), len(kv_caches), 2, *cache.shape[2:])
    if tuple(kv.shape) != expected:
        raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not fit this cache "
                         f"(expected {expected})")
    if stream is None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        _scatter(kv_caches, idx, kv)
        return
    side = side_stream(stream)
    host = _pin(to_cache(kv, cache.dtype).to(cache.dtype))
    with _cuda.stream(side):
        idx = _pinned_ids(block_ids).to(device, non_blocking=True)
        staged = host.to(device, non_blocking=True)  # overlaps the step in flight
        side.wait_event(_record(stream))  # the blocks' previous users are done
        _scatter(kv_caches, idx, staged)
        done = _record(side)
    stream.wait_event(done)  # the next step reads the blocks after the scatter
    done.synchronize()  # in this worker thread: ``host`` must outlive the copy


def _scatter(kv_caches: list[torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> None:
    for layer, cache in enumerate(kv_caches):
        index_copy(cache, 1, idx, to_cache(kv[:, layer].transpose(0, 1), cache.dtype)
                   .to(cache.device, cache.dtype).contiguous())
