"""Where the own CPU kernels apply: the one rule every op's dispatch asks.

The C++ kernels (``packed.py``, ``layer_ops.py``, the MoE, head and argmax kernels) read host
memory through raw pointers, so they take tensors in host memory only, and they are opaque
calls that ``torch.compile``'s tracer does not follow: a traced forward takes torch's ops
instead, so that the compiled graph stays whole. An op's dispatch asks:

- :func:`host_kernel` before calling a kernel from the forward pass (host memory, eager);
- :func:`on_host` for a choice made outside a trace (how weights are packed at load, which
  sampling method or algorithm a batch uses, whether a copy to the host is needed).

The device's own choices (threads, the memory profile, FlashInfer's start-up work) are the
device's (``runtime/device.py``); which way a whole step runs is the paths' (``paths/``).
"""

from __future__ import annotations

import torch


def on_host(x: torch.Tensor | torch.device | str) -> bool:
    """``x`` (a tensor, or a device) is in host memory."""
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu"
    return torch.device(x).type == "cpu"


def host_kernel(x: torch.Tensor) -> bool:
    """A CPU kernel may run on ``x`` now: in host memory, and no trace under way."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()
