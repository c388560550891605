"""The plugin API, ``asyncengine.plugins``: the one module a plugin imports.

* A snapshot of its names per contract version: a name leaving the module, or a contract
  class gaining or losing an abstract method, fails here unless the contract's version in
  ``CONTRACT_VERSION`` is bumped (and a snapshot for the new version added).
* A plugin built outside the repository, importing nothing of asyncengine but
  ``asyncengine.plugins``, installed through an entry point, runs in the engine: its
  scheduler schedules and its KV connector, keyed by the block-hash helper, serves a second
  engine's prefill.
* The paths of plugin API 1 (and older) still import, with a DeprecationWarning; a class
  declaring version 1 is accepted with one, an unknown version refused.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import anyio
import pytest

import asyncengine.plugins as api
from asyncengine.ext import registry
from asyncengine.ext.contracts import hooks

REPO = Path(__file__).resolve().parents[2]

# -- the snapshot ------------------------------------------------------------------------------
# (contract, version) -> {name in asyncengine.plugins: members it must keep, or None}. For an
# abstract class the members are exactly its abstract methods (adding one breaks plugins too);
# for other classes, attributes or data-class fields it must still have (more may be added).
# Bumping a version: add its entry here; keep the old one until that version is dropped.
SNAPSHOT: dict[tuple[str, int], dict[str, tuple[str, ...] | None]] = {
    ("hooks", 2): {
        "hookimpl": None, "Register": None, "new_plugin_manager": None, "registered": None,
        "CONTRACT_VERSION": None, "ACCEPTED_VERSIONS": None,
        # the hooks themselves, by name
        "<hooks>": ("register_schedulers", "register_structured_output_backends",
                    "register_kv_connectors", "register_models", "add_cli_arguments",
                    "register_http_routes", "register_reasoning_parsers"),
    },
    ("scheduler", 2): {
        "Scheduler": ("__init__", "add_request", "schedule", "update_from_output",
                      "finish_requests", "has_unfinished_requests",
                      "get_num_unfinished_requests", "reset_prefix_cache", "make_stats",
                      "shutdown"),
        "FCFSScheduler": ("_new_waiting_queue", "_running_order", "_choose_victim",
                          "_admission_victim", "set_kv_connector", "kv_cache_manager",
                          "waiting", "running", "requests"),
        "PriorityScheduler": None,
        "FCFSQueue": ("add", "add_front", "peek", "pop", "remove", "__len__", "__iter__"),
        "PriorityQueue": ("add", "add_front", "peek", "pop", "remove", "__len__", "__iter__"),
        "KVCacheManager": ("get_computed_blocks", "allocate_slots", "cache_full_blocks", "free",
                           "get_block_ids", "reset_prefix_cache"),
        "Request": ("request_id", "prompt_token_ids", "sampling_params", "arrival_time",
                    "priority", "status", "output_token_ids", "num_computed_tokens",
                    "num_output_placeholders", "num_cached_tokens", "block_hashes",
                    "num_tokens", "num_prompt_tokens", "max_tokens", "check_stop", "tenant"),
        "RequestStatus": ("WAITING", "RUNNING", "FINISHED_STOPPED", "FINISHED_LENGTH",
                          "FINISHED_ABORTED", "FINISHED_ERROR", "finished"),
        "SamplingParams": ("max_tokens", "temperature"),
        "StructuredOutputsParams": None,
        "SchedulerOutput": ("scheduled", "finished_req_ids", "preempted_req_ids"),
        "ScheduledRequest": ("request", "start", "num_new_tokens", "block_ids", "kv_load",
                             "samples"),
        "ModelRunnerOutput": ("sampled_token_ids", "logprobs", "prompt_logprobs"),
        "SchedulerStats": ("num_running", "num_waiting", "kv_cache_usage", "num_free_blocks",
                           "num_total_blocks"),
        "KVLoad": ("block_ids", "block_hashes", "first_token"),
        "KVConnectorLookup": ("lookup", "request_finished"),
        "Logprob": ("logprob", "rank"),
        "PositionLogprobs": None,
        "EngineConfig": ("from_dict", "replace"),
        # images (added, optional): a request's placeholders, and the cut that keeps a
        # bidirectionally attended image in one chunk
        "MMInput": ("hash", "offset", "length", "whole", "end"),
        "chunk_without_split": None,
    },
    ("structured_output", 2): {
        "StructuredOutputBackend": ("__init__", "compile_grammar", "allocate_bitmask",
                                    "apply_bitmask"),
        "Grammar": ("accept_token", "fill_bitmask", "is_terminated", "rollback", "reset",
                    "fresh"),
        "STRUCTURED_OUTPUT_KINDS": None,
        "Tokenizer": None,
        "fill_rows": None,
    },
    ("kv_connector", 2): {
        "KVConnector": ("__init__", "lookup", "load", "save"),
        "KVCacheLayout": ("model_id", "num_layers", "block_size", "num_kv_heads", "head_dim",
                          "dtype", "block_shape"),
        "hash_block_tokens": None,
        "update_block_hashes": None,
        "ROOT_HASH": None,
        "kv_connector_extra_config": None,
    },
    ("reasoning_parser", 1): {
        "ReasoningParser": ("__init__", "initial_state", "reasoning_ended_in_prompt",
                            "in_reasoning", "ended", "feed", "finish", "parse",
                            "count_reasoning_tokens"),
        "ReasoningDelta": None,
        "ReasoningOutput": None,
    },
}


def current_snapshot(contract: str) -> dict[str, tuple[str, ...] | None]:
    version = api.CONTRACT_VERSION[contract]
    assert (contract, version) in SNAPSHOT, (
        f"CONTRACT_VERSION[{contract!r}] is {version}: add its snapshot to SNAPSHOT")
    return SNAPSHOT[(contract, version)]


def attributes_set_by_init(cls: object) -> set[str]:
    """``self.x`` assigned in the class's own ``__init__`` or ``__post_init__``."""
    found: set[str] = set()
    for method in ("__init__", "__post_init__"):
        fn = vars(cls).get(method) if isinstance(cls, type) else None
        try:
            source = textwrap.dedent(inspect.getsource(fn)) if fn else ""
        except (OSError, TypeError):  # generated (a data class's __init__)
            continue
        found |= {node.attr for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute)}
    return found


