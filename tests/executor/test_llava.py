"""LLaVA-1.5 against transformers: its image processing, its encoder, and greedy tokens
through the engine with one and two images, chunked prefill through an image, a prefix hit
on a follow-up turn with the same image, and preemption."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncengine.core.multimodal import ImagePrompt
from asyncengine.core.sched.interface import SchedulerOutput
from asyncengine.engine.engine import AsyncEngine
from tests.vision_utils import (
    LLAVA_IMAGE_TOKENS,
    greedy,
    greedy_at_once,
    image,
    image_item,
    llava_processor,
    llava_reference,
    vision_engine,
)

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nCompare them. ASSISTANT:"
N = 8


item = image_item
make_engine = vision_engine


def test_image_processing_matches_transformers(tiny_llava):
    import transformers

    from asyncengine.executor.models.vision.processor import process_image
    from asyncengine.executor.models.vision.spec import describe_vision, with_preprocessor_config

    spec = with_preprocessor_config(describe_vision(
        transformers.AutoConfig.from_pretrained(tiny_llava)), tiny_llava)
    ref = llava_processor(transformers.AutoTokenizer.from_pretrained(tiny_llava)).image_processor
    for w, h in ((97, 61), (40, 130), (56, 56), (300, 200)):
        img = image(w, h, seed=w)
        want = ref(images=img, return_tensors="np")["pixel_values"][0]
        got = process_image(img, spec.processing)
        assert got.shape == want.shape == (3, 56, 56)
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.fixture(scope="module")
def llava_engine(tiny_llava) -> AsyncEngine:
    return make_engine(tiny_llava)


def test_one_and_two_images_match_transformers(tiny_llava, llava_engine):
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    want_ids, want = llava_reference(tiny_llava, PROMPT, [a], N)
    want2_ids, want2 = llava_reference(tiny_llava, TWO, [a, b], N)
    _, text_only = llava_reference(tiny_llava, "USER: What is shown here? ASSISTANT:", [], N)

    async def main():
        async with llava_engine:
            one = await greedy(llava_engine, ImagePrompt(PROMPT, [item(a, b"a")]))
            two = await greedy(llava_engine, ImagePrompt(TWO, [item(a, b"a"), item(b, b"b")]))
        return one, two

    one, two = anyio.run(main)
    assert one[0] == want_ids and one[1] == want
    assert two[0] == want2_ids and two[1] == want2
    assert want != text_only or want2 != text_only  # the images matter
    assert llava_engine.num_free_blocks == llava_engine.num_total_blocks


def test_chunked_prefill_and_prefix_hits(tiny_llava):
    """Chunks of 8 tokens split the 16 image tokens; the follow-up turn with the same image
    hits the prefix cache through the image; a different image at the same place does not:
    the tokens stay transformers'."""
    a, b = image(97, 61, seed=1), image(80, 50, seed=3)
    _, want = llava_reference(tiny_llava, PROMPT, [a], N)
    follow = PROMPT + " something ASSISTANT: USER: say more ASSISTANT:"
    _, want_follow = llava_reference(tiny_llava, follow, [a], N)
    _, want_b = llava_reference(tiny_llava, PROMPT, [b], N)
    engine = make_engine(tiny_llava, max_num_batched_tokens=8)
    steps = []  # (the step's phase, whether it carries image slices)
    prepare = engine.runner.prepare

    def spy(out, **kw):
        inputs = prepare(out, **kw)
        steps.append((inputs.phase, inputs.mm is not None))
        return inputs

    engine.runner.prepare = spy

    async def main():
        async with engine:
            first = await greedy(engine, ImagePrompt(PROMPT, [item(a, b"a")]))
            again = await greedy(engine, ImagePrompt(follow, [item(a, b"a")]))
            other = await greedy(engine, ImagePrompt(PROMPT, [item(b, b"b")]))
        return first, again, other

    first, again, other = anyio.run(main)
    assert first[1] == want
    assert again[1] == want_follow
    image_end = image_end_of(first[0])
    assert again[2] >= image_end  # the cached prefix covers the image
    assert other[1] == want_b
    assert other[2] < image_end  # another image at the same place is not a hit
    cache = engine.runner.encoder_cache
    assert len(cache) == 2 and cache.misses == 2  # each image encoded once
    # the first prompt's 16 placeholders took 2 or 3 chunks of 8; decode steps carry nothing
    assert sum(mm for _, mm in steps) >= 3 + 1
    assert not any(mm for phase, mm in steps if phase == "decode")
    assert not engine.runner._mm_pending
    assert engine.num_free_blocks == engine.num_total_blocks


