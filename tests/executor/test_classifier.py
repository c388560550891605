"""The classification head (``executor/models/classifier.py``): what a config and vLLM's
``--hf-overrides`` make of a model, and a family beyond Llama's layout against transformers."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch
import transformers

from asyncengine.executor.models.classifier import (
    activate,
    apply_hf_overrides,
    classifier_spec,
)
from tests.utils import make_tiny_classifier, tiny_config


def test_the_reranker_override_implies_the_rest():
    config = tiny_config("qwen3")
    apply_hf_overrides(config, {"is_original_qwen3_reranker": True})
    assert config.architectures == ["Qwen3ForSequenceClassification"]
    spec = classifier_spec(config)
    assert (spec.num_labels, spec.from_tokens, spec.two_way, spec.template) == (
        1, ("no", "yes"), True, "qwen3_reranker")
    assert (spec.labels, spec.score_activation, spec.classify_activation) == (
        ("LABEL_0",), "sigmoid", "sigmoid")
    config = tiny_config("llama")  # bge-reranker-v2-gemma's form: one row per token
    apply_hf_overrides(config, {"architectures": ["LlamaForSequenceClassification"],
                                "classifier_from_token": ["Yes"],
                                "method": "no_post_processing"})
    spec = classifier_spec(config)
    assert (spec.num_labels, spec.two_way, spec.template) == (1, False, None)


@pytest.mark.parametrize("overrides, message", [
    ({"rope_theta": 1.0}, "overriding rope_theta"),
    ({"architectures": ["LlamaForCausalLM"]}, "one \\*ForSequenceClassification"),
    ({"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no"]},
     "needs a method"),
    ({"classifier_from_token": ["a", "b", "c"], "method": "from_2_way_softmax"},
     "two classifier_from_token"),
    ({"classifier_from_token": "yes", "method": "no_post_processing"}, "a list of token"),
    ({"method": "softmax_twice", "classifier_from_token": ["a"]}, "method 'softmax_twice'"),
])
def test_an_override_asyncengine_cannot_honour_names_the_flag(overrides, message):
    with pytest.raises(ValueError, match="--hf-overrides: .*" + message):
        apply_hf_overrides(tiny_config("llama"), overrides)


def test_activations_follow_the_config():
    def spec(**kw):
        return classifier_spec(tiny_config("llama", **kw))

    assert spec(num_labels=3).classify_activation == "softmax"
    assert spec(num_labels=3, problem_type="multi_label_classification"
                ).classify_activation == "sigmoid"
    assert spec(num_labels=1, problem_type="regression").classify_activation == "identity"
    assert spec(num_labels=3).score_activation == "identity"  # CrossEncoder's defaults
    assert spec(num_labels=1).score_activation == "sigmoid"
    assert spec(num_labels=1, sentence_transformers={
        "activation_fn": "torch.nn.modules.linear.Identity"}).score_activation == "identity"
    assert spec(num_labels=1, sbert_ce_default_activation_function=(
        "torch.nn.modules.activation.Sigmoid")).score_activation == "sigmoid"
    logits = np.array([[-1000.0, 0.0, 1000.0]], np.float32)
    assert activate(logits, "sigmoid").tolist() == [[0.0, 0.5, 1.0]]  # no overflow
    assert np.allclose(activate(logits, "softmax"), [[0.0, 0.0, 1.0]])


def test_gemma2s_head_reads_the_uncapped_hidden_state(tmp_path):
    """Gemma 2: sandwich norms, embedding scale, soft caps; the score head is not capped."""
    from asyncengine.engine.llm import LLM
    from asyncengine.engine.scoring import classify

    model_dir = make_tiny_classifier(tmp_path, "gemma2", num_labels=1)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    prompts = [list(range(100, 100 + n)) for n in (5, 12)]
    with torch.no_grad():
        want = np.stack([ref(torch.tensor([p])).logits[0].numpy() for p in prompts])
    llm = LLM(model_dir, num_gpu_blocks_override=32)

    async def run():
        async with llm.engine:
            return await classify(llm.engine, prompts, activation=False)

    assert np.abs(anyio.run(run) - want).max() < 1e-4


def test_a_token_the_vocabulary_lacks_is_refused(tiny_models):
    from asyncengine.engine.llm import LLM

    with pytest.raises(ValueError, match="'definitely-not-a-token' is not a token"):
        LLM(tiny_models["qwen3"], num_gpu_blocks_override=16, hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "definitely-not-a-token"],
            "method": "from_2_way_softmax"})
