"""llama-server's flags on ``asyncengine serve``, for operators coming from llama.cpp.

``asyncengine serve -m model.gguf -c 8192 -np 4 --port 8080 -ngl 99 -fa on --jinja`` starts
as llama-server would: before the command line is parsed, each llama-server flag that
asyncengine does not define itself is rewritten to the asyncengine flag that means the same,
and one line on stderr says so. Flags with no meaning here (layer offload, mmap, warm-up,
slot and HTTP-thread settings) are accepted and named as ignored. A flag whose value cannot
be honoured (a q4_0 KV cache) is an error that names it. Flags both servers share (``--host``,
``--port``, ``--api-key``, ``--seed``...) mean the same and pass through; a llama-server
command line without ``--port`` listens on llama-server's 8080 (asyncengine's own default is
vLLM's 8000). What is not listed here stays unknown to argparse, which names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from asyncengine.entrypoints.flags.foreign import Flag, rewrite, to


def _hub(key: str) -> Callable[[str, str | None, dict], list[str]]:
    """-hf user/repo[:quant] and -hff FILE: the model is read as ``--model user/repo[:QUANT]``
    (``executor/weights/hub_gguf.py``: without a quant, Q4_K_M or the repository's only GGUF
    model), with -hff's file name in place of the quant."""
    def put(name: str, value: str | None, state: dict) -> list[str]:
        if not value:
            raise ValueError(f"{name}: expects a value")
        state[key] = str(value)
        return []
    return put


def _ctx_size(_name: str, value: str | None, _state: dict) -> list[str]:
    return [] if _int(_name, value) == 0 else ["--max-model-len", str(value)]


def _parallel(name: str, value: str | None, _state: dict) -> list[str]:
    return [] if _int(name, value) <= 0 else ["--max-num-seqs", str(value)]


def _threads(name: str, value: str | None, _state: dict) -> list[str]:
    return [] if _int(name, value) <= 0 else ["--num-threads", str(value)]


def _alias(_name: str, value: str | None, _state: dict) -> list[str]:
    return ["--served-model-name", *str(value).split(",")]


#: llama.cpp's KV-cache types -> --kv-cache-dtype
_CACHE_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "fp8"}


def _cache_type(name: str, value: str | None, state: dict) -> list[str]:
    dtype = _CACHE_TYPES.get(str(value).lower())
    if dtype is None:
        raise ValueError(f"{name} {value}: asyncengine's KV cache is f32, f16, bf16 or 8 bits "
                         "(q8_0, read as --kv-cache-dtype fp8); llama.cpp's 4- and 5-bit "
                         "cache types are not supported")
    if "kv_cache_dtype" in state:  # -ctk and -ctv: one cache dtype for both
        if state["kv_cache_dtype"] != dtype:
            raise ValueError(f"{name} {value}: K and V caches of different types (asyncengine "
                             "keeps both in one --kv-cache-dtype)")
        return []
    state["kv_cache_dtype"] = dtype
    return ["--kv-cache-dtype", dtype]


def _lora(_name: str, value: str | None, state: dict) -> list[str]:
    state.setdefault("lora", []).extend(p for p in str(value).split(",") if p)
    return []


