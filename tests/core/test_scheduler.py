"""The built-in schedulers, driven by a simulated engine loop and a fake runner."""

from __future__ import annotations

import itertools
import random
import weakref

import pytest

from asyncengine.config import EngineConfig
from asyncengine.core.request import Logprob, Request, RequestStatus
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched import BUILTIN_SCHEDULERS, FCFSScheduler, PriorityScheduler
from asyncengine.core.sched.interface import ModelRunnerOutput, SchedulerOutput


def make_config(block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                chunked: bool = True, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig.from_dict({
        "cache": {"block_size": block_size, "enable_prefix_caching": prefix_caching},
        "scheduler": {"max_num_seqs": max_num_seqs,
                      "max_num_batched_tokens": max_num_batched_tokens,
                      "enable_chunked_prefill": chunked},
    })


def make_request(rid: str, prompt: list[int] | int, max_tokens: int = 4, priority: int = 0,
                 arrival: float | None = None, **params) -> Request:
    if isinstance(prompt, int):  # distinct tokens: no accidental prefix hits
        base = 1000 * next(_prompt_ids)
        prompt = list(range(base, base + prompt))
    tokens = prompt
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=frozenset({0}), max_model_len=4096, priority=priority, **kw)


_prompt_ids = itertools.count(1)


class FakeRunner:
    """A model whose "KV" at position p is a fingerprint of tokens[0..p] (real K/V depends on
    the whole prefix). It writes the computed positions into their slots, then checks that
    every position a request attends to holds that request's fingerprint: a wrong block table
    or a bad prefix hit shows up as a mismatch. Samples random tokens."""

    def __init__(self, sched: FCFSScheduler, seed: int = 0, vocab: int = 1000) -> None:
        kv = sched.kv_cache_manager
        self.block_size = kv.block_size
        self.slots: list[int | None] = [None] * (kv.num_total_blocks * kv.block_size)
        self.rng = random.Random(seed)
        self.vocab = vocab

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    @staticmethod
    def fingerprints(tokens: list[int]) -> list[int]:
        out, fp = [], 0
        for t in tokens:
            fp = hash((fp, t))
            out.append(fp)
        return out

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        expected = {s.request.request_id: self.fingerprints(
            s.request.all_token_ids[:s.start + s.num_new_tokens]) for s in out.scheduled}
        for s in out.scheduled:  # write, then attend (as the attention backends do)
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.slots[self.slot(s.block_ids, pos)] = expected[s.request.request_id][pos]
        for s in out.scheduled:
            seen = [self.slots[self.slot(s.block_ids, p)]
                    for p in range(s.start + s.num_new_tokens)]
            assert seen == expected[s.request.request_id], s.request
        result = ModelRunnerOutput()
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            if s.samples:
                result.sampled_token_ids[s.request.request_id] = self.rng.randrange(1, self.vocab)
            if s.request.sampling_params.prompt_logprobs is not None:
                prompt = s.request.prompt_token_ids
                # Positions start..end-1 predict prompt tokens start+1..end.
                result.prompt_logprobs[s.request.request_id] = [
                    {prompt[p]: Logprob(-float(p))}
                    for p in range(s.start + 1, min(end + 1, len(prompt)))]
        return result


RUNNERS: weakref.WeakKeyDictionary[FCFSScheduler, FakeRunner] = weakref.WeakKeyDictionary()


def run(sched: FCFSScheduler, arrivals: dict[int, list[Request]] | None = None,
        max_steps: int = 5000, runner: FakeRunner | None = None,
        ) -> tuple[list[str], list[list[tuple[str, int, int, bool]]]]:
    """The engine loop; ``arrivals[step]`` are added before that step. Checks the budgets on
    every step. Returns the finish order and, per step, (id, start, num_new_tokens, samples)
    for each scheduled request."""
    runner = runner or RUNNERS.setdefault(sched, FakeRunner(sched))
    arrivals = dict(arrivals or {})
    finished: list[str] = []
    trace: list[list[tuple[str, int, int, bool]]] = []
    step = 0
    while sched.has_unfinished_requests() or arrivals:
        for req in arrivals.pop(step, []):
            sched.add_request(req)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs and len(sched.running) <= \
            sched.max_num_seqs
        trace.append([(s.request.request_id, s.start, s.num_new_tokens, s.samples)
                      for s in out.scheduled])
        for req in sched.update_from_output(out, runner.execute(out)):
            if req.is_finished:
                finished.append(req.request_id)
        step += 1
        assert step < max_steps, "no progress"
    return finished, trace


