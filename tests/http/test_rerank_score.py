"""vLLM's /rerank (Jina's and Cohere's shapes), /score and /classify over HTTP, on the two kinds
of model a server can be: a reranker started with vLLM's own Qwen3-Reranker command line
(``--runner pooling --hf_overrides ...``), and a plain model, which scores by the cosine of
its embeddings and does not classify. The values against transformers are
``tests/engine/test_scoring.py``'s; here, the shapes, the agreement between the routes, and
every refusal in OpenAI's error shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.robust_utils import MAX_MODEL_LEN, post, robust_server
from tests.server_utils import ServerProcess, shared_server

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Horses and cows are both animals",
        "Paris is the capital of France, a country of Europe."]
RERANKER = json.dumps({"architectures": ["Qwen3ForSequenceClassification"],
                       "classifier_from_token": ["no", "yes"],
                       "is_original_qwen3_reranker": True})
CONTEXT = 256
ROUTES = ["/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"]


@pytest.fixture(scope="module")
def reranker(tiny_models) -> ServerProcess:
    return shared_server(tiny_models["qwen3"], "--runner", "pooling", "--hf_overrides", RERANKER,
                         "--max-model-len", str(CONTEXT), "--num-gpu-blocks-override", "64",
                         "--max-num-batched-tokens", "256", "--shutdown-timeout", "2")


@pytest.fixture(scope="module")
def plain(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


def ok(server: ServerProcess, path: str, body: dict) -> dict:
    status, _, out = post(server, path, body)
    assert status == 200, out
    return out


def refused(server: ServerProcess, path: str, body: dict, status: int = 400) -> dict:
    got, _, out = post(server, path, body)
    assert got == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"}, out
    return out["error"]


def test_openapi_lists_the_routes_each_model_answers(reranker, plain):
    paths = reranker.get_json("/openapi.json")["paths"]
    assert all("post" in paths[r] for r in [*ROUTES, "/classify"])
    paths = plain.get_json("/openapi.json")["paths"]
    assert all("post" in paths[r] for r in ROUTES) and "/classify" not in paths
    error = refused(plain, "/classify", {"input": "hi"}, 404)
    assert "is an embedding model (scored by cosine similarity): no classification" in \
        error["message"]


def test_rerank_in_jinas_and_coheres_shapes(reranker):
    jina = ok(reranker, "/v1/rerank", {"model": reranker_model(reranker), "query": QUERY,
                                       "documents": DOCS, "top_n": 2})
    assert jina["id"].startswith("rerank-") and jina["model"] == reranker_model(reranker)
    results = jina["results"]
    assert len(results) == 2 and set(results[0]) == {"index", "relevance_score", "document"}
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert [r["document"]["text"] for r in results] == [DOCS[r["index"]] for r in results]
    full = ok(reranker, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS]})
    scores = {r["index"]: r["relevance_score"] for r in full["results"]}
    assert sorted(scores.values(), reverse=True) == [r["relevance_score"]
                                                      for r in full["results"]]
    assert [r["index"] for r in full["results"][:2]] == [r["index"] for r in results]
    assert full["usage"]["prompt_tokens"] == full["usage"]["total_tokens"] > 0
    cohere = ok(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3,
                                         "return_documents": False})
    assert all(set(r) == {"index", "relevance_score"} for r in cohere["results"])
    assert {r["index"]: r["relevance_score"] for r in cohere["results"]} == \
        pytest.approx(scores, abs=1e-6)
    short = ok(reranker, "/v2/rerank", {"query": QUERY, "documents": DOCS,
                                        "max_tokens_per_doc": 2})
    assert short["usage"]["prompt_tokens"] < full["usage"]["prompt_tokens"]
    assert [r["document"]["text"] for r in short["results"]] == \
        [DOCS[r["index"]] for r in short["results"]]  # the documents as sent


def reranker_model(server: ServerProcess) -> str:
    return server.get_json("/v1/models")["data"][0]["id"]


def test_score_pairs_one_to_one_one_to_n_and_n_to_n(reranker):
    rerank = ok(reranker, "/rerank", {"query": QUERY, "documents": DOCS})["results"]
    want = [s for _, s in sorted((r["index"], r["relevance_score"]) for r in rerank)]
    one_n = ok(reranker, "/score", {"text_1": QUERY, "text_2": DOCS})
    assert one_n["id"].startswith("score-") and one_n["object"] == "list"
    assert [(d["index"], d["object"]) for d in one_n["data"]] == [(0, "score"), (1, "score"),
                                                                   (2, "score")]
    assert [d["score"] for d in one_n["data"]] == pytest.approx(want, abs=1e-6)
    n_n = ok(reranker, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[1:]})
    assert [d["score"] for d in n_n["data"]] == pytest.approx(want[1:], abs=1e-6)
    one = ok(reranker, "/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False})
    assert 1 / (1 + np.exp(-one["data"][0]["score"])) == pytest.approx(want[0], abs=1e-6)
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0
    other = ok(reranker, "/score", {"text_1": QUERY, "text_2": DOCS[0],
                                    "instruction": "Judge the city"})
    assert other["data"][0]["score"] != pytest.approx(want[0], abs=1e-6)


def test_classify_gives_each_inputs_label_and_probabilities(reranker):
    out = ok(reranker, "/classify", {"input": ["a first text", "and a second"]})
    assert out["id"].startswith("classify-") and out["object"] == "list"
    data = out["data"]
    assert [(d["index"], d["label"], d["num_classes"], len(d["probs"])) for d in data] == [
        (0, "LABEL_0", 1, 1), (1, "LABEL_0", 1, 1)]
    assert all(0 < d["probs"][0] < 1 for d in data)
    raw = ok(reranker, "/classify", {"input": "a first text", "use_activation": False})
    assert 1 / (1 + np.exp(-raw["data"][0]["probs"][0])) == pytest.approx(data[0]["probs"][0])
    assert out["usage"]["prompt_tokens"] > raw["usage"]["prompt_tokens"] > 0


def test_the_plain_model_scores_by_the_cosine_of_its_embeddings(plain):
    vectors = ok(plain, "/v1/embeddings", {"input": [QUERY, *DOCS]})["data"]
    vecs = np.array([v["embedding"] for v in vectors])
    want = vecs[1:] @ vecs[0]
    got = ok(plain, "/score", {"text_1": QUERY, "text_2": DOCS})["data"]
    assert [d["score"] for d in got] == pytest.approx(want.tolist(), abs=1e-5)
    ranked = ok(plain, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1})
    assert ranked["results"][0]["index"] == int(np.argmax(want))


def test_what_cannot_be_scored_is_a_400_in_openais_shape(reranker, plain):
    assert refused(reranker, "/rerank", {"query": QUERY, "documents": []})["param"] == \
        "documents"
    many = refused(reranker, "/v1/rerank", {"query": QUERY, "documents": ["a"] * 1001})
    assert many["param"] == "documents" and "1000" in many["message"]
    long = "word " * 300
    error = refused(reranker, "/score", {"text_1": QUERY, "text_2": [DOCS[0], long]})
    assert f"maximum context length is {CONTEXT} tokens. However, pair 1 has" in \
        error["message"]
    assert ok(reranker, "/score", {"text_1": QUERY, "text_2": long,
                                   "truncate_prompt_tokens": -1})["usage"]["total_tokens"] == \
        CONTEXT
    error = refused(plain, "/rerank", {"query": QUERY, "documents": ["word " * 100]})
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    error = refused(reranker, "/score", {"text_1": [QUERY] * 2, "text_2": DOCS})
    assert "1:1, 1:N or N:N" in error["message"] and error["param"] == "text_2"
    assert refused(reranker, "/score", {"text_1": QUERY, "text_2": "x",
                                        "truncate_prompt_tokens": 0})["param"] == \
        "truncate_prompt_tokens"
    assert refused(reranker, "/rerank", {"query": "", "documents": DOCS})["param"] == "query"
    assert refused(reranker, "/rerank", {"model": "nope", "query": QUERY, "documents": DOCS},
                   404)["code"] == "model_not_found"
    error = refused(reranker, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert "is a cross-encoder (one label): no generation" in error["message"]
