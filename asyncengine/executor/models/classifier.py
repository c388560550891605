"""Sequence classification: the decoder with a ``score`` head on its last token.

transformers' ``*ForSequenceClassification`` (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, the
MoE families) put a bias-free linear ``score`` ``[num_labels, hidden]`` on the final normed
hidden state and read it at the prompt's last token. :class:`SequenceClassifier` is the same
decoder with that head: ``score.weight`` comes from the checkpoint, or, for a causal LM turned
into a classifier by ``--hf-overrides`` (vLLM's ``classifier_from_token``), from rows of the
vocabulary head once the tokenizer names their ids (``bind_tokens``):

- ``from_2_way_softmax`` (``is_original_qwen3_reranker``: tokens ``["no", "yes"]``): one
  label, ``w_yes - w_no``; its sigmoid is softmax([no, yes])[yes], the reranker's P(yes);
- ``no_post_processing``: one label per token, that token's row.

The head runs on the device, in float32, right after the pooled forward pass
(``classify_batch``); activations (sigmoid, softmax) are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.config.sections import HF_OVERRIDE_KEYS
from asyncengine.executor.attention.base import AttentionBackend
from asyncengine.executor.models.decoder import CausalLM
from asyncengine.executor.models.pooling import pool_batch

METHODS = ("from_2_way_softmax", "no_post_processing")
ACTIVATIONS = ("sigmoid", "softmax", "identity")


@dataclass(frozen=True)
class ClassifierSpec:
    """What a classifier's outputs mean, read from its config."""

    num_labels: int
    labels: tuple[str, ...]  # id2label
    classify_activation: str  # /classify's probabilities: sigmoid, softmax or identity
    score_activation: str  # a one-label cross-encoder's score: sigmoid or identity
    from_tokens: tuple[str, ...] = ()  # classifier_from_token
    two_way: bool = False  # from_2_way_softmax
    template: str | None = None  # "qwen3_reranker": the prompt is Qwen's reranker template


def classifier_spec(config: Any) -> ClassifierSpec:
    """The classifier a (possibly overridden) transformers config describes."""
    tokens = tuple(getattr(config, "classifier_from_token", None) or ())
    method = getattr(config, "method", None)
    qwen3 = bool(getattr(config, "is_original_qwen3_reranker", False))
    if qwen3:
        tokens, method = tokens or ("no", "yes"), "from_2_way_softmax"
    if tokens and method is None:
        raise ValueError("--hf-overrides: classifier_from_token needs a method "
                         f"({', '.join(METHODS)})")
    if method is not None and method not in METHODS:
        raise ValueError(f"--hf-overrides: method {method!r} (supported: {', '.join(METHODS)})")
    two_way = method == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ValueError("--hf-overrides: from_2_way_softmax needs two classifier_from_token "
                         f"(false, true), got {list(tokens)}")
    if method is not None and not tokens:
        raise ValueError(f"--hf-overrides: method {method} needs classifier_from_token")
    num_labels = 1 if two_way else len(tokens) or int(getattr(config, "num_labels", 1))
    id2label = getattr(config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))
                   if len(id2label) == num_labels else f"LABEL_{i}" for i in range(num_labels))
    return ClassifierSpec(num_labels, labels, _classify_activation(config, num_labels),
                          _score_activation(config, num_labels), tokens, two_way,
                          "qwen3_reranker" if qwen3 else None)


