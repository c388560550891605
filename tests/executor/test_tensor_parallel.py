"""Tensor parallelism on the CPU (gloo, two ranks): greedy tokens equal to TP=1 and to
transformers under chunked prefill, preemption and prefix hits; KV heads split, replicated, or
refused; the flags; two "nodes" on one machine; a worker killed mid-stream."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import anyio
import psutil
import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from tests.engine.test_engine import PROMPTS, assert_free, hf_greedy
from tests.server_utils import ServerProcess, free_port, sse_events
from tests.utils import make_tiny_model, tiny_config

# A 32-token budget chunks every prompt's prefill; 12 blocks of 8 tokens force preemption.
KW = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
          num_gpu_blocks_override=12, block_size=8, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check(llm: LLM, hf, prompts: list[list[int]], tp1: LLM | None = None) -> None:
    outs = llm.generate(prompts, GREEDY)
    refs = tp1.generate(prompts, GREEDY) if tp1 is not None else [None] * len(prompts)
    for p, out, ref in zip(prompts, outs, refs, strict=True):
        tokens, lps = hf_greedy(hf, p, GREEDY.max_tokens)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {p[:5]}...: {got.token_ids} != {tokens}"
        assert [got.logprobs[i][t].logprob for i, t in enumerate(tokens)] == \
            pytest.approx(lps, abs=2e-3)
        if ref is not None:
            assert ref.outputs[0].token_ids == got.token_ids
            assert [x and next(iter(x.values())).logprob for x in out.prompt_logprobs] == \
                pytest.approx([x and next(iter(x.values())).logprob
                               for x in ref.prompt_logprobs], abs=1e-4)
    assert_free(llm.engine)


def stop_workers(llm: LLM) -> None:
    llm.engine.shutdown()
    procs = llm.engine.parts.parallel.workers.procs
    assert [p.exitcode for p in procs] == [0] * len(procs)  # stopped by the stop message


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "qwen2_moe"])
def test_tp2_matches_tp1_and_transformers(family, tiny_models, tmp_path):
    """Phi-3's checkpoint fuses q/k/v and gate/up (each rank reads its rows of every part);
    Gemma 2 ties its head to the embedding, scales it, and soft-caps attention and logits;
    Qwen2-MoE's experts and shared expert are split over their features."""
    path = tiny_models[family] if family in tiny_models else make_tiny_model(
        tmp_path / family, family)
    hf = hf_model(path)
    tp1 = LLM(path, **KW)
    # llama: an explicit tcp:// rendezvous (what --distributed-init-method gives)
    extra = {"distributed_init_method": f"tcp://127.0.0.1:{free_port()}"} \
        if family == "llama" else {}
    tp2 = LLM(path, tensor_parallel_size=2, **extra, **KW)
    try:
        prompts = [tp2.tokenizer.encode(p) for p in PROMPTS]
        check(tp2, hf, prompts, tp1)
        check(tp2, hf, prompts[::-1], tp1)  # prefix-cache hits
        stats = tp2.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        # rank 0's KV cache holds its own heads only: 2 KV heads over 2 ranks
        assert tp2.engine.runner.kv_caches[0].shape[-2] == 1
        assert tp1.engine.runner.kv_caches[0].shape[-2] == 2
    finally:
        stop_workers(tp2)


@pytest.mark.parametrize(("overrides", "tp", "what"), [
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2, "3 KV heads"),
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "4 attention heads"),
])
def test_unsplittable_heads_are_refused(tmp_path, overrides, tp, what):
    tiny_config("llama", **overrides).save_pretrained(tmp_path)
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {tp}: the model's {what}"):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=tp, **KW)
    assert time.monotonic() - started < 10  # refused before any worker starts


