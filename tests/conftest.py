"""Shared fixtures: tiny random models and the embedded model, made once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random llama / qwen2 / qwen3 checkpoints saved as safetensors, by family."""
    from tests.utils import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model(root / f, f) for f in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]
