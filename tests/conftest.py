"""Shared fixtures: tiny random models and the embedded model, made once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `--dtype auto` on the CPU is bfloat16 where the CPU has bfloat16 dot products, else float32.
# The suite's references (transformers' float32 outputs, greedy texts, tolerances) hold for
# float32, so every machine runs it so (subprocesses inherit this); the bfloat16 paths have
# their own tests with an explicit --dtype.
os.environ.setdefault("ASYNCENGINE_CPU_BF16", "0")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random llama / qwen2 / qwen3 checkpoints saved as safetensors, by family."""
    from tests.utils import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model(root / f, f) for f in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_classifiers(tmp_path_factory) -> dict[str, str]:
    """Tiny random ``*ForSequenceClassification`` checkpoints: ``llama`` with two labels (no
    tied head), ``qwen3`` with one (a cross-encoder)."""
    from tests.utils import make_tiny_classifier

    root = tmp_path_factory.mktemp("tiny-classifiers")
    return {"llama": make_tiny_classifier(root / "llama", "llama", num_labels=2,
                                          id2label={0: "negative", 1: "positive"}),
            "qwen3": make_tiny_classifier(root / "qwen3", "qwen3", num_labels=1)}


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    """A tiny random LLaVA-1.5 (CLIP 56 px, 16 image tokens; a 2-layer Llama) with the
    embedded tokenizer plus ``<image>``, and its processor (``tests/vision_utils.py``)."""
    from tests.vision_utils import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    """A tiny random Gemma 3 with images (SigLIP 32 px, 4 image tokens; a 3-layer Gemma 3
    text model) with the embedded tokenizer plus its image tokens (``tests/vision_utils.py``)."""
    from tests.vision_utils import make_tiny_gemma3

    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory) -> str:
    """A tiny random Idefics3 (SigLIP 32 px tiles, 4 tokens a tile, images up to 96 px: 3 x 3
    tiles and the global one; a 2-layer Llama) with its processor
    (``tests/vision_tiling_utils.py``)."""
    from tests.vision_tiling_utils import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


@pytest.fixture(scope="session")
def tiny_smolvlm(tmp_path_factory) -> str:
    """The tiny Idefics3's twin as a ``SmolVLMForConditionalGeneration``."""
    from tests.vision_tiling_utils import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-smolvlm"), "SmolVLM")


@pytest.fixture(scope="session")
def tiny_llava_next(tmp_path_factory) -> str:
    """A tiny random LLaVA-NeXT (CLIP 32 px, anyres grids up to 64 x 64 or 3 x 1; a 2-layer
    Llama) with its processor (``tests/vision_tiling_utils.py``)."""
    from tests.vision_tiling_utils import make_tiny_llava_next

    return make_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next"))
