"""One decoder for every family: Llama 2/3, Mistral, Qwen2/2.5/3, Gemma 2/3, Phi-3/4, and the
mixture-of-experts ones (Mixtral, Qwen2/3-MoE).

A pre-norm decoder over a paged KV cache, read off a :class:`~family.ModelSpec`::

    h = embed(ids) * embed_scale                              # Gemma: sqrt(hidden)
    for each layer:
        a = attn(norm(h))       # RoPE (its own table per layer type), window, soft cap
        h = h + post_attn_norm(a)          if sandwich_norms (Gemma), else h + a
        m = mlp(pre_ff_norm(h))            # gated MLP or mixture of experts
        h = h + post_ff_norm(m)            if sandwich_norms, else h + m
    logits = lm_head(norm(h)), soft-capped (Gemma 2)

Tokens of many requests are flattened into one ``[T]`` batch; attention over the paged cache
is the backend's job (``executor/attention``). Projections are fused: ``qkv_proj`` holds q, k,
v stacked by rows and ``gate_up_proj`` holds gate, up; ``load_weights`` copies a checkpoint's
separate tensors into the right rows (Phi-3 checkpoints are fused already).

The residual stream is carried next to each layer's output (``h, residual``), so that every
residual add is fused with the RMSNorm that follows it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)
from asyncengine.executor.kernels.cuda_layer_ops import RopeTable
from asyncengine.executor.models.family import LayerSpec, ModelSpec, describe, text_config
from asyncengine.executor.models.layers import (
    FUSED_SHARDS,
    MLP,
    Embedding,
    Linear,
    RMSNorm,
    rope,
)
from asyncengine.executor.models.mrope import MRotaryEmbedding
from asyncengine.executor.models.rope import RotaryEmbedding
from asyncengine.executor.models.small_matmul import small_matmuls
from asyncengine.executor.weights.int4 import step_requests

logger = logging.getLogger(__name__)

class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = head_dim = spec.head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(spec.hidden, self.q_size + 2 * self.kv_size, spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden, spec.o_bias)
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, spec.norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(head_dim, spec.norm_eps, spec.norm_offset)
        self.scale = spec.attn_scale
        self.options: AttentionOptions = layer.attention
        self.rope_name = layer.rope

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
            if isinstance(cos, RopeTable):  # CUDA: FlashInfer's RoPE, in place
                cos.apply_(q.view(T, -1), k.view(T, -1), self.head_dim)
            else:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
        elif isinstance(cos, RopeTable):  # CUDA: FlashInfer's RoPE, in place in qkv
            cos.apply_(qkv[:, :self.q_size], qkv[:, self.q_size:qk_size], self.head_dim)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:qk_size].view(T, self.num_kv_heads, self.head_dim)
        else:  # q and k heads rotated together
            qk = rope(qkv[:, :qk_size].view(T, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.options.window is None and self.options.soft_cap is None:
            o = backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, heads, head_dim]
        else:
            o = backend.forward(q, k, v, kv_cache, meta, self.scale, self.options)
        return self.o_proj(o.reshape(T, self.q_size))


def _make_mlp(spec: ModelSpec) -> nn.Module:
    if spec.moe is None:
        return MLP(spec.hidden, spec.intermediate, spec.mlp_bias, spec.activation)
    try:
        from asyncengine.executor.models.moe import SparseMoE
    except ImportError:
        raise ValueError(f"{spec.family}: mixture-of-experts layers are not built yet") from None
    return SparseMoE(spec)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer)
        self.mlp = _make_mlp(spec)
        eps, off = spec.norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(spec.hidden, eps, off)
        self.post_attention_layernorm = RMSNorm(spec.hidden, eps, off)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm normalizes the attention output
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden, eps, off)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden, eps, off)

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
        if self.sandwich:
            h = self.post_attention_layernorm(h)
            x, residual = self.pre_feedforward_layernorm(h, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, layer) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden, spec.norm_eps, spec.norm_offset)


class CausalLM(nn.Module):
    """A causal LM of any supported family over a paged KV cache, built from a transformers
    config (``family.describe`` reads it).

    Parameters are created empty in the current default device and dtype; fill them with
    ``load_weights`` (or the loader's dummy initializer).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config = text_config(config)
        self.spec = spec = describe(config)
        self.hidden_size, self.vocab_size = spec.hidden, spec.vocab
        self.num_layers, self.num_heads = spec.num_layers, spec.num_heads
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.tie_word_embeddings = spec.tie_word_embeddings
        # The widest attention window, None when any layer attends the whole context.
        self.sliding_window = spec.sliding_window
        self.model = DecoderModel(spec)
        self.ropes = nn.ModuleDict({name: self._rope_table(name) for name in spec.ropes})
        self.rotary = self.ropes[spec.layers[0].rope]  # the first layer's table
        self.lm_head = None if self.tie_word_embeddings else Linear(spec.hidden, spec.vocab)
        # --enable-lora: the adapters' tables (``executor/lora/tables.py``); the decode stack
        # adds their updates too.
        self.lora: Any = None

    def _rope_table(self, name: str, long_context: bool = False) -> RotaryEmbedding:
        spec = self.spec
        per_type = name if len(spec.ropes) > 1 else None
        if spec.mrope_section is not None:  # Qwen2-VL: three position streams
            return MRotaryEmbedding(self.config, spec.head_dim, spec.ropes[name],
                                    spec.rotary_dim, spec.mrope_section,
                                    interleaved=spec.mrope_interleaved)
        return RotaryEmbedding(self.config, spec.head_dim, spec.ropes[name], spec.rotary_dim,
                               layer_type=per_type, long_context=long_context)

    def configure_context(self, max_model_len: int) -> None:
        """The served context length, once known: LongRoPE tables switch to their long
        factors when it exceeds the original context (``rope.py``)."""
        after = self.spec.long_rope_after
        if after is not None and max_model_len > after:
            logger.info("LongRoPE: long factors (context %d > original %d)", max_model_len,
                        after)
            for name in list(self.ropes):
                self.ropes[name] = self._rope_table(name, long_context=True)
            self.rotary = self.ropes[self.spec.layers[0].rope]

    def use_cuda_rope_tables(self, max_model_len: int, device: torch.device) -> None:
        """FlashInfer's RoPE (``cuda_layer_ops``): a float32 table of every position for each
        RoPE table that turns whole heads (partial rotary keeps the PyTorch path)."""
        for table in self.ropes.values():
            if table.rotary_dim == self.head_dim:
                table.use_table(max_model_len, device)

    def attention_options(self) -> list[AttentionOptions]:
        """Each layer's attention options, for ``AttentionBackend.configure_layers``."""
        return [layer.attention for layer in self.spec.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> the first layer's input [T, hidden] (Gemma: scaled)."""
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.spec.embed_scale is not None:
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        return h

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table's (cos, sin) at ``positions`` [T], by the name layers use
        (``LayerSpec.rope``): [T, 1, 2, rotary_dim / 2] each."""
        return {name: table(positions, dtype) for name, table in self.ropes.items()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                attn_backend: AttentionBackend,
                inputs_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed); M-RoPE
        positions may be [3, T] (``mrope.py``).
        ``inputs_embeds``: the first layer's input instead of ``embed(input_ids)`` (a step
        with images: their placeholders' rows replaced). ``deepstack`` (Qwen3-VL): rows
        ``[n]`` and features ``[k, n, hidden]`` added to those rows after layers 0..k-1."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        tables = self.rope_tables(positions, h.dtype)
        residual = None
        with small_matmuls(h), step_requests(attn_metadata.num_requests):
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches,
                                                      strict=True)):
                cos, sin = tables[layer.self_attn.rope_name]  # [T, 1, 2, rotary_dim / 2]
                h, residual = layer(h, residual, cos, sin, kv_cache, attn_metadata,
                                    attn_backend)
                if deepstack is not None and i < len(deepstack[1]):  # (the stream: h + res.)
                    h = h.index_add(0, deepstack[0], deepstack[1][i].to(h.dtype))
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        with small_matmuls(hidden):
            if self.lm_head is None:  # tied embeddings
                logits = F.linear(hidden, self.model.embed_tokens.weight).float()
            else:
                logits = self.lm_head(hidden).float()
        cap = self.spec.final_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def plain_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The logits head as a plain weight ``[vocab, hidden]`` and bias, for computing it a
        slice at a time (None when the head is not a plain linear, e.g. quantized).

        Soft-capped logits (Gemma 2) take it too: ``cap * tanh(x / cap)`` is increasing, so
        the raw logits' argmax is the capped ones'. Only logits within float32 rounding of
        each other can come out otherwise (capping may round two of them to one value, which
        goes to the lower id), as the head's own summation order may already; and a row whose
        best raw logit is infinite gets NO_TOKEN where capping would have kept it."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight, None
        if type(self.lm_head) is Linear:
            return self.lm_head.weight, self.lm_head.bias
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into place, one at a time.

        Separate q/k/v and gate/up tensors land in their rows of the fused projections; a
        module with its own ``load_checkpoint_tensor`` (the experts of a mixture) takes the
        names under it. Raises ValueError when a parameter (or a fused shard) was never
        provided.
        """
        params = dict(self.named_parameters())
        owners = {name: m for name, m in self.named_modules()
                  if hasattr(m, "load_checkpoint_tensor")}
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            for old, new in self.spec.renames:
                name = name.replace(old, new)
            if name == "rope_freqs.weight":  # from GGUF files
                for table in self.ropes.values():
                    table.apply_freq_factors(tensor)
                continue
            if "rotary_emb." in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            owner = _owner(owners, name)
            if owner is not None:
                owners[owner].load_checkpoint_tensor(name[len(owner) + 1:], tensor)
                continue
            target, shard = name, None
            for part, (fused, shard_name) in FUSED_SHARDS.items():
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_name
                    break
            param = params.get(target)
            if param is None:
                if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision")):
                    continue  # Gemma 3's image side: the text model only
                logger.warning("ignoring checkpoint tensor %s (no such parameter)", name)
                continue
            dest = param.data
            if shard is not None:
                module = self.get_submodule(target.rsplit(".", 2)[0])
                start, size = module.shard_rows(shard)
                dest = dest.narrow(0, start, size)
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = [n for n in params if _owner(owners, n) is None
                   and not self._is_loaded(n, loaded)]
        for prefix, module in owners.items():
            missing += [f"{prefix}.{n}" for n in module.missing_weights()]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
        self.finish_loading()

    def finish_loading(self) -> None:
        """After the weights are in (any loader): Gemma's float32 norms take the plain form."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_offset()

    @staticmethod
    def _is_loaded(name: str, loaded: set[tuple[str, str | None]]) -> bool:
        if (name, None) in loaded:  # a fused tensor in the checkpoint (Phi-3)
            return True
        if ".qkv_proj." in name:
            return all((name, s) in loaded for s in ("q", "k", "v"))
        if ".gate_up_proj." in name:
            return all((name, s) in loaded for s in ("gate", "up"))
        return False


def _owner(owners: dict[str, nn.Module], name: str) -> str | None:
    """The module among ``owners`` whose prefix ``name`` is under, if any."""
    for prefix in owners:
        if name.startswith(prefix + "."):
            return prefix
    return None
