"""--compile (the CPU decoder through torch.compile, per token bucket): greedy tokens and
logprobs equal transformers' for a tiny model and the embedded one, padded buckets included;
bad values name their flag."""

from __future__ import annotations

import pytest

from asyncengine import LLM
from asyncengine.config import EngineConfig
from asyncengine.executor.paths.compiled import CompiledModel, token_buckets
from tests.engine.test_engine import PROMPTS, check_against_hf
from tests.utils import embedded_gguf_path, hf_reference_model, make_tiny_model


def graphs_of(model: CompiledModel) -> int:
    """The graphs dynamo holds for ``model`` (its own code object's cache)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(model.code))


@pytest.fixture(autouse=True)
def _inductor_cache(tmp_path_factory, monkeypatch):
    # One cache per test session: the second LLM of a session reuses the first one's kernels.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR",
                       str(tmp_path_factory.getbasetemp() / "inductor"))


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(4) == [1, 2, 4]
    assert token_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def test_tiny_model_compiled_matches_transformers(tmp_path):
    """Buckets 1, 2, 4: decodes of 1..4 rows run compiled (3 rows padded to 4), prefill chunks
    above 4 tokens eagerly; a tiny block pool forces preemption. The model is a Gemma 3, whose
    layout has everything the traced decoder must follow: scaled embeddings, two RoPE tables
    (local and global layers), sliding windows on some layers (the attention op finds each
    layer's options), q/k norms, norms before and after each block. (The embedded model's
    test below is the Llama layout.)"""
    model = make_tiny_model(tmp_path / "gemma3", "gemma3", num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])
    hf = hf_reference_model(model)
    llm = LLM(model, dtype="float32", compile=True, compile_max_tokens=4,
              max_num_batched_tokens=32, max_num_seqs=3, num_gpu_blocks_override=12,
              block_size=8, max_model_len=128)
    plan = llm.engine.runner.paths
    # every phase offers its steps to the compiled forward first; larger ones run eagerly
    assert [[p.name for p in plan.chains[ph]] for ph in ("decode", "prefill", "mixed")] == \
        [["compiled", "eager"]] * 3
    model = plan.path("compiled").model
    assert isinstance(model, CompiledModel) and model.buckets == [1, 2, 4]
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    check_against_hf(llm, hf, prompts, 16)
    assert model.compiled_steps >= 16
    check_against_hf(llm, hf, prompts[:1], 8)  # alone: the 1-token bucket
    assert graphs_of(model) == 3  # one per bucket, from warm-up: no step recompiled one


def test_a_mixture_of_experts_compiles_with_each_layer_as_one_op(tmp_path):
    """Qwen2-MoE (experts and a shared expert): the traced decoder calls each MoE layer as
    one opaque op (``models/moe_op.py``: its experts' rows depend on the router), so every
    decode step (one bucket: requests one at a time) runs compiled, and the tokens and
    logprobs equal transformers'."""
    model = make_tiny_model(tmp_path / "moe", "qwen2_moe")
    hf = hf_reference_model(model)
    llm = LLM(model, dtype="float32", compile=True, compile_max_tokens=1,
              max_num_batched_tokens=32, max_num_seqs=1, num_gpu_blocks_override=24,
              block_size=8, max_model_len=128)
    compiled = llm.engine.runner.paths.path("compiled").model
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    check_against_hf(llm, hf, prompts, 10)
    assert compiled.compiled_steps >= 2 * 9
    assert graphs_of(compiled) == 1  # its own cache, whatever other models compiled before


@pytest.mark.slow
def test_embedded_model_compiled_matches_transformers():
    """The embedded SmolLM2 with one bucket (a batch-1 decode; ~1 min to compile on 2 cores):
    requests one at a time, so every decode step runs compiled."""
    hf = hf_reference_model(embedded_gguf_path())
    llm = LLM(None, dtype="float32", compile=True, compile_max_tokens=1, max_num_seqs=1,
              max_num_batched_tokens=64, num_gpu_blocks_override=16, block_size=16,
              max_model_len=256)
    model = llm.engine.runner.paths.path("compiled").model
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    check_against_hf(llm, hf, prompts, 12)
    assert model.compiled_steps >= 3 * 11


def test_bad_compile_values():
    with pytest.raises(ValueError, match="--compile-max-tokens"):
        EngineConfig.from_dict({"compile": True, "compile_max_tokens": 0})
