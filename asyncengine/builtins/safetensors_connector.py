"""SafetensorsKVConnector (``--kv-connector safetensors``): KV blocks on disk, one file each.

Layout under ``--kv-connector-path``::

    <model>-<dtype>-bs<block_size>-<digest>/      one store per model identity and KV layout
      store.json                                  what the digest was made from (for people)
      ab/abcd...ef.safetensors                    one block: tensor "kv", [*layout.block_shape]

The file name is the hex of the block hash; the store directory's digest covers the model
identity (``KVCacheLayout.model_id``), the dtype and the block shape, since block hashes cover
token ids only. Each write goes to a uniquely named temporary file in the block's directory
and is renamed into place, so a reader sees a whole file or none, and any number of servers
(or engines of one process) may share the directory: writers of the same block race
harmlessly (the last rename wins, both wrote the same block). A file that cannot be read as a
block of this store (truncated by a crash, foreign) counts as missing and is recomputed.
Nothing is ever deleted: prune old files (``find -atime``) if the directory grows too large.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import safetensors.torch
import torch

from asyncengine.plugins import KVCacheLayout, KVConnector, kv_connector_extra_config

if TYPE_CHECKING:
    from asyncengine.plugins import EngineConfig, Request

logger = logging.getLogger("asyncengine")

FORMAT = "asyncengine-kv-block/1"
# Hashes known to be on disk (our saves, earlier lookups); cleared when it grows past this.
MAX_KNOWN_HASHES = 1 << 20


class SafetensorsKVConnector(KVConnector):
    """A directory of ``.safetensors`` KV blocks, shared by every server that can see it."""

    contract_version = 2

    def __init__(self, config: EngineConfig, layout: KVCacheLayout) -> None:
        self.validate_config(config)
        self.layout = layout
        self.block_size = layout.block_size
        base = Path(str(store_path(config))).expanduser()
        self.root = base / store_name(layout)
        description = json.dumps({"format": FORMAT, **layout.describe()}, indent=2,
                                  sort_keys=True)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not (self.root / "store.json").exists():
                _write_atomic(self.root / "store.json", description.encode())
        except OSError as e:
            raise ValueError(f"--kv-connector-path: cannot use {str(base)!r} as a KV block "
                             f"store: {e}") from None
        self._known: set[bytes] = set()
        self._save_limiter = anyio.CapacityLimiter(1)  # one writer thread per connector
        self.num_loaded_blocks = 0  # cumulative, blocks handed to the engine
        self.num_saved_blocks = 0  # cumulative, files this connector wrote

    @classmethod
    def validate_config(cls, config: EngineConfig) -> None:
        path = store_path(config)
        if not path or not isinstance(path, str):
            raise ValueError("--kv-connector safetensors needs --kv-connector-path (or "
                             "\"path\" in --kv-transfer-config's kv_connector_extra_config): "
                             "the directory that holds the KV blocks (created if missing)")

    def block_path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}.safetensors"

    # -- scheduler side ---------------------------------------------------------------------
    def lookup(self, request: Request, num_local_tokens: int) -> int:
        bs = self.block_size
        last = (request.num_tokens - 1) // bs  # the last token is always computed
        found = 0
        for block_hash in request.block_hashes[num_local_tokens // bs:last]:
            if block_hash not in self._known:
                if not self.block_path(block_hash).is_file():  # a stat, no data read
                    break
                self._remember([block_hash])
            found += 1
        return found * bs

    # -- worker side ------------------------------------------------------------------------
    async def load(self, block_hashes: list[bytes]) -> torch.Tensor:
        blocks = await anyio.to_thread.run_sync(self._read_blocks, list(block_hashes))
        if len(blocks) < len(block_hashes):
            self._known.discard(block_hashes[len(blocks)])
        self.num_loaded_blocks += len(blocks)
        if not blocks:
            return torch.empty((0, *self.layout.block_shape), dtype=self.layout.dtype)
        return torch.stack(blocks)

    async def save(self, block_hashes: list[bytes], kv: torch.Tensor) -> None:
        todo = [(i, h) for i, h in enumerate(block_hashes) if h not in self._known]
        if not todo:
            return
        present, written = await anyio.to_thread.run_sync(
            self._write_blocks, todo, kv, limiter=self._save_limiter)
        self._remember(present)
        self.num_saved_blocks += written

    # -- off the loop -----------------------------------------------------------------------
    def _read_blocks(self, block_hashes: list[bytes]) -> list[torch.Tensor]:
        blocks = []
        for block_hash in block_hashes:
            block = self._read_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _read_block(self, block_hash: bytes) -> torch.Tensor | None:
        path = self.block_path(block_hash)
        try:
            data = path.read_bytes()
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
            kv = safetensors.torch.load(data).get("kv")
        except FileNotFoundError:
            return None
        except Exception as e:
            return self._discard(path, f"unreadable ({e})")
        if (meta.get("format") != FORMAT or meta.get("block_hash") != block_hash.hex()
                or kv is None or tuple(kv.shape) != self.layout.block_shape
                or kv.dtype != self.layout.dtype):
            return self._discard(path, "not a block of this store")
        return kv

    @staticmethod
    def _discard(path: Path, why: str) -> None:
        """Writes are atomic, so a bad file is damaged for good (or foreign): remove it, and
        the recomputed block is saved again."""
        logger.warning("KV block %s is %s: recomputing it", path, why)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def _write_blocks(self, todo: list[tuple[int, bytes]],
                      kv: torch.Tensor) -> tuple[list[bytes], int]:
        kv = kv.to("cpu")
        present: list[bytes] = []
        written = 0
        for i, block_hash in todo:
            path = self.block_path(block_hash)
            if not path.is_file():  # else another writer (or an earlier run) stored it
                data = safetensors.torch.save(
                    {"kv": kv[i].contiguous()},
                    metadata={"format": FORMAT, "block_hash": block_hash.hex()})
                _write_atomic(path, data)
                written += 1
            present.append(block_hash)
        return present, written

    def _remember(self, block_hashes: list[bytes]) -> None:
        if len(self._known) + len(block_hashes) > MAX_KNOWN_HASHES:
            self._known.clear()
        self._known.update(block_hashes)


def store_path(config: EngineConfig) -> str | None:
    """``--kv-connector-path``, else ``path`` (or vLLM's ``shared_storage_path``) in
    ``--kv-transfer-config``'s ``kv_connector_extra_config``."""
    extra = kv_connector_extra_config(config.plugins)
    return (config.plugins.kv_connector_path or extra.get("path")
            or extra.get("shared_storage_path"))


def store_name(layout: KVCacheLayout) -> str:
    """The store's directory name: readable prefix, digest of everything that keys it."""
    description = layout.describe()
    digest = hashlib.sha256(json.dumps({"format": FORMAT, **description},
                                       sort_keys=True).encode()).hexdigest()[:16]
    model = description["model"]
    if isinstance(model, dict):
        model = model.get("path", "model")
    model = os.path.basename(str(model).rstrip("/"))
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip(".-")[:48] or "model"
    return f"{model}-{description['dtype']}-bs{layout.block_size}-{digest}"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all at once for readers: a private temporary file in the
    same directory, then a rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
