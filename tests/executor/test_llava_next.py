"""LLaVA-NeXT against transformers: anyres processing (the best resolution, the padded grid,
the base patch), the token count of each image size (unpadding, a newline per row), the
packed encoder output, greedy tokens through the engine with one and two images of different
sizes, chunked prefill through an image and a prefix hit on a follow-up turn."""

from __future__ import annotations

import numpy as np
import pytest

from tests.vision_tiling_utils import (
    NEXT_PATCH,
    NEXT_PINPOINTS,
    NEXT_SIZE,
    greedy_in_turn,
    llava_next_processor,
    reference,
)
from tests.vision_utils import image, vision_engine

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nCompare them. ASSISTANT:"
N = 8
SIZES = ((97, 61), (40, 130), (20, 20), (300, 200), (64, 64), (33, 90), (200, 30))


def _spec(directory: str):
    import transformers

    from asyncengine.executor.models.vision.spec import describe_vision, with_preprocessor_config

    return with_preprocessor_config(describe_vision(
        transformers.AutoConfig.from_pretrained(directory)), directory)


def test_best_resolution_matches_transformers():
    from transformers.image_processing_utils import select_best_resolution

    from asyncengine.executor.models.vision.tiling import best_resolution

    pins = tuple(tuple(p) for p in NEXT_PINPOINTS)
    for h in range(1, 200, 7):
        for w in range(1, 200, 11):
            assert best_resolution(h, w, pins) == select_best_resolution((h, w), NEXT_PINPOINTS)


def test_processing_and_counts_match_transformers(tiny_llava_next):
    import transformers

    from asyncengine.executor.models.vision.tiling import anyres_pixels, anyres_tokens

    p = _spec(tiny_llava_next).processing
    processor = llava_next_processor(transformers.AutoTokenizer.from_pretrained(tiny_llava_next))
    image_id = processor.image_token_id
    for w, h in SIZES:
        img = image(w, h, seed=w)
        want = processor(text=PROMPT, images=[img], return_tensors="np")
        got = anyres_pixels(img, p)
        np.testing.assert_allclose(got.patches, want["pixel_values"][0], atol=1e-6)
        assert got.size == tuple(want["image_sizes"][0]) == (h, w)
        count = int((want["input_ids"][0] == image_id).sum())
        assert anyres_tokens(h, w, p, NEXT_SIZE // NEXT_PATCH) == count


@pytest.fixture(scope="module")
def engine(tiny_llava_next):
    return vision_engine(tiny_llava_next)


def test_packed_features_match_transformers(tiny_llava_next, engine):
    import torch

    from asyncengine.executor.models.vision.tiling import anyres_pixels
    from tests.vision_utils import _reference_model

    p = _spec(tiny_llava_next).processing
    imgs = [image(97, 61, seed=1), image(40, 130, seed=2)]
    items = [anyres_pixels(im, p) for im in imgs]
    ref = _reference_model(tiny_llava_next, "LlavaNextForConditionalGeneration")
    with torch.no_grad():
        want = ref.model.get_image_features(
            torch.from_numpy(np.concatenate([it.patches for it in items])),
            torch.tensor([it.size for it in items])).pooler_output
        got = engine.runner.model.vision.encode_many(items, torch.device("cpu"))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_one_and_two_images_match_transformers(tiny_llava_next, engine):
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    want_ids, want = reference("llava_next", tiny_llava_next, PROMPT, [a], N)
    want2_ids, want2 = reference("llava_next", tiny_llava_next, TWO, [a, b], N)
    _, text_only = reference("llava_next", tiny_llava_next,
                             "USER: What is shown here? ASSISTANT:", [], N)
    one, two = greedy_in_turn(engine, [(PROMPT, [a]), (TWO, [a, b])], N)
    assert one[0] == want_ids and one[1] == want
    assert two[0] == want2_ids and two[1] == want2
    assert want != text_only
    assert engine.num_free_blocks == engine.num_total_blocks


def test_chunked_prefill_and_prefix_hit(tiny_llava_next):
    """Chunks of 16 tokens split the image's run; the follow-up turn with the same image hits
    the prefix cache past the image; the image is encoded once."""
    a = image(130, 45, seed=4)
    want_ids, want = reference("llava_next", tiny_llava_next, PROMPT, [a], N)
    follow = PROMPT + " something USER: say more ASSISTANT:"
    _, want_follow = reference("llava_next", tiny_llava_next, follow, [a], N)
    engine = vision_engine(tiny_llava_next, max_num_batched_tokens=16)
    first, again = greedy_in_turn(engine, [(PROMPT, [a]), (follow, [a])], N)
    assert first[0] == want_ids and first[1] == want
    assert again[1] == want_follow
    image_token = engine.runner.model.vision.spec.image_token_id
    image_end = max(i for i, t in enumerate(want_ids) if t == image_token) + 1
    assert want_ids.count(image_token) > 16
    assert again[2] >= image_end - image_end % 8
    assert engine.runner.encoder_cache.misses == 1
    assert engine.num_free_blocks == engine.num_total_blocks
