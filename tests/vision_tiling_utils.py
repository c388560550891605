"""Tiny random tiling vision-language models made at test time (Idefics3, LLaVA-NeXT), their
processors and their transformers references (``vision_utils.py`` has the fixed-size ones)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.vision_utils import _reference_model, greedy  # noqa: F401  (the tests' import)

#: The tiny Idefics3: SigLIP 32 px tiles in 8 px patches, pixel-shuffled by 2 (4 tokens a
#: tile), images resized to a longest edge of 96 px (up to 3 x 3 tiles and the global one).
IDEFICS3_TILE, IDEFICS3_PATCH, IDEFICS3_LONGEST = 32, 8, 96
IDEFICS3_TILE_TOKENS = (IDEFICS3_TILE // IDEFICS3_PATCH // 2) ** 2
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                   "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 4)
                                      for c in range(1, 4)]

#: The tiny LLaVA-NeXT: CLIP 32 px in 8 px patches (16 base tokens), a grid of up to 3 patches.
NEXT_SIZE, NEXT_PATCH = 32, 8
NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]


def _tokenizer(extra: list[str]) -> Any:
    import transformers

    from tests.utils import embedded_tokenizer_dir

    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _llama(vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
        tie_word_embeddings=False)


def make_tiny_idefics3(directory: str | os.PathLike[str], family: str = "Idefics3") -> str:
    """Save a tiny random ``Idefics3ForConditionalGeneration`` (or, with ``family``
    "SmolVLM", ``SmolVLMForConditionalGeneration``: the same architecture) (float32, seed 0),
    the embedded tokenizer plus Idefics3's image tokens, and its processor."""
    import torch
    import transformers

    directory = Path(directory)
    tok = _tokenizer(IDEFICS3_TOKENS)
    image_token = tok.convert_tokens_to_ids("<image>")
    vision = getattr(transformers, f"{family}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IDEFICS3_TILE, patch_size=IDEFICS3_PATCH)
    config = getattr(transformers, f"{family}Config")(
        vision_config=vision.to_dict(), text_config=_llama(len(tok) + 64).to_dict(),
        scale_factor=2, image_token_id=image_token, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).float()
    with torch.no_grad():  # image embeddings of the text's scale, so that they matter
        model.model.connector.modality_projection.proj.weight.mul_(20.0)
    model.save_pretrained(str(directory))
    idefics3_processor(tok).save_pretrained(str(directory))
    return str(directory)


def idefics3_processor(tok: Any, **kw: Any) -> Any:
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    images = Idefics3ImageProcessorPil(size={"longest_edge": IDEFICS3_LONGEST},
                                       max_image_size={"longest_edge": IDEFICS3_TILE}, **kw)
    return transformers.Idefics3Processor(image_processor=images, tokenizer=tok,
                                          image_seq_len=IDEFICS3_TILE_TOKENS)


def make_tiny_llava_next(directory: str | os.PathLike[str]) -> str:
    """Save a tiny random ``LlavaNextForConditionalGeneration`` (float32, seed 0), the
    embedded tokenizer plus ``<image>``, and its processor."""
    import torch
    import transformers

    directory = Path(directory)
    tok = _tokenizer(["<image>"])
    image_token = tok.convert_tokens_to_ids("<image>")
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=NEXT_SIZE, patch_size=NEXT_PATCH, projection_dim=32)
    config = transformers.LlavaNextConfig(
        vision_config=vision.to_dict(), text_config=_llama(image_token + 64).to_dict(),
        image_token_index=image_token, image_grid_pinpoints=NEXT_PINPOINTS,
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).float()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(20.0)
        model.model.image_newline.mul_(10.0)
    model.save_pretrained(str(directory))
    llava_next_processor(tok).save_pretrained(str(directory))
    return str(directory)


def llava_next_processor(tok: Any) -> Any:
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    images = LlavaNextImageProcessorPil(size={"shortest_edge": NEXT_SIZE},
                                        crop_size={"height": NEXT_SIZE, "width": NEXT_SIZE},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
    return transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok,
                                           patch_size=NEXT_PATCH,
                                           vision_feature_select_strategy="default",
                                           num_additional_image_tokens=1)


_FAMILIES = {"idefics3": ("Idefics3ForConditionalGeneration", idefics3_processor),
             "llava_next": ("LlavaNextForConditionalGeneration", llava_next_processor),
             # (SmolVLM's processor writes Idefics3's prompt and cuts the same tiles)
             "smolvlm": ("SmolVLMForConditionalGeneration", idefics3_processor)}


def reference(family: str, directory: str, prompt: str, images: list[Any],
              max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy new tokens) for ``family``."""
    import torch
    import transformers

    cls, make_processor = _FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    processor = make_processor(tok)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    model = _reference_model(directory, cls)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def greedy_in_turn(engine: Any, prompts: list[tuple[str, list[Any]]], n: int
                   ) -> list[tuple[list[int], list[int], int]]:
    """``greedy`` for each (prompt, images) in turn, on one engine (a later turn of the same
    conversation is a prefix hit past its images)."""
    import anyio

    from asyncengine.core.multimodal import ImagePrompt
    from tests.vision_utils import image_item

    async def main():
        async with engine:
            return [await greedy(engine, ImagePrompt(text, [
                image_item(img, bytes([97 + i])) for i, img in enumerate(images)]), n)
                for text, images in prompts]

    return anyio.run(main)
