"""Scores, reranking and classification, computed on the engine's device as embeddings are
(``embedding.py``: between two steps, at most ``--max-num-batched-tokens`` tokens at a time).

What the served model answers is decided once, at load, by its architecture and config
(:class:`ModelKind`):

- a **classifier** (``executor/models/classifier.py``: a ``*ForSequenceClassification``
  checkpoint, or a causal LM turned into one by ``--hf-overrides``) classifies; with one
  label it is a cross-encoder too: each (query, document) pair is one prompt and its score
  the label's logit through the model's activation (sigmoid unless its config says
  otherwise, as sentence-transformers' CrossEncoder). It does not generate.
- **any other model** scores a pair by the cosine similarity of the two texts' embeddings
  (the vectors of ``/v1/embeddings``), as vLLM scores with an embedding model.

A cross-encoder's pair prompt is the two texts concatenated (vLLM's prompt for a decoder
reranker), except for Qwen3-Reranker (``is_original_qwen3_reranker``), whose pair is put in
the template of its model card: system prefix, ``<Instruct>: ...\\n<Query>: ...\\n<Document>:
...``, then the assistant's empty thinking. A query that already starts with that prefix (a
client that formats pairs itself, as vLLM's examples do) is used as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from asyncengine.engine.embedding import embed, on_device
from asyncengine.executor.models.classifier import ClassifierSpec, activate, classify_batch

QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                "on the Query and the Instruct provided. Note that the answer can only be "
                "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class ModelKind:
    """What the served model answers: generation, embeddings, scores, classes."""

    architecture: str
    classifier: ClassifierSpec | None = None

    @property
    def generates(self) -> bool:
        return self.classifier is None

    @property
    def scores(self) -> bool:
        """/score and /rerank: by embeddings, or as a one-label cross-encoder."""
        return self.classifier is None or self.classifier.num_labels == 1

    @property
    def classifies(self) -> bool:
        return self.classifier is not None

    @property
    def name(self) -> str:
        if self.classifier is None:
            return "an embedding model (scored by cosine similarity)"
        if self.classifier.num_labels == 1:
            return "a cross-encoder (one label)"
        return f"a classifier ({self.classifier.num_labels} labels)"

    def refusal(self, what: str) -> str:
        """Why ``what`` (generation, scoring, classification) is not served."""
        hint = {"generation": "it serves /classify, /score and /rerank",
                "scoring": "/score and /rerank need one label or no classification head",
                "classification": "/classify needs a *ForSequenceClassification model or a "
                                  "reranker made by --hf-overrides"}[what]
        return f"This model ({self.architecture}) is {self.name}: no {what} ({hint})."


def model_kind(model: Any) -> ModelKind:
    """The kind of a loaded model (its class and config decide it)."""
    arch = (getattr(getattr(model, "config", None), "architectures", None) or ["?"])[0]
    return ModelKind(arch, getattr(model, "classifier", None))


@dataclass
class Scores:
    """One score per pair, and the tokens each pair cost."""

    scores: list[float]
    prompt_tokens: list[int]


async def score(engine: Any, text_1: list[str], text_2: list[str], *,
                instruction: str | None = None, activation: bool = True,
                truncate: int | None = None,
                names: tuple[str, str] = ("text_1 item", "text_2 item")) -> Scores:
    """Scores of the pairs (``text_1[i]``, ``text_2[i]``); a single ``text_1`` goes with every
    ``text_2``. ``truncate``: keep each prompt's last ``truncate`` tokens (-1: the context;
    Qwen3-Reranker's template keeps its prefix and suffix and cuts the pair's end, as its
    model card does). ValueError for what cannot be scored, naming the text by ``names``."""
    kind: ModelKind = engine.model_kind
    if not kind.scores:
        raise ValueError(kind.refusal("scoring"))
    if not text_1 or not text_2:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(text_1) not in (1, len(text_2)):
        raise ValueError(f"text_1 and text_2 must pair 1:1, 1:N or N:N (got {len(text_1)} and "
                         f"{len(text_2)} texts)")
    if truncate is not None and (truncate == -1 or truncate > engine.max_model_len):
        truncate = engine.max_model_len
    queries = text_1 * len(text_2) if len(text_1) == 1 else text_1
    if kind.classifier is None:
        return await _cosine(engine, text_1, text_2, truncate, names)
    prompts = [_pair_prompt(engine, kind.classifier, q, d, instruction, truncate)
               for q, d in zip(queries, text_2, strict=True)]
    _check_lengths(engine, prompts, "pair")
    logits = await _logits(engine, prompts)
    values = logits[:, 0]
    if activation:
        values = activate(values, kind.classifier.score_activation)
    return Scores([float(v) for v in values], [len(p) for p in prompts])


async def classify(engine: Any, prompts: list[list[int]], *,
                   activation: bool = True) -> np.ndarray:
    """``[len(prompts), num_labels]`` float32: the classifier's probabilities of each prompt
    (softmax, or sigmoid for one label or multi-label models), or its logits."""
    kind: ModelKind = engine.model_kind
    if kind.classifier is None:
        raise ValueError(kind.refusal("classification"))
    _check_lengths(engine, prompts, "input")
    logits = await _logits(engine, prompts)
    return activate(logits, kind.classifier.classify_activation) if activation else logits


async def _logits(engine: Any, prompts: list[list[int]]) -> np.ndarray:
    runner = engine.runner
    out = await on_device(engine, prompts, lambda batch: partial(
        classify_batch, runner.model, runner.attn_backend, runner.block_size, runner.device,
        engine.parts.dtype, batch))
    return np.concatenate(out)


async def _cosine(engine: Any, text_1: list[str], text_2: list[str], truncate: int | None,
                  names: tuple[str, str]) -> Scores:
    def tokens(text: str) -> list[int]:
        ids = engine.tokenizer.encode(text)
        return ids[-truncate:] if truncate is not None else ids

    first, second = [tokens(t) for t in text_1], [tokens(t) for t in text_2]
    _check_lengths(engine, first, names[0])
    _check_lengths(engine, second, names[1])
    vectors = await embed(engine, first + second)  # L2-normalized: their dot is the cosine
    a, b = vectors[:len(first)], vectors[len(first):]
    if len(first) == 1:
        a = np.broadcast_to(a, b.shape)
        first = first * len(second)
    return Scores([float(v) for v in np.einsum("ij,ij->i", a, b)],
                  [len(x) + len(y) for x, y in zip(first, second, strict=True)])


def _pair_prompt(engine: Any, spec: ClassifierSpec, query: str, document: str,
                 instruction: str | None, truncate: int | None) -> list[int]:
    tokenizer = engine.tokenizer
    if spec.template == "qwen3_reranker" and not query.startswith(QWEN3_PREFIX):
        prefix = tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False)
        suffix = tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False)
        body = tokenizer.encode(f"<Instruct>: {instruction or QWEN3_INSTRUCTION}\n"
                                f"<Query>: {query}\n<Document>: {document}")
        if truncate is not None:
            body = body[:max(truncate - len(prefix) - len(suffix), 0)]
        return prefix + body + suffix
    ids = tokenizer.encode(query + document)
    return ids[-truncate:] if truncate is not None else ids


def _check_lengths(engine: Any, prompts: list[list[int]], what: str) -> None:
    limit = engine.max_model_len
    for i, p in enumerate(prompts):
        if not p:  # a text of characters the tokenizer drops (control characters)
            raise ValueError(f"{what} {i} tokenizes to no tokens")
        if len(p) > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, "
                             f"{what} {i} has {len(p)} tokens; shorten it.")
