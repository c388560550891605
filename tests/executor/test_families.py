"""Every family beyond the plain Llama layout gives transformers' greedy tokens, from
safetensors and from an F32 GGUF written as llama.cpp writes it: Gemma 2 (soft-caps, window
on alternate layers, sandwich norms, GELU-tanh, (1 + w) norms, embedding scale, head_dim 256),
Gemma 3 (q/k norms, local and global RoPE bases, linear scaling on the global layers), Phi-3
(fused checkpoint tensors), Phi-4-mini's shape (partial rotary, LongRoPE) and Mistral / Qwen2
with a sliding window. Prompts are longer than every window; the engine runs chunked prefill,
preemption from a small block pool and, in a second round, prefix-cache hits."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from asyncengine.executor.attention.base import AttentionOptions
from asyncengine.executor.models.family import describe
from asyncengine.executor.weights.loader import load_model, resolve_model
from tests.engine.test_engine import hf_greedy
from tests.executor.test_models import PagedRunner, reference_logits
from tests.utils import hf_reference_model, make_tiny_gguf, make_tiny_model

FAMILIES = ["gemma2", "gemma3", "phi3", "phi4mini", "mistral_sw", "qwen2_sw"]
PROMPTS = ["The capital of France is Paris, and the capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "Once upon a time, in a land far away, there lived a"]
N = 12
# llama.cpp's qwen2 architecture has no window key (released Qwen2/2.5 ship with
# use_sliding_window false): such a file cannot say it, so it is not converted here.
NO_GGUF = {"qwen2_sw"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (safetensors directory, GGUF file)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        # std 0.1: attention sharp enough that a wrong window or RoPE moves the tokens
        d = make_tiny_model(root / family, family, initializer_range=0.1)
        out[family] = (d, None if family in NO_GGUF else make_tiny_gguf(
            d, root / f"{family}.gguf"))
    return out


def test_each_family_differs_where_it_should(models):
    from transformers import AutoConfig

    specs = {f: describe(AutoConfig.from_pretrained(models[f][0])) for f in FAMILIES}
    g2, g3 = specs["gemma2"], specs["gemma3"]
    assert [layer.attention.window for layer in g2.layers] == [8, None, 8]
    assert {layer.attention.soft_cap for layer in g2.layers} == {50.0}
    assert g2.final_soft_cap == 30.0 and g2.head_dim == 256 and g2.norm_offset == 1.0
    assert [layer.rope for layer in g3.layers] == ["sliding_attention", "full_attention",
                                                   "sliding_attention"]
    assert g3.qk_norm and g3.ropes["full_attention"]["rope_type"] == "linear"
    assert specs["phi4mini"].rotary_dim == 12 and specs["phi4mini"].head_dim == 16
    assert [layer.attention.window for layer in specs["qwen2_sw"].layers] == [None, 8, 8]
    for family in FAMILIES:  # the C++ decode stack reads every family's description
        assert "decode_stack" not in specs[family].lacks()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_across_the_window(models, family):
    """Prefill, then one decode at a time far past the window, through shuffled blocks, from
    both formats; and the window matters: without it the logits move."""
    directory, gguf = models[family]
    want_model = hf_reference_model(directory)
    tokens = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(3))
    want = reference_logits(want_model, tokens)
    for path in (directory, gguf) if gguf else (directory,):
        model = load_model(resolve_model(path), "auto", torch.float32, "cpu")
        model.configure_context(60)
        runner = PagedRunner(model, block_size=4)
        runner.backend.configure_layers(model.attention_options())
        got = [runner.step({"r": tokens[:11]})["r"]]
        got += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(11, 30)]
        torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    if model.sliding_window is None and all(
            layer.self_attn.options.window is None for layer in model.model.layers):
        return
    for layer in model.model.layers:  # the same model attending the whole context
        layer.self_attn.options = AttentionOptions(None, layer.self_attn.options.soft_cap)
    runner = PagedRunner(model, block_size=4)
    runner.backend.configure_layers(model.attention_options())
    full = runner.step({"r": tokens})["r"]
    assert (full[8:] - want[8:]).abs().max() > 1e-2


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(models, family, fmt):
    directory, gguf = models[family]
    if fmt == "gguf" and gguf is None:
        pytest.skip("llama.cpp's qwen2 GGUF has no sliding window")
    # Mistral's window is on every layer, so blocks before it go back to the pool as a
    # request runs (core/kv/manager.py): a smaller pool still preempts.
    extra = {"num_gpu_blocks_override": 8} if family == "mistral_sw" else {}
    check_greedy_in_the_engine(directory, directory if fmt == "safetensors" else gguf, **extra)


def check_greedy_in_the_engine(directory: str, model: str, **config) -> None:
    """The engine's greedy tokens for PROMPTS equal transformers' generate on the model of
    ``directory`` (served from ``model``: the directory or its GGUF), under chunked prefill
    and preemption (a pool of 12 blocks of 8), twice: the second round hits the prefix
    cache. The pool is whole again after."""
    hf = hf_reference_model(directory)
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": model, "tokenizer": directory, "dtype": "float32", "max_num_seqs": 4,
        "max_num_batched_tokens": 16, "block_size": 8, "num_gpu_blocks_override": 12,
        "max_model_len": 60, **config}))
    prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(ids) > 8 for ids in prompt_ids)  # longer than the window
    refs = [hf_greedy(hf, ids, N)[0] for ids in prompt_ids]
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    results: dict[tuple[int, int], list[int]] = {}

    async def run(rnd: int, i: int) -> None:
        async for out in engine.generate(prompt_ids[i], greedy):
            results[rnd, i] = out.outputs[0].token_ids

    async def main() -> None:
        async with engine:
            for rnd in range(2):  # the second round hits the prefix cache
                async with anyio.create_task_group() as tg:
                    for i in range(len(PROMPTS)):
                        tg.start_soon(run, rnd, i)

    anyio.run(main)
    for rnd in range(2):
        for i, ref in enumerate(refs):
            assert results[rnd, i] == ref, (model, rnd, i)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_window_does_not_cap_the_context(models):
    """A 40-token prompt on a model with a window of 8 runs (it was refused as longer than
    the context before), and the context is the model's, not the window."""
    from asyncengine import LLM

    llm = LLM(models["mistral_sw"][0], dtype="float32", max_model_len=64)
    assert llm.engine.max_model_len == 64
    out = llm.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([list(range(100, 170))], SamplingParams(max_tokens=2))


def _unsupported(tmp_path) -> tuple[str, str]:
    """A model directory of an architecture nobody registered, and a GGUF file of one."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig

    directory = tmp_path / "foo"
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4)
    config.architectures = ["FooForCausalLM"]
    config.save_pretrained(directory)
    path = str(tmp_path / "falcon.gguf")
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(directory), path


def test_unsupported_architecture_is_one_line_naming_the_supported(tmp_path):
    """The CLI exits 2 with one line and no traceback; the offline API raises the
    ValueError itself; both name what is supported."""
    from asyncengine import LLM
    from tests.cli.test_cli import run_cli

    directory, gguf_file = _unsupported(tmp_path)
    r = run_cli("serve", directory, "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "'FooForCausalLM' is not supported" in lines[0]
    assert "LlamaForCausalLM" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]
    for model, name, supported in ((directory, "FooForCausalLM", "Qwen3MoeForCausalLM"),
                                   (gguf_file, "falcon", "qwen3moe")):
        with pytest.raises(ValueError, match=f"{name}.* is not supported .*{supported}") as e:
            LLM(model)
        assert "\n" not in str(e.value)
