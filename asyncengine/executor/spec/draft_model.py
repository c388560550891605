"""The ``draft_model`` method: a small model of the same vocabulary proposes the drafts,
greedily, in the same process and on the same device queue as the target.

The draft has its own weights, KV cache (its own ``KVCacheManager`` over its own blocks) and
persistent batch (its own ``ModelRunner``). Each speculating request has a proxy request on
the draft side holding the request's tokens plus the drafts being made. A proposal for a batch
is k draft steps: the first computes the tokens the draft has not seen (the whole prompt the
first time, then the tokens the last target step kept) and samples the first draft; each
next step computes the previous draft and samples the next. Afterwards the proxy forgets its
drafts: the draft's KV stays valid for the request's real tokens, and the next proposal
computes only what the target kept since. The draft samples greedily, so each draft is one
token with certainty and verification (``accept.py``) is exact rejection sampling.
"""

from __future__ import annotations

from typing import Any

from asyncengine.core.kv.manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.interface import ScheduledRequest, SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftModelProposer:
    def __init__(self, runner: Any, device: Any, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        self.device = device
        self.kv = KVCacheManager(num_blocks, block_size, False)
        self.proxies: dict[str, tuple[Request, Request]] = {}  # id -> (request, proxy)
        self._gone: set[str] = set()  # proxies freed since the last draft step
        self.num_steps = 0

    def _proxy(self, request: Request) -> Request:
        rid = request.request_id
        entry = self.proxies.get(rid)
        if entry is None or entry[0] is not request:
            if entry is not None:
                self._forget(rid)
            proxy = Request(rid, list(request.all_token_ids), _GREEDY,
                            max_model_len=request.max_model_len)
            proxy.spec_state = len(proxy.all_token_ids)  # its real tokens
            self.proxies[rid] = (request, proxy)
            return proxy
        proxy = entry[1]
        tokens, real = proxy.all_token_ids, proxy.spec_state
        del tokens[real:]  # the last proposal's drafts
        tokens.extend(request.all_token_ids[real:])  # what the target kept since
        proxy.spec_state = len(tokens)
        proxy.num_computed_tokens = min(proxy.num_computed_tokens, real)
        return proxy

    def _forget(self, rid: str) -> None:
        _, proxy = self.proxies.pop(rid)
        self.kv.free(proxy)
        self._gone.add(rid)

    def _sweep(self) -> None:
        for rid in [rid for rid, (r, _) in self.proxies.items() if r.is_finished]:
            self._forget(rid)

    async def propose_batch(self, wanting: list[tuple[Request, int]]) -> None:
        """Set ``spec_token_ids`` of each ``(request, k)``: up to k greedy drafts."""
        self._sweep()
        active: list[tuple[Request, Request, int, list[int]]] = []
        for request, k in wanting:
            proxy = self._proxy(request)
            unseen = len(proxy.all_token_ids) - proxy.num_computed_tokens
            if self.kv.allocate_slots(proxy, unseen + k - 1):
                active.append((request, proxy, k, []))
        for j in range(max((k for _, _, k, _ in active), default=0)):
            out = SchedulerOutput(finished_req_ids=self._gone)
            self._gone = set()
            rows = []
            for _, proxy, k, drafts in active:
                if j >= k or len(drafts) < j:  # done, or stopped at a row with no token
                    continue
                start = proxy.num_computed_tokens
                n = len(proxy.all_token_ids) - start
                out.scheduled.append(ScheduledRequest(
                    proxy, start, n, self.kv.get_block_ids(proxy.request_id)))
                proxy.num_computed_tokens = start + n
                rows.append((proxy, drafts))
            if not rows:
                break
            inputs = self.runner.prepare(out)
            result = await self.device.launch_step(self.runner, inputs).wait()
            self.num_steps += 1
            for proxy, drafts in rows:
                token = result.sampled_token_ids.get(proxy.request_id, -1)
                if token >= 0:
                    drafts.append(token)
                    proxy.all_token_ids.append(token)
        for request, proxy, _, drafts in active:
            request.spec_token_ids = drafts
            proxy.num_computed_tokens = min(proxy.num_computed_tokens, proxy.spec_state)