@pytest.mark.parametrize("contract", ["hooks", "scheduler", "structured_output", "kv_connector"])
def test_no_name_leaves_the_facade_without_a_version_bump(contract):
    for name, members in current_snapshot(contract).items():
        if name == "<hooks>":
            specs = {n for n in dir(hooks) if hasattr(getattr(hooks, n), "asyncengine_spec")}
            missing = set(members) - specs
            assert not missing, f"hooks removed without bumping the hooks version: {missing}"
            continue
        assert name in api.__all__ and hasattr(api, name), (
            f"{name} left asyncengine.plugins: bump CONTRACT_VERSION[{contract!r}]")
        if members is None:
            continue
        obj = getattr(api, name)
        abstract = getattr(obj, "__abstractmethods__", None)
        if abstract:
            assert set(abstract) == set(members), (
                f"{name}'s abstract methods changed ({sorted(set(abstract) ^ set(members))}): "
                f"bump CONTRACT_VERSION[{contract!r}]")
            continue
        have = set(dir(obj))
        if dataclasses.is_dataclass(obj):
            have |= {f.name for f in dataclasses.fields(obj)}
        have |= attributes_set_by_init(obj)
        missing = {m for m in members if m not in have and not hasattr(obj, m)}
        assert not missing, f"{name} lost {sorted(missing)}: bump CONTRACT_VERSION[{contract!r}]"


def test_every_public_name_is_in_a_snapshot():
    snapped = {n for (c, v), names in SNAPSHOT.items() if api.CONTRACT_VERSION[c] == v
               for n in names}
    unrecorded = set(api.__all__) - snapped
    assert not unrecorded, f"record these in SNAPSHOT (their contract's entry): {unrecorded}"
    assert set(api.CONTRACT_VERSION) == {c for c, _ in SNAPSHOT}


