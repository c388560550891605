"""Scores and classes through the engine (``engine/scoring.py``) against transformers, one model
kind each: Qwen3-Reranker (a causal LM read as P(yes) in its model card's template), a
one-label cross-encoder, a two-label classifier, and an embedding model (cosine)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch
import transformers

from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.scoring import (
    QWEN3_INSTRUCTION,
    QWEN3_PREFIX,
    QWEN3_SUFFIX,
    classify,
    score,
)
from tests.utils import hf_reference_model

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Horses and cows are both animals",
        "Paris is the capital of France, a country of Europe."]
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def run(llm, fn, *args, **kwargs):
    async def go():
        async with llm.engine:
            try:
                return await fn(llm.engine, *args, **kwargs), None
            except ValueError as e:  # raised here, not wrapped by the engine's task group
                return None, e

    result, error = anyio.run(go)
    if error is not None:
        raise error
    return result


@pytest.fixture(scope="module")
def reranker(tiny_models):
    from asyncengine.engine.llm import LLM

    # A small token budget: the pairs are split across device submissions.
    return LLM(tiny_models["qwen3"], hf_overrides=RERANKER, num_gpu_blocks_override=64,
               max_num_batched_tokens=128, max_num_seqs=4)


def yes_no_logits(model_dir: str, ids_list: list[list[int]]) -> np.ndarray:
    """transformers' causal LM: (logit of "no", logit of "yes") at each prompt's last token."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    ref = hf_reference_model(model_dir)
    with torch.no_grad():
        return np.stack([ref(torch.tensor([ids])).logits[0, -1, [no, yes]].numpy()
                         for ids in ids_list])


def test_qwen3_reranker_is_p_yes_in_its_model_cards_template(reranker, tiny_models):
    model_dir = tiny_models["qwen3"]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prefix = tok.encode(QWEN3_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_SUFFIX, add_special_tokens=False)

    def card(query: str, doc: str, instruction: str = QWEN3_INSTRUCTION) -> list[int]:
        return prefix + tok(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
                            )["input_ids"] + suffix

    ref = yes_no_logits(model_dir, [card(QUERY, d) for d in DOCS])
    p_yes = torch.softmax(torch.from_numpy(ref), dim=-1)[:, 1].numpy()  # the model card's
    got = run(reranker, score, [QUERY], DOCS)
    assert np.abs(np.array(got.scores) - p_yes).max() < 1e-5
    assert got.prompt_tokens == [len(card(QUERY, d)) for d in DOCS]
    raw = run(reranker, score, [QUERY] * 3, DOCS, activation=False)  # N:N, the logit
    assert np.abs(np.array(raw.scores) - (ref[:, 1] - ref[:, 0])).max() < 1e-4
    mine = run(reranker, score, [QUERY], DOCS[:1], instruction="Find the city")
    want = yes_no_logits(model_dir, [card(QUERY, DOCS[0], "Find the city")])[0]
    assert abs(mine.scores[0] - torch.softmax(torch.from_numpy(want), 0)[1].item()) < 1e-5
    # Pairs a client formatted itself (vLLM's example) are read as given: query + document.
    query = f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {QUERY}\n"
    doc = f"<Document>: {DOCS[0]}{QWEN3_SUFFIX}"
    given = run(reranker, score, [query], [doc], activation=False)
    want = yes_no_logits(model_dir, [tok(query + doc)["input_ids"]])[0]
    assert abs(given.scores[0] - (want[1] - want[0])) < 1e-4


def test_truncation_and_the_context(reranker, tiny_models):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    fixed = len(tok.encode(QWEN3_PREFIX + QWEN3_SUFFIX, add_special_tokens=False))
    cut = run(reranker, score, [QUERY], [DOCS[2]], truncate=fixed + 10)
    assert cut.prompt_tokens == [fixed + 10]  # the pair's end cut, the template kept
    long = "word " * 5000
    with pytest.raises(ValueError, match=r"maximum context length is 4096 tokens\. However, "
                                         r"pair 1 has \d+ tokens"):
        run(reranker, score, [QUERY], [DOCS[0], long])
    assert run(reranker, score, [QUERY], [long], truncate=-1).prompt_tokens == [4096]
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        run(reranker, score, [QUERY, QUERY], DOCS)


def test_a_classifier_does_not_generate(reranker):
    assert not reranker.engine.model_kind.generates
    with pytest.raises(ValueError, match=r"Qwen3ForSequenceClassification\) is a "
                                         r"cross-encoder.*no generation"):
        reranker.generate("hi", SamplingParams(max_tokens=2))


def test_a_cross_encoder_is_the_sigmoid_of_its_logit(tiny_classifiers):
    from asyncengine.engine.llm import LLM

    model_dir = tiny_classifiers["qwen3"]
    llm = LLM(model_dir, num_gpu_blocks_override=64)
    got = run(llm, score, [QUERY], DOCS)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():  # sentence-transformers' CrossEncoder: sigmoid for one label
        want = [torch.sigmoid(ref(**tok(QUERY + d, return_tensors="pt")).logits[0, 0]).item()
                for d in DOCS]
    assert np.abs(np.array(got.scores) - want).max() < 1e-5
    assert len(set(np.round(want, 3))) == 3  # the head is not ~0: the scores differ
    probs = run(llm, classify, [tok(QUERY + d)["input_ids"] for d in DOCS])
    assert probs.shape == (3, 1) and np.abs(probs[:, 0] - want).max() < 1e-5


def test_a_classifier_gives_softmax_probabilities_and_no_scores(tiny_classifiers):
    from asyncengine.engine.llm import LLM

    model_dir = tiny_classifiers["llama"]
    llm = LLM(model_dir, num_gpu_blocks_override=64, max_num_batched_tokens=32,
              max_num_seqs=4)
    kind = llm.engine.model_kind
    assert kind.classifies and not kind.scores
    assert kind.classifier.labels == ("negative", "positive")
    prompts = [list(range(100, 100 + n)) for n in (3, 40, 17)]
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = np.stack([ref(torch.tensor([p])).logits[0].numpy() for p in prompts])
    got = run(llm, classify, prompts, activation=False)
    assert np.abs(got - logits).max() < 1e-4
    probs = run(llm, classify, prompts)
    assert np.abs(probs - torch.softmax(torch.from_numpy(logits), -1).numpy()).max() < 1e-5
    with pytest.raises(ValueError, match=r"a classifier \(2 labels\): no scoring"):
        run(llm, score, ["a"], ["b"])


def test_an_embedding_model_scores_by_cosine(tiny_llama):
    from asyncengine.engine.llm import LLM

    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    assert llm.engine.model_kind.scores and not llm.engine.model_kind.classifies
    got = run(llm, score, [QUERY], DOCS)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    ref = hf_reference_model(tiny_llama)
    with torch.no_grad():
        def vec(text: str) -> torch.Tensor:
            return ref.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]

        want = [torch.cosine_similarity(vec(QUERY), vec(d), dim=0).item() for d in DOCS]
    assert np.abs(np.array(got.scores) - want).max() < 1e-5
    assert got.prompt_tokens == [len(tok(QUERY)["input_ids"]) + len(tok(d)["input_ids"])
                                 for d in DOCS]
    with pytest.raises(ValueError, match="no classification"):
        run(llm, classify, [[1, 2, 3]])
