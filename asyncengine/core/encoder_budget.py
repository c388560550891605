"""The image encoder's share of a step (vLLM V1's encoder budget and encoder-cache manager).

Each step may encode images worth at most ``compute_budget`` placeholder tokens (vLLM's
``max_num_encoder_input_tokens``: ``--max-num-encoder-input-tokens``, by default
``--max-num-batched-tokens``), and their outputs must find room in the encoder cache
(``--mm-encoder-cache`` tokens) next to the outputs the step reads from it. A prefill chunk
that reaches an image that is neither cached nor affordable this step ends at that image's
first placeholder; the image is encoded in a later step. A cached image costs nothing, and the
first image of a step is always affordable (one larger than the budget would never run
otherwise).

:class:`EncoderBudget` applies this to whatever the scheduler chose, right after
``schedule()`` (so any scheduler, built-in or plugin, keeps the contract unchanged): it cuts
the chunks it cannot afford, as the scheduler would have cut them to its token budget. A
scheduler may also ask while it builds the step (``fit``, as ``FCFSScheduler`` does when the
engine hands it the budget), so that the tokens a cut frees go to other requests in the same
step, as in vLLM. It also owns the cache's bookkeeping, least recently used first out: the
step's :class:`EncoderPlan` names the outputs the runner encodes and keeps, and the ones it
drops first, so the runner's cache (``executor/models/vision/encoder_cache.py``) holds
exactly what this one counts and the runner never encodes what was not counted (should the
two ever differ, the runner encodes what it lacks rather than answer wrongly).

Per step it costs nothing while no request has an image still to compute; otherwise it looks
at the step's requests (O(requests in the step)) and at their images in the chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from asyncengine.core.multimodal import MMInput
from asyncengine.core.request import Request


@dataclass
class _StepState:
    """The encoder's share of the step being scheduled (reservations may outnumber what the
    step finally encodes: a request preempted after its chunk fitted wastes its share)."""

    budget: int
    encode: dict[bytes, MMInput] = field(default_factory=dict)
    pinned: set[bytes] = field(default_factory=set)  # cached outputs the step reads
    pinned_tokens: int = 0
    new_tokens: int = 0  # cache space the step's new outputs take


@dataclass
class EncoderPlan:
    """What a step's encoder does: drop ``evict`` from the cache, then encode ``encode``
    (keeping each whose output fits the cache: ``keep``)."""

    evict: list[bytes] = field(default_factory=list)
    encode: list[MMInput] = field(default_factory=list)
    keep: set[bytes] = field(default_factory=set)


class EncoderBudget:
    def __init__(self, compute_budget: int, cache_size: int) -> None:
        if compute_budget < 1 or cache_size < 1:
            raise ValueError("the encoder budget and cache need at least one token")
        self.compute_budget = compute_budget
        self.cache_size = cache_size
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # key -> tokens, LRU first
        self.used = 0
        self.requests: dict[str, Request] = {}  # unfinished requests with images
        self.pending: dict[str, Request] = {}  # ... whose images are not all computed
        self.num_encoded = 0  # images (runs) encoded since the start
        self.num_deferred = 0  # chunks cut short at an image this budget could not take
        self._step: _StepState | None = None  # the step ``fit`` is filling

    def add(self, request: Request) -> None:
        """A request with images was queued."""
        if request.mm_inputs:
            self.requests[request.request_id] = request
            self.pending[request.request_id] = request

    def fit(self, request: Request, start: int, num_new: int) -> int:
        """A scheduler's chunk ``[start, start + num_new)`` of ``request``, cut to what this
        step's encoder can take (the scheduler calls it while it builds the step, before it
        allocates blocks, so that the tokens a cut frees go to other requests; one that does
        not is cut by ``apply`` all the same)."""
        if request.request_id not in self.pending:
            return num_new
        if self._step is None:
            self._step = _StepState(self.compute_budget)
        cut = self._fit(self._step, request, start, start + num_new, loaded=False)
        if cut is None:
            return num_new
        self.num_deferred += 1
        return cut

    def apply(self, out: Any) -> EncoderPlan | None:
        """Fit a step (a ``SchedulerOutput``) to the budget: cut chunks at unaffordable
        images (dropping a request that is left with nothing) and plan the encoder's work.
        None: the step encodes nothing."""
        step, self._step = self._step, None
        if not self.requests:
            return None
        for rid in out.finished_req_ids:
            if self.requests.pop(rid, None) is not None:
                self.pending.pop(rid, None)
        for rid in out.preempted_req_ids:  # recomputed from its first token
            request = self.requests.get(rid)
            if request is not None:
                self.pending[rid] = request
        if not self.pending:
            return None
        step = step or _StepState(self.compute_budget)
        needed: dict[bytes, MMInput] = {}  # what the step's final chunks encode
        dropped = False
        for s in out.scheduled:
            request = s.request
            if request.request_id not in self.pending or s.spec_token_ids:
                continue
            start, end = s.start, s.start + s.num_new_tokens
            cut = self._fit(step, request, start, end, loaded=s.kv_load is not None)
            if cut is not None:
                self._cut(s, cut)
                dropped = dropped or cut == 0
                end = start + cut
            for item in request.mm_inputs:
                if item.offset < end and item.end > start and item.hash in step.encode:
                    needed[item.hash] = item
            if end >= request.mm_inputs[-1].end:
                del self.pending[request.request_id]
        if dropped:
            out.scheduled = [s for s in out.scheduled if s.num_new_tokens > 0]
        for key in step.pinned:
            self.cached.move_to_end(key)
        if not needed:
            return None
        return self._plan(list(needed.values()), step.pinned)

    def _fit(self, step: _StepState, request: Request, start: int, end: int,
             loaded: bool) -> int | None:
        """Reserve what the chunk ``[start, end)`` needs of the step's encoder; None: all of
        it, else the chunk's length up to the first image it cannot have (``loaded``: the
        chunk follows blocks a KV connector loads, so it cannot be dropped)."""
        for item in request.mm_inputs:
            if item.end <= start:
                continue
            if item.offset >= end:
                break
            key, n = item.hash, item.length
            if key in step.encode:
                continue
            if key in self.cached:
                if key not in step.pinned:
                    step.pinned.add(key)
                    step.pinned_tokens += self.cached[key]
                continue
            fits_cache = n > self.cache_size or \
                step.pinned_tokens + step.new_tokens + n <= self.cache_size
            cut = max(0, item.offset - start)  # (it may have begun in an earlier step)
            if (n <= step.budget or step.budget == self.compute_budget) and fits_cache \
                    or cut == 0 and loaded:
                step.encode[key] = item
                step.budget -= n
                if n <= self.cache_size:
                    step.new_tokens += n
                continue
            return cut
        return None

    def _cut(self, s: Any, num_new: int) -> None:
        """End a scheduled chunk after ``num_new`` tokens (it no longer samples)."""
        request = s.request
        request.num_computed_tokens = s.start + num_new
        if s.samples:
            request.num_output_placeholders -= 1
            s.samples = False
        s.num_new_tokens = num_new
        self.num_deferred += 1

    def _plan(self, items: list[MMInput], pinned: set[bytes]) -> EncoderPlan:
        plan = EncoderPlan(encode=items)
        for item in items:
            n = item.length
            if n > self.cache_size:
                continue  # used by its step, never kept
            while self.used + n > self.cache_size:  # apply() left room among the unpinned
                key = next((k for k in self.cached if k not in pinned), None)
                if key is None:
                    break
                self.used -= self.cached.pop(key)
                plan.evict.append(key)
            if self.used + n > self.cache_size:
                continue  # no room (a chunk that had to take it): used, not kept
            pinned.add(item.hash)
            self.cached[item.hash] = n
            self.used += n
            plan.keep.add(item.hash)
        self.num_encoded += len(items)
        return plan
