"""KVCacheManager: the block tables of running requests, with prefix caching.

Pure Python, no torch: the runner turns the block ids into slots of its KV tensors
(``block_table[p // block_size] * block_size + p % block_size`` for position ``p``).

Lifecycle of a request's blocks::

    blocks, n = kv.get_computed_blocks(req)        # on admission: the cached prefix
    kv.allocate_slots(req, num_new, blocks)        # False, and nothing changed, if it won't fit
    ...                                            # later steps: allocate_slots(req, num_new)
    kv.cache_full_blocks(req, num_computed)        # once a step has computed the tokens
    kv.free(req)                                   # finished or preempted

A block enters the prefix cache only after its tokens' K/V have been computed, so a hit never
reads a block that a step still has to write.

With a sliding window on every layer (``sliding_window``: a query at position ``p`` sees keys
``> p - window``), a request's blocks wholly before its window are released as its
computation moves on (in ``cache_full_blocks``, after indexing them: they stay prefix-cache
hits until reused): a request then holds about ``(window + chunk) / block_size + 2`` blocks
whatever its length. Its block table keeps their ids, so positions still map to table rows;
attention never reads them again (the window masks them). Per step this is O(blocks released).

A prefix hit there needs only the blocks the window of the first uncomputed token reaches,
as in vLLM's sliding-window manager: the leading blocks of a request that ran before were
released and may have been reused, so the chain from block 0 is often broken. The blocks of
the hit before the window are placeholders: ``Block`` objects outside the pool, each with the
id of the hit's first real block. That id is a row the window masks, and it is never written
(its positions are computed), touched or freed: the placeholders count as released. The cache
is zero-filled, so a masked read of any block is finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncengine.core.kv.block_pool import Block, BlockPool
from asyncengine.core.kv.hashing import update_block_hashes

if TYPE_CHECKING:
    from asyncengine.core.request import Request


class KVCacheManager:
    """Allocates blocks to requests from a :class:`BlockPool` and serves prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Every layer's window (None: some layer sees the whole context; nothing is released).
        self.sliding_window = sliding_window
        # How many leading blocks of each request were released as out of its window.
        self._num_released: dict[str, int] = {}
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache stats, in tokens, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included); equals the total when idle."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of full blocks and its length in tokens.

        Never the whole sequence: the last token is always recomputed (its logits are needed).
        Takes no reference: pass the blocks to :meth:`allocate_slots` right away.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            blocks = self._windowed_hit(hashes[:max_blocks])
            return blocks, len(blocks) * self.block_size
        blocks: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _windowed_hit(self, hashes: list[bytes]) -> list[Block]:
        """The longest hit of ``L`` blocks whose blocks ``[first, L)`` are cached, ``first``
        being the block of the oldest key the window of position ``L * block_size`` sees;
        placeholders before ``first``. O(len(hashes)), once per admission."""
        bs, window = self.block_size, self.sliding_window
        cached = [self.pool.get_cached_block(h) for h in hashes]
        runs, run = [], 0  # runs[i]: cached blocks in a row ending at block i
        for block in cached:
            run = run + 1 if block is not None else 0
            runs.append(run)
        for end in range(len(cached), 0, -1):
            # The query at position end * bs sees keys > end * bs - window.
            first = max(0, (end * bs - window + 1) // bs)
            if runs[end - 1] >= end - first:
                stand_in = cached[first].block_id
                return [Block(stand_in) for _ in range(first)] + cached[first:end]
        return []

    def _num_placeholders(self, blocks: list[Block]) -> int:
        """How many leading entries of a windowed hit are placeholders (not pool blocks)."""
        pool_blocks = self.pool.blocks
        n = 0
        for block in blocks:
            if pool_blocks[block.block_id] is block:
                break
            n += 1
        return n

    def has_room(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's blocks already hold ``num_tokens`` tokens (the common decode
        step: no allocation needed)."""
        blocks = self._blocks.get(request_id)
        return blocks is not None and len(blocks) * self.block_size >= num_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[Block] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after ``request.num_computed_tokens`` (and
        after ``new_computed_blocks``, the prefix hit of an admission). Returns False, with no
        state changed, when there are not enough free blocks."""
        computed = new_computed_blocks or []
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks and computed:
            raise ValueError("new_computed_blocks are only for a request's first allocation")
        have = len(blocks) if blocks else 0
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - have - len(computed)
        if num_new_blocks <= 0 and blocks is not None:
            return True  # the common decode step: the last block has room
        num_new_blocks = max(num_new_blocks, 0)
        skip = self._num_placeholders(computed) if self.sliding_window is not None else 0
        real = computed[skip:] if skip else computed
        # Hit blocks nobody holds sit in the free list: taking them shrinks it too.
        num_evictable = sum(1 for b in real if b.ref_cnt == 0)
        if num_new_blocks + num_evictable > self.pool.num_free_blocks:
            return False

        if blocks is None:
            blocks = self._blocks[rid] = []
            self._block_ids[rid] = []
            self._num_cached_blocks[rid] = len(computed)
            if skip:  # placeholders: released from the start, never freed
                self._num_released[rid] = skip
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed) * self.block_size
        self.pool.touch(real)  # before allocate(), which could evict them
        new = computed + self.pool.allocate(num_new_blocks)
        blocks.extend(new)
        self._block_ids[rid].extend(b.block_id for b in new)
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full blocks among its first ``num_computed_tokens`` tokens, whose
        K/V a step has computed; with a sliding window, release the blocks now wholly before
        the window of the request's next token."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        if self.enable_prefix_caching and \
                num_computed_tokens // self.block_size > self._num_cached_blocks[rid]:
            self._cache_full_blocks(request, blocks, num_computed_tokens)
        if self.sliding_window is not None:
            # The next query is at a position p >= num_computed_tokens and sees keys
            # > p - window: block i (its last key i * bs + bs - 1) is done with once that
            # key <= num_computed_tokens - window.
            start = self._num_released.get(rid, 0)
            end = min((num_computed_tokens - self.sliding_window + 1) // self.block_size,
                      len(blocks))
            if end > start:
                self.pool.free(blocks[start:end])
                self._num_released[rid] = end

    def _cache_full_blocks(self, request: Request, blocks: list[Block],
                           num_computed_tokens: int) -> None:
        rid = request.request_id
        start = self._num_cached_blocks[rid]
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        for i in range(start, end):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its prefix."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        released = self._num_released.pop(rid, 0)
        if blocks:
            self.pool.free(reversed(blocks[released:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: the live list (no copy per step), which later
        allocations extend. Read it, never mutate it."""
        return self._block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request uses. False if some cached blocks are
        still in use (they stay cached)."""
        return self.pool.reset_prefix_cache()
