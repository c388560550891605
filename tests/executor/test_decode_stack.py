"""The decode step's layers in one C++ call (``paths/cpu_stack.py``): the very numbers of
the per-layer path, for every family and weight format, and only where it applies."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.paths.cpu_stack import DecodeStack
from asyncengine.executor.weights.int4 import TILE_REQUESTS
from asyncengine.executor.weights.loader import load_model, resolve_model
from tests.executor.test_models import PagedRunner
from tests.utils import FAMILIES, make_tiny_gguf, make_tiny_model

pytestmark = pytest.mark.skipif(not packed_kernels.available("int4"),
                                reason="the packed CPU kernel does not build here")


def _run(model, stack: DecodeStack | None, prompts: dict[str, torch.Tensor],
         decodes: list[list[str]], kv_dtype: torch.dtype | None = None
         ) -> list[dict[str, torch.Tensor]]:
    """Prefill ``prompts``, then one decode step per entry of ``decodes`` (the requests in
    it each feed their last greedy token), the KV cache in ``kv_dtype`` (None: the model's).
    Returns every step's logits."""
    runner = PagedRunner(model, num_blocks=320, block_size=4,
                         dtype=kv_dtype or model.model.norm.weight.dtype, stack=stack)
    out = [runner.step(prompts)]
    last = {r: int(out[0][r][-1].argmax()) for r in prompts}
    for reqs in decodes:
        logits = runner.step({r: torch.tensor([last[r]]) for r in reqs})
        last.update({r: int(logits[r][-1].argmax()) for r in reqs})
        out.append(logits)
    return out


def _count_runs(stack: DecodeStack, monkeypatch) -> list[int]:
    """Patch ``stack.run`` to record the token count of each step it ran itself."""
    ran: list[int] = []
    run = stack.run

    def counting(h, *args):
        result = run(h, *args)
        if result is not None:
            ran.append(h.shape[0])
        return result

    monkeypatch.setattr(stack, "run", counting)
    return ran


@pytest.mark.parametrize("source", ["embedded-gguf", "embedded-gguf-bf16", "tiny-int4",
                                    "tiny-int4-bf16", "mixed-gguf", "mixed-gguf-bf16"])
def test_stack_equals_the_per_layer_path_bit_for_bit(source, tiny_models, monkeypatch,
                                                     tmp_path):
    check_stack(source, None, tiny_models, monkeypatch, tmp_path)


@pytest.mark.parametrize(("source", "kv_dtype"), [
    ("embedded-gguf-bf16", torch.float8_e4m3fn), ("tiny-int4", torch.float8_e5m2),
    ("mixed-gguf", torch.float8_e4m3fn)])
def test_stack_equals_the_per_layer_path_with_a_float8_cache(source, kv_dtype, tiny_models,
                                                             monkeypatch, tmp_path):
    """--kv-cache-dtype fp8: both stacks (int4, GGUF blocks) built for a float8 cache give
    the per-layer path's numbers, which read and write the same cache."""
    check_stack(source, kv_dtype, tiny_models, monkeypatch, tmp_path)


def check_stack(source: str, kv_dtype: torch.dtype | None, tiny_models, monkeypatch,
                tmp_path) -> None:
    dtype = torch.bfloat16 if source.endswith("bf16") else torch.float32
    if dtype == torch.bfloat16 and not source.startswith("mixed-gguf") and \
            not packed_kernels.int4_bf16_available():
        pytest.skip("int4 in bfloat16 needs the AVX-512 BF16 kernel (int4_bf16.cpp)")
    if source.startswith("embedded-gguf"):  # the default: the file's Q4_1 blocks, packed
        model = load_model(resolve_model(None), "auto", dtype, "cpu", quantization="auto")
    elif source.startswith("mixed-gguf"):  # Q4_K_M's mix of types kept packed, q/k/v bias
        from tests.executor.test_kquants import write_mixed_gguf

        path = write_mixed_gguf(str(tmp_path / "tiny-Q4_K_M.gguf"))
        model = load_model(resolve_model(path), "auto", dtype, "cpu", quantization="auto")
    else:
        model = load_model(resolve_model(tiny_models["llama"]), "auto", dtype, "cpu",
                           quantization="int4")
    stack = DecodeStack.for_model(model)
    assert stack is not None
    assert stack.formats == (("GGUF blocks",) if source.startswith("mixed-gguf") else ("int4",))
    gen = torch.Generator().manual_seed(3)
    # Eighteen requests; "long" reaches past two attention splits of 128 positions when it
    # decodes alone (the split results are merged), the others are short. All of them: a step
    # of TILE_REQUESTS requests and more (int4 in bfloat16: the byte tiles, in the stack too).
    prompts = {f"r{i}": torch.randint(0, 49152, (3 + 3 * i,), generator=gen) for i in range(17)}
    prompts["long"] = torch.randint(0, 49152, (300,), generator=gen)
    everyone = list(prompts)
    assert len(everyone) >= TILE_REQUESTS
    decodes = [["long"], ["long"], everyone[:3], everyone[:10], everyone, everyone,
               ["r4", "long"]]
    if source in ("embedded-gguf-bf16", "tiny-int4-bf16"):
        assert stack.tile_requests == (TILE_REQUESTS if packed_kernels.int4_tile8_available()
                                       else 1 << 62)
    ran = _count_runs(stack, monkeypatch)
    fused = _run(model, stack, prompts, decodes, kv_dtype)
    # every decode step in the stack's range ran fused (GGUF: fewer than 8 tokens), no prefill
    assert ran == [len(d) for d in decodes if len(d) < stack.max_rows]
    per_layer = _run(model, None, prompts, decodes, kv_dtype)
    for got, want in zip(fused, per_layer, strict=True):
        for r in want:
            assert torch.equal(got[r], want[r]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_stack_takes_a_model_of_mixed_formats(dtype, monkeypatch, tmp_path):
    """Each projection carries its own format: a GGUF model some of whose projections are
    int4 (with a bias, Qwen2's q/k/v) runs in the one stack, each matmul dispatched on its
    kind, to the bit the per-layer path's."""
    from asyncengine.executor.weights.int4 import Int4Linear
    from tests.executor.test_kquants import write_mixed_gguf

    if dtype == torch.bfloat16 and not packed_kernels.int4_bf16_available():
        pytest.skip("int4 in bfloat16 needs the AVX-512 BF16 kernel (int4_bf16.cpp)")
    path = write_mixed_gguf(str(tmp_path / "tiny-Q4_K_M.gguf"))
    model = load_model(resolve_model(path), "auto", dtype, "cpu", quantization="auto")
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for parent, name in ((attn, "qkv_proj"), (mlp, "down_proj"))[i % 2:]:
            lin = getattr(parent, name)
            setattr(parent, name, Int4Linear(lin.dequantized(), lin.bias))
    stack = DecodeStack.for_model(model)
    assert stack is not None and stack.formats == ("int4", "GGUF blocks")
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(0, 49152, (2 + i,), generator=gen) for i in range(4)}
    everyone = list(prompts)
    decodes = [everyone, everyone[:1], everyone[1:]]
    ran = _count_runs(stack, monkeypatch)
    fused = _run(model, stack, prompts, decodes)
    assert ran == [4, 1, 3]
    per_layer = _run(model, None, prompts, decodes)
    for got, want in zip(fused, per_layer, strict=True):
        for r in want:
            assert torch.equal(got[r], want[r]), r


# A GGUF type per family (the tiny models' rows are too short for the k-quants' 256): the
# blocks of 32 each in some family.
_GGUF_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")


class _FamilyModels:
    """Each tiny family's safetensors directory and GGUF file, made when first asked for."""

    def __init__(self, root) -> None:
        self.root, self.made = root, {}

    def __getitem__(self, family: str) -> tuple[str, str]:
        if family not in self.made:
            # std 0.1: attention sharp enough that the windows and soft caps matter
            d = make_tiny_model(self.root / family, family, initializer_range=0.1)
            qtype = _GGUF_TYPES[list(FAMILIES).index(family) % len(_GGUF_TYPES)]
            self.made[family] = (d, make_tiny_gguf(d, self.root / f"{family}-{qtype}.gguf",
                                                   quant=qtype))
        return self.made[family]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> _FamilyModels:
    return _FamilyModels(tmp_path_factory.mktemp("stack-families"))


def _check_family(model, monkeypatch, kv_dtype: torch.dtype | None = None) -> DecodeStack:
    """Stack and per-layer path through one schedule, logits equal to the bit: a request past
    every window (8 in the tiny Gemma / Mistral / Qwen2 ones) decoding alone, small steps,
    and a step of 18 requests (int4 in bfloat16: the byte tiles; GGUF in bfloat16: the
    kernel's own tiles)."""
    stack = DecodeStack.for_model(model)
    assert stack is not None, DecodeStack.why_not(model)
    gen = torch.Generator().manual_seed(3)
    prompts = {f"r{i}": torch.randint(0, 49152, (3 + 2 * i,), generator=gen) for i in range(17)}
    prompts["long"] = torch.randint(0, 49152, (40,), generator=gen)
    everyone = list(prompts)
    decodes = [["long"], everyone[:3], everyone, ["r4", "long"], ["long"]]
    ran = _count_runs(stack, monkeypatch)
    fused = _run(model, stack, prompts, decodes, kv_dtype)
    assert ran == [len(d) for d in decodes if len(d) < stack.max_rows]
    per_layer = _run(model, None, prompts, decodes, kv_dtype)
    for got, want in zip(fused, per_layer, strict=True):
        for r in want:
            assert torch.equal(got[r], want[r]), r
    return stack


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_on_the_stack_equals_its_per_layer_path(family, family_models,
                                                              monkeypatch):
    """Each family of tests/utils.py (Gemma 2 / 3's norms, soft caps, windows and RoPE
    tables, Qwen3's q / k norms, Phi-4-mini's partial rotary, Qwen2's biases, the mixtures
    of experts...) in int4 and as a GGUF file kept packed, float32 and bfloat16: the stack's
    logits are the per-layer path's, bit for bit."""
    from asyncengine.executor.runtime import cpu_flags

    directory, gguf = family_models[family]
    bf16 = packed_kernels.int4_bf16_available()
    for path, quantization in ((directory, "int4"), (gguf, "gguf")):
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and quantization == "gguf" and bf16:
                # the kernel's bfloat16 tiles up to FUSED_ROWS (the suite runs without)
                monkeypatch.setattr(cpu_flags, "cpu_has_bf16", lambda: True)
            model = load_model(resolve_model(path), "auto", dtype, "cpu",
                               quantization=quantization)
            stack = _check_family(model, monkeypatch)
            monkeypatch.undo()
            assert stack.formats == (("int4",) if quantization == "int4" else ("GGUF blocks",))


@pytest.mark.parametrize(("family", "kv_dtype"), [("gemma2", torch.float8_e4m3fn),
                                                  ("qwen2_moe", torch.float8_e5m2)])
def test_families_on_the_stack_with_a_float8_cache(family, kv_dtype, family_models,
                                                   monkeypatch):
    directory, _ = family_models[family]
    model = load_model(resolve_model(directory), "auto", torch.float32, "cpu",
                       quantization="int4")
    _check_family(model, monkeypatch, kv_dtype)


def test_gguf_stack_takes_fused_tile_batches(monkeypatch, tmp_path):
    """A bfloat16 GGUF model where the kernel multiplies bfloat16 tiles itself
    (``kquant_tile.h``): decode steps of 16 to 64 tokens run in the stack too, to the bit the
    per-layer path's (its GGUFLinears send those rows to the same kernel)."""
    from asyncengine.executor.runtime import cpu_flags
    from asyncengine.executor.weights import kquants
    from tests.executor.test_kquants import write_mixed_gguf

    if not (kquants.kernels_available() and packed_kernels.kquant_bf16_tile()):
        pytest.skip("no AVX-512 BF16 here")
    monkeypatch.setattr(cpu_flags, "cpu_has_bf16", lambda: True)  # the suite runs without
    path = write_mixed_gguf(str(tmp_path / "tiny-Q4_K_M.gguf"))
    model = load_model(resolve_model(path), "auto", torch.bfloat16, "cpu", quantization="auto")
    stack = DecodeStack.for_model(model)
    assert stack is not None and stack.max_rows == kquants.FUSED_ROWS + 1
    gen = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(0, 49152, (2 + i,), generator=gen) for i in range(21)}
    everyone = list(prompts)
    decodes = [everyone, everyone[:17], everyone]
    ran = _count_runs(stack, monkeypatch)
    fused = _run(model, stack, prompts, decodes)
    assert ran == [21, 17, 21]
    per_layer = _run(model, None, prompts, decodes)
    for got, want in zip(fused, per_layer, strict=True):
        for r in want:
            assert torch.equal(got[r], want[r]), r