def test_the_snapshot_check_catches_a_removed_name(monkeypatch):
    monkeypatch.delattr(api, "KVCacheLayout")
    with pytest.raises(AssertionError, match="KVCacheLayout left asyncengine.plugins: bump"):
        test_no_name_leaves_the_facade_without_a_version_bump("kv_connector")
    monkeypatch.setitem(SNAPSHOT, ("kv_connector", 2), {})  # a bump without a snapshot
    monkeypatch.setattr(api, "CONTRACT_VERSION", {**api.CONTRACT_VERSION, "kv_connector": 3})
    with pytest.raises(AssertionError, match="add its snapshot"):
        test_no_name_leaves_the_facade_without_a_version_bump("kv_connector")


def test_the_snapshot_check_catches_a_new_abstract_method(monkeypatch):
    monkeypatch.setattr(api.Grammar, "__abstractmethods__",
                        api.Grammar.__abstractmethods__ | {"jump_forward"})
    with pytest.raises(AssertionError, match=r"Grammar's abstract methods changed "
                       r"\(\['jump_forward'\]\)"):
        test_no_name_leaves_the_facade_without_a_version_bump("structured_output")


# -- a plugin from outside the repository --------------------------------------------------------
PLUGIN = '''
"""A third-party plugin: a scheduler and an in-memory KV connector."""
import torch

from asyncengine.plugins import (
    ROOT_HASH, FCFSScheduler, KVCacheLayout, KVConnector, Register, Request, hash_block_tokens,
    hookimpl,
)

STORE: dict = {}
STATS = {"steps": 0, "loaded": 0}


class CountingScheduler(FCFSScheduler):
    contract_version = 2

    def schedule(self):
        STATS["steps"] += 1
        return super().schedule()


class MemoryConnector(KVConnector):
    contract_version = 2

    def __init__(self, config, layout: KVCacheLayout):
        self.layout = layout
        self.store = STORE.setdefault(layout.model_id, {})

    def lookup(self, request: Request, num_local_tokens: int) -> int:
        bs = self.layout.block_size
        # The engine's hashes are the documented chain over the token ids.
        tokens = request.prompt_token_ids
        assert request.block_hashes[0] == hash_block_tokens(ROOT_HASH, tokens[:bs])
        n = 0
        for h in request.block_hashes[num_local_tokens // bs:]:
            if h not in self.store:
                break
            n += 1
        return n * bs

    async def load(self, block_hashes):
        STATS["loaded"] += len(block_hashes)
        return torch.stack([self.store[h] for h in block_hashes])

    async def save(self, block_hashes, kv):
        for h, block in zip(block_hashes, kv.cpu()):
            self.store[h] = block.clone()


@hookimpl
def register_schedulers(register: Register) -> None:
    register("counting", CountingScheduler)


@hookimpl
def register_kv_connectors(register: Register) -> None:
    register("memory", MemoryConnector)
'''


def asyncengine_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    return {m for m in found if m.split(".")[0] == "asyncengine"}


@pytest.fixture
def outside_plugin(tmp_path, monkeypatch):
    """The plugin as an installed distribution (module + dist-info with its entry point) in a
    directory outside the repository."""
    site = tmp_path / "site"
    site.mkdir()
    assert REPO not in site.parents
    (site / "outside_plugin.py").write_text(PLUGIN)
    info = site / "outside_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[asyncengine]\noutside = outside_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(registry.ALLOWLIST_ENV, "outside")  # not what else is installed
    yield "outside_plugin"
    sys.modules.pop("outside_plugin", None)