def _sampling(key: str, cast: type) -> Callable[[str, str | None, dict], list[str]]:
    def put(name: str, value: str | None, state: dict) -> list[str]:
        try:
            state.setdefault("sampling", {})[key] = cast(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {value!r} is not a number") from None
        return []
    return put


def _speculative(key: str) -> Callable[[str, str | None, dict], list[str]]:
    def put(name: str, value: str | None, state: dict) -> list[str]:
        spec = state.setdefault("speculative", {})
        if key == "spec_type":
            kinds = [k for k in str(value).split(",") if k and k != "none"]
            if any(k.startswith("ngram") for k in kinds):
                spec["method"] = "ngram"
            elif any(k.startswith("draft") for k in kinds):
                spec.setdefault("method", "draft_model")
            elif kinds:
                raise ValueError(f"{name} {value}: asyncengine drafts by n-gram (ngram-*) or "
                                 "with a draft model (draft-simple, -md)")
        elif key == "model":
            spec["model"] = str(value)
            spec.setdefault("method", "draft_model")
        else:
            spec[key] = _int(name, value)
        return []
    return put


def _int(name: str, value: str | None) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not an integer") from None


_IGNORED = "has no counterpart here"
FLAGS: tuple[Flag, ...] = (
    Flag(("-m", "--model"), "value", to("--model")),
    Flag(("-hf", "-hfr", "--hf-repo"), "value", _hub("hf_repo")),
    Flag(("-mm",), "value", to("--mmproj")),
    Flag(("--no-mmproj",), "none", lambda *_: ["--no-mmproj-auto"]),
    Flag(("-hff", "--hf-file"), "value", _hub("hf_file")),
    Flag(("-c", "--ctx-size"), "value", _ctx_size),
    Flag(("-np", "--parallel"), "value", _parallel),
    Flag(("-t", "--threads"), "value", _threads),
    Flag(("-b", "--batch-size"), "value", to("--max-num-batched-tokens")),
    Flag(("-a", "--alias"), "value", _alias),
    Flag(("-s",), "value", to("--seed")),
    Flag(("--chat-template-file",), "value", to("--chat-template")),
    Flag(("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), "value", _cache_type),
    Flag(("--lora",), "value", _lora),
    Flag(("--no-webui", "--no-ui"), "none", lambda *_: ["--no-web-ui"]),
    Flag(("--temp", "--temperature"), "value", _sampling("temperature", float)),
    Flag(("--top-k",), "value", _sampling("top_k", int)),
    Flag(("--top-p",), "value", _sampling("top_p", float)),
    Flag(("--min-p",), "value", _sampling("min_p", float)),
    Flag(("--repeat-penalty",), "value", _sampling("repetition_penalty", float)),
    Flag(("-n", "--predict", "--n-predict"), "value", _sampling("max_new_tokens", int)),
    Flag(("--spec-type",), "value", _speculative("spec_type")),
    Flag(("-md", "--model-draft", "--spec-draft-model"), "value", _speculative("model")),
    Flag(("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n"), "value",
          _speculative("num_speculative_tokens")),
    Flag(("--spec-draft-n-min", "--draft-min", "--draft-n-min"), "value",
          _speculative("draft_min")),
    Flag(("--spec-ngram-simple-size-n",), "value", _speculative("prompt_lookup_max")),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), "value", None,
          "layers are not split between devices: the whole model runs on --device (auto: a "
          "CUDA GPU where there is one)"),
    Flag(("-fa", "--flash-attn"), "optional", None,
          "the attention backend is chosen by --attention-backend", ("on", "off", "auto")),
    Flag(("-ub", "--ubatch-size"), "value", None, "a step's tokens are --max-num-batched-tokens"),
    Flag(("--jinja", "--no-jinja"), "none", None, "chat templates are always Jinja here"),
    Flag(("--mlock", "--no-mmap", "--mmap"), "none", None, _IGNORED),
    Flag(("-cb", "--cont-batching"), "none", None, "batching is always continuous"),
    Flag(("--metrics",), "none", None, "/metrics is always served"),
    Flag(("--slots", "--no-slots", "--props"), "none", None, _IGNORED),
    Flag(("--warmup", "--no-warmup"), "none", None, _IGNORED),
    Flag(("--cache-prompt",), "none", None, "prefix caching is on by default"),
    Flag(("--numa",), "value", None, _IGNORED),
    Flag(("-to", "--timeout", "--threads-http", "--cache-reuse"), "value", None, _IGNORED),
    Flag(("--log-disable",), "none", None, "use --log-level"),
)


def translate(argv: Sequence[str], own: set[str],
              say: Callable[[str], None]) -> list[str]:
    """``serve``'s arguments with llama-server's flags rewritten (``own``: the flags
    asyncengine defines itself, which win over a llama-server flag of the same name); each
    rewrite or ignored flag reported through ``say``. ValueError naming a flag whose value
    cannot be honoured."""
    state: dict = {}
    out, llama = rewrite(argv, own, FLAGS, "llama-server", say, state)
    out += _gathered(state, own, argv, say)
    if llama and not any(a.partition("=")[0] == "--port" for a in argv):
        say("llama-server's default port: --port 8080")
        out += ["--port", "8080"]
    return out


def _gathered(state: dict, own: set[str], argv: Sequence[str],
              say: Callable[[str], None]) -> list[str]:
    """The flags that several llama-server flags make together: the adapters, sampling
    defaults and the speculative configuration."""
    out: list[str] = []
    repo = state.get("hf_repo")
    if repo is not None:  # -hf user/repo[:quant], -hff FILE (which overrides the quant)
        file = state.get("hf_file")
        if file is not None:
            repo = f"{repo.partition(':')[0]}:{os.path.basename(file)}"
        out += ["--model", repo]
    elif "hf_file" in state:
        raise ValueError("-hff / --hf-file without -hf user/repo: which repository?")
    loras = state.get("lora")
    if loras:  # every --lora FILE as one adapter each, named by its file
        names = [os.path.splitext(os.path.basename(p.rstrip("/")))[0] or "lora" for p in loras]
        out += ["--enable-lora", "--lora-modules",
                *(f"{n}={p}" for n, p in zip(names, loras, strict=True))]
    sampling = state.get("sampling")
    if sampling:
        if any(a.partition("=")[0] == "--override-generation-config" for a in argv):
            raise ValueError("llama-server's sampling flags (--temp, --top-k, ...) and "
                             "--override-generation-config: give one")
        out += ["--override-generation-config", json.dumps(sampling)]
    spec = state.get("speculative")
    if spec:
        spec.pop("draft_min", None)  # drafts are as long as the match: no minimum
        if "method" not in spec:
            raise ValueError("--spec-draft-n-max / --draft-max without --spec-type or "
                             "--model-draft: nothing to draft with")
        if spec["method"] == "draft_model" and "model" not in spec:
            raise ValueError("--spec-type draft-*: needs the draft model (-md FILE)")
        spec.setdefault("num_speculative_tokens", 3)  # llama-server's default draft length
        if any(a.partition("=")[0] == "--speculative-config" for a in argv):
            raise ValueError("llama-server's speculative flags and --speculative-config: "
                             "give one")
        out += ["--speculative-config", json.dumps(spec)]
    if out:
        say(f"llama-server flags: read as {' '.join(out)}")
    return out