def test_the_structs_layout_is_checked_when_the_stack_loads():
    """The structs are declared once (kernels/stack_layout.h); the compiled stack reports
    their layout, which must be what Python reads from the header: a header that no longer
    matches the build (two fields swapped) is refused, loudly."""
    from asyncengine.executor.kernels.build import kernel_dir
    from asyncengine.executor.paths import cpu_stack, stack_layout

    fn = cpu_stack._load(torch.float32)
    if fn is None:
        pytest.skip("the stack does not build here")
    stack_layout.check(fn)
    text = (kernel_dir() / stack_layout.HEADER).read_text()
    swapped = text.replace("F(int64_t, n) \\\n    F(int64_t, k)",
                           "F(int64_t, k) \\\n    F(int64_t, n)")
    assert swapped != text
    _, structs = stack_layout.parse(swapped)
    with pytest.raises(RuntimeError, match="differ"):
        stack_layout.check(fn, structs)


def test_stack_only_where_it_applies(tiny_models, monkeypatch):
    # float weights, a format the stack does not take (int8), or the own kernels turned
    # off: no stack
    path = tiny_models["llama"]
    assert DecodeStack.for_model(load_model(resolve_model(path), "auto", torch.float32,
                                            "cpu")) is None
    int8 = load_model(resolve_model(tiny_models["qwen3"]), "auto", torch.float32, "cpu",
                      quantization="int8")
    assert "Int8Linear" in DecodeStack.why_not(int8)
    model = load_model(resolve_model(path), "auto", torch.float32, "cpu", quantization="int4")
    monkeypatch.setattr(layer_ops, "ENABLED", False)
    assert DecodeStack.for_model(model) is None
    monkeypatch.undo()
    stack = DecodeStack.for_model(model)
    ran = _count_runs(stack, monkeypatch)
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 49152, (n,), generator=gen) for n in (7, 5))
    runner = PagedRunner(model, block_size=4, stack=stack)
    runner.step({"a": a})
    runner.step({"a": a[:1], "b": b})  # a decode next to a prefill: the per-layer path
    runner.step({"a": a[:1], "b": b[:1]})
    assert ran == [2]
