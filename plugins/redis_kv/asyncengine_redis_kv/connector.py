"""RedisKVConnector: KV-cache blocks in Redis (or Valkey), shared by every server that can
reach it.

Configured the vLLM way::

    asyncengine serve MODEL --kv-transfer-config '{"kv_connector": "redis",
        "kv_role": "kv_both", "kv_connector_extra_config": {"url": "redis://HOST:PORT"}}'

``kv_connector_extra_config`` (only ``url`` is required):

* ``url``: ``redis://[user:password@]host:port[/db]`` (``rediss://`` for TLS,
  ``unix:///path``);
* ``ttl``: seconds a block lives after it is written (default: none; rely on the server's
  ``maxmemory`` with an ``allkeys-lru`` policy, or give a TTL);
* ``namespace``: the key prefix (default ``asyncengine-kv``);
* ``timeout``: seconds for a connect or a command (default 2);
* ``retry``: seconds between reconnection attempts while the store is down (default 5).

Keys: ``<namespace>:<store>:<block hash hex>``, where ``<store>`` is a digest of the model's
identity (``KVCacheLayout.model_id``: checkpoint path, files, sizes, mtimes), the dtype and the
block shape, since block hashes cover token ids only. A value is one block: a 40-byte header
(magic, the block hash) and the raw K/V bytes (``[*layout.block_shape]`` in
``layout.dtype``); a value of the wrong size or hash is ignored and overwritten.

``lookup`` is synchronous and must not touch the network, so the connector keeps the set of
block hashes it knows the store holds: read with ``SCAN`` when it starts (so a fresh server
uses the blocks an earlier one saved), grown by its own saves, and by a background ``EXISTS``
probe of the blocks a request asked for and that were not known (another server's recent
blocks are hits for the next request with that prefix). The set may be stale in the other
direction too: a block evicted since (``maxmemory``, TTL) is simply missing when loaded, and
the engine recomputes from there.

If the store becomes unreachable the connector logs one warning and the engine serves on
without it (lookups find nothing, saves are dropped); every ``retry`` seconds the next call
tries again, and once a command succeeds it logs that the store is back.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
import torch

from asyncengine.plugins import KVCacheLayout, KVConnector, kv_connector_extra_config

if TYPE_CHECKING:
    from asyncengine.plugins import EngineConfig, Request

logger = logging.getLogger("asyncengine.redis_kv")

FLAG = "--kv-transfer-config"
MAGIC = b"AEKVBLK1"  # 8 bytes, then the 32-byte block hash
HEADER = len(MAGIC) + 32
MAX_KNOWN = 1 << 20  # hashes remembered; past it the set is cleared (and rebuilt by probes)
MAX_PROBED = 1 << 16  # recently probed missing hashes, not probed again for a while
OPTIONS = ("url", "ttl", "namespace", "timeout", "retry")
CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


def parse_options(config: EngineConfig) -> dict[str, Any]:
    extra = kv_connector_extra_config(config.plugins)
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{FLAG}: the redis connector does not know {unknown} in "
                         f"kv_connector_extra_config (known: {', '.join(OPTIONS)})")
    url = extra.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{FLAG}: the redis connector needs \"url\" in "
                         "kv_connector_extra_config (redis://HOST:PORT)")
    try:
        redis.connection.parse_url(url)
    except ValueError as e:
        raise ValueError(f"{FLAG}: redis url {url!r}: {e}") from None
    options = {"url": url, "ttl": extra.get("ttl"), "namespace": extra.get("namespace",
                                                                          "asyncengine-kv"),
               "timeout": extra.get("timeout", 2.0), "retry": extra.get("retry", 5.0)}
    for name in ("ttl", "timeout", "retry"):
        value = options[name]
        if value is None and name == "ttl":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{FLAG}: the redis connector's {name!r} must be a positive number "
                             f"of seconds, got {value!r}")
    if not isinstance(options["namespace"], str) or not options["namespace"]:
        raise ValueError(f"{FLAG}: the redis connector's 'namespace' must be a non-empty "
                         "string")
    return options


class RedisKVConnector(KVConnector):
    """KV blocks in Redis, keyed by model identity and block hash (see the module docs)."""

    contract_version = 2

    def __init__(self, config: EngineConfig, layout: KVCacheLayout) -> None:
        options = parse_options(config)
        self.url: str = options["url"]
        self.ttl: int | None = None if options["ttl"] is None else max(1, int(options["ttl"]))
        self.timeout: float = float(options["timeout"])
        self.retry: float = float(options["retry"])
        self.layout = layout
        self.block_size = layout.block_size
        description = json.dumps(layout.describe(), sort_keys=True)
        self.store = hashlib.sha256(description.encode()).hexdigest()[:16]
        self.prefix = f"{options['namespace']}:{self.store}:"
        self.block_bytes = (torch.Size(layout.block_shape).numel()
                            * torch.empty((), dtype=layout.dtype).element_size())
        self._known: set[bytes] = set()
        self._probed: OrderedDict[bytes, None] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._async_client: redis.asyncio.Redis | None = None  # of the loop below
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._down_since: float | None = None
        self._next_try = 0.0
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self._read_index()

    @classmethod
    def validate_config(cls, config: EngineConfig) -> None:
        parse_options(config)

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    # -- the store's state -------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while the store is down (until the next retry is due)."""
        return self._down_since is None or time.monotonic() >= self._next_try

    def _failed(self, error: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            logger.warning("KV store %s is unreachable (%s: %s): serving without it; "
                           "retrying every %gs", self.url, type(error).__name__, error,
                           self.retry)
        self._next_try = now + self.retry

    def _succeeded(self, started: float) -> None:
        """A call begun at ``started`` (time.monotonic()) went through. One begun before the
        store was marked down proves nothing about it now: the store stays down."""
        if self._down_since is not None and started >= self._down_since:
            logger.warning("KV store %s is reachable again (down %.1fs)", self.url,
                           time.monotonic() - self._down_since)
            self._down_since = None

    def _client(self) -> redis.asyncio.Redis:
        """The asyncio client of the running event loop (its connections belong to it)."""
        loop = asyncio.get_running_loop()
        if self._client_loop is not loop or self._async_client is None:
            if self._async_client is not None:  # an earlier loop has ended: drop its pool
                self._async_client.connection_pool.reset()
            self._client_loop = loop
            self._async_client = redis.asyncio.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout)
        return self._async_client

    def _read_index(self) -> None:
        """The hashes this store holds, at start-up (a blocking SCAN, before serving)."""
        started = time.monotonic()
        try:
            with redis.Redis.from_url(self.url, socket_timeout=self.timeout,
                                      socket_connect_timeout=self.timeout) as client:
                start = len(self.prefix)
                for key in client.scan_iter(match=self.prefix + "*", count=1000):
                    try:
                        self._known.add(bytes.fromhex(key[start:].decode()))
                    except ValueError:
                        continue
                    if len(self._known) >= MAX_KNOWN:
                        break
        except CONNECTION_ERRORS as e:
            self._failed(e)
        else:
            self._succeeded(started)

    def _remember(self, block_hashes: list[bytes]) -> None:
        if len(self._known) + len(block_hashes) > MAX_KNOWN:
            self._known.clear()
        self._known.update(block_hashes)

    # -- scheduler side ----------------------------------------------------------------------
    def lookup(self, request: Request, num_local_tokens: int) -> int:
        if self._down_since is not None:
            if self.available:
                self._spawn(self._ping())
            return 0
        bs = self.block_size
        hashes = request.block_hashes[num_local_tokens // bs:(request.num_tokens - 1) // bs]
        found = 0
        for block_hash in hashes:
            if block_hash not in self._known:
                break
            found += 1
        unknown = [h for h in hashes[found:] if h not in self._probed]
        if unknown:
            for h in unknown:
                self._probed[h] = None
            while len(self._probed) > MAX_PROBED:
                self._probed.popitem(last=False)
            self._spawn(self._probe(unknown))
        return found * bs

    def _spawn(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no running asyncio loop (a synchronous caller)
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, block_hashes: list[bytes]) -> None:
        """Learn which of these blocks the store holds (written by another server)."""
        started = time.monotonic()
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                for h in block_hashes:
                    pipe.exists(self.key(h))
                present = await pipe.execute()
        except CONNECTION_ERRORS as e:
            self._failed(e)
            return
        self._succeeded(started)
        held = [h for h, n in zip(block_hashes, present, strict=True) if n]
        self._remember(held)
        for h in held:
            self._probed.pop(h, None)

    async def _ping(self) -> None:
        started = time.monotonic()
        self._next_try = started + self.retry
        try:
            await self._client().ping()
        except CONNECTION_ERRORS as e:
            self._failed(e)
        else:
            self._succeeded(started)

    # -- worker side -------------------------------------------------------------------------
    async def load(self, block_hashes: list[bytes]) -> torch.Tensor:
        blocks: list[torch.Tensor] = []
        if block_hashes and self.available:
            started = time.monotonic()
            try:
                values = await self._client().mget([self.key(h) for h in block_hashes])
            except CONNECTION_ERRORS as e:
                self._failed(e)
                values = []
            else:
                self._succeeded(started)
            complete = True
            for block_hash, value in zip(block_hashes, values, strict=False):
                block = self._decode(block_hash, value)
                if block is None:  # evicted (maxmemory, TTL) or damaged: recomputed, and
                    self._known.discard(block_hash)  # saved again once it is
                    complete = False
                elif complete:
                    blocks.append(block)
        self.num_loaded_blocks += len(blocks)
        if not blocks:
            return torch.empty((0, *self.layout.block_shape), dtype=self.layout.dtype)
        return torch.stack(blocks)

    def _decode(self, block_hash: bytes, value: bytes | None) -> torch.Tensor | None:
        if (value is None or len(value) != HEADER + self.block_bytes
                or value[:len(MAGIC)] != MAGIC or value[len(MAGIC):HEADER] != block_hash):
            return None
        data = torch.frombuffer(bytearray(value[HEADER:]), dtype=torch.uint8)
        return data.view(self.layout.dtype).reshape(self.layout.block_shape)

    async def save(self, block_hashes: list[bytes], kv: torch.Tensor) -> None:
        todo = [(i, h) for i, h in enumerate(block_hashes) if h not in self._known]
        if not todo or not self.available:
            return
        kv = kv.to("cpu")
        started = time.monotonic()
        try:
            async with self._client().pipeline(transaction=False) as pipe:
                for i, h in todo:
                    raw = kv[i].contiguous().view(torch.uint8).numpy().tobytes()
                    pipe.set(self.key(h), MAGIC + h + raw, ex=self.ttl)
                await pipe.execute()
        except CONNECTION_ERRORS as e:
            self._failed(e)
            return
        self._succeeded(started)
        self._remember([h for _, h in todo])
        self.num_saved_blocks += len(todo)
