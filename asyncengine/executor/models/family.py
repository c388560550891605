"""Model families as data: what one decoder (``decoder.py``) needs to know about each.

Every supported architecture is the same pre-norm decoder,
``h = h + attn(norm(h)); h = h + mlp(norm(h))``, with a few switches. A family is a function
that reads a transformers config and returns a :class:`ModelSpec` with those switches
resolved to values: which norm, which activation, biases, per-head q/k norms, Gemma's extra
norms around attention and the MLP, embedding scale, soft-caps, partial rotary, and per layer
its attention window and its RoPE table. Adding a family is one describer below (usually a
few lines over :func:`_base`) and its architecture names in ``registry.py``.

The fast paths that know only the plain Llama layout (``--compile``, tensor parallelism, the
sliced greedy head) read :meth:`ModelSpec.lacks`: a family that needs what they do not do
runs the general path instead, and loading it says so in one log line
(``--tensor-parallel-size`` on such a family is refused, naming the flag). The C++ decode
stack reads the whole description (``paths/stack_model.py``) and takes every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from asyncengine.executor.attention.base import AttentionOptions
from asyncengine.executor.models.rope import rope_parameters


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionOptions  # window, soft cap
    rope: str  # key of ``ModelSpec.ropes``


@dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts MLP (``moe.py``)."""

    num_experts: int
    top_k: int
    intermediate: int  # per expert
    renormalize: bool  # top-k weights rescaled to sum to 1 (Mixtral, Qwen3-MoE's default)
    shared_intermediate: int = 0  # Qwen2-MoE's always-on shared expert (0: none)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    hidden: int
    intermediate: int
    vocab: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first ``rotary_dim`` of each head are rotated (partial rotary)
    norm_eps: float
    layers: tuple[LayerSpec, ...]
    ropes: dict[str, dict[str, Any]]  # RoPE parameters by name (``rope.py``)
    attn_scale: float
    activation: str = "silu"  # or "gelu_tanh"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + w)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 2/3)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    final_soft_cap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    tie_word_embeddings: bool = False
    moe: MoESpec | None = None
    # Checkpoint name rewrites (prefix or infix, in order) before loading.
    renames: tuple[tuple[str, str], ...] = ()
    # RoPE tables that switch to LongRoPE's long factors past this context (Phi-3).
    long_rope_after: int | None = None
    # M-RoPE (Qwen2-VL): the rotary frequencies split into (t, h, w) sections, each turned
    # by its own position stream (``mrope.py``); None: one position per token. Interleaved
    # (Qwen3-VL): the sections' frequencies take turns (t, h, w, t, h, w, ...).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @property
    def sliding_window(self) -> int | None:
        """The widest window of any layer (None when some layer sees the whole context)."""
        windows = [layer.attention.window for layer in self.layers]
        return None if None in windows else max(windows)  # type: ignore[type-var]

    def lacks(self) -> dict[str, str]:
        """Fast paths this family cannot take (``compile``, ``tensor_parallel``,
        ``greedy_head``), each with the reason, for the chooser's one log line. Every built-in
        family takes them all (and the C++ decode stack, which reads this description); a
        family whose layout one of them does not follow says so here."""
        return {}


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _window_layers(config: Any, window: int | None) -> list[int | None]:
    """Each layer's window: from ``layer_types`` where the config has them (Qwen2's
    ``max_window_layers``, Gemma's pattern), else the config's window for every layer."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * n
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def _base(config: Any, family: str, **kw: Any) -> ModelSpec:
    head_dim = _head_dim(config)
    rope = rope_parameters(config)
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", None)
                                      or getattr(config, "partial_rotary_factor", None) or 1.0))
    windows = kw.pop("windows", None) or [None] * config.num_hidden_layers
    soft_cap = kw.pop("attn_soft_cap", None)
    rope_of = kw.pop("rope_of", None) or (lambda i: "default")
    values: dict[str, Any] = dict(
        family=family, hidden=config.hidden_size, intermediate=config.intermediate_size,
        vocab=config.vocab_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim, rotary_dim=rotary_dim, norm_eps=float(config.rms_norm_eps),
        layers=tuple(LayerSpec(AttentionOptions(w, soft_cap), rope_of(i))
                     for i, w in enumerate(windows)),
        ropes={"default": rope}, attn_scale=head_dim**-0.5,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    values.update(kw)
    return ModelSpec(**values)


def _llama(config: Any) -> ModelSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return _base(config, config.model_type, qkv_bias=bias, o_bias=bias,
                 mlp_bias=bool(getattr(config, "mlp_bias", False)),
                 windows=_window_layers(config, getattr(config, "sliding_window", None)))


def _qwen2(config: Any) -> ModelSpec:
    window = getattr(config, "sliding_window", None) \
        if getattr(config, "use_sliding_window", False) else None
    return _base(config, config.model_type, qkv_bias=config.model_type == "qwen2",
                 qk_norm=config.model_type == "qwen3", windows=_window_layers(config, window))


def _qwen2_vl(config: Any) -> ModelSpec:
    """The language model of Qwen2-VL and Qwen2.5-VL (Qwen2's) and of Qwen3-VL (Qwen3's),
    rotated by M-RoPE (Qwen3-VL's interleaved)."""
    qwen3 = config.model_type == "qwen3_vl_text"
    window = getattr(config, "sliding_window", None) \
        if getattr(config, "use_sliding_window", False) else None
    bias = bool(getattr(config, "attention_bias", False))
    spec = _base(config, config.model_type.removesuffix("_text"), qkv_bias=bias or not qwen3,
                 o_bias=bias, qk_norm=qwen3, windows=_window_layers(config, window))
    section = tuple(int(s) for s in rope_parameters(config).get("mrope_section")
                    or ((24, 20, 20) if qwen3 else (16, 24, 24)))  # (transformers' defaults)
    if len(section) != 3 or sum(section) * 2 != spec.rotary_dim:
        raise ValueError(f"{config.model_type}: mrope_section {list(section)} does not split "
                         f"the head's {spec.rotary_dim // 2} rotary frequencies in three")
    return replace(spec, mrope_section=section, mrope_interleaved=qwen3)


def _phi3(config: Any) -> ModelSpec:
    rope = rope_parameters(config)
    long_after = None
    if rope["rope_type"] == "longrope":
        long_after = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
    return _base(config, "phi3", windows=_window_layers(config, getattr(
        config, "sliding_window", None)), long_rope_after=long_after)


def _gemma(config: Any) -> ModelSpec:
    gemma3 = config.model_type.startswith("gemma3")
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{config.model_type}: hidden_activation {act!r} is not supported "
                         "(only gelu_pytorch_tanh)")
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    ropes = config.rope_parameters if gemma3 else None
    spec = _base(
        config, "gemma3" if gemma3 else "gemma2", activation="gelu_tanh", norm_offset=1.0,
        qk_norm=gemma3, sandwich_norms=True, embed_scale=config.hidden_size**0.5,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_soft_cap=getattr(config, "attn_logit_softcapping", None),
        final_soft_cap=getattr(config, "final_logit_softcapping", None),
        windows=_window_layers(config, config.sliding_window),
        rope_of=(lambda i: types[i]) if ropes else None,
        renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head.")))
    if ropes:  # Gemma 3: local and global layers rotate with their own bases
        spec = replace(spec, ropes={t: dict(ropes[t]) for t in set(types)})
    return spec


def _moe(config: Any) -> ModelSpec:
    if config.model_type == "mixtral":
        moe = MoESpec(config.num_local_experts, config.num_experts_per_tok,
                      config.intermediate_size, renormalize=True)
        return _base(config, "mixtral", moe=moe, renames=((".block_sparse_moe.", ".mlp."),),
                     windows=_window_layers(config, getattr(config, "sliding_window", None)))
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    moe = MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                  renormalize=bool(getattr(config, "norm_topk_prob", True)),
                  shared_intermediate=shared)
    if getattr(config, "mlp_only_layers", None) or getattr(
            config, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"{config.model_type}: dense layers between the sparse ones "
                         "(mlp_only_layers, decoder_sparse_step) are not supported")
    window = getattr(config, "sliding_window", None) \
        if getattr(config, "use_sliding_window", False) else None
    return _base(config, config.model_type, moe=moe, qk_norm=config.model_type == "qwen3_moe",
                 qkv_bias=config.model_type == "qwen2_moe",
                 windows=_window_layers(config, window))


