"""Images on a GPU (``pytest -m gpu``; skipped without CUDA, as in CI).

The tiny LLaVA (CLIP 56 px in 14 px patches, a 2-layer Llama of head_dim 16, which FlashInfer
has no kernels for: float32 runs torch_paged on CUDA):

* float32: the engine on CUDA (the image's rows spliced in on the CUDA step path, decode
  replayed from CUDA graphs) gives transformers' greedy tokens on the same GPU, one image and
  two of different sizes;
* bfloat16: the vision tower and projector as CUDA runs them for a bfloat16 model (SDPA in
  bfloat16) agree with transformers' image features in bfloat16 on the same GPU, and with
  their own float32 result, within bfloat16's resolution.

The checks are written as functions of the device, so that they run on the CPU as well (the
CPU suite covers the same ground in float32: ``tests/executor/test_llava.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import pytest
import torch

from asyncengine.core.multimodal import ImagePrompt
from tests.vision_utils import (
    greedy,
    image,
    image_item,
    llava_processor,
    make_tiny_llava,
    vision_engine,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nCompare them. ASSISTANT:"
N = 8
#: bfloat16 keeps 8 bits of mantissa: features within a few of its steps of the reference.
BF16_REL = 3e-2


def _reference(directory: str, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(directory, dtype=dtype)
    return llava_processor(tok), model.to(device).eval()


def greedy_equals_transformers(directory: str, device: str) -> None:
    processor, model = _reference(directory, device, torch.float32)
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    wants = []
    for prompt, images in ((PROMPT, [a]), (TWO, [a, b])):
        inputs = processor(text=prompt, images=images, return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        n = inputs["input_ids"].shape[1]
        wants.append((inputs["input_ids"][0].tolist(), out[0, n:].tolist()))
    engine = vision_engine(directory, device=device)

    async def main():
        async with engine:
            one = await greedy(engine, ImagePrompt(PROMPT, [image_item(a, b"a")]), N)
            two = await greedy(engine, ImagePrompt(TWO, [image_item(a, b"a"),
                                                         image_item(b, b"b")]), N)
        return one, two

    one, two = anyio.run(main)
    assert (one[0], one[1]) == wants[0]
    assert (two[0], two[1]) == wants[1]
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.shutdown()


def bfloat16_tower_agrees(directory: str, device: str) -> None:
    processor, ref = _reference(directory, device, torch.bfloat16)
    engine = vision_engine(directory, device=device)
    ours32 = engine.runner.model.vision
    ours16 = copy.deepcopy(ours32).to(torch.bfloat16)
    img = image(97, 61, seed=1)
    (run,) = [r for r in ours32.process(img) if getattr(r, "data", None) is not None]
    with torch.no_grad():
        got16 = ours16.encode_many([run.data], torch.device(device))[0].float()
        got32 = ours32.encode_many([run.data], torch.device(device))[0].float()
        pixels = processor(text=PROMPT, images=[img], return_tensors="pt")["pixel_values"]
        want = ref.get_image_features(pixel_values=pixels.to(device, torch.bfloat16))
    want = getattr(want, "pooler_output", want)  # (transformers 5: a model output)
    if isinstance(want, (list, tuple)):  # one tensor per image
        want = torch.cat([w.reshape(-1, w.shape[-1]) for w in want])
    want = want.reshape(got16.shape).float()
    scale = got32.abs().max()
    assert (got16 - want).abs().max() / scale < BF16_REL
    assert (got16 - got32).abs().max() / scale < BF16_REL
    engine.shutdown()


def test_llava_float32_greedy_equals_transformers_on_the_gpu(tmp_path):
    greedy_equals_transformers(make_tiny_llava(tmp_path / "llava"), "cuda")


def test_llava_tower_in_bfloat16_on_the_gpu(tmp_path):
    bfloat16_tower_agrees(make_tiny_llava(tmp_path / "llava"), "cuda")