@pytest.mark.parametrize("name", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked,prefix", [(True, True), (False, True), (True, False)])
def test_many_requests_tiny_pool(name: str, chunked: bool, prefix: bool) -> None:
    rng = random.Random(7)
    sched = BUILTIN_SCHEDULERS[name](make_config(chunked=chunked, prefix_caching=prefix), 20)
    shared = [rng.randrange(1, 1000) for _ in range(12)]
    arrivals: dict[int, list[Request]] = {}
    reqs = []
    for i in range(40):
        n = rng.randrange(3, 30)
        prompt = (shared if i % 2 else [])[:n] + [rng.randrange(1, 1000) for _ in range(n)]
        req = make_request(f"r{i}", prompt[:30], max_tokens=16, priority=rng.randrange(3))
        arrivals.setdefault(rng.randrange(60), []).append(req)
        reqs.append(req)
    finished, _ = run(sched, arrivals)
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 16
        assert r.first_scheduled_time <= r.first_token_time <= r.last_token_time
    stats = sched.make_stats()
    assert stats.num_preemptions > 0 and sum(r.num_preemptions for r in reqs) == \
        stats.num_preemptions
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert (stats.prefix_cache_hits > 0) == prefix
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_chunked_prefill_respects_the_budget() -> None:
    sched = FCFSScheduler(make_config(max_num_batched_tokens=16), 64)
    sched.add_request(make_request("a", 5, max_tokens=8))
    sched.add_request(make_request("long", 40, max_tokens=2))
    _, trace = run(sched)
    chunks = [e[1:] for step in trace for e in step if e[0] == "long"]
    assert chunks[:3] == [(0, 11, False), (11, 15, False), (26, 14, True)]
    assert [sum(e[2] for e in step) for step in trace[:3]] == [16, 16, 15]


def test_without_chunked_prefill_a_prompt_is_admitted_whole() -> None:
    sched = FCFSScheduler(make_config(max_num_batched_tokens=16, chunked=False), 64)
    sched.add_request(make_request("a", 5, max_tokens=8))
    sched.add_request(make_request("b", 12, max_tokens=2))
    _, trace = run(sched)
    assert trace[0] == [("a", 0, 5, True)]  # 11 tokens left in the budget: b waits
    assert trace[1] == [("a", 5, 1, True), ("b", 0, 12, True)]
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        sched.add_request(make_request("c", 17))


def test_max_num_seqs() -> None:
    sched = FCFSScheduler(make_config(max_num_seqs=3), 64)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=3))
    finished, trace = run(sched)  # run() checks the limit on every step
    assert max(len(step) for step in trace) == 3
    assert finished == [f"r{i}" for i in range(10)]  # first come, first served


def test_request_that_can_never_fit_is_rejected() -> None:
    sched = FCFSScheduler(make_config(), 4)  # 16 tokens
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens <= 16"):
        sched.add_request(make_request("big", 10, max_tokens=7))
    sched.add_request(make_request("fits", 10, max_tokens=6))  # exactly the pool
    sched.add_request(make_request("other", 9, max_tokens=7))
    finished, _ = run(sched)
    assert sorted(finished) == ["fits", "other"]
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 3))
        sched.add_request(make_request("x", 3))


