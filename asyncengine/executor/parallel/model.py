"""The built-in decoder (any family: ``models/family.py``) sharded over the tensor-parallel
ranks.

Built as the ordinary :class:`LlamaForCausalLM` of the rank's *shard config* (its heads, its
slice of the MLP, its slice of the vocabulary: ``sharding.shard_config``), so q/k/v and
gate/up already have this rank's rows and the attention runs over this rank's heads and KV
cache only. Three modules change (and a mixture of experts' output, all-reduced):

* ``o_proj`` and ``down_proj`` (:class:`RowParallelLinear`): the partial products are
  all-reduced, then the (whole) bias is added;
* the embedding (:class:`VocabParallelEmbedding`): ids outside the rank's slice look up zeros,
  then an all-reduce sums the ranks' rows;
* ``compute_logits``: each rank's ``[N, vocab / ranks]`` slice is gathered on rank 0, which
  alone samples; the other ranks get None.

``vocab_size``, ``num_heads``... that the runner and the KV cache read are the rank's own
except ``vocab_size``, which stays the model's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncengine.executor.models.llama import Embedding, Linear, LlamaForCausalLM
from asyncengine.executor.models.small_matmul import small_matmuls
from asyncengine.executor.parallel.sharding import ShardPlan, shard_config
from asyncengine.executor.parallel.state import TPState


class RowParallelLinear(Linear):
    """``y = all_reduce(x W_rank^T) + b``: input features split over the ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TPState) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Embedding):
    def __init__(self, num: int, dim: int, start: int, tp: TPState) -> None:
        super().__init__(num, dim)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)


class TPLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, plan: ShardPlan, tp: TPState) -> None:
        super().__init__(shard_config(config, plan))
        self.full_config = config
        self.plan, self.tp = plan, tp
        self.vocab_size = config.vocab_size
        hidden = self.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(plan.vocab_per_rank, hidden,
                                                         plan.vocab_start, tp)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, hidden, attn.o_proj.bias is not None,
                                            tp)
            if hasattr(mlp, "down_proj"):
                mlp.down_proj = RowParallelLinear(mlp.intermediate_size, hidden,
                                                  mlp.down_proj.bias is not None, tp)
            else:  # a mixture of experts: each rank's experts give partial sums
                mlp.register_forward_hook(self._all_reduce_output)

    def _all_reduce_output(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(out)

    def plain_head(self) -> None:
        """No sliced greedy head (``sampler/greedy_head.py``): this rank holds a part of the
        vocabulary only, and the logits are gathered on rank 0."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> float32 logits [N, vocab] on rank 0; None elsewhere."""
        with small_matmuls(hidden):
            weight = self.model.embed_tokens.weight if self.lm_head is None \
                else self.lm_head.weight
            local = F.linear(hidden, weight).float()
        full = self.tp.gather_last_dim(local)
        if full is None:
            return None
        logits = full[:, :self.vocab_size]
        cap = self.spec.final_soft_cap  # Gemma 2's
        return logits if cap is None else torch.tanh(logits / cap) * cap
