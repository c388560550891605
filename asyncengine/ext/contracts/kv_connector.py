"""The KV-connector contract (public as ``asyncengine.plugins``): moving KV-cache blocks
between the cache and external storage.

A connector is a store of KV-cache blocks keyed by their prefix-cache block hashes
(``Request.block_hashes``: chained sha256 of the token ids, see
``asyncengine.core.kv.hashing.hash_block_tokens``), which are the same in every process, on every
machine, across restarts. So a prefix computed once can be loaded instead of recomputed by a
later request, a restarted server, or another server that sees the same storage.

One object plays both roles the engine needs, all from the engine's event loop:

* scheduler side (plain, synchronous, cheap): ``lookup`` when a waiting request is admitted,
  ``request_finished`` when a request leaves the scheduler;
* worker side (coroutines the loop awaits; heavy I/O goes to threads): ``load`` before the
  forward pass of the step that admitted the request, ``save`` after the step that computed
  new full blocks.

The data exchanged is one tensor per call, ``[num_blocks, *layout.block_shape]`` — for each
block, the K and V of all layers::

    kv[i, layer, 0 | 1, slot, kv_head, :]     # block i, K (0) or V (1), slot 0..block_size-1

in ``layout.dtype``. Block hashes do not include the model: a connector must keep the blocks
of different models (and dtypes, block sizes, head layouts) apart, by ``layout.model_id`` and
the layout's shape.

A connector is chosen with ``--kv-connector NAME`` (registered through the
``register_kv_connectors`` hook, or ``pkg.module:Class``) and constructed once by the engine as
``cls(config, layout)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from asyncengine.config import EngineConfig
    from asyncengine.core.request import Request

#: Bumped when the contract below changes incompatibly (see docs/plugins.md).
#: 2: imported from ``asyncengine.plugins`` (the methods did not change; 1 is still accepted).
KV_CONNECTOR_API_VERSION = 2


@dataclass(frozen=True)
class KVCacheLayout:
    """What a connector needs to know about the engine's KV cache."""

    #: Identifies the weights the KV comes from (JSON text; see :func:`model_identity`).
    model_id: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's K and V, all layers: ``[num_layers, 2, block_size, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (e.g. to key or label a store)."""
        try:
            model = json.loads(self.model_id)
        except ValueError:
            model = self.model_id
        return {"model": model, "dtype": str(self.dtype).removeprefix("torch."),
                "block_shape": list(self.block_shape)}


class KVConnector(ABC):
    """A store of KV-cache blocks keyed by block hash.

    Construction: ``cls(config: EngineConfig, layout: KVCacheLayout)``, once, at start-up;
    raise ``ValueError`` naming the flag for bad configuration. Every method is called from
    the engine's event loop. The coroutines may overlap: the loads of one step run
    concurrently, and saves run in the background while later steps load and save.
    """

    @abstractmethod
    def __init__(self, config: EngineConfig, layout: KVCacheLayout) -> None: ...

    @classmethod
    def validate_config(cls, config: EngineConfig) -> None:
        """Check the configuration before the model loads (fail fast); raise ``ValueError``
        naming the flag. The default accepts everything."""
        return None

    # -- scheduler side ---------------------------------------------------------------------
    @abstractmethod
    def lookup(self, request: Request, num_local_tokens: int) -> int:
        """How many tokens after the first ``num_local_tokens`` (the prefix found in the local
        prefix cache, a multiple of the block size) the store holds, as whole blocks: the
        blocks ``request.block_hashes[num_local_tokens // block_size:]`` present, counted
        from the first one up to the first missing one, times ``block_size``.

        Synchronous and on the loop: answer from memory or cheap metadata (a ``stat``), never
        read block data here. The scheduler caps the answer so that the last token of the
        sequence is always computed (its logits are needed), and may call ``lookup`` again
        for the same request on a later step if it could not admit it.
        """

    def request_finished(self, request: Request) -> None:
        """The request finished (stopped, length, aborted) and its blocks were freed. Drop
        any per-request state. The default does nothing."""
        return None

    # -- worker side ------------------------------------------------------------------------
    @abstractmethod
    async def load(self, block_hashes: list[bytes]) -> torch.Tensor:
        """Read the blocks of ``block_hashes`` (ones ``lookup`` reported) from the store.

        Returns ``[n, *layout.block_shape]`` in ``layout.dtype`` (on any device) for the
        first ``n`` of them; ``n < len(block_hashes)`` when a block has gone missing or is
        unreadable since the lookup (another process evicted it, a corrupt file): the engine
        then recomputes from the first block not returned. Awaited before the step's forward
        pass: do the reading off the loop (``anyio.to_thread``).
        """

    @abstractmethod
    async def save(self, block_hashes: list[bytes], kv: torch.Tensor) -> None:
        """Store newly computed full blocks: ``kv[i]`` (``[*layout.block_shape]``) is the
        block of ``block_hashes[i]``.

        ``kv`` is a private copy taken on the loop right after the step that computed the
        blocks (the cache's blocks may be reused at once); it may live on the accelerator:
        move it to the host off the loop. The engine runs ``save`` in the background and
        waits for pending saves when it stops. A block already in the store may be skipped;
        errors are logged by the engine and otherwise ignored (a save is best effort).
        """


# -- model identity --------------------------------------------------------------------------

# Options that do not change the K/V computed for given token ids.
_NOT_KV_AFFECTING = frozenset({
    "model", "tokenizer", "revision", "served_model_name", "chat_template", "max_model_len",
    "dtype", "seed", "download_dir", "load_format", "generation_config",
    "override_generation_config", "max_logprobs", "pooling_type", "trust_remote_code",
    "enforce_eager",
})
_WEIGHT_SUFFIXES = (".safetensors", ".json", ".gguf", ".bin", ".pt", ".pth")


def model_identity(config: EngineConfig, model_dir: str, gguf_file: str | None) -> str:
    """A JSON text that identifies the weights a KV cache is computed from: the real path of
    the checkpoint, name, size and mtime of its weight and config files, and every model/load
    option that changes the weights' values (today: dummy weights' seed; options added later
    count unless known not to matter). The dtype is not in it (it is in the layout).

    Two servers share KV blocks when they load the same checkpoint files from the same path.
    Replacing a checkpoint's files in place changes their mtimes, so it starts a new store.
    """
    if gguf_file is not None:
        paths = [Path(model_dir, gguf_file)]
        root = paths[0]
    else:
        root = Path(model_dir)
        paths = sorted(p for p in root.iterdir()
                       if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    files = []
    for p in paths:
        st = p.stat()
        files.append([p.name, st.st_size, st.st_mtime_ns])
    options: dict[str, Any] = {}
    for section in (config.model, config.load):
        for f in dataclasses.fields(section):
            if f.name not in _NOT_KV_AFFECTING:
                options[f.name] = getattr(section, f.name)
    if config.load.load_format == "dummy":
        options["dummy_seed"] = config.model.seed
    identity = {"path": os.path.realpath(root), "files": files, "options": options}
    return json.dumps(identity, sort_keys=True, default=str)