def test_fcfs_preempts_the_most_recent_request() -> None:
    sched = FCFSScheduler(make_config(), 4)
    a, b = make_request("a", 7, max_tokens=9), make_request("b", 7, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    runner = RUNNERS.setdefault(sched, FakeRunner(sched))
    for _ in range(2):  # prefill, then decode position 7: two blocks each, the pool is full
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert out.preempted_req_ids == set()
    out = sched.schedule()  # a needs a third block
    assert out.preempted_req_ids == {"b"} and [s.request for s in out.scheduled] == [a]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2 and b.num_preemptions == 1
    assert sched.waiting.peek() is b
    sched.update_from_output(out, runner.execute(out))
    finished, _ = run(sched)
    assert a.num_output_tokens == b.num_output_tokens == 9


def test_a_request_that_is_its_own_victim_waits() -> None:
    sched = FCFSScheduler(make_config(), 5)
    a, b = make_request("a", 7, max_tokens=9), make_request("b", 7, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    runner = RUNNERS.setdefault(sched, FakeRunner(sched))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # a takes the last free block; b would need one more
    assert out.preempted_req_ids == {"b"} and [s.request for s in out.scheduled] == [a]
    assert sched.running == [a]


def test_prefix_hit_skips_computation() -> None:
    sched = FCFSScheduler(make_config(block_size=16, max_num_batched_tokens=64), 16)
    prompt = list(range(1, 41))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    run(sched)
    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    out = sched.schedule()
    [s] = out.scheduled
    assert (s.start, s.num_new_tokens, b.num_cached_tokens) == (32, 8, 32)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    c = make_request("c", prompt[:32], max_tokens=2)  # all cached: the last block is redone
    sched.add_request(c)
    step = {s.request.request_id: s.num_new_tokens for s in sched.schedule().scheduled}
    assert step == {"b": 1, "c": 16}  # b decodes its in-flight token (async scheduling)


def test_async_scheduling_schedules_on_tokens_in_flight() -> None:
    """Step N+1 is scheduled before step N's result: a request that sampled in N decodes
    that token in N+1; results apply in order; a request whose in-flight token is its last is
    not scheduled again; results for requests that left meanwhile are dropped."""
    sched = FCFSScheduler(make_config(max_num_seqs=4), 32)
    a = make_request("a", 5, max_tokens=3)
    b = make_request("b", 5, max_tokens=8)
    c = make_request("c", 5, max_tokens=8)
    for r in (a, b, c):
        sched.add_request(r)
    s1 = sched.schedule()  # prefills: every request samples its first token
    assert all(s.samples for s in s1.scheduled)
    assert [r.num_output_placeholders for r in (a, b, c)] == [1, 1, 1]
    s2 = sched.schedule()  # before s1's result: decode the in-flight tokens
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in s2.scheduled] == \
        [("a", 5, 1), ("b", 5, 1), ("c", 5, 1)]
    assert [r.num_output_placeholders for r in (a, b, c)] == [2, 2, 2]

    def result(out, token):
        return ModelRunnerOutput({s.request.request_id: token for s in out.scheduled})

    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)  # gone while s1, s2 run
    assert sched.update_from_output(s1, result(s1, 10)) == [a, b]
    assert a.output_token_ids == [10] and c.output_token_ids == []
    s3 = sched.schedule()  # a: 1 known + 2 in flight... the third is its last (max_tokens=3)
    assert [s.request.request_id for s in s3.scheduled] == ["a", "b"]
    assert sched.update_from_output(s2, result(s2, 11)) == [a, b]
    s4 = sched.schedule()
    assert [s.request.request_id for s in s4.scheduled] == ["b"]  # a's last token is in s3
    sched.update_from_output(s3, result(s3, 12))
    assert a.is_finished and a.output_token_ids == [10, 11, 12]
    sched.update_from_output(s4, result(s4, 13))
    assert b.output_token_ids == [10, 11, 12, 13] and b.num_output_placeholders == 0
    assert a.num_output_placeholders == 0


def test_a_fault_of_one_request_ends_it_alone() -> None:
    """A sampled id of -1 (no valid token) or a grammar that raises ends that request with
    FINISHED_ERROR; the others get their tokens."""

    class Exploding(CountingGrammar):
        def accept_token(self, token_id):
            raise RuntimeError("grammar bug")

    sched = FCFSScheduler(make_config(max_num_seqs=4), 32)
    reqs = [make_request(f"r{i}", 4, max_tokens=4) for i in range(3)]
    reqs[2].grammar = Exploding(100)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    tokens = {"r0": 5, "r1": -1, "r2": 6}
    sched.update_from_output(out, ModelRunnerOutput(tokens))
    assert reqs[0].output_token_ids == [5] and not reqs[0].is_finished
    assert reqs[1].status == RequestStatus.FINISHED_ERROR and "no valid next token" in \
        reqs[1].error
    assert reqs[2].status == RequestStatus.FINISHED_ERROR and "grammar bug" in reqs[2].error
    assert sched.kv_cache_manager.num_free_blocks == 32 - 1