def test_a_plugin_built_outside_the_repo_runs_on_the_public_api_alone(outside_plugin,
                                                                       tiny_llama):
    from asyncengine import SamplingParams
    from asyncengine.engine.engine import AsyncEngine

    assert asyncengine_imports(PLUGIN) == {"asyncengine.plugins"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no deprecated path on the way
        pm = api.new_plugin_manager()
        assert {"counting"} <= set(api.registered("schedulers", pm))
        assert {"memory"} <= set(api.registered("kv_connectors", pm))
    plugin = sys.modules[outside_plugin]

    config = api.EngineConfig.from_dict({
        "model": tiny_llama, "scheduler": "counting", "kv_connector": "memory",
        "dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 64,
        "max_model_len": 128})
    prompt = list(range(10, 50))  # 40 tokens: 4 whole blocks before the last token
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run() -> tuple[list[int], int]:
        engine = AsyncEngine(config, plugin_manager=pm)
        async with engine:
            outs = [o async for o in engine.generate(prompt, params)]
        assert engine.num_free_blocks == engine.num_total_blocks
        return outs[-1].outputs[0].token_ids, outs[-1].num_cached_tokens

    first, cached = anyio.run(run)
    assert cached == 0 and plugin.STATS["steps"] > 0 and plugin.STORE
    again, cached = anyio.run(run)  # a fresh engine: its prefill comes from the plugin's store
    assert again == first and cached == 32 and plugin.STATS["loaded"] == 4


# -- the old paths -------------------------------------------------------------------------------
OLD_PATHS = [
    ("asyncengine.ext.hookspecs", "hookimpl", "hookimpl"),
    ("asyncengine.hookspecs", "hookimpl", "hookimpl"),
    ("asyncengine.scheduling", "SchedulerInterface", "Scheduler"),
    ("asyncengine.core.sched.interface", "SchedulerInterface", "Scheduler"),
    ("asyncengine.schedulers.fcfs", "FCFSScheduler", "FCFSScheduler"),
    ("asyncengine.ext.kv_connector.contract", "KVConnector", "KVConnector"),
    ("asyncengine.ext.kv_connector.contract", "KVCacheLayout", "KVCacheLayout"),
    ("asyncengine.ext.structured_output", "StructuredOutputBackend", "StructuredOutputBackend"),
    ("asyncengine.ext.structured_output.contract", "Grammar", "Grammar"),
]


@pytest.mark.parametrize(("module", "old", "new"), OLD_PATHS)
def test_old_paths_work_one_more_version_with_a_warning(module, old, new):
    with pytest.warns(DeprecationWarning, match=f"use asyncengine.plugins|import {new} from "
                      "asyncengine.plugins"):
        value = getattr(importlib.import_module(module), old)
    assert value is getattr(api, new)


def test_an_old_plugin_still_imports_in_a_fresh_interpreter():
    """``from OLD import NAME`` statements, as a plugin of API 1 wrote them."""
    code = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            from asyncengine.ext.hookspecs import hookimpl
            from asyncengine.ext.kv_connector.contract import KVConnector
            from asyncengine.ext.structured_output.xgrammar import XGrammarBackend
        import asyncengine.plugins as api
        assert hookimpl is api.hookimpl and KVConnector is api.KVConnector
        for w in seen:
            print(w.category.__name__, w.message)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("DeprecationWarning") for line in lines)
    assert "asyncengine.ext.hookspecs.hookimpl is deprecated" in lines[0]
    assert "import hookimpl from asyncengine.plugins" in lines[0]
    assert "it is internal now (asyncengine.builtins.xgrammar.XGrammarBackend)" in lines[2]


def test_declared_versions():
    class V1(api.FCFSScheduler):
        contract_version = 1

    class V2(api.FCFSScheduler):
        contract_version = api.CONTRACT_VERSION["scheduler"]

    class V0(api.FCFSScheduler):
        contract_version = 0

    with pytest.warns(DeprecationWarning, match="written for Scheduler version 1; this "
                      "asyncengine implements version 2 and accepts 1 until the next"):
        registry.check_contract("schedulers", V1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.check_contract("schedulers", V2)
    with pytest.raises(ValueError, match="written for Scheduler version 0; this asyncengine "
                       "implements version 2"):
        registry.check_contract("schedulers", V0)


def test_docs_import_only_the_plugin_api():
    """docs/plugins.md's code imports asyncengine.plugins, never a module behind it (the
    engine's own API, ``from asyncengine import LLM``, is fine in the testing examples)."""
    import re

    text = (REPO / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    found = set()
    for block in blocks:
        for line in block.splitlines():
            m = re.match(r"\s*(?:from|import)\s+(asyncengine(?:\.[\w.]+)?)\b(?!_)", line)
            if m:
                found.add(m.group(1))
    assert found <= {"asyncengine", "asyncengine.plugins"}, found


def test_a_bad_kv_transfer_config_on_the_command_line_names_the_flag():
    result = subprocess.run(
        [sys.executable, "-m", "asyncengine", "serve", "--kv-transfer-config",
         '{"kv_connector": "redis", "kv_role": "kv_producer"}'],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--kv-transfer-config: kv_role 'kv_producer' is not supported" in result.stderr
    assert "Traceback" not in result.stderr
