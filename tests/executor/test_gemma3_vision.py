"""Gemma 3 with images against transformers: SigLIP and the pooling projector, its image
processing, and greedy tokens through the engine with one and two images (their tokens
attend to each other both ways), chunked prefill around an image, a prefix hit on a
follow-up turn with the same image, and preemption."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from asyncengine.core.multimodal import ImagePrompt
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import AsyncEngine
from tests.vision_utils import (
    GEMMA3_IMAGE_TOKENS,
    gemma3_image_processor,
    gemma3_reference,
    image,
    image_item,
    vision_engine,
)

PROMPT = "<bos>User: <start_of_image>What is shown here? Model:"
TWO = "<bos>User: <start_of_image> and <start_of_image>Compare them. Model:"
N = 8


item = image_item
make_engine = vision_engine


async def greedy(engine: AsyncEngine, prompt, n: int = N) -> tuple[list[int], list[int], int]:
    """(prompt ids, new tokens, cached prompt tokens, the new tokens' logprobs)."""
    final = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True, logprobs=0)):
        final = out
    c = final.outputs[0]
    logprobs = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids, strict=True)]
    return final.prompt_token_ids, c.token_ids, final.num_cached_tokens or 0, logprobs


def close(got: list[float], want: list[float]) -> None:
    """Logprobs equal to transformers' (they tell causal from bidirectional image attention
    where a tiny model's greedy tokens may not)."""
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_encoder_and_processing_match_transformers(tiny_gemma3):
    import transformers

    from asyncengine.executor.weights.loader import load_model, resolve_model

    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3, dtype=torch.float32).eval()
    ours = load_model(resolve_model(tiny_gemma3, "auto", None, None), "auto", torch.float32,
                      torch.device("cpu"))
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref.model.get_image_features(px).pooler_output
        got = ours.vision.encode(px)
    assert got.shape == want.shape == (2, GEMMA3_IMAGE_TOKENS, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    from asyncengine.executor.models.vision.processor import process_image
    from asyncengine.executor.models.vision.spec import with_preprocessor_config

    spec = with_preprocessor_config(ours.vision.spec, tiny_gemma3)
    for w, h in ((97, 61), (20, 50), (32, 32)):
        img = image(w, h, seed=w)
        want_px = gemma3_image_processor()(images=img, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(process_image(img, spec.processing), want_px, atol=1e-6)


def test_one_and_two_images_match_transformers(tiny_gemma3):
    a, b = image(97, 61, seed=1), image(20, 50, seed=2)
    want_ids, want, want_lp = gemma3_reference(tiny_gemma3, PROMPT, [a], N, True)
    want2_ids, want2, want2_lp = gemma3_reference(tiny_gemma3, TWO, [a, b], N, True)
    engine = make_engine(tiny_gemma3)

    async def main():
        async with engine:
            one = await greedy(engine, ImagePrompt(PROMPT, [item(a, b"a")],
                                                   add_special_tokens=False))
            two = await greedy(engine, ImagePrompt(TWO, [item(a, b"a"), item(b, b"b")],
                                                   add_special_tokens=False))
        return one, two

    one, two = anyio.run(main)
    assert one[0] == want_ids and one[1] == want
    assert two[0] == want2_ids and two[1] == want2
    close(one[3], want_lp)
    close(two[3], want2_lp)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_chunks_prefix_hits_and_preemption(tiny_gemma3):
    """Chunks of 9 tokens never end inside an image (its 4 tokens are computed in one step);
    the follow-up turn with the same image is a prefix hit; under a small KV cache requests
    are preempted and recomputed: the tokens stay transformers'."""
    a = image(97, 61, seed=1)
    follow = PROMPT + " something. User: say more. Model:"
    _, want, want_lp = gemma3_reference(tiny_gemma3, PROMPT, [a], N, True)
    _, want_follow, follow_lp = gemma3_reference(tiny_gemma3, follow, [a], N, True)
    imgs = [image(40 + 9 * i, 30 + 5 * i, seed=20 + i) for i in range(4)]
    wants = [gemma3_reference(tiny_gemma3, PROMPT, [im], 16)[1] for im in imgs]
    engine = make_engine(tiny_gemma3, max_num_batched_tokens=9, max_num_seqs=4,
                         num_gpu_blocks_override=14)

    async def main():
        async with engine:
            first = await greedy(engine, ImagePrompt(PROMPT, [item(a, b"a")],
                                                     add_special_tokens=False))
            again = await greedy(engine, ImagePrompt(follow, [item(a, b"a")],
                                                     add_special_tokens=False))
            results = {}

            async def one(i):
                results[i] = (await greedy(engine, ImagePrompt(
                    PROMPT, [item(imgs[i], bytes([i]))], add_special_tokens=False), 16))[1]

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
        return first, again, results

    first, again, results = anyio.run(main)
    assert first[1] == want and again[1] == want_follow
    close(first[3], want_lp)
    close(again[3], follow_lp)
    soft = max(first[0])
    assert again[2] > max(i for i, t in enumerate(first[0]) if t == soft)  # a hit past it
    assert [results[i] for i in range(4)] == wants
    assert engine.scheduler.make_stats().num_preemptions > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_budget_below_one_image_is_refused(tiny_gemma3):
    with pytest.raises(ValueError, match="--max-num-batched-tokens 3"):
        make_engine(tiny_gemma3, max_num_batched_tokens=3, max_num_seqs=2)


def test_pan_and_scan_matches_transformers(tiny_gemma3):
    """--mm-processor-kwargs '{"do_pan_and_scan": true}': a wide image is cut into crops as
    Gemma3ImageProcessor cuts them, the prompt says so as Gemma3Processor writes it, and the
    greedy tokens are transformers'; a request's own mm_processor_kwargs override the
    server's (off again, or other crop options)."""
    from asyncengine.executor.models.vision.spec import with_preprocessor_config
    from tests.vision_utils import gemma3_processor_reference

    wide, tall = image(900, 300, seed=4), image(40, 130, seed=5)
    engine = make_engine(tiny_gemma3, mm_processor_kwargs='{"do_pan_and_scan": true}')
    encoder = engine.runner.model.vision
    encoder.spec = with_preprocessor_config(encoder.spec, tiny_gemma3)
    few = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16,
           "pan_and_scan_max_num_crops": 2}
    for img, kw in ((wide, {"do_pan_and_scan": True}), (tall, few), (image(70, 61, 1), few)):
        full = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2, **kw}  # (Gemma3Processor's)
        want = gemma3_image_processor()(images=img, return_tensors="np", **full)["pixel_values"]
        runs = [p.data for p in encoder.process(img, kw) if hasattr(p, "data")]
        assert len(runs) == len(want)
        np.testing.assert_allclose(np.stack(runs), want, atol=1e-6)
    assert len(want) == 1  # (70 x 61 is not elongated enough: no crops)
    refs = [gemma3_processor_reference(tiny_gemma3, PROMPT, [wide], N, do_pan_and_scan=True),
            gemma3_processor_reference(tiny_gemma3, PROMPT, [tall], N, **few),
            gemma3_processor_reference(tiny_gemma3, PROMPT, [wide], N)]
    assert [r[2] for r in refs] == [4, 3, 1]  # the whole image and 3, 2, 0 crops

    async def main():
        async with engine:
            return [await greedy(engine, ImagePrompt(PROMPT, [item(img, key)],
                                                     add_special_tokens=False,
                                                     processor_kwargs=kw))
                    for img, key, kw in ((wide, b"w", None), (tall, b"t", few),
                                         (wide, b"w", {"do_pan_and_scan": False}))]

    got = anyio.run(main)
    for (ids, tokens, *_), (want_ids, want, _) in zip(got, refs, strict=True):
        assert ids == want_ids and tokens == want
    assert engine.num_free_blocks == engine.num_total_blocks
