"""BlockPool: the KV-cache blocks, their reference counts, and the prefix-cache index.

A block holds the K/V of ``block_size`` consecutive tokens of one or more requests. A full
block of computed tokens can carry a *block hash*: a chained hash of all the tokens up to and
including it, so two requests whose token sequences share a prefix share its blocks.

The free list is also the LRU of evictable cached blocks: a freed block keeps its hash and stays
findable until it is handed out again. Blocks are reused from the front of the free list;
a freed block with a hash goes to the back (evicted last), one without a hash to the front
(it is worth nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Set iff the block is in the prefix-cache index (BlockPool.get_cached_block finds it).
    block_hash: bytes | None = None


class BlockPool:
    """``num_blocks`` blocks, a free list (the eviction LRU) and the ``hash -> block`` index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Every block with ref_cnt == 0, least recently freed first.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0..1."""
        return 1.0 - len(self._free) / len(self.blocks)

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` fresh blocks (ref_cnt 1, no hash), evicting cached ones LRU first."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} are free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take another reference on blocks found in the cache (O(1) each, even when free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block; the ones first in ``blocks`` are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: Block, block_hash: bytes) -> bool:
        """Index a full, computed block under ``block_hash``. False (and nothing changes) when
        another block already holds that hash: the first copy stays the shared one."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of all free blocks. False if blocks in use keep theirs."""
        for block in self._free.values():
            self._uncache(block)
        return not self._cached

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