# model_type -> describer
FAMILIES: dict[str, Callable[[Any], ModelSpec]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _qwen2, "qwen3": _qwen2,
    "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3,
    "mixtral": _moe, "qwen3_moe": _moe, "qwen2_moe": _moe,
    "qwen2_vl_text": _qwen2_vl, "qwen2_5_vl_text": _qwen2_vl, "qwen3_vl_text": _qwen2_vl,
}


#: Multimodal checkpoints' model types, whose config nests the language model's.
MULTIMODAL = ("gemma3", "llava", "llava_next", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl",
              "qwen3_vl")
#: Those whose outer config says whether the head is tied to the embeddings.
_OUTER_TIE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def text_config(config: Any) -> Any:
    """The language model's config (multimodal checkpoints nest it)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and getattr(config, "model_type", "") in MULTIMODAL \
        else config


def describe(config: Any) -> ModelSpec:
    """The spec of a transformers config; ValueError naming the supported model types."""
    outer, config = config, text_config(config)
    fn = FAMILIES.get(getattr(config, "model_type", ""))
    if fn is None:
        raise ValueError(f"model type {getattr(config, 'model_type', None)!r} is not supported "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    spec = fn(config)
    if outer is not config and getattr(outer, "model_type", "") in _OUTER_TIE:
        # (older saves said it in the text config, which transformers 5 forwards outward)
        spec = replace(spec, tie_word_embeddings=bool(
            getattr(outer, "tie_word_embeddings", False)
            or getattr(config, "tie_word_embeddings", False)))
    return spec
