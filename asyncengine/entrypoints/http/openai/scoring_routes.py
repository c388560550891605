"""The routes of vLLM's scoring API (``score.py``, ``classify.py``), for the route table
(``app.py``): each listed in /openapi.json only where the served model answers it."""

from __future__ import annotations

from asyncengine.entrypoints.http.openai import classify, score
from asyncengine.entrypoints.http.openapi import Route

_SCORE = "Score text pairs (vLLM's: a cross-encoder's score, or the cosine of embeddings)"
_RERANK = "Rerank documents by relevance to a query"

SCORING_ROUTES = [
    Route("POST", "/score", score.create_score, _SCORE, score.ScoreRequest,
          score.ScoreResponse, enabled=score.scoring_enabled),
    Route("POST", "/v1/score", score.create_score_v1, _SCORE, score.ScoreRequest,
          score.ScoreResponse, enabled=score.scoring_enabled),
    Route("POST", "/rerank", score.create_rerank, _RERANK + " (Jina's and Cohere's shapes)",
          score.RerankRequest, score.RerankResponse, enabled=score.scoring_enabled),
    Route("POST", "/v1/rerank", score.create_rerank_v1, _RERANK + " (Jina's shape)",
          score.RerankRequest, score.RerankResponse, enabled=score.scoring_enabled),
    Route("POST", "/v2/rerank", score.create_rerank_v2, _RERANK + " (Cohere's shape)",
          score.RerankRequest, score.RerankResponse, enabled=score.scoring_enabled),
    Route("POST", "/classify", classify.create_classify,
          "Classify inputs (a sequence-classification model)", classify.ClassificationRequest,
          classify.ClassificationResponse, enabled=classify.classify_enabled),
]
