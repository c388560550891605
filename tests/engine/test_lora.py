"""Multi-LoRA serving against PEFT: tiny random-weight models with random PEFT adapters
(non-zero B: ``init_lora_weights=False``; several ranks and target sets, rsLoRA), base and
adapter requests mixed in one batch, on float and on packed int4 / int8 base weights (PEFT
then runs on the dequantized base)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import AsyncEngine
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.lora import ops
from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
from tests.engine.test_engine import hf_greedy
from tests.utils import make_tiny_model

peft = pytest.importorskip("peft")

N = 6
PROMPTS = ["The capital of France is", "Once upon a time, in a land", "1, 2, 3, 4,",
           "def fibonacci(n):", "Hello there, my name is", "The quick brown fox"]
# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], False),
    "mlp2": (2, 4, ["o_proj", "gate_proj", "down_proj"], True),
}


def make_adapter(base_dir: str, out: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> str:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    pm = peft.get_peft_model(model, config)
    with torch.no_grad():  # large enough updates that the greedy tokens change
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    pm.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def lora_families(tmp_path_factory):
    """family -> {"base": model dir, adapter name: adapter dir}, made on first use."""
    made: dict[str, dict[str, str]] = {}

    def get(family: str) -> dict[str, str]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"lora_{family}")
            paths = {"base": make_tiny_model(root / family, family)}
            for i, (name, spec) in enumerate(ADAPTERS.items()):
                paths[name] = make_adapter(paths["base"], root / name, *spec, seed=10 + i)
            made[family] = paths
        return made[family]

    return get


def peft_reference(base_dir: str, adapter: str | None, prompts: list[list[int]],
                   state: dict[str, torch.Tensor] | None = None) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if state is not None:  # the dequantized base weights our engine computes with
        model.load_state_dict(state, strict=False)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    return [hf_greedy(model, ids, N)[0] for ids in prompts]


def engine_for(paths: dict[str, str], **extra) -> AsyncEngine:
    modules = [f"{n}={paths[n]}" for n in ADAPTERS]
    return AsyncEngine(EngineConfig.from_dict({
        "model": paths["base"], "dtype": "float32", "max_num_seqs": 16,
        "max_num_batched_tokens": 64, "block_size": 8, "num_gpu_blocks_override": 128,
        "max_model_len": 64, "enable_lora": True, "lora_modules": modules,
        "max_lora_rank": 8, **extra}))


def run_mixed(engine: AsyncEngine, jobs: list[tuple[list[int], str | None]]
              ) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    results: list[list[int]] = [[] for _ in jobs]

    async def one(i: int) -> None:
        ids, name = jobs[i]
        async for out in engine.generate(ids, greedy, lora_name=name):
            results[i] = out.outputs[0].token_ids

    async def main() -> None:
        async with engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return results


def dequantized_state(engine: AsyncEngine) -> dict[str, torch.Tensor]:
    """Our packed model's weights, dequantized, under transformers' names."""
    model = engine.runner.model
    state = {}
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv = a.qkv_proj.dequantized()
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size])
        gate, up = m.gate_up_proj.dequantized().chunk(2)
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v,
                      p + "self_attn.o_proj.weight": a.o_proj.dequantized(),
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": m.down_proj.dequantized()})
    state["lm_head.weight"] = model.lm_head.dequantized()
    return state


@pytest.mark.parametrize("family,quantization", [("llama", "none"), ("llama", "int4"),
                                                 ("llama", "int8"), ("qwen3", "none")])
def test_mixed_batch_gives_pefts_greedy_tokens(lora_families, family, quantization):
    lora_models = lora_families(family)
    engine = engine_for(lora_models, max_loras=2, max_cpu_loras=2,
                        quantization=quantization)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    names = [None, *ADAPTERS]
    jobs = [(prompts[i], names[i % len(names)]) for i in range(len(prompts))]
    jobs += [(prompts[0], n) for n in names]  # one prompt under every adapter
    state = None if quantization == "none" else dequantized_state(engine)
    refs: dict[str | None, dict[int, list[int]]] = {}
    for name in names:
        mine = sorted({i for i, (_, n) in enumerate(jobs) if n == name})
        want = peft_reference(lora_models["base"], lora_models.get(name) if name else None,
                              [jobs[i][0] for i in mine], state)
        refs[name] = dict(zip(mine, want, strict=True))
    got = run_mixed(engine, jobs)
    for i, (_, name) in enumerate(jobs):
        assert got[i] == refs[name][i], (quantization, name, i)
    # the adapters change the tokens (the test would pass vacuously otherwise)
    first = [got[i] for i in range(len(prompts), len(jobs))]
    assert len({tuple(t) for t in first}) == len(names)
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.num_unfinished_requests == 0
    if quantization == "int4" and packed_kernels.available("int4"):
        # the decode steps with adapter rows ran in the C++ decode stack, with its LoRA
        path = engine.runner.paths.path("cpu_stack")
        stack = None if path is None else path.stack
        assert stack is not None and stack.lora_table is not None and stack.lora_steps > 0


def dense_add_lora(x: torch.Tensor, base: torch.Tensor, table: SlotTable,
                   slots: torch.Tensor, S: int) -> torch.Tensor:
    """``base`` plus the adapters' deltas through the dense torch path (not the kernel)."""
    ops.USE_KERNEL = False
    try:
        dense = base.clone()
        add_lora(x, dense, table, LoRAStep(slots, S))
    finally:
        ops.USE_KERNEL = True
    return dense


def test_kernel_equals_the_torch_path():
    gen = torch.Generator().manual_seed(0)
    S, R, K, N_ = 4, 12, 64, 96
    A = torch.randn(S, R, K, generator=gen)
    B = torch.randn(S, R, N_, generator=gen)
    A[0] = B[0] = 0
    rows = torch.tensor([0, 12, 5, 12])
    A[2, 5:] = B[2, 5:] = 0
    span = torch.zeros(S, R, 2, dtype=torch.int64)
    span[..., 1] = N_
    span[3, :6] = torch.tensor([0, 40])  # slot 3: rows 0-5 write columns 0-39, 6-11 the rest
    span[3, 6:] = torch.tensor([40, N_])
    B[3, :6, 40:] = 0
    B[3, 6:, :40] = 0
    table = SlotTable(A, B, rows, span)
    x = torch.randn(9, K, generator=gen)
    slots = torch.tensor([0, 1, 2, 1, 3, 0, 2, 2, 1])
    base = torch.randn(9, N_, generator=gen)
    want = base.clone()
    for t in range(9):
        s = int(slots[t])
        want[t] += (A[s] @ x[t]) @ B[s]
    if ops.kernel(torch.float32) is None:
        pytest.skip("no C++ compiler")
    got = base.clone()
    add_lora(x, got, table, LoRAStep(slots, S))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dense_add_lora(x, base, table, slots, S), want, rtol=1e-5,
                               atol=1e-4)
