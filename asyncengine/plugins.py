"""The plugin API: the one module a plugin imports (as ``pytest`` is to ``_pytest``).

Everything a scheduler, structured-output backend or KV connector sees, and the hook marker
that registers it, is here; the modules these names come from are internal and may move. A
plugin imports ``asyncengine.plugins`` and nothing else of asyncengine::

    from asyncengine.plugins import FCFSScheduler, Register, hookimpl

    class ShortestFirst(FCFSScheduler):
        contract_version = 2          # CONTRACT_VERSION["scheduler"] it was written for
        ...

    @hookimpl
    def register_schedulers(register: Register) -> None:
        register("sjf", ShortestFirst)

and names that module in its distribution's entry points (group ``asyncengine``). The hooks:
``register_schedulers``, ``register_structured_output_backends``, ``register_kv_connectors``,
``register_models``, ``register_reasoning_parsers`` (each ``(register)``),
``add_cli_arguments(parser, command)``, ``register_http_routes(app, engine)``.

Versions: :data:`CONTRACT_VERSION` is the one table of the contracts' versions (``hooks``,
``scheduler``, ``structured_output``, ``kv_connector``, ``reasoning_parser``). A version is
bumped when its contract changes incompatibly, including a name leaving this module;
``tests/plugins/test_plugins_api.py``
keeps a snapshot of the names of each version. See docs/plugins.md.
"""

from __future__ import annotations

from asyncengine.config import EngineConfig, kv_connector_extra_config
from asyncengine.core.kv.hashing import ROOT_HASH, hash_block_tokens, update_block_hashes
from asyncengine.core.kv.manager import KVCacheManager
from asyncengine.core.multimodal import MMInput, chunk_without_split
from asyncengine.core.request import Logprob, PositionLogprobs, Request, RequestStatus
from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.core.sched.interface import (
    KVConnectorLookup,
    KVLoad,
    ModelRunnerOutput,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from asyncengine.core.sched.priority import PriorityScheduler
from asyncengine.core.sched.queues import FCFSQueue, PriorityQueue
from asyncengine.ext.contracts import ACCEPTED_VERSIONS, CONTRACT_VERSION
from asyncengine.ext.contracts.hooks import Register, hookimpl
from asyncengine.ext.contracts.kv_connector import KVCacheLayout, KVConnector
from asyncengine.ext.contracts.structured_output import KINDS as STRUCTURED_OUTPUT_KINDS
from asyncengine.ext.contracts.structured_output import (
    Grammar,
    StructuredOutputBackend,
    fill_rows,
)
from asyncengine.ext.registry import new_plugin_manager, registered
from asyncengine.text.reasoning_parsers.base import (
    ReasoningDelta,
    ReasoningOutput,
    ReasoningParser,
)
from asyncengine.text.tokenizer import Tokenizer

__all__ = [
    # versions
    "ACCEPTED_VERSIONS",
    "CONTRACT_VERSION",
    # hooks (and, for a plugin's tests, a fresh manager and the registered names)
    "Register",
    "hookimpl",
    "new_plugin_manager",
    "registered",
    # scheduler: the contract, the built-ins to subclass, and what a scheduler sees
    "EngineConfig",
    "FCFSQueue",
    "FCFSScheduler",
    "KVCacheManager",
    "KVConnectorLookup",
    "KVLoad",
    "Logprob",
    "MMInput",
    "ModelRunnerOutput",
    "PositionLogprobs",
    "PriorityQueue",
    "PriorityScheduler",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
    "chunk_without_split",
    # structured-output backend
    "Grammar",
    "STRUCTURED_OUTPUT_KINDS",
    "StructuredOutputBackend",
    "Tokenizer",
    "fill_rows",
    # KV connector, and the block hashes it keys blocks by
    "KVCacheLayout",
    "KVConnector",
    "ROOT_HASH",
    "hash_block_tokens",
    "kv_connector_extra_config",
    "update_block_hashes",
    # reasoning parser (--reasoning-parser; registered by register_reasoning_parsers)
    "ReasoningDelta",
    "ReasoningOutput",
    "ReasoningParser",
]
