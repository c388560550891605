"""PrefixAffinityRouter: Ray Serve's request-router hook, routing by prompt prefix.

A request whose prompt shares a prefix with one routed before goes to the replica that served
it, whose local prefix cache holds that prefix's KV blocks, unless that replica is busier than
the least busy one by more than ``imbalance_threshold`` requests: then the request is routed
the default way (the less loaded of two random replicas), and that replica loads the prefix
from the shared KV store (``--kv-connector safetensors``) instead of computing it.

The ingress passes the prompt's routing text as the ``prefix`` keyword of the call (Serve's
HTTP proxy routes before the body is read, so the body is read by the ingress, which then
calls the engine deployment through a handle that uses this router). ``replica`` pins a request
to one replica: its id, or its index in the sorted ids (the ``X-AsyncEngine-Replica`` header).

Why not Ray's ``PrefixCacheAffinityRouter`` (``ray.serve.llm``): it keeps its character trie
in a separate detached actor and calls it with blocking ``ray.get`` from the router's event
loop on every request, and it reads the prompt from a request object's ``prompt`` or
``messages`` attribute (ray.serve.llm's own request types). This router keeps its table in
the handle's process (``prefix_table.PrefixTable``: chained chunk hashes, one dict lookup per
chunk, no remote call), exact for one ingress replica; with several ingress replicas each
keeps its own table (see docs/deploy.md).
"""

from __future__ import annotations

import logging
import random

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from asyncengine.deploy.prefix_table import PrefixTable

logger = logging.getLogger("asyncengine.deploy")


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, chunk_chars: int = 64, min_match_chars: int = 64,
                         imbalance_threshold: int = 8, max_entries: int = 1 << 18) -> None:
        self.table = PrefixTable(chunk_chars, max_entries)
        self.min_match_chars = min_match_chars
        self.imbalance_threshold = imbalance_threshold
        self.num_affinity_routed = 0

    # -- the hook -----------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = _pinned(candidate_replicas, kwargs.get("replica"))
        if pinned is not None:
            return [[pinned]]
        fallback = _two_random(candidate_replicas)
        text = kwargs.get("prefix") or ""
        if not text:
            return [fallback]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        owner, length = self.table.match(text, by_id)
        if owner is None or length < self.min_match_chars:
            return [fallback]
        preferred = by_id[owner]
        if self._too_busy(preferred, candidate_replicas):
            return [fallback]
        self.num_affinity_routed += 1
        return [[preferred], [r for r in fallback if r is not preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        text = pending_request.kwargs.get("prefix") if pending_request is not None else None
        if text:
            self.table.record(text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    # -- helpers ------------------------------------------------------------------------------
    def _too_busy(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """More ongoing requests than the least busy replica, by more than the threshold
        (from Serve's queue-length cache; unknown lengths never count as busy)."""
        cache = self.replica_queue_len_cache
        mine = cache.get(preferred.replica_id)
        if mine is None:
            return False
        known = [q for q in (cache.get(r.replica_id) for r in candidates) if q is not None]
        return mine - min(known) > self.imbalance_threshold


def _pinned(candidates: list[RunningReplica], pin: str | None) -> RunningReplica | None:
    """The replica a request is pinned to: by id, or by index in the sorted ids."""
    if not pin:
        return None
    ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
    for r in ordered:
        if r.replica_id.unique_id == pin:
            return r
    if pin.isdigit() and int(pin) < len(ordered):
        return ordered[int(pin)]
    return None


def _two_random(candidates: list[RunningReplica]) -> list[RunningReplica]:
    """Power of two choices: Serve sends the request to the less loaded of the two."""
    return random.sample(candidates, min(2, len(candidates)))
