"""The ``vllm serve`` flags asyncengine does not define itself, so that a vLLM command line
runs unchanged (``docs/serving.md``, "Coming from vLLM").

Flags that tune what asyncengine has no counterpart for (CUDA-graph capture sizes, torch.compile
levels, swap space, executor backends, API-server processes) are accepted and named as ignored
on stderr: they change how fast vLLM runs, not what it answers. Flags that would change what
the server answers and that asyncengine cannot honour (logits-processor plugins, the Mistral
tokenizer, another response role) exit 2 naming them, as do values beyond what asyncengine
does (data parallelism over processes). The rest are rewritten to asyncengine's flag of the
same meaning. ``--hf-overrides`` is asyncengine's own flag (the keys that make a reranker or a
classifier of a causal LM: ``config/sections.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from asyncengine.entrypoints.flags.foreign import Flag, refuse, rewrite

_SPEED = "a vLLM tuning knob: it changes how fast vLLM runs, not what it answers"


def _structured_outputs(name: str, value: str | None, _state: dict) -> list[str]:
    config = _json(name, value)
    unknown = set(config) - {"backend"}
    if unknown:
        raise ValueError(f"{name}: asyncengine reads its backend only (not "
                         f"{', '.join(sorted(unknown))})")
    return ["--structured-output-backend", str(config["backend"])] if "backend" in config \
        else []


def _one_of(allowed: tuple[str, ...], why: str) -> Callable[[str, str | None, dict], list[str]]:
    def check(name: str, value: str | None, _state: dict) -> list[str]:
        if str(value) not in allowed:
            raise ValueError(f"{name} {value}: {why}")
        return []
    return check


def _json(name: str, value: str | None) -> dict:
    try:
        data = json.loads(str(value))
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: a JSON object")
    return data


FLAGS: tuple[Flag, ...] = (
    Flag(("--swap-space",), "value", None, "preempted requests are recomputed, never swapped"),
    Flag(("--cpu-offload-gb",), "value", None, "weights are not offloaded"),
    Flag(("--preemption-mode",), "value", None, "preemption always recomputes"),
    Flag(("--max-seq-len-to-capture",), "value", None, _SPEED),
    Flag(("--cuda-graph-sizes",), "values", None, _SPEED),
    Flag(("--compilation-config",), "value", None, _SPEED),
    Flag(("-O", "-O0", "-O1", "-O2", "-O3"), "optional", None, _SPEED, ("0", "1", "2", "3")),
    Flag(("--distributed-executor-backend", "--worker-cls", "--model-impl"), "value", None,
         _SPEED),
    Flag(("--max-parallel-loading-workers", "--safetensors-load-strategy",
          "--scheduler-delay-factor", "--max-num-partial-prefills",
          "--long-prefill-token-threshold", "--prefix-caching-hash-algo", "--lora-dtype",
          "--h11-max-incomplete-event-size"), "value", None, _SPEED),
    Flag(("--api-server-count",), "value", None, "one process serves HTTP from the loop"),
    Flag(("--disable-custom-all-reduce",
          "--disable-frontend-multiprocessing", "--enable-server-load-tracking",
          "--fully-sharded-loras", "--enable-expert-parallel"), "none", None, _SPEED),
    Flag(("--async-scheduling", "--no-async-scheduling"), "none", None,
         "the loop always prepares a step while the one before runs"),
    Flag(("--calculate-kv-scales",), "none", None,
         "the float8 KV cache is unscaled (--kv-cache-dtype)"),
    Flag(("--trust-request-chat-template",), "none", None,
         "requests cannot carry a chat template here"),
    Flag(("--chat-template-content-format",), "value", None,
         "message contents are read in either format"),
    Flag(("--code-revision",), "value", None, "no remote code ever runs"),
    Flag(("--tokenizer-revision",), "value", None, "the tokenizer is read at --revision"),
    Flag(("--show-hidden-metrics-for-version", "--max-log-len", "--log-config-file"), "value",
         None, "logging and metrics are asyncengine's own"),
    Flag(("--tokenizer-mode",), "value", _one_of(
        ("auto", "hf", "slow"), "the Mistral tokenizer is not supported (auto, hf, slow)")),
    Flag(("--response-role",), "value", _one_of(
        ("assistant",), "responses are the assistant's")),
    Flag(("--data-parallel-size", "-dp"), "value", _one_of(
        ("1",), "one engine a process; run replicas behind a balancer (docs/deploy.md)")),
    Flag(("--structured-outputs-config",), "value", _structured_outputs),
    Flag(("--runner", "--task"), "value", None,
         "what the model serves follows from its architecture and --hf-overrides"),
    Flag(("--convert",), "value", _one_of(
        ("auto", "none", "embed"), "a classifier made of a causal LM: --hf-overrides "
        "'{\"architectures\": [\"...ForSequenceClassification\"]}' (auto, none, embed)")),
    Flag(("--disable-sliding-window",), "none", refuse(
        "the model's sliding window is part of it: not supported")),
    Flag(("--logits-processors", "--tool-parser-plugin", "--middleware"), "value", refuse(
        "vLLM's Python plugins do not load here; asyncengine's plugins are entry points "
        "(docs/plugins.md)")),
    Flag(("--return-tokens-as-token-ids",), "none", refuse("not supported")),
    Flag(("--headless",), "none", refuse("data parallelism over processes is not supported")),
    Flag(("--data-parallel-address",), "value", refuse(
        "data parallelism over processes is not supported")),
)


def translate(argv: Sequence[str], own: set[str], say: Callable[[str], None]) -> list[str]:
    """``serve``'s arguments with the vLLM flags of ``FLAGS`` rewritten, ignored (said
    through ``say``) or refused (a ValueError naming the flag)."""
    return rewrite(argv, own, FLAGS, "vLLM", say, {})[0]
