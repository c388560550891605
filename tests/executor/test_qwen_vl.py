"""Qwen2.5-VL, Qwen2-VL and Qwen3-VL against transformers: the image processing (dynamic
resolution, 3D patches), the tower (2D rotary, Qwen2.5-VL's windows and full-attention
layers, Qwen3-VL's resampled learned positions and deepstack mergers, the merger), the
prompt's M-RoPE positions (Qwen3-VL's interleaved), greedy tokens through the engine with
one and two images of different sizes and without images, chunked prefill through an
image, a prefix hit on a follow-up turn and preemption; and each family from a GGUF decoder
with an mmproj file."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from asyncengine.core.multimodal import ImagePrompt
from tests.vision_qwen_utils import (
    _ARCH,
    QWEN_IMAGE,
    make_tiny_qwen_vl,
    qwen_image_processor,
    qwen_inputs,
    qwen_reference,
)
from tests.vision_tiling_utils import greedy, greedy_in_turn
from tests.vision_utils import (
    _reference_model,
    greedy_at_once,
    image,
    image_item,
    vision_engine,
)

PROMPT = f"User:{QWEN_IMAGE}What is shown here?\nAssistant:"
TWO = f"User:{QWEN_IMAGE} and {QWEN_IMAGE}Compare them.\nAssistant:"
N = 8
#: (width, height): resized to the nearest multiples of 28 px, up to the minimum area (20 x
#: 20), down to the maximum (300 x 200), or kept (84 x 112)
SIZES = ((97, 61), (84, 112), (20, 20), (300, 200), (40, 130), (130, 120))
ARCH = {f: f"{name}ForConditionalGeneration" for f, name in _ARCH.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-qwen-vl")
    return {f: make_tiny_qwen_vl(root / f, f) for f in ARCH}


@pytest.fixture(scope="module")
def engines(tiny) -> dict[str, object]:
    """An engine per family; Qwen3-VL's computes prompts in chunks of 8 tokens (its images'
    deepstack features, too, are sliced across chunks)."""
    return {f: vision_engine(d, **({"max_num_batched_tokens": 8} if f == "qwen3_vl" else {}))
            for f, d in tiny.items()}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_image_processing_matches_transformers(engines, family):
    """Pixels, grids and token counts (with and without the pixels) as transformers'
    Qwen2VLImageProcessor gives them (Qwen3-VL: 16 px patches, its mean and std)."""
    encoder = engines[family].runner.model.vision
    ref = qwen_image_processor(family)
    for w, h in SIZES:
        img = image(w, h, seed=w)
        want = ref(images=[img], return_tensors="np")
        (run,) = encoder.process(img)
        assert run.data.grid == tuple(want["image_grid_thw"][0])
        np.testing.assert_allclose(run.data.patches, want["pixel_values"], atol=1e-6)
        assert run.length == want["image_grid_thw"][0].prod() // 4
        assert encoder.layout(w, h)[0].length == run.length


@pytest.mark.parametrize("family", list(ARCH))
def test_encoder_and_positions_match_transformers(tiny, engines, family):
    """The tower and merger over two images at once (Qwen2.5-VL: two windows a side in the
    first layer, the whole image in the second; Qwen3-VL: its deepstack features too), and
    the prompt's M-RoPE positions and delta as ``get_rope_index`` gives them."""
    from asyncengine.engine.multimodal import locate

    encoder = engines[family].runner.model.vision
    imgs = [image(97, 61, seed=1), image(130, 120, seed=2)]
    px = qwen_image_processor(family)(images=imgs, return_tensors="pt")
    ref = _reference_model(tiny[family], ARCH[family])
    with torch.no_grad():
        features = ref.model.get_image_features(px["pixel_values"], px["image_grid_thw"])
        want = torch.cat([torch.cat(features.pooler_output),
                          *(torch.cat(f) for f in getattr(features, "deepstack_features",
                                                          None) or ())], dim=-1)
        got = torch.cat(encoder.encode_many([encoder.process(im)[0].data for im in imgs],
                                            torch.device("cpu")))
    assert got.shape[1] == 64 * (1 + encoder.deepstack)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    t, _ = qwen_inputs(tiny[family], TWO, imgs, family)
    ids = t[0].tolist()
    layouts = [encoder.process(im) for im in imgs]
    spec = encoder.spec
    mm = locate(ids, [image_item(im, bytes([i])) for i, im in enumerate(imgs)], layouts, spec)
    rope = encoder.rope_positions(len(ids), mm)
    want_pos, want_delta = ref.model.get_rope_index(
        t, (t == spec.image_token_id).int(), image_grid_thw=px["image_grid_thw"])
    np.testing.assert_array_equal(rope.table, want_pos[:, 0].numpy())
    assert rope.delta == int(want_delta) != 0


