"""A mixture-of-experts layer as one opaque op inside a ``torch.compile`` trace.

Which tokens go to which expert is known only once the router has run, so the experts' work
has data-dependent shapes, which the compiled path's static-shape graphs cannot hold
(``paths/compiled.py``). Traced, :class:`~asyncengine.executor.models.moe.SparseMoE` becomes
``asyncengine::moe_layer(x, key)``: the graph keeps everything around it (attention is the
same kind of op) and, when it runs, the op runs the layer eagerly (its C++ kernel on the
CPU). ``key`` finds the layer in a registry of weak references, so that an engine's model is
freed with the engine.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(layer: Any) -> int:
    """A key for ``layer`` (an ``nn.Module`` with ``eager_forward(x)``)."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


@torch.library.custom_op("asyncengine::moe_layer", mutates_args=())
def moe_layer(x: torch.Tensor, key: int) -> torch.Tensor:
    """The layer's output ``[T, hidden]`` for ``x`` ``[T, hidden]``, computed eagerly."""
    return _LAYERS[key].eager_forward(x).clone()


@moe_layer.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)