def image_end_of(ids: list[int]) -> int:
    """Where the image's placeholders end in an expanded prompt."""
    image_token = max(ids)
    last = max(i for i, t in enumerate(ids) if t == image_token)
    assert ids.count(image_token) == LLAVA_IMAGE_TOKENS
    return last + 1


def test_preemption_recomputes_through_images(tiny_llava):
    """A KV cache too small for four image prompts at once: requests are preempted and
    recomputed, their images' embeddings from the encoder cache."""
    imgs = [image(60 + 7 * i, 50 + 3 * i, seed=10 + i) for i in range(4)]
    wants = [llava_reference(tiny_llava, PROMPT, [im], 24)[1] for im in imgs]
    engine = make_engine(tiny_llava, num_gpu_blocks_override=12, max_num_batched_tokens=64)
    results = greedy_at_once(engine, PROMPT, imgs, 24)
    assert [r[1] for r in results] == wants
    assert engine.scheduler.make_stats().num_preemptions > 0
    assert engine.runner.encoder_cache.misses == 4  # recomputed from the cached outputs
    assert engine.num_free_blocks == engine.num_total_blocks


def test_encoder_budget_spreads_images_over_steps(tiny_llava):
    """Three requests with distinct images join in one step, but the encoder may take one
    image (16 tokens) per step: their chunks stop before their images, which are encoded
    one per step; the tokens stay transformers'. The same images in new prompts are cached:
    they cost no budget and run in one step."""
    imgs = [image(60 + 9 * i, 50 + 4 * i, seed=30 + i) for i in range(3)]
    again = "USER: Look. <image>\nWhat is it? ASSISTANT:"
    wants = [llava_reference(tiny_llava, p, [im], N)[1] for p in (PROMPT, again)
             for im in imgs]
    engine = make_engine(tiny_llava, max_num_encoder_input_tokens=LLAVA_IMAGE_TOKENS)
    encoded, steps = [], []  # images per encoder call; image slices per step
    vision, prepare = engine.runner.model.vision, engine.runner.prepare
    encode_many = vision.encode_many

    def count(data, device):
        encoded.append(len(data))
        return encode_many(data, device)

    def spy(out, **kw):
        inputs = prepare(out, **kw)
        steps.append(len(inputs.mm or ()))
        return inputs

    vision.encode_many, engine.runner.prepare = count, spy
    schedule, sched = engine.scheduler.schedule, engine.scheduler

    hold = [True]

    def together():  # no step until a round's three are queued: they join in one step
        if hold[0] and sched.get_num_unfinished_requests() < 3:
            return SchedulerOutput()
        hold[0] = False
        return schedule()

    sched.schedule = together

    async def main():
        results = {}

        async def one(i, prompt):
            im = imgs[i % 3]
            results[i] = (await greedy(engine, ImagePrompt(prompt, [item(im, bytes([i % 3]))])))[1]

        async with engine:
            for k, prompt in enumerate((PROMPT, again)):
                hold[0] = True
                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(one, 3 * k + i, prompt)
                if k == 0:
                    first = (list(encoded), list(steps))
        return [results[i] for i in range(6)], first

    results, (first_encoded, first_steps) = anyio.run(main)
    assert results == wants
    assert first_encoded == [1, 1, 1]  # one image per step, each once
    assert first_steps[:3] == [1, 1, 1] and engine.loop.encoder_budget.num_deferred == 3
    assert encoded == first_encoded  # the second round's images were all cached
    assert steps[len(first_steps)] == 3  # ... and all three ran in its first step
    assert engine.num_free_blocks == engine.num_total_blocks


def test_processor_options_of_another_family_are_refused(tiny_llava):
    with pytest.raises(ValueError, match="--mm-processor-kwargs: do_pan_and_scan: not an "
                                         "option of llava's image processor"):
        make_engine(tiny_llava, mm_processor_kwargs={"do_pan_and_scan": True})