@pytest.mark.parametrize("family", list(ARCH))
def test_one_and_two_images_match_transformers(tiny, engines, family):
    """Greedy tokens with one image, two of different sizes, and none (a text prompt's
    M-RoPE positions are the plain ones); the two-image prompt given as token ids too."""
    d = tiny[family]
    a, b = image(97, 61, seed=1), image(84, 112, seed=2)
    want_ids, want = qwen_reference(family, d, PROMPT, [a], N)
    want2_ids, want2 = qwen_reference(family, d, TWO, [a, b], N)
    text = PROMPT.replace(QWEN_IMAGE, "")
    text_ids, text_only = qwen_reference(family, d, text, [], N)
    engine = engines[family]
    two_ids = engine.tokenizer.encode(TWO, True)

    async def main():
        async with engine:
            return [await greedy(engine, ImagePrompt(PROMPT, [image_item(a, b"a")]), N),
                    await greedy(engine, ImagePrompt(TWO, [image_item(a, b"a"),
                                                           image_item(b, b"b")]), N),
                    await greedy(engine, text, N),
                    await greedy(engine, ImagePrompt(two_ids, [image_item(a, b"a"),
                                                               image_item(b, b"b")]), N)]

    one, two, plain, as_ids = anyio.run(main)
    assert one[:2] == (want_ids, want)
    assert two[:2] == (want2_ids, want2)
    assert plain[:2] == (text_ids, text_only)
    assert as_ids[:2] == (want2_ids, want2)
    assert want != text_only
    assert engine.num_free_blocks == engine.num_total_blocks


def test_chunked_prefill_prefix_hit_and_preemption(tiny):
    """Chunks of 8 tokens cut through a 20-token image; the follow-up turn with the same
    image hits the prefix cache past it (its M-RoPE positions recomputed for the longer
    prompt); then a KV cache too small for three image prompts at once preempts and
    recomputes them, each image encoded once."""
    d = tiny["qwen2_5_vl"]
    a = image(130, 120, seed=3)
    want_ids, want = qwen_reference("qwen2_5_vl", d, PROMPT, [a], N)
    follow = PROMPT + " A picture.\nUser: Say more.\nAssistant:"
    _, want_follow = qwen_reference("qwen2_5_vl", d, follow, [a], N)
    engine = vision_engine(d, max_num_batched_tokens=8)
    first, again = greedy_in_turn(engine, [(PROMPT, [a]), (follow, [a])], N)
    assert first[:2] == (want_ids, want)
    assert again[1] == want_follow
    image_token = engine.runner.model.vision.spec.image_token_id
    image_end = max(i for i, t in enumerate(want_ids) if t == image_token) + 1
    assert again[2] >= image_end - image_end % 8 > 0
    assert engine.runner.encoder_cache.misses == 1

    imgs = [image(140 - 10 * i, 130, seed=20 + i) for i in range(3)]  # 20-25 tokens each
    wants = [qwen_reference("qwen2_5_vl", d, PROMPT, [im], 16) for im in imgs]
    # each prompt takes 5 blocks of 8, 7 with its 16 new tokens: two prompts fit, not all
    engine = vision_engine(d, num_gpu_blocks_override=12, max_num_batched_tokens=64)
    results = greedy_at_once(engine, PROMPT, imgs, 16)
    assert [r[:2] for r in results] == [tuple(w) for w in wants]
    assert engine.scheduler.make_stats().num_preemptions > 0
    assert engine.runner.encoder_cache.misses == 3
    assert engine.num_free_blocks == engine.num_total_blocks