def _classify_activation(config: Any, num_labels: int) -> str:
    """transformers' losses' reading of ``problem_type``, as vLLM applies it."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def _score_activation(config: Any, num_labels: int) -> str:
    """sentence-transformers' CrossEncoder: the activation its config names, else sigmoid for
    one label and identity for more."""
    st = getattr(config, "sentence_transformers", None)
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or \
        getattr(config, "sbert_ce_default_activation_function", None)
    if isinstance(name, str) and name.endswith("Identity"):
        return "identity"
    if isinstance(name, str) and name.endswith("Sigmoid"):
        return "sigmoid"
    return "sigmoid" if num_labels == 1 else "identity"


def apply_hf_overrides(config: Any, overrides: dict[str, Any] | None) -> None:
    """vLLM's ``--hf-overrides`` onto a checkpoint's config, for the keys that make a causal LM
    a classifier (``HF_OVERRIDE_KEYS``; ValueError for others). ``is_original_qwen3_reranker``
    alone implies the rest: the family's ``*ForSequenceClassification`` over tokens no, yes."""
    if not overrides:
        return
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:  # EngineConfig.validate refuses them first
        raise ValueError(f"--hf-overrides: overriding {', '.join(unknown)} is not supported")
    archs = overrides.get("architectures")
    if archs is not None and (not isinstance(archs, list) or len(archs) != 1
                              or not str(archs[0]).endswith("ForSequenceClassification")):
        raise ValueError("--hf-overrides: architectures must be one *ForSequenceClassification "
                         f"name, got {archs!r}")
    tokens = overrides.get("classifier_from_token")
    if tokens is not None and (not isinstance(tokens, list) or not tokens
                               or not all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"--hf-overrides: classifier_from_token must be a list of token "
                         f"strings, got {tokens!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    current = (getattr(config, "architectures", None) or [""])[0]
    if overrides.get("is_original_qwen3_reranker") and archs is None:
        family = current.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification")
        config.architectures = [f"{family}ForSequenceClassification"]
    classifier_spec(config)  # an inconsistent override fails now, naming the flag


class ScoreHead(nn.Module):
    """``score``: ``[num_labels, hidden]``, no bias (not a ``Linear``: quantization leaves it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class SequenceClassifier(CausalLM):
    """A decoder of any supported family with a ``score`` head (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.classifier = spec = classifier_spec(self.config)
        self.score: ScoreHead | None = None
        if not spec.from_tokens:  # the checkpoint's own head, and no vocabulary head
            self.lm_head = None
            self.score = ScoreHead(torch.empty(spec.num_labels, self.hidden_size))

    @torch.no_grad()
    def bind_tokens(self, tokenizer: Any) -> None:
        """Make the head from the vocabulary head's rows of ``classifier_from_token``
        (``tokenizer``: transformers'); nothing for a checkpoint's own head."""
        spec = self.classifier
        if not spec.from_tokens:
            return
        ids = []
        for token in spec.from_tokens:
            i = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(i, int) or (i == tokenizer.unk_token_id
                                          and token != tokenizer.unk_token):
                raise ValueError(f"--hf-overrides: classifier_from_token {token!r} is not a "
                                 "token of this model's vocabulary")
            ids.append(i)
        head = self.model.embed_tokens.weight if self.lm_head is None else \
            getattr(self.lm_head, "weight", None)
        if not isinstance(head, torch.Tensor) or not head.is_floating_point() or \
                tuple(head.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError("--hf-overrides classifier_from_token: the vocabulary head is not "
                             "a float matrix (load it unquantized: --quantization none)")
        rows = head[ids].float()
        self.score = ScoreHead(rows[1:] - rows[:1] if spec.two_way else rows)


@torch.inference_mode()
def classify_batch(model: SequenceClassifier, attn_backend: AttentionBackend, block_size: int,
                   device: torch.device, dtype: torch.dtype,
                   prompts: list[list[int]]) -> np.ndarray:
    """``[len(prompts), num_labels]`` float32 logits: the head on each prompt's last token."""
    hidden = pool_batch(model, attn_backend, block_size, device, dtype, prompts, "last")
    return F.linear(hidden, model.score.weight.float()).cpu().numpy()


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """``activation`` (``ACTIVATIONS``) over the last axis of float32 ``logits``."""
    if activation == "sigmoid":  # in the tanh form, which overflows nowhere
        return 0.5 * (1.0 + np.tanh(0.5 * logits))
    if activation == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return logits
