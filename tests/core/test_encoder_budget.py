"""The encoder's share of a step (``core/encoder_budget.py``) over the built-in scheduler:
chunks end before images the step cannot afford, cached images cost nothing, the cache's
space is counted, and what the plan encodes is what the chunks need."""

from __future__ import annotations

from asyncengine.core.encoder_budget import EncoderBudget
from asyncengine.core.multimodal import MMInput
from asyncengine.core.sched import FCFSScheduler
from asyncengine.core.sched.interface import ModelRunnerOutput
from tests.core.test_scheduler import make_config, make_request

IMAGE = 16  # placeholders per image


def image_request(rid: str, key: bytes, offset: int = 4, prompt: int = 30):
    request = make_request(rid, prompt, max_tokens=2)
    request.mm_inputs = [MMInput(key.ljust(32, b"\0"), offset, IMAGE, None)]
    return request


def step(sched: FCFSScheduler, gate: EncoderBudget):
    out = sched.schedule()
    plan = gate.apply(out)
    sched.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={s.request.request_id: 7 for s in out.scheduled if s.samples}))
    chunks = {s.request.request_id: (s.start, s.num_new_tokens) for s in out.scheduled}
    encoded = [m.hash.rstrip(b"\0") for m in plan.encode] if plan else []
    evicted = [k.rstrip(b"\0") for k in plan.evict] if plan else []
    return chunks, encoded, evicted


def run(sched: FCFSScheduler, gate: EncoderBudget, requests: list) -> list:
    for r in requests:
        sched.add_request(r)
        gate.add(r)
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched, gate))
        assert len(steps) < 50
    return steps


def test_one_image_per_step_and_cached_images_cost_nothing():
    sched = FCFSScheduler(make_config(max_num_batched_tokens=128), num_blocks=64)
    gate = EncoderBudget(compute_budget=IMAGE, cache_size=1000)
    steps = run(sched, gate, [image_request(r, r.encode()) for r in "abc"])
    # Step 1: all three join; a's image is encoded, b and c stop before theirs (offset 4).
    assert steps[0] == ({"a": (0, 30), "b": (0, 4), "c": (0, 4)}, [b"a"], [])
    assert steps[1][0]["b"] == (4, 26) and steps[1][1] == [b"b"]
    assert "c" not in steps[1][0]  # nothing left for c this step: it is not in it
    assert steps[2][0]["c"] == (4, 26) and steps[2][1] == [b"c"]
    assert [e for s in steps for e in s[1]] == [b"a", b"b", b"c"]  # each encoded once
    assert gate.num_deferred == 3 and not gate.pending
    assert gate.apply(sched.schedule()) is None and not gate.requests  # finished: forgotten
    # The same images again, elsewhere in new prompts: cached, so all in one step.
    steps = run(sched, gate, [image_request(r + "2", r.encode(), offset=6) for r in "abc"])
    assert steps[0][0] == {"a2": (0, 30), "b2": (0, 30), "c2": (0, 30)}
    assert all(not encoded for _, encoded, _ in steps)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_total_blocks


def test_the_cache_space_is_counted_and_the_oldest_output_goes():
    sched = FCFSScheduler(make_config(max_num_batched_tokens=128), num_blocks=64)
    gate = EncoderBudget(compute_budget=1000, cache_size=IMAGE)  # room for one output
    steps = run(sched, gate, [image_request("a", b"a"), image_request("b", b"b")])
    assert steps[0] == ({"a": (0, 30), "b": (0, 4)}, [b"a"], [])
    assert steps[1][0]["b"] == (4, 26) and steps[1][1:] == ([b"b"], [b"a"])
    assert list(gate.cached) == [b"b".ljust(32, b"\0")] and gate.used == IMAGE


def test_an_image_larger_than_the_budget_still_runs_alone():
    sched = FCFSScheduler(make_config(max_num_batched_tokens=128), num_blocks=64)
    gate = EncoderBudget(compute_budget=4, cache_size=1000)
    steps = run(sched, gate, [image_request("a", b"a"), image_request("b", b"b")])
    assert [s[1] for s in steps[:2]] == [[b"a"], [b"b"]]
    assert steps[0][0]["b"] == (0, 4)


def test_a_chunk_that_splits_an_image_encodes_it_once():
    """Chunks of 12 tokens: the image (positions 4..19) spans two steps, encoded in the
    first, read from the cache in the second (it is pinned there: c's image cannot push it
    out)."""
    sched = FCFSScheduler(make_config(max_num_batched_tokens=12), num_blocks=64)
    gate = EncoderBudget(compute_budget=IMAGE, cache_size=IMAGE)
    steps = run(sched, gate, [image_request("a", b"a"), image_request("c", b"c")])
    assert steps[0] == ({"a": (0, 12)}, [b"a"], [])
    assert steps[1][0]["a"] == (12, 12) and steps[1][1] == []
    assert "c" not in steps[1][0] or steps[1][0]["c"][0] + steps[1][0]["c"][1] <= 4
    assert [e for s in steps for e in s[1]] == [b"a", b"c"]


def test_the_scheduler_that_asks_gives_the_freed_tokens_on():
    """FCFSScheduler asks while it builds the step (``set_encoder_budget``): b's chunk ends
    before its image and the tokens it leaves admit t, a text request, in the same step;
    cut only afterwards (any other scheduler), they are lost to that step."""
    def first_step(hand_over: bool) -> dict:
        sched = FCFSScheduler(make_config(max_num_batched_tokens=40), num_blocks=64)
        gate = EncoderBudget(compute_budget=IMAGE, cache_size=1000)
        if hand_over:
            sched.set_encoder_budget(gate)
        requests = [image_request("a", b"a"), image_request("b", b"b"),
                    make_request("t", 20, max_tokens=2)]
        return run(sched, gate, requests)[0][0]

    assert first_step(True) == {"a": (0, 30), "b": (0, 4), "t": (0, 6)}
    assert first_step(False) == {"a": (0, 30), "b": (0, 4)}
