"""Which part of each weight of the built-in decoder a tensor-parallel rank holds
(Megatron-style).

* q/k/v and gate/up are split by output rows (columns of ``y = x W^T``): each rank computes
  its own heads and its slice of the MLP's intermediate features.
* o_proj and down_proj are split by input columns: each rank's partial sums are all-reduced.
  Their biases are kept whole and added once, after the sum.
* the embedding and the logits head are split over the vocabulary, in slices of
  ``ceil(vocab / N)`` rows (the last one padded with zero rows).
* KV heads: ``num_kv_heads / N`` per rank when N divides them; with fewer KV heads than ranks
  (N a multiple of them) each rank holds the one KV head its query heads use, replicated.
  Any other split is refused, naming ``--tensor-parallel-size``.
* norms (and Qwen3's and Gemma 3's per-head q/k norms) are replicated.
* a mixture of experts: each expert's gate/up (``w1``/``w3``) split by rows and its down
  (``w2``) by columns, as a dense MLP's, over the experts' intermediate features; Qwen2-MoE's
  shared expert the same over its own; the router and the shared expert's gate replicated.
  Every rank routes the same tokens to the same experts, and the layer's output is
  all-reduced (``parallel/model.py``).
* a checkpoint's fused projections (Phi-3's ``qkv_proj``, ``gate_up_proj``) are read as the
  separate ones they stack (:func:`unfused`), each split as above.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    num_heads: int  # per rank
    num_kv_heads: int  # per rank
    kv_head_start: int  # first KV head of this rank (of the model's)
    head_dim: int
    intermediate: int  # per rank
    vocab_size: int  # the model's
    vocab_per_rank: int
    model_kv_heads: int = 0  # the model's (the rows of a fused qkv_proj after q's)
    model_intermediate: int = 0  # the model's (the rows of a fused gate_up_proj after gate's)
    expert_intermediate: int = 0  # per rank: each expert's features (mixtures of experts)
    shared_intermediate: int = 0  # per rank: Qwen2-MoE's shared expert's features

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def rows(self, kind: str) -> tuple[int, int] | None:
        """(start, size) of the rows this rank holds of a column-split weight kind."""
        r, d = self.rank, self.head_dim
        if kind == "q":
            return r * self.num_heads * d, self.num_heads * d
        if kind in ("k", "v"):
            return self.kv_head_start * d, self.num_kv_heads * d
        if kind == "mlp":
            return r * self.intermediate, self.intermediate
        if kind == "expert":
            return r * self.expert_intermediate, self.expert_intermediate
        if kind == "shared":
            return r * self.shared_intermediate, self.shared_intermediate
        if kind == "vocab":
            start = self.vocab_start
            return start, max(0, min(self.vocab_per_rank, self.vocab_size - start))
        return None


def make_plan(config: Any, rank: int, world_size: int) -> ShardPlan:
    """The shard of ``rank``; a ValueError naming the flag when the model cannot be split."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = world_size
    if heads % n:
        raise ValueError(f"{FLAG} {n}: the model's {heads} attention heads cannot be split "
                         f"evenly over {n} ranks (use a divisor of {heads})")
    if kv_heads % n == 0:
        kv_per_rank, kv_start = kv_heads // n, rank * (kv_heads // n)
    elif n % kv_heads == 0:  # fewer KV heads than ranks: each rank holds its group's one
        kv_per_rank, kv_start = 1, rank // (n // kv_heads)
    else:
        raise ValueError(f"{FLAG} {n}: the model's {kv_heads} KV heads can be neither split "
                         f"evenly over {n} ranks nor replicated (N must divide the KV heads "
                         "or be a multiple of them)")
    if config.intermediate_size % n:
        raise ValueError(f"{FLAG} {n}: the MLP's {config.intermediate_size} features cannot "
                         f"be split evenly over {n} ranks")
    experts = _per_rank(config, "moe_intermediate_size", n, "each expert's") if \
        getattr(config, "moe_intermediate_size", None) else config.intermediate_size // n
    shared = _per_rank(config, "shared_expert_intermediate_size", n, "the shared expert's")
    vocab = config.vocab_size
    return ShardPlan(rank=rank, world_size=n, num_heads=heads // n, num_kv_heads=kv_per_rank,
                     kv_head_start=kv_start, head_dim=head_dim,
                     intermediate=config.intermediate_size // n, vocab_size=vocab,
                     vocab_per_rank=-(-vocab // n), model_kv_heads=kv_heads,
                     model_intermediate=config.intermediate_size,
                     expert_intermediate=experts, shared_intermediate=shared)


def _per_rank(config: Any, key: str, n: int, what: str) -> int:
    size = getattr(config, key, None) or 0
    if size % n:
        raise ValueError(f"{FLAG} {n}: {what} {size} features cannot be split evenly over "
                         f"{n} ranks")
    return size // n


def shard_config(config: Any, plan: ShardPlan) -> Any:
    """The transformers config of one rank's model: its heads, features and vocabulary."""
    c = copy.deepcopy(config)
    c.head_dim = plan.head_dim
    c.num_attention_heads = plan.num_heads
    c.num_key_value_heads = plan.num_kv_heads
    c.intermediate_size = plan.intermediate
    c.vocab_size = plan.vocab_per_rank
    if getattr(c, "moe_intermediate_size", None):
        c.moe_intermediate_size = plan.expert_intermediate
    if getattr(c, "shared_expert_intermediate_size", None):
        c.shared_expert_intermediate_size = plan.shared_intermediate
    return c


# checkpoint name part -> (how it is split, which rows)
_SPLITS = {
    ".q_proj.": ("rows", "q"), ".k_proj.": ("rows", "k"), ".v_proj.": ("rows", "v"),
    ".gate_proj.": ("rows", "mlp"), ".up_proj.": ("rows", "mlp"),
    ".o_proj.weight": ("cols", "q"), ".down_proj.weight": ("cols", "mlp"),
    "embed_tokens.weight": ("rows", "vocab"), "lm_head.weight": ("rows", "vocab"),
}


# an expert's (or the shared expert's) projections, by name part -> how they are split
_EXPERT_SPLITS = {".gate_proj.": "rows", ".up_proj.": "rows", ".w1.": "rows", ".w3.": "rows",
                  ".down_proj.weight": "cols", ".w2.weight": "cols"}


def split_of(name: str) -> tuple[str, str] | None:
    for owner, kind in ((".experts.", "expert"), (".shared_expert.", "shared")):
        if owner in name:
            how = next((h for part, h in _EXPERT_SPLITS.items() if part in name), None)
            return None if how is None else (how, kind)
    for part, split in _SPLITS.items():
        if part in name:
            return split
    return None


#: ``get(rows, cols)``: the tensor, or its slice ``[rows[0]:rows[1]]`` / ``[:, cols...]``.
Getter = Callable[[tuple[int, int] | None, tuple[int, int] | None], torch.Tensor]


def shard_tensor(name: str, get: Getter, plan: ShardPlan) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name``, reading only that part when ``get``
    can (a safetensors slice)."""
    split = split_of(name)
    if split is None:
        return get(None, None)
    how, kind = split
    start, size = plan.rows(kind)
    span = (start, start + size)
    if how == "cols":
        return get(None, span)
    part = get(span, None)
    if kind == "vocab" and size < plan.vocab_per_rank:  # the last slice: zero padding rows
        pad = part.new_zeros(plan.vocab_per_rank - size, *part.shape[1:])
        part = torch.cat([part, pad])
    return part


# a fused checkpoint projection -> the separate ones it stacks, in row order
_FUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
          ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def unfused(name: str, get: Getter, plan: ShardPlan) -> list[tuple[str, Getter]]:
    """``[(name, get)]``, or for a fused projection its parts: each named as the separate
    projection and read at its rows' offset in the fused tensor."""
    fused = next((f for f in _FUSED if f in name), None)
    if fused is None:
        return [(name, get)]
    parts = _FUSED[fused]
    if fused == ".qkv_proj.":
        q = plan.num_heads * plan.world_size * plan.head_dim
        sizes = (q, plan.model_kv_heads * plan.head_dim, plan.model_kv_heads * plan.head_dim)
    else:
        sizes = (plan.model_intermediate, plan.model_intermediate)
    out, offset = [], 0
    for part, size in zip(parts, sizes, strict=True):
        out.append((name.replace(fused, part), _rows_from(get, offset, size)))
        offset += size
    return out


def _rows_from(get: Getter, offset: int, size: int) -> Getter:
    """``get`` over rows ``offset .. offset + size`` of its tensor."""
    def part(rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        if rows is not None:
            return get((offset + rows[0], offset + rows[1]), None)
        whole = get((offset, offset + size), None)
        return whole if cols is None else whole[:, cols[0]:cols[1]]
    return part


def tensor_getter(t: torch.Tensor) -> Getter:
    """A getter over a tensor already in memory (GGUF)."""
    def get(rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        if rows is not None:
            return t[rows[0]:rows[1]]
        if cols is not None:
            return t[:, cols[0]:cols[1]]
        return t
    return get


def slice_getter(sl: Any) -> Getter:
    """A getter over a safetensors ``get_slice`` handle: reads only the requested part."""
    def get(rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        if rows is not None:
            return sl[rows[0]:rows[1]]
        if cols is not None:
            return sl[:, cols[0]:cols[1]]
        return sl[:]
    return get
