"""The Llama family in one module: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

A pre-norm decoder: ``h = h + attn(norm(h)); h = h + mlp(norm(h))``. The variants differ only in
a few switches read from the transformers config:

- Qwen2: bias on q/k/v (``qkv_bias``); Llama: ``attention_bias`` (q/k/v and o) and ``mlp_bias``.
- Qwen3: an RMSNorm over each head of q and k before RoPE (``qk_norm``), explicit ``head_dim``.
- Llama 3: RoPE scaling (see ``rope.py``); SmolLM2 / Qwen small models: tied embeddings.

Tokens of many requests are flattened into one ``[T]`` batch; attention over the paged KV cache
is the backend's job (``executor/attention``). Projections are fused: ``qkv_proj`` holds
q, k, v stacked by rows and ``gate_up_proj`` holds gate, up; ``load_weights`` copies the
checkpoint's separate tensors into the right rows.

The residual stream is carried next to each layer's output (``h, residual``), so that every
residual add is fused with the RMSNorm that follows it. On the CPU in eager mode the small ops
(that norm, RoPE, SiLU * up) are one own C++ call each (``executor/kernels/layer_ops.py``);
elsewhere, and under ``torch.compile``, the PyTorch code below them runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.models.decode_stack import DecodeStack
from asyncengine.executor.models.rope import RotaryEmbedding, apply_rope
from asyncengine.executor.models.small_matmul import small_matmuls

logger = logging.getLogger(__name__)

_UNSET = object()

# checkpoint projection -> (our fused projection, shard)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _empty(*shape: int) -> nn.Parameter:
    # Weights are loaded (or filled by the dummy loader), never initialized here.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)
        self.bias = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` (the
        residual add fused; the given ``residual`` tensor may be updated in place)."""
        if x.dim() == 2 and layer_ops.usable(x):
            return layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, scale in the model dtype (as the reference implementation does).
        x32 = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, attention_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.scale = head_dim**-0.5

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(start, size) of a checkpoint shard inside ``qkv_proj``."""
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        return start, self.q_size if shard == "q" else self.kv_size

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (heads + 2 * kv_heads) * head_dim]
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:qk_size].view(T, self.num_kv_heads, self.head_dim))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        else:  # q and k heads rotated together
            qk = _rope(qkv[:, :qk_size].view(T, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias)

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(start, size) of a checkpoint shard inside ``gate_up_proj``."""
        return (0 if shard == "gate" else self.intermediate_size), self.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if layer_ops.usable(gate_up):
            return self.down_proj(layer_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (h', residual'): the residual stream after this layer is
        ``h' + residual'`` (``residual`` None at the first layer: the stream is ``h``)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, cos, sin, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` [T, heads, head_dim]: in place by the CPU kernel, else ``apply_rope``."""
    if layer_ops.usable(x):
        return layer_ops.rope_(x, cos, sin)
    return apply_rope(x, cos, sin)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _empty(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache, built from a transformers config.

    Parameters are created empty in the current default device and dtype; fill them with
    ``load_weights`` (or the loader's dummy initializer).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Attention here is full-context; a runner should cap the context at this when set.
        sliding = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
        self.sliding_window: int | None = getattr(config, "sliding_window", None) if sliding \
            else None
        self.model = LlamaModel(config, self.head_dim)
        self.rotary = RotaryEmbedding(config, self.head_dim)
        self.lm_head = None if self.tie_word_embeddings else \
            Linear(self.hidden_size, self.vocab_size)
        self._stack: DecodeStack | None | object = _UNSET

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                attn_backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, h.dtype)  # [T, 1, 2, head_dim / 2] each
        if h.device.type == "cpu" and not torch.compiler.is_compiling():
            if self._stack is _UNSET:  # built at the first step: the weights are final then
                self._stack = DecodeStack.for_model(self)
            if self._stack is not None:  # every layer in one C++ call (decode_stack.py)
                out = self._stack.run(h, cos, sin, kv_caches, attn_metadata, attn_backend)
                if out is not None:
                    return out
        residual = None
        with small_matmuls(h):
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                h, residual = layer(h, residual, cos, sin, kv_cache, attn_metadata,
                                    attn_backend)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        with small_matmuls(hidden):
            if self.lm_head is None:  # tied embeddings
                return F.linear(hidden, self.model.embed_tokens.weight).float()
            return self.lm_head(hidden).float()

    def plain_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The logits head as a plain weight ``[vocab, hidden]`` and bias, for computing it a
        slice at a time (None when the head is not a plain linear, e.g. quantized)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight, None
        if type(self.lm_head) is Linear:
            return self.lm_head.weight, self.lm_head.bias
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into place, one at a time.

        Separate q/k/v and gate/up tensors land in their rows of the fused projections.
        Raises ValueError when a parameter (or a fused shard) was never provided.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name == "rope_freqs.weight":  # from GGUF files
                self.rotary.apply_freq_factors(tensor)
                continue
            if "rotary_emb." in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, shard = name, None
            for part, (fused, shard_name) in FUSED_SHARDS.items():
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_name
                    break
            param = params.get(target)
            if param is None:
                logger.warning("ignoring checkpoint tensor %s (no such parameter)", name)
                continue
            dest = param.data
            if shard is not None:
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                start, size = owner.shard_rows(shard)
                dest = dest.narrow(0, start, size)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = [n for n in params if not self._is_loaded(n, loaded)]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    @staticmethod
    def _is_loaded(name: str, loaded: set[tuple[str, str | None]]) -> bool:
        if ".qkv_proj." in name:
            return all((name, s) in loaded for s in ("q", "k", "v"))
        if ".gate_up_proj." in name:
            return all((name, s) in loaded for s in ("gate", "up"))
        return (name, None) in loaded
