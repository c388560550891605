"""Start-up of a vision-language model's image side: the checkpoint's processor numbers and
the encoder's output cache (``--mm-encoder-cache``)."""

from __future__ import annotations

import logging
from typing import Any

from asyncengine.executor.models.vision.encoder_cache import EncoderCache
from asyncengine.executor.models.vision.pan_and_scan import check_family_kwargs
from asyncengine.executor.models.vision.spec import with_preprocessor_config

logger = logging.getLogger("asyncengine")


def attach_mmproj(model: Any, path: str, tokenizer: Any, dtype: Any, device: Any,
                  fetched: bool = False) -> None:
    """``--mmproj``: the image encoder of a llama.cpp projector file beside a GGUF model's
    decoder (``gguf_mmproj.py``). ``fetched``: the hub repository's own projector, fetched
    with the model (``--no-mmproj-auto`` goes without)."""
    from asyncengine.executor.models.vision.gguf_mmproj import load_mmproj

    if getattr(model, "vision", None) is not None:
        raise ValueError("--mmproj: the model has an image encoder of its own")
    if not hasattr(model, "embed") or not hasattr(model, "hidden_size"):
        raise ValueError("--mmproj: only for a generative model")
    try:
        model.vision = device.run_at_start_up(lambda: load_mmproj(
            path, model.hidden_size, tokenizer, dtype, device.torch_device))
    except (ValueError, IndexError, OSError) as e:  # (a file gguf cannot read: IndexError)
        if not fetched:
            raise
        raise ValueError(f"the model repository's vision projector {path}: {e} "
                         "(--no-mmproj-auto serves the model without it)") from None
    if fetched:
        logger.info("images: the vision projector %s, from the model's repository "
                    "(--no-mmproj-auto: without it)", path)


def setup_vision(model: Any, runner: Any, config: Any, model_dir: str | None) -> None:
    encoder = model.vision
    encoder.spec = with_preprocessor_config(encoder.spec, model_dir)
    budget = config.scheduler.max_num_batched_tokens
    if encoder.spec.bidirectional and encoder.spec.tokens_per_image > budget:
        raise ValueError(f"--max-num-batched-tokens {budget}: {encoder.spec.family}'s "
                         f"{encoder.spec.tokens_per_image} tokens per image are computed in "
                         "one step; raise it to at least that")
    p, size = encoder.spec.processing, getattr(encoder.spec.tower, "image_size", None)
    if encoder.spec.layout == "anyres" and (p.crop or p.size or (p.shortest_edge,))[0] != size:
        raise ValueError(f"{encoder.spec.family}: the image processor's patches are not the "
                         f"vision tower's {size} px")
    check_family_kwargs(encoder.spec.family, config.multimodal.mm_processor_kwargs,
                        "--mm-processor-kwargs")
    runner.encoder_cache = EncoderCache(config.multimodal.mm_encoder_cache)
    spec = encoder.spec
    per = {"idefics3": f"{spec.tokens_per_image} tokens per tile",
           "anyres": "tokens by the image's size",
           "qwen": "tokens by the image's size, M-RoPE"}.get(spec.layout,
                                                     f"{spec.tokens_per_image} tokens per image")
    logger.info("images: %s, %s (image token %d), encoder cache %d tokens", spec.family, per,
                spec.image_token_id, config.multimodal.mm_encoder_cache)
