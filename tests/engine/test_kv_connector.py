"""KV connectors: the built-in safetensors block store end to end — blocks saved by one engine
are loaded (not recomputed) by a new engine in a new process, greedy tokens unchanged; a
shared prefix loads only that prefix; a damaged block is recomputed; concurrent writers;
stores keyed by model and layout; configuration errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.builtins.safetensors_connector import SafetensorsKVConnector
from asyncengine.config import EngineConfig
from asyncengine.core.kv.hashing import update_block_hashes
from asyncengine.core.request import Request
from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.core.sched.interface import Scheduler
from asyncengine.ext.contracts.kv_connector import KVCacheLayout

BS = 16
MAX_TOKENS = 12
ENGINE = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=512, block_size=BS)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in (50, 75, 100)]


PROMPTS = make_prompts()


def loadable(prompt: list[int]) -> int:
    """Tokens of a prompt the store can serve: whole blocks, never the last token."""
    return (len(prompt) - 1) // BS * BS


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def count_computed_tokens(llm: LLM) -> list[int]:
    """Count the tokens the model is run on (every step's input ids)."""
    runner = llm.engine.runner
    prepare, counter = runner.prepare, [0]

    def counting(out, **kw):
        inputs = prepare(out, **kw)
        counter[0] += len(inputs.input_ids)
        return inputs

    runner.prepare = counting
    return counter


def assert_free(llm: LLM) -> None:
    assert llm.engine.num_unfinished_requests == 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


@pytest.fixture(scope="module")
def plain_llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def baseline(plain_llm) -> list[list[int]]:
    return generate(plain_llm, PROMPTS)[0]


@pytest.fixture(scope="module")
def store(tiny_llama, baseline, tmp_path_factory) -> Path:
    """Engine A fills a store with the blocks it computes for PROMPTS."""
    path = tmp_path_factory.mktemp("kv-store")
    a = LLM(tiny_llama, kv_connector="safetensors", kv_connector_path=str(path), **ENGINE)
    tokens, cached = generate(a, PROMPTS)
    assert tokens == baseline
    assert cached == [0, 0, 0] and a.engine.kv_transfer.num_loaded_tokens == 0
    # Every full block of computed tokens (prompt and output; the last sampled token is not
    # computed) is saved, one file each.
    expected = sum((len(p) + MAX_TOKENS - 1) // BS for p in PROMPTS)
    assert a.engine.parts.kv_connector.num_saved_blocks == expected
    assert len(block_files(path)) == expected
    assert_free(a)
    return path


B_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from asyncengine import LLM, SamplingParams
from tests.engine.test_kv_connector import ENGINE, GREEDY, PROMPTS, count_computed_tokens, generate
llm = LLM(sys.argv[2], kv_connector="safetensors", kv_connector_path=sys.argv[3], **ENGINE)
computed = count_computed_tokens(llm)
tokens, cached = generate(llm, PROMPTS)
print(json.dumps({"tokens": tokens, "cached": cached, "computed": computed[0],
                  "loaded": llm.engine.kv_transfer.num_loaded_tokens,
                  "free": llm.engine.num_free_blocks, "total": llm.engine.num_total_blocks}))
"""


def test_new_process_loads_prefixes_from_disk(tiny_llama, baseline, store):
    """Engine B, in a fresh process, reads the prompts' prefixes from A's files instead of
    computing them, and its greedy tokens equal A's and a run without a connector."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", B_SCRIPT, str(REPO), tiny_llama, str(store)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = json.loads(proc.stdout.strip().splitlines()[-1])
    assert b["tokens"] == baseline
    assert b["cached"] == [loadable(p) for p in PROMPTS]
    assert b["loaded"] == sum(loadable(p) for p in PROMPTS)
    # Only the tails of the prompts went through the model, then one token per decode step.
    assert b["computed"] == sum(len(p) - loadable(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert b["free"] == b["total"]


def test_shared_prefix_loads_only_that_prefix(tiny_llama, plain_llm, store):
    prompt = PROMPTS[2][:40] + make_prompts()[0][:30]  # 40 tokens in common: 2 whole blocks
    expected = generate(plain_llm, [prompt])[0]
    c = LLM(tiny_llama, kv_connector="safetensors", kv_connector_path=str(store), **ENGINE)
    computed = count_computed_tokens(c)
    tokens, cached = generate(c, [prompt])
    assert tokens == expected
    assert cached == [2 * BS] and c.engine.kv_transfer.num_loaded_tokens == 2 * BS
    assert computed[0] == len(prompt) - 2 * BS + MAX_TOKENS - 1
    assert_free(c)


def test_damaged_block_is_recomputed_and_replaced(tiny_llama, baseline, store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    d = LLM(tiny_llama, kv_connector="safetensors", kv_connector_path=str(copy), **ENGINE)
    connector = d.engine.parts.kv_connector
    req = Request("r", PROMPTS[0], GREEDY)
    damaged = connector.block_path(update_block_hashes(req, BS)[1])
    damaged.write_bytes(damaged.read_bytes()[:100])  # prompt 0's second block, truncated
    computed = count_computed_tokens(d)
    tokens, cached = generate(d, PROMPTS[:1])
    assert tokens == baseline[:1]
    assert cached == [BS]  # the first block loaded; the step recomputed from the second
    assert d.engine.kv_transfer.num_failed_load_tokens == loadable(PROMPTS[0]) - BS
    assert computed[0] == len(PROMPTS[0]) - BS + MAX_TOKENS - 1
    assert connector._read_block(update_block_hashes(req, BS)[1]) is not None  # saved again
    assert_free(d)


def test_configuration_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="--kv-connector: KV connector 'nope' is not "
                                         "registered.*safetensors"):
        LLM(tiny_llama, kv_connector="nope", **ENGINE)
    with pytest.raises(ValueError, match="--kv-connector-path"):
        LLM(tiny_llama, kv_connector="safetensors", **ENGINE)
    with pytest.raises(ValueError, match="does not implement KVConnector.save"):
        LLM(tiny_llama, kv_connector=f"{__name__}:NoSave", kv_connector_path=str(tmp_path),
            **ENGINE)
    with pytest.raises(ValueError, match="scheduler NoConnectors does not support KV"):
        LLM(tiny_llama, kv_connector="safetensors", kv_connector_path=str(tmp_path),
            scheduler=f"{__name__}:NoConnectors", **ENGINE)


class NoSave:
    def __init__(self, config, layout): ...
    def lookup(self, request, num_local_tokens): return 0
    async def load(self, block_hashes): ...


class NoConnectors(FCFSScheduler):
    set_kv_connector = Scheduler.set_kv_connector


def layout(model: str = "m", dtype: torch.dtype = torch.float32, block_size: int = 4):
    return KVCacheLayout(json.dumps({"path": f"/models/{model}"}), num_layers=2,
                         block_size=block_size, num_kv_heads=2, head_dim=8, dtype=dtype)


def test_store_concurrent_writers_and_separate_models(tmp_path):
    config = EngineConfig.from_dict({"kv_connector": "safetensors",
                                     "kv_connector_path": str(tmp_path)})
    req = Request("r", list(range(3, 20)), SamplingParams())
    hashes = update_block_hashes(req, 4)  # 4 full blocks of 17 tokens
    kv = torch.randn(len(hashes), *layout().block_shape)
    writers = [SafetensorsKVConnector(config, layout()) for _ in range(2)]

    async def save_both():
        async with anyio.create_task_group() as tg:
            for w in writers:
                tg.start_soon(w.save, hashes, kv)

    anyio.run(save_both)
    root = writers[0].root
    assert len(block_files(root)) == 4 and not [p for p in root.rglob("*.tmp")]
    reader = SafetensorsKVConnector(config, layout())
    assert reader.lookup(req, 0) == 16  # all 4 blocks: the last token (17th) is outside
    assert reader.lookup(req, 8) == 8
    assert torch.equal(anyio.run(reader.load, hashes[:3]), kv[:3])
    # Another model, dtype or block size has a store of its own: nothing to share.
    for other in (layout(model="other"), layout(dtype=torch.bfloat16), layout(block_size=8)):
        c = SafetensorsKVConnector(config, other)
        assert c.root != root and c.lookup(req, 0) == 0
    assert json.loads((root / "store.json").read_text())["dtype"] == "float32"


def test_the_vllm_form_of_the_configuration(tmp_path):
    """--kv-transfer-config selects the built-in connector too, with its directory in
    kv_connector_extra_config ("path", or vLLM's "shared_storage_path")."""
    req = Request("r", list(range(3, 20)), SamplingParams())
    hashes = update_block_hashes(req, 4)
    kv = torch.randn(len(hashes), *layout().block_shape)
    for key in ("path", "shared_storage_path"):
        config = EngineConfig.from_dict({"kv_transfer_config": json.dumps({
            "kv_connector": "safetensors", "kv_role": "kv_both",
            "kv_connector_extra_config": {key: str(tmp_path / key)}})})
        assert config.plugins.kv_connector == "safetensors"
        connector = SafetensorsKVConnector(config, layout())
        assert connector.root.parent == tmp_path / key
        anyio.run(connector.save, hashes, kv)
        assert SafetensorsKVConnector(config, layout()).lookup(req, 0) == 16
    module_path = EngineConfig.from_dict({"kv_transfer_config": {
        "kv_connector": "SafetensorsKVConnector",
        "kv_connector_module_path": "asyncengine.builtins.safetensors_connector",
        "kv_connector_extra_config": {"path": str(tmp_path)}}})
    from asyncengine.ext import registry

    assert registry.resolve_kv_connector(module_path.plugins.kv_connector) is \
        SafetensorsKVConnector
    with pytest.raises(ValueError, match="--kv-connector-path"):
        SafetensorsKVConnector.validate_config(EngineConfig.from_dict({"kv_transfer_config": {
            "kv_connector": "safetensors"}}))