def test_chat_placeholder_and_bad_configs(tiny, engines):
    """A chat message's image is written as Qwen's chat template writes it, and counted
    (without its pixels) as the processor expands it; an M-RoPE split that is not the
    head's, or a window not made of merged patches, is refused."""
    import transformers

    from asyncengine.engine.multimodal import expanded_ids, image_placeholder
    from asyncengine.executor.models.family import describe
    from asyncengine.executor.models.vision.spec import describe_vision

    engine = engines["qwen2_vl"]
    assert image_placeholder(engine) == QWEN_IMAGE
    for w, h in SIZES[:3]:
        want, _ = qwen_inputs(tiny["qwen2_vl"], TWO, [image(w, h, 0), image(h, w, 0)])
        assert expanded_ids(engine, TWO, [(w, h), (h, w)], True) == want[0].tolist()
    config = transformers.AutoConfig.from_pretrained(tiny["qwen2_5_vl"])
    config.text_config.rope_parameters["mrope_section"] = [2, 3, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        describe(config)
    config.vision_config.window_size = 50
    with pytest.raises(ValueError, match="window_size"):
        describe_vision(config)
    # the processor's bounds, at its top level (the Qwen2-VL repositories') or in its size
    from asyncengine.executor.models.vision.qwen_spec import qwen_processing

    spec = engine.runner.model.vision.spec
    p = qwen_processing({"min_pixels": 100, "max_pixels": 5000}, spec.processing, spec.tower)
    assert (p.min_pixels, p.max_pixels) == (100, 5000)
    p = qwen_processing({"size": {"shortest_edge": 10, "longest_edge": 20}}, p, spec.tower)
    assert (p.min_pixels, p.max_pixels) == (10, 20)
    with pytest.raises(ValueError, match="patch_size 16"):
        qwen_processing({"patch_size": 16}, p, spec.tower)
    with pytest.raises(ValueError, match="not a range"):
        qwen_processing({"min_pixels": 30}, p, spec.tower)


def test_step_positions_from_the_tables():
    """The runner's M-RoPE positions (``step/mrope_rows.py``): a text prompt at its sequence
    positions; a prompt with an image from its table, chunk by chunk, ``[3, T]`` only while
    a chunk holds image placeholders; decode tokens at their position plus the delta."""
    from types import SimpleNamespace

    from asyncengine.executor.models.mrope_positions import rope_positions
    from asyncengine.executor.step.mrope_rows import MRopeRows

    rope = rope_positions(12, [(2, 1, 2, 3)])  # 2 text tokens, 2 x 3 image, 4 text tokens
    assert rope.table[:, :2].tolist() == [[0, 1]] * 3
    assert rope.table[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert rope.table[0, 8:].tolist() == [5, 6, 7, 8] and rope.delta == -3
    rows = MRopeRows(1)  # (grows with the batch)
    image_req = SimpleNamespace(request_id="img", rope_positions=rope)
    text_req = SimpleNamespace(request_id="txt", rope_positions=None)
    rows.join(text_req, 0)
    rows.join(image_req, 3)
    row_of = {"txt": 0, "img": 3}

    def step(chunks):  # [(row, start, n)] -> the step's positions
        r, s, n = (np.array(c, dtype=np.int64) for c in zip(*chunks, strict=True))
        firsts = np.cumsum(n) - n
        pos = np.repeat(s - firsts, n) + np.arange(int(n.sum()))
        return rows.positions(pos, np.repeat(r, n), r, s, n, firsts, row_of)

    assert step([(0, 0, 5), (3, 0, 2)]).tolist() == [0, 1, 2, 3, 4, 0, 1]
    three = step([(0, 5, 1), (3, 2, 4)])  # the image's first four placeholders
    assert three.tolist() == [[5, 2, 2, 2, 2], [5, 2, 2, 2, 3], [5, 2, 3, 4, 2]]
    assert step([(3, 6, 6)]).tolist() == [[2, 2, 5, 6, 7, 8], [3, 3, 5, 6, 7, 8],
                                          [3, 4, 5, 6, 7, 8]]
    assert not rows.pending  # its prompt is all computed: decode rows by the delta
    assert step([(0, 6, 1), (3, 12, 1)]).tolist() == [6, 9]


@pytest.mark.parametrize("family", list(ARCH))
def test_gguf_mmproj_pair_matches_transformers(tiny, family, tmp_path):
    """A ``qwen2vl`` / ``qwen3vl`` GGUF decoder (M-RoPE's sections in
    ``rope.dimension_sections``) with an mmproj file as llama.cpp's converter writes them
    (the 3D patch kernel split, Qwen2-VL's ``qkv`` too; Qwen2.5-VL's windows as
    ``n_wa_pattern``; Qwen3-VL's deepstack mergers) answers with transformers' tokens."""
    from tests.mmproj_utils import qwen_gguf_pair

    text, mmproj = qwen_gguf_pair(tiny[family], tmp_path, family)
    a, b = image(97, 61, seed=1), image(84, 112, seed=2)
    want_ids, want = qwen_reference(family, tiny[family], TWO, [a, b], N)
    engine = vision_engine(text, tokenizer=tiny[family], mmproj=mmproj)
    assert engine.runner.mrope is not None

    async def main():
        async with engine:
            return await greedy(engine, ImagePrompt(TWO, [image_item(a, b"a"),
                                                          image_item(b, b"b")]), N)

    assert anyio.run(main)[:2] == (want_ids, want)
