"""A step's host-to-device inputs: numpy arrays in, device tensors out.

``runner.prepare`` (on the event loop) builds a step's arrays with numpy and turns each into a
tensor with ``staging.put(array)``:

* :class:`DirectStaging` (CPU): ``torch.from_numpy``, no copy at all.
* :class:`PinnedStaging` (CUDA): the arrays of a step are packed into one pinned host buffer
  and uploaded with ONE ``non_blocking`` copy on the device's stream when the step is complete
  (``flush``). ``put`` returns, at once, a view of the device buffer at the array's offset:
  its contents are valid for every kernel enqueued on that stream after ``flush``, so the
  loop never waits for a copy and a step costs one copy launch, not one per array.

Reuse is safe without any waiting of ours: each step gets a fresh host buffer from torch's
pinned-memory caching allocator, which does not hand a block out again until the copies that
read it (recorded on the stream by ``copy_``) have run; the device buffer comes from the CUDA
caching allocator on the device's stream, where freed memory is reused only by later work on
that stream. The buffers start at ``initial_bytes`` and grow to the largest step seen, so a
step normally fits in one buffer; a step that does not spills into a second one (two copies).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy as np
import torch

#: Offsets of the arrays inside the buffers (bytes): any dtype's alignment, and a whole
#: 64-byte line for vectorized loads.
ALIGN = 64

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.uint8): torch.uint8, np.dtype(np.float64): torch.float64}


class Staging(Protocol):
    def begin(self) -> None: ...

    def put(self, array: np.ndarray) -> torch.Tensor: ...

    def flush(self) -> None: ...


class DirectStaging:
    """The CPU: the arrays themselves, as tensors (``torch.from_numpy``: shared memory)."""

    def begin(self) -> None:
        pass

    def put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    def flush(self) -> None:
        pass


class PinnedStaging:
    """Packs a step's arrays into pinned memory; one ``non_blocking`` upload per step.

    ``pin=False`` and a CPU ``device`` exercise the packing on a machine without CUDA (tests).
    """

    def __init__(self, device: torch.device | str, stream: Any = None, *, pin: bool = True,
                 initial_bytes: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.stream = stream
        self.pin = pin
        self.capacity = initial_bytes
        self.num_uploads = 0  # copies issued (tests, benchmarks)
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None
        self._dev: torch.Tensor | None = None
        self._dev_as: dict[torch.dtype, torch.Tensor] = {}
        self._used = 0
        self._step_bytes = 0

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def begin(self) -> None:
        """Start a step: later ``put``s go to fresh buffers."""
        self._step_bytes = 0
        self._open(self.capacity)

    def _open(self, nbytes: int) -> None:
        nbytes = -(-nbytes // ALIGN) * ALIGN  # (viewable as any dtype)
        with self._on_stream():
            self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._dev_as = {}  # the device buffer viewed as each dtype put() returned
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self._host_np = self._host.numpy()
        self._used = 0

    def put(self, array: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(array)
        dtype = _TORCH_DTYPES.get(a.dtype)
        if dtype is None:
            raise TypeError(f"cannot stage an array of dtype {a.dtype}")
        if self._host_np is None:
            self.begin()
        n = a.nbytes
        offset = -(-self._used // ALIGN) * ALIGN
        if offset + n > self._host_np.size:  # spill: upload this buffer, open a bigger one
            self._upload()
            self._open(max(self.capacity, n))
            offset = 0
        self._host_np[offset:offset + n] = a.reshape(-1).view(np.uint8)
        self._used = offset + n
        self._step_bytes += n + ALIGN
        typed = self._dev_as.get(dtype)
        if typed is None:  # one view per dtype and buffer, then one slice per array
            typed = self._dev_as[dtype] = self._dev.view(dtype)
        first = offset // a.itemsize
        out = typed[first:first + a.size]
        return out if a.ndim == 1 else out.view(a.shape)

    def flush(self) -> None:
        """Upload what was put since ``begin``; the step's kernels may be enqueued after this."""
        if self._host_np is None:
            return
        self._upload()
        self._host = self._host_np = self._dev = None
        self._dev_as = {}
        # The next steps get buffers big enough for this one.
        self.capacity = max(self.capacity, -(-self._step_bytes // ALIGN) * ALIGN)

    def _upload(self) -> None:
        if self._used == 0:
            return
        with self._on_stream():
            self._dev[:self._used].copy_(self._host[:self._used], non_blocking=True)
        self.num_uploads += 1


def pinned(array: np.ndarray, pin: bool = True) -> torch.Tensor:
    """A copy of ``array`` in (pinned) host memory: the source of an asynchronous copy."""
    a = np.ascontiguousarray(array)
    t = torch.empty(a.shape, dtype=_TORCH_DTYPES[a.dtype], pin_memory=pin)
    t.numpy()[...] = a
    return t
