"""What differs between GGUF architectures as llama.cpp writes them: tensor names, the config
keys, and the tensors llama.cpp's converter changed on the way in.

- **gemma2 / gemma3**: ``ffn_norm`` is the norm *before* the MLP and ``post_attention_norm``
  / ``post_ffw_norm`` the norms after attention and the MLP; every norm weight is stored as
  ``1 + w`` (the converter added Gemma's offset), so 1 is taken off again here. The query scale
  is ``1 / sqrt(head_dim)`` except on the 27B models (``hidden / heads``), as llama.cpp does.
  Gemma 3's local layers rotate with base 10000 and every sixth layer is global.
- **phi3**: q, k, v come fused as ``attn_qkv`` and gate, up as ``ffn_up``; LongRoPE's factors
  are the tensors ``rope_factors_long`` / ``rope_factors_short`` (read into the config, not
  loaded as weights); partial rotary is ``rope.dimension_count < head_dim``.
- **Mixture of experts**: ``qwen3moe``, ``qwen2moe``, and Mixtral as ``llama`` with an
  ``expert_count``. The router is ``ffn_gate_inp``, the experts stacked ``[E, rows, cols]`` as
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, Qwen2-MoE's shared expert
  ``ffn_*_shexp`` with its gate ``ffn_gate_inp_shexp``. llama.cpp renormalizes the top-k
  weights of qwen3moe and Mixtral and not those of qwen2moe; ``expert_weights_norm`` says so
  where a file carries it.
- **qwen2vl** / **qwen3vl** (Qwen2-VL's and Qwen2.5-VL's language model, Qwen3-VL's): Qwen2's
  / Qwen3's tensors; M-RoPE's sections are ``rope.dimension_sections`` (t, h, w and a fourth,
  unused; Qwen3-VL's interleaved); the images come from an ``--mmproj`` file
  (``vision/gguf_mmproj_qwen.py``), Qwen3-VL's deepstack features beside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# GGUF block part -> our module name, where an architecture differs from Llama's table.
LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
LAYER_NAMES["gemma3"] = LAYER_NAMES["gemma2"]
LAYER_NAMES["qwen3moe"] = LAYER_NAMES["qwen2moe"] = {}
LAYER_NAMES["qwen2vl"] = LAYER_NAMES["qwen3vl"] = {}

# The MoE tensors, the same in every architecture that has them.
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
             "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj",
             "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}

# Every GGUF architecture read here or in ``gguf.py``, for the error naming them.
SUPPORTED = ("gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen2moe", "qwen2vl",
             "qwen3", "qwen3moe", "qwen3vl")

# Tensors that configure rather than weigh (read by ``config``; skipped by the loader).
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def layer_name(arch: str, part: str) -> str | None:
    return LAYER_NAMES.get(arch, {}).get(part) or MOE_NAMES.get(part)


def fix_tensor(arch: str, name: str, w: np.ndarray) -> np.ndarray:
    """Undo what llama.cpp's converter did to a tensor of ``arch`` (``name``: ours)."""
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return np.asarray(w, dtype=np.float32) - 1.0
    return w


def config(arch: str, md: dict[str, Any], base: dict[str, Any],
           read: Any) -> Any | None:
    """A transformers config for ``arch`` (None when not one of these); ``base`` holds the
    keys every architecture shares (``gguf_header.config_from_header``), ``read(name)`` a small
    tensor of the file as float32."""
    import transformers

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    kw = dict(base)
    theta = float(get("rope.freq_base", 10000.0))
    if arch in ("qwen3moe", "qwen2moe") or (arch == "llama" and get("expert_count")):
        return _moe_config(arch, get, kw, theta)
    if arch in ("gemma2", "gemma3"):
        head_dim = kw["head_dim"]
        big = kw["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        kw.update(query_pre_attn_scalar=kw["hidden_size"] // kw["num_attention_heads"]
                  if big else head_dim, sliding_window=get("attention.sliding_window"),
                  hidden_activation="gelu_pytorch_tanh")
        if arch == "gemma2":
            kw.update(attn_logit_softcapping=get("attn_logit_softcapping"),
                      final_logit_softcapping=get("final_logit_softcapping"), rope_theta=theta)
            return transformers.Gemma2Config(**kw)
        pattern = get("attention.sliding_window_pattern", 6)  # a period, or a flag per layer
        n = kw["num_hidden_layers"]
        sliding = [bool(f) for f in pattern] if isinstance(pattern, (list, np.ndarray)) else [
            (i + 1) % int(pattern) != 0 for i in range(n)]
        kw["layer_types"] = ["sliding_attention" if f else "full_attention" for f in sliding]
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        if get("rope.scaling.type") == "linear":
            full.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
        kw["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": 10000.0}}
        return transformers.Gemma3TextConfig(**kw)
    if arch in ("qwen2vl", "qwen3vl"):
        sections = [int(x) for x in get("rope.dimension_sections", ())][:3]
        if len(sections) != 3:
            raise ValueError(f"GGUF {arch}: no rope.dimension_sections (M-RoPE's sections)")
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                                 "mrope_section": sections}
        if arch == "qwen3vl":
            return transformers.Qwen3VLTextConfig(**kw)
        kw.pop("head_dim")
        return transformers.Qwen2VLTextConfig(**kw)
    if arch == "phi3":
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        rot = get("rope.dimension_count")
        if rot and rot != kw["head_dim"]:
            rope["partial_rotary_factor"] = rot / kw["head_dim"]
        if read("rope_factors_long.weight") is not None:
            rope.update(rope_type="longrope",
                        long_factor=read("rope_factors_long.weight").tolist(),
                        short_factor=read("rope_factors_short.weight").tolist(),
                        original_max_position_embeddings=get(
                            "rope.scaling.original_context_length"))
            if get("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(get("rope.scaling.attn_factor"))
        kw.update(rope_parameters=rope, sliding_window=get("attention.sliding_window"))
        kw.pop("head_dim")
        return transformers.Phi3Config(**kw)
    return None


def _moe_config(arch: str, get: Any, kw: dict[str, Any], theta: float) -> Any:
    import transformers

    kw.update(num_experts_per_tok=get("expert_used_count"),
              rope_parameters={"rope_type": "default", "rope_theta": theta})
    if arch == "llama":  # Mixtral
        kw.update(num_local_experts=get("expert_count"),
                  sliding_window=get("attention.sliding_window"))
        return transformers.MixtralConfig(**kw)
    kw.update(num_experts=get("expert_count"), moe_intermediate_size=get(
        "expert_feed_forward_length"), norm_topk_prob=bool(get(
            "expert_weights_norm", arch == "qwen3moe")))
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(**kw)
    kw.update(shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0))
    kw.pop("head_dim")
    return transformers.Qwen2MoeConfig(**kw)