@pytest.mark.parametrize(("values", "flag"), [
    (dict(tensor_parallel_size=2, nnodes=2), "--distributed-init-method"),
    (dict(tensor_parallel_size=3, nnodes=2, distributed_init_method="tcp://h:1"), "--nnodes"),
    (dict(nnodes=2, node_rank=2, distributed_init_method="tcp://h:1"), "--node-rank"),
    (dict(tensor_parallel_size=2, distributed_init_method="localhost:29500"),
     "--distributed-init-method"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
])
def test_parallel_flags_are_validated(values, flag):
    with pytest.raises(ValueError, match=re.escape(flag)):
        EngineConfig.from_dict(values)


def test_two_nodes_on_one_machine_and_a_replicated_kv_head(tmp_path):
    """--nnodes 2: node 1 runs rank 1 only (``serve --node-rank 1``); node 0 serves. The
    model has one KV head: each rank holds a copy of it."""
    path = make_tiny_model(tmp_path / "mqa", "qwen2", num_key_value_heads=1)
    method = f"tcp://127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "asyncengine", "serve", path, "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--distributed-init-method", method,
         "--dtype", "float32", "--block-size", "8"],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0,
                  distributed_init_method=method, **KW)
        check(llm, hf_model(path), [llm.tokenizer.encode(p) for p in PROMPTS[:3]])
        assert llm.engine.runner.kv_caches[0].shape[-2] == 1
        llm.engine.shutdown()
        assert node1.wait(timeout=30) == 0, node1.stderr.read().decode()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_killed_worker_fails_every_stream_and_the_server_exits(tiny_llama):
    server = ServerProcess(tiny_llama, "--tensor-parallel-size", "2", "--max-model-len", "512",
                           "--num-gpu-blocks-override", "128", "--block-size", "16")
    try:
        pids = re.search(r"worker ranks \[1\] \(pids \[(\d+)\]\)", server.log())
        assert pids, server.log()
        worker = int(pids.group(1))

        async def client(session: aiohttp.ClientSession, i: int, killed: anyio.Event,
                         ready: list[int], results: list) -> None:
            body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with session.post(server.url("/v1/completions"), json=body) as resp:
                if resp.status != 200:
                    results.append((resp.status, b""))
                    return
                first = await resp.content.readline()
                ready.append(i)
                await killed.wait()
                with anyio.fail_after(20):  # an error event, not a hang
                    results.append((resp.status, first + await resp.read()))

        async def main() -> tuple[list, float]:
            killed, ready, results = anyio.Event(), [], []
            async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(client, session, i, killed, ready, results)
                with anyio.fail_after(30):
                    while len(ready) < 4:
                        await anyio.sleep(0.05)
                os.kill(worker, signal.SIGKILL)
                at = time.monotonic()
                killed.set()
            return results, at

        results, killed_at = anyio.run(main)
        assert len(results) == 4
        for status, raw in results:
            events = sse_events(raw)
            assert status == 200 and events[-1] == "[DONE]", raw[-300:]
            assert "tensor-parallel worker rank 1" in events[-2]["error"]["message"] or \
                events[-2]["error"]["type"] == "server_error", events[-2]
        code = server.proc.wait(timeout=30)
        assert code == 1, server.log()
        took = time.monotonic() - killed_at
        print(f"the server exited {took:.2f}s after the worker was killed")
        assert took < 10, server.log()
        assert "tensor-parallel worker rank 1" in server.log()
    finally:
        server.stop()
        Path(server._log.name).unlink(missing_ok=True)


def test_serve_stops_its_workers_on_sigterm(tiny_llama):
    server = ServerProcess(tiny_llama, "-tp", "2", "--max-model-len", "256",
                           "--num-gpu-blocks-override", "64", "--block-size", "16")
    try:
        worker = int(re.search(r"worker ranks \[1\] \(pids \[(\d+)\]\)", server.log()).group(1))
        body = json.dumps({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}).encode()
        req = urllib.request.Request(server.url("/v1/completions"), data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 8
        started = time.monotonic()
        assert server.stop(timeout=30) == 0, server.log()
        assert time.monotonic() - started < 15
        assert not psutil.pid_exists(worker) or \
            psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()
