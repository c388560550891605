"""Tiny random vision-language models made at test time, and their transformers references."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The tiny LLaVA: CLIP 56 px in 14 px patches (16 image tokens), a 2-layer Llama.
LLAVA_IMAGE_SIZE, LLAVA_PATCH = 56, 14
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2


def image(width: int, height: int, seed: int) -> Any:
    """A random RGB PIL image (noise: every pixel matters)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")



def image_item(img: Any, key: bytes) -> Any:
    """An engine-side image: ``img`` with a 32-byte content key made of ``key``."""
    from asyncengine.core.multimodal import ImageItem

    return ImageItem(img, key.ljust(32, b"\0"))


async def greedy(engine: Any, prompt: Any, n: int = 8) -> tuple[list[int], list[int], int]:
    """(prompt ids as the engine expanded them, ``n`` greedy new tokens, cached prompt
    tokens)."""
    from asyncengine.core.sampling_params import SamplingParams

    final = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True)):
        final = out
    return final.prompt_token_ids, final.outputs[0].token_ids, final.num_cached_tokens or 0


def greedy_at_once(engine: Any, prompt: str, images: list[Any], n: int
                   ) -> list[tuple[list[int], list[int], int]]:
    """``prompt`` with each of ``images`` (its content key its index + 1), all at once on
    ``engine``: what :func:`greedy` gives for each, in order."""
    import anyio

    from asyncengine.core.multimodal import ImagePrompt

    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await greedy(engine, ImagePrompt(prompt, [
            image_item(images[i], bytes([i + 1]))]), n)

    async def main() -> None:
        async with engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(images)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return [results[i] for i in range(len(images))]


def vision_engine(model: str, **kw: Any) -> Any:
    """A small float32 engine for the vision tests (8 sequences, 64 blocks of 8 tokens)."""
    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine

    return AsyncEngine(EngineConfig.from_dict({
        "model": model, "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 256,
        "block_size": 8, "num_gpu_blocks_override": 64, "max_model_len": 256, **kw}))

def make_tiny_llava(directory: str | os.PathLike[str]) -> str:
    """Save a tiny random ``LlavaForConditionalGeneration`` (float32, seed 0) with the
    embedded tokenizer plus an ``<image>`` token, and its processor. Returns the directory."""
    import torch
    import transformers

    from tests.utils import embedded_tokenizer_dir

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tok.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=image_token + 64, max_position_embeddings=512,
        tie_word_embeddings=False)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=image_token,
                                      image_seq_length=LLAVA_IMAGE_TOKENS)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).float()
    with torch.no_grad():  # image embeddings of the text's scale, so that they matter
        model.model.multi_modal_projector.linear_2.weight.mul_(20.0)
    model.save_pretrained(str(directory))
    llava_processor(tok).save_pretrained(str(directory))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (directory / f).is_file() is False and (embedded_tokenizer_dir() / f).is_file():
            shutil.copy(embedded_tokenizer_dir() / f, directory / f)
    return str(directory)


def llava_server(tiny_llava: str) -> Any:
    """The tiny LLaVA served (shared by the HTTP test files): API key ``KEY``, model name
    ``llava``, 2 images per prompt at most, a 1 Mpixel limit, file URLs under
    ``<model dir>/media`` (which holds ``ok.png``), http(s) from 127.0.0.1 only, fetches of
    1 s at most."""
    from tests.server_utils import KEY, shared_server

    media = Path(tiny_llava) / "media"
    if not (media / "ok.png").is_file():
        media.mkdir(exist_ok=True)
        image(70, 40, seed=5).save(media / "ok.png", format="PNG")
    return shared_server(tiny_llava, "--num-gpu-blocks-override", "128", "--max-model-len",
                         "256", "--limit-mm-per-prompt", '{"image": 2}',
                         "--allowed-local-media-path", str(media),
                         "--max-image-pixels", "1000000", "--served-model-name", "llava",
                         "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "1",
                         api_key=KEY)


def llava_processor(tokenizer: Any) -> Any:
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIZE},
                                   crop_size={"height": LLAVA_IMAGE_SIZE,
                                              "width": LLAVA_IMAGE_SIZE})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                                       patch_size=LLAVA_PATCH,
                                       vision_feature_select_strategy="default",
                                       num_additional_image_tokens=1,
                                       chat_template=tokenizer.chat_template)


@functools.lru_cache(maxsize=4)
def _reference_model(directory: str, cls_name: str) -> Any:
    """transformers' model of ``directory``, float32, loaded once per test session."""
    import torch
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def llava_reference(directory: str, prompt: str, images: list[Any], max_new_tokens: int
                    ) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy new tokens)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    processor = llava_processor(tok)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    model = _reference_model(directory, "LlavaForConditionalGeneration")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


