"""Idefics3 (SmolVLM's architecture) against transformers: its image splitting (tiles, the
global image, the prompt's tile tags), the NaViT positions and the pixel-shuffle connector,
greedy tokens through the engine with one and two images of different sizes, chunked
prefill through the tiles and a prefix hit on a follow-up turn."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncengine.core.multimodal import ImagePrompt
from tests.vision_tiling_utils import (
    IDEFICS3_TILE_TOKENS,
    greedy,
    greedy_in_turn,
    idefics3_processor,
    reference,
)
from tests.vision_utils import greedy_at_once, image, image_item, vision_engine

PROMPT = "User:<image>What is shown here?<end_of_utterance>\nAssistant:"
TWO = "User:<image>and<image>Compare them.<end_of_utterance>\nAssistant:"
N = 8
SIZES = ((97, 61), (40, 130), (20, 20), (300, 200), (32, 32), (33, 90))


def _spec(directory: str):
    import transformers

    from asyncengine.executor.models.vision.spec import describe_vision, with_preprocessor_config

    return with_preprocessor_config(describe_vision(
        transformers.AutoConfig.from_pretrained(directory)), directory)


@pytest.mark.parametrize("split", [True, False])
def test_tiles_match_transformers(tiny_idefics3, split):
    import transformers

    from asyncengine.executor.models.vision.tiling import idefics3_grid, idefics3_tiles

    spec = _spec(tiny_idefics3)
    p = spec.processing
    if not split:
        from dataclasses import replace

        p = replace(p, split=False)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_idefics3)
    ref = idefics3_processor(tok, do_image_splitting=split).image_processor
    for w, h in SIZES:
        img = image(w, h, seed=w)
        want = ref(images=[img], return_tensors="np", return_row_col_info=True)
        tiles, rows, cols = idefics3_tiles(img, p)
        assert (rows, cols) == (want["rows"][0][0], want["cols"][0][0])
        assert idefics3_grid(w, h, p) == (rows, cols)
        np.testing.assert_allclose(np.stack(tiles), want["pixel_values"][0], atol=1e-6)


def test_encoder_matches_transformers(tiny_idefics3):
    """The tower (NaViT positions) and the connector on a batch of tiles."""
    import torch

    from asyncengine.executor.models.vision.tiling import idefics3_tiles
    from tests.vision_utils import _reference_model

    engine = vision_engine(tiny_idefics3)
    tiles, _, _ = idefics3_tiles(image(97, 61, seed=1), _spec(tiny_idefics3).processing)
    px = torch.from_numpy(np.stack(tiles))
    ref = _reference_model(tiny_idefics3, "Idefics3ForConditionalGeneration")
    with torch.no_grad():
        want = ref.model.get_image_features(px[None]).pooler_output[0]
        got = torch.cat(engine.runner.model.vision.encode_many(list(tiles), torch.device("cpu")))
    assert got.shape == want.shape == (len(tiles) * IDEFICS3_TILE_TOKENS, 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def engine(tiny_idefics3):
    return vision_engine(tiny_idefics3)


def test_one_and_two_images_match_transformers(tiny_idefics3, engine):
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    want_ids, want = reference("idefics3", tiny_idefics3, PROMPT, [a], N)
    want2_ids, want2 = reference("idefics3", tiny_idefics3, TWO, [a, b], N)
    _, text_only = reference("idefics3", tiny_idefics3, PROMPT.replace("<image>", ""), [], N)
    one, two = greedy_in_turn(engine, [(PROMPT, [a]), (TWO, [a, b])], N)
    assert one[0] == want_ids and one[1] == want
    assert two[0] == want2_ids and two[1] == want2
    assert want != text_only
    assert engine.num_free_blocks == engine.num_total_blocks


def test_token_count_without_pixels(tiny_idefics3, engine):
    """What /tokenize counts (the layout of an image's size, no pixels) is what a request
    expands to."""
    from asyncengine.engine.multimodal import expanded_ids

    for w, h in SIZES:
        want_ids, _ = reference("idefics3", tiny_idefics3, PROMPT, [image(w, h, seed=3)], 1)
        assert expanded_ids(engine, PROMPT, [(w, h)], True) == want_ids


def test_chunked_prefill_and_prefix_hit(tiny_idefics3):
    """Chunks of 8 tokens cut through the tiles' runs; the follow-up turn with the same image
    hits the prefix cache past the image, each tile encoded once."""
    a = image(97, 61, seed=1)
    want_ids, want = reference("idefics3", tiny_idefics3, PROMPT, [a], N)
    follow = PROMPT + " A picture.<end_of_utterance>\nUser:Say more.<end_of_utterance>\n" \
        "Assistant:"
    _, want_follow = reference("idefics3", tiny_idefics3, follow, [a], N)
    engine = vision_engine(tiny_idefics3, max_num_batched_tokens=8)
    first, again = greedy_in_turn(engine, [(PROMPT, [a]), (follow, [a])], N)
    assert first[0] == want_ids and first[1] == want
    assert again[1] == want_follow
    image_token = engine.runner.model.vision.spec.image_token_id
    image_end = max(i for i, t in enumerate(want_ids) if t == image_token) + 1
    assert again[2] >= image_end - image_end % 8
    runs = want_ids.count(image_token) // IDEFICS3_TILE_TOKENS
    assert runs == 7  # 2 x 3 tiles and the global image
    assert engine.runner.encoder_cache.misses == runs
    assert engine.num_free_blocks == engine.num_total_blocks


def test_smolvlm_matches_transformers(tiny_smolvlm):
    """SmolVLM is Idefics3's architecture under its own names: two images, greedy tokens."""
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    want_ids, want = reference("smolvlm", tiny_smolvlm, TWO, [a, b], N)
    engine = vision_engine(tiny_smolvlm)

    async def main():
        async with engine:
            return await greedy(engine, ImagePrompt(TWO, [image_item(a, b"a"),
                                                          image_item(b, b"b")]), N)

    ids, new, _ = anyio.run(main)
    assert ids == want_ids and new == want


def test_preemption_recomputes_through_tiles(tiny_idefics3):
    """A KV cache too small for three image prompts at once: requests are preempted and
    recomputed, each tile's embeddings from the encoder cache (each tile encoded once)."""
    imgs = [image(90 + 30 * i, 59 + 9 * i, seed=20 + i) for i in range(3)]  # 57 tokens each
    wants = [reference("idefics3", tiny_idefics3, PROMPT, [im], 16) for im in imgs]
    # two prompts fit (8 blocks each), not their 16 new tokens (10 blocks each)
    engine = vision_engine(tiny_idefics3, num_gpu_blocks_override=17, max_num_batched_tokens=64)
    results = greedy_at_once(engine, PROMPT, imgs, 16)
    assert [r[:2] for r in results] == [tuple(w) for w in wants]
    assert engine.scheduler.make_stats().num_preemptions > 0
    image_token = engine.runner.model.vision.spec.image_token_id
    tiles = sum(ids.count(image_token) for ids, _ in wants) // IDEFICS3_TILE_TOKENS
    assert engine.runner.encoder_cache.misses == tiles
    assert engine.num_free_blocks == engine.num_total_blocks