def test_abort_waiting_and_running_requests() -> None:
    sched = FCFSScheduler(make_config(max_num_seqs=2), 16)
    reqs = [make_request(f"r{i}", 6, max_tokens=8) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner = RUNNERS.setdefault(sched, FakeRunner(sched))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    sched.finish_requests(["r0", "r3", "nope"], RequestStatus.FINISHED_ABORTED)  # mid-step
    assert sched.update_from_output(out, runner.execute(out)) == [reqs[1]]
    assert reqs[0].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    assert reqs[0].num_output_tokens == 1
    assert sched.schedule().finished_req_ids == {"r0", "r3"}
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("r1", RequestStatus.FINISHED_STOPPED)  # already finished: ignored
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED
    sched.shutdown()
    assert not sched.has_unfinished_requests() and reqs[2].is_finished
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


class CountingGrammar:
    def __init__(self, length: int) -> None:
        self.accepted: list[int] = []
        self.length = length

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_update_from_output_logprobs_grammar_and_stop() -> None:
    sched = FCFSScheduler(make_config(max_num_batched_tokens=8, prefix_caching=True), 32)
    req = make_request("a", 12, max_tokens=10, logprobs=0, prompt_logprobs=0)
    req.grammar = CountingGrammar(3)
    sched.add_request(req)
    step = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        [s] = out.scheduled
        predicted = range(s.start + 1,
                          min(s.start + s.num_new_tokens + 1, req.num_prompt_tokens))
        result = ModelRunnerOutput(prompt_logprobs={
            "a": [{p: Logprob(-float(p))} for p in predicted]})
        if s.samples:
            tok = 100 + step
            result.sampled_token_ids["a"] = tok
            result.logprobs["a"] = {tok: Logprob(-0.5, rank=1), 7: Logprob(-1.0, rank=2)}
        sched.update_from_output(out, result)
        step += 1
    assert req.status == RequestStatus.FINISHED_STOPPED  # the grammar ended it
    assert req.output_token_ids == req.grammar.accepted == [101, 102, 103]
    assert len(req.logprobs) == 3 and req.cumulative_logprob == pytest.approx(-1.5)
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == 12
    assert [next(iter(e)) for e in req.prompt_logprobs[1:]] == list(range(1, 12))


def test_prompt_logprobs_skip_the_cache_and_survive_preemption() -> None:
    sched = FCFSScheduler(make_config(), 5)
    prompt = list(range(1, 8))
    sched.add_request(make_request("warm", prompt, max_tokens=1))
    run(sched)
    a = make_request("a", prompt, max_tokens=9)
    b = make_request("b", prompt, max_tokens=9, prompt_logprobs=0)
    sched.add_request(a)
    sched.add_request(b)
    finished, trace = run(sched)
    firsts: dict[str, int] = {}
    for step in trace:
        for rid, start, _, _ in step:
            firsts.setdefault(rid, start)
    assert firsts == {"a": 4, "b": 0}  # a hits the cache, b computes every prompt position
    assert b.num_preemptions >= 1  # its prompt was computed again
    assert b.prompt_logprobs == [None] + [{t: Logprob(-float(p))} for p, t in
                                          enumerate(range(2, 8), start=1)]


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_aborting_waiting_requests_keeps_the_queue_in_order(cls) -> None:
    """Aborts of waiting requests are lazy deletions: the rest keep their order, the queue's
    length is right at once, and the aborted ones never run."""
    sched = cls(make_config(max_num_seqs=2), 64)
    ids = [f"r{i}" for i in range(10)]
    for i, rid in enumerate(ids):
        sched.add_request(make_request(rid, 4, max_tokens=2, arrival=float(i)))
    gone = ["r0", "r3", "r4", "r9"]
    sched.finish_requests(gone, RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 6
    assert [r.request_id for r in sched.waiting] == ["r1", "r2", "r5", "r6", "r7", "r8"]
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r1", "r2"]
    assert sched.get_num_unfinished_requests() == 6


# -- priority ----------------------------------------------------------------------------------
def test_priority_admission_order() -> None:
    sched = PriorityScheduler(make_config(max_num_seqs=1), 64)
    for rid, prio, t in [("low", 5, 0.0), ("mid", 1, 1.0), ("high", 0, 2.0), ("mid2", 1, 3.0)]:
        sched.add_request(make_request(rid, 4, max_tokens=2, priority=prio, arrival=t))
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "mid2", "low"]
    finished, _ = run(sched)
    assert finished == ["high", "mid", "mid2", "low"]


def test_priority_preempts_the_least_urgent() -> None:
    sched = PriorityScheduler(make_config(), 4)
    low = make_request("low", 7, max_tokens=9, priority=1, arrival=0.0)
    high = make_request("high", 7, max_tokens=9, priority=0, arrival=1.0)
    sched.add_request(low)
    sched.add_request(high)
    runner = RUNNERS.setdefault(sched, FakeRunner(sched))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    # The pool is full and both need a third block: FCFS would preempt high (admitted last),
    # priority serves high first and preempts low.
    out = sched.schedule()
    assert out.preempted_req_ids == {"low"} and [s.request for s in out.scheduled] == [high]
    assert low.status == RequestStatus.PREEMPTED
    sched.update_from_output(out, runner.execute(out))
    finished, _ = run(sched)
    assert finished == ["high", "low"]


def test_priority_victim_can_be_the_request_being_scheduled() -> None:
    sched = PriorityScheduler(make_config(), 5)
    low = make_request("low", 7, max_tokens=9, priority=1, arrival=0.0)
    high = make_request("high", 7, max_tokens=9, priority=0, arrival=1.0)
    for r in (low, high):
        sched.add_request(r)
    runner = RUNNERS.setdefault(sched, FakeRunner(sched))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # high takes the free block; low is the least urgent: it waits
    assert out.preempted_req_ids == {"low"} and sched.running == [high]


def test_urgent_requests_overtake_a_full_pool() -> None:
    sched = PriorityScheduler(make_config(max_num_seqs=4), 16)
    lows = [make_request(f"low{i}", 12, max_tokens=20, priority=5, arrival=float(i))
            for i in range(6)]
    highs = [make_request(f"high{i}", 10, max_tokens=5, priority=0, arrival=10.0 + i)
             for i in range(4)]
    finished, _ = run(sched, {0: lows, 3: highs})
    assert sorted(finished) == sorted(r.request_id for r in lows + highs)
    assert max(finished.index(h.request_id) for h in highs) < min(
        finished.index(r.request_id) for r in lows)
    assert sum(r.num_preemptions for r in lows) > 0
    assert all(r.num_output_tokens == 20 for r in lows)
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


# -- random workloads --------------------------------------------------------------------------
@pytest.mark.parametrize("first_seed", range(0, 300, 20))
def test_random_workloads_keep_the_invariants(first_seed: int) -> None:
    """Random configs, prompts with shared prefixes, EOS stops and aborts (waiting, running,
    mid-step): block ref counts always match the block tables, nothing is lost or leaked."""
    for seed in range(first_seed, first_seed + 20):
        rng = random.Random(seed)
        bs = rng.choice([1, 2, 4, 8])
        config = make_config(bs, rng.randint(1, 8), rng.randint(8, 64),
                             chunked=rng.random() < 0.7, prefix_caching=rng.random() < 0.7)
        sched = BUILTIN_SCHEDULERS[rng.choice(["fcfs", "priority"])](config, rng.randint(4, 30))
        kv, runner = sched.kv_cache_manager, FakeRunner(sched, seed, vocab=30)
        shared = [rng.randrange(1, 50) for _ in range(40)]
        arrivals: dict[int, list[Request]] = {}
        for i in range(rng.randint(1, 30)):
            n = rng.randint(1, 40)
            prompt = shared[:rng.randint(0, n)]
            prompt += [rng.randrange(1, 50) for _ in range(n - len(prompt))]
            req = make_request(f"r{i}", prompt, rng.randint(1, 20), priority=rng.randrange(3))
            if req.num_prompt_tokens + req.max_tokens <= kv.num_total_blocks * bs and (
                    config.scheduler.enable_chunked_prefill or n <= sched.max_num_batched_tokens):
                req.sampling_params.ignore_eos = rng.random() < 0.7
                req.eos_token_ids = frozenset({rng.randrange(1, 30)})
                arrivals.setdefault(rng.randrange(40), []).append(req)
        reqs = [r for rs in arrivals.values() for r in rs]
        step = 0
        while sched.has_unfinished_requests() or any(k >= step for k in arrivals):
            for req in arrivals.get(step, []):
                sched.add_request(req)
            if rng.random() < 0.03 and sched.requests:
                sched.finish_requests(rng.choice(list(sched.requests)),
                                      RequestStatus.FINISHED_ABORTED)
            out = sched.schedule()
            assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
            assert len(sched.running) <= sched.max_num_seqs
            holders = [b for r in sched.running for b in kv.get_block_ids(r.request_id)]
            assert [b.ref_cnt for b in kv.pool.blocks] == [
                holders.count(b.block_id) for b in kv.pool.blocks]
            if rng.random() < 0.03 and out.scheduled:
                sched.finish_requests(rng.choice(out.scheduled).request.request_id,
                                      RequestStatus.FINISHED_ABORTED)
            sched.update_from_output(out, runner.execute(out))
            step += 1
            assert step < 5000, "no progress"
        assert kv.num_free_blocks == kv.num_total_blocks
        for req in reqs:
            assert req.is_finished
            if req.status == RequestStatus.FINISHED_LENGTH:
                assert req.num_output_tokens == req.max_tokens
            if req.status == RequestStatus.FINISHED_STOPPED:
                assert req.output_token_ids[-1] in req.eos_token_ids