#: The tiny Gemma 3: SigLIP 32 px in 8 px patches, pooled to 4 image tokens; a 3-layer Gemma 3
#: text model with a window of 8 on its sliding layers.
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_IMAGE_TOKENS = 32, 8, 4
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def make_tiny_gemma3(directory: str | os.PathLike[str]) -> str:
    """Save a tiny random ``Gemma3ForConditionalGeneration`` (float32, seed 0) with the
    embedded tokenizer plus Gemma 3's three image tokens. Returns the directory."""
    import torch
    import transformers

    from tests.utils import FAMILIES, TINY, embedded_tokenizer_dir

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS)})
    boi, eoi, soft = (tok.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS)
    text = transformers.Gemma3TextConfig(**{**TINY, **FAMILIES["gemma3"][1],
                                            "vocab_size": soft + 64, "sliding_window": 8})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                                       boi_token_index=boi, eoi_token_index=eoi,
                                       image_token_index=soft)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # a projection of the text's scale (it starts at zeros)
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0, 1.0)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    gemma3_image_processor().save_pretrained(str(directory))
    return str(directory)


def gemma3_image_processor() -> Any:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE,
                                         "width": GEMMA3_IMAGE_SIZE})


def gemma3_reference(directory: str, prompt: str, images: list[Any], max_new_tokens: int,
                     with_logprobs: bool = False, add_special_tokens: bool = True
                     ) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy new tokens): the prompt's
    ``<start_of_image>`` expanded as Gemma3Processor does, then tokenized. With
    ``with_logprobs``, the new tokens' log-probabilities too (a third item)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    boi, eoi, soft = GEMMA3_TOKENS
    full = f"\n\n{boi}{soft * GEMMA3_IMAGE_TOKENS}{eoi}\n\n"
    assert prompt.count(boi) == len(images)
    ids = tok(prompt.replace(boi, full), return_tensors="pt",
              add_special_tokens=add_special_tokens)["input_ids"]
    soft_id = tok.convert_tokens_to_ids(soft)
    kwargs: dict[str, Any] = {}
    if images:
        px = gemma3_image_processor()(images=images, return_tensors="pt")["pixel_values"]
        kwargs = {"pixel_values": px, "token_type_ids": (ids == soft_id).long()}
    model = _reference_model(directory, "Gemma3ForConditionalGeneration")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    new = out.sequences[0, ids.shape[1]:].tolist()
    if not with_logprobs:
        return ids[0].tolist(), new
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, new, strict=True)]
    return ids[0].tolist(), new, logprobs  # type: ignore[return-value]


@contextlib.contextmanager
def serve_media(body: bytes) -> Iterator[tuple[str, str]]:
    """A local aiohttp server on its own thread: ``/img`` answers ``body`` (a PNG),
    ``/slow`` after 1.5 s, ``/delayed`` after 0.4 s, ``/big`` streams 4 MiB of zeros,
    ``/redirect?to=URL`` redirects. Yields its base URL by address and by name."""
    import asyncio

    import anyio
    from aiohttp import web

    async def img(request):
        return web.Response(body=body, content_type="image/png")

    async def slow(request):
        await anyio.sleep(1.5)
        return await img(request)

    async def delayed(request):
        await anyio.sleep(0.4)
        return await img(request)

    async def big(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"\0" * 65536)
        return resp

    async def redirect(request):
        raise web.HTTPFound(request.query["to"])

    app = web.Application()
    app.add_routes([web.get("/img", img), web.get("/slow", slow), web.get("/big", big),
                    web.get("/delayed", delayed), web.get("/redirect", redirect)])
    started = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["loop"] = loop
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}", f"http://localhost:{box['port']}"
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)


def gemma3_processor(directory: str) -> Any:
    """transformers' ``Gemma3Processor`` of the tiny Gemma 3 (its tokenizer told Gemma's
    image tokens, which the embedded tokenizer does not name)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(directory)
    boi, eoi, soft = GEMMA3_TOKENS
    tok.boi_token, tok.eoi_token, tok.image_token = boi, eoi, soft
    tok.boi_token_id, tok.eoi_token_id, tok.image_token_id = (
        tok.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS)
    return transformers.Gemma3Processor(image_processor=gemma3_image_processor(),
                                        tokenizer=tok, image_seq_length=GEMMA3_IMAGE_TOKENS)


def gemma3_processor_reference(directory: str, prompt: str, images: list[Any],
                               max_new_tokens: int, **processor_kwargs: Any
                               ) -> tuple[list[int], list[int], int]:
    """(prompt ids, greedy new tokens, pixel batches) with the prompt and images through
    ``Gemma3Processor`` (e.g. ``do_pan_and_scan=True``)."""
    import torch

    inputs = gemma3_processor(directory)(text=prompt, images=images, return_tensors="pt",
                                         add_special_tokens=False, **processor_kwargs)
    model = _reference_model(directory, "Gemma3ForConditionalGeneration")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist(), inputs["pixel_values"].shape[0]
