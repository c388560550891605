"""Chained block hashes: the prefix-cache key of every full block of a request's tokens.

A block's hash covers all the tokens up to and including it (its parent's hash and its own
token ids), so equal hashes mean equal prefixes. The hashes are stable across processes,
machines and restarts: a KV connector keys its store by them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncengine.core.multimodal import block_extra_keys

if TYPE_CHECKING:
    from asyncengine.core.request import Request

#: The parent hash of a request's first block.
ROOT_HASH = b""


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of one full block: sha256(parent hash || token ids as little-endian uint32
    || extra), ``extra`` being the block's images (``core/multimodal.block_extra_keys``).

    Stable across processes, machines and restarts (a KV connector keys a disk store by it).
    """
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``
    (prompt and generated tokens alike) and return it. A request with a LoRA adapter chains
    from the adapter's key instead of ``ROOT_HASH``: its blocks are its adapter's alone."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    if hashes:
        parent = hashes[-1]
    else:
        lora = request.lora
        parent = ROOT_HASH if lora is None else lora.key
    mm = request.mm_inputs
    for i in range(len(hashes), len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        extra = block_extra_keys(mm, lo, hi) if mm else b""
        parent = hash_block_tokens(parent, tokens[lo:hi], extra)
        hashes.append(parent)
    return hashes
