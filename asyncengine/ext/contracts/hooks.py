"""The plugin contract: the hooks a plugin may implement (pluggy project ``asyncengine``).

A plugin is a module (or any object) with functions marked ``@hookimpl``, made known to
asyncengine through an entry point in the group ``asyncengine``::

    # pyproject.toml of the plugin's distribution
    [project.entry-points.asyncengine]
    spf = "spf_scheduler.plugin"

    # spf_scheduler/plugin.py
    from asyncengine.plugins import hookimpl

    @hookimpl
    def register_schedulers(register):
        register("spf", ShortestPromptFirstScheduler)

An implementation may accept fewer arguments than the spec names (pluggy passes only the ones
it asks for). The ``register_*`` hooks are called once per plugin manager, when a component is
first looked up; the built-in components are registered through these same hooks by the
default plugin ``asyncengine.builtins``. See docs/plugins.md for the contracts the
registered classes implement and how they are versioned.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from aiohttp import web

PROJECT_NAME = "asyncengine"

#: Bumped when a hook is removed or its arguments change meaning (see docs/plugins.md).
#: 2: the hooks are imported from ``asyncengine.plugins`` (nothing else changed).
HOOKS_API_VERSION = 2

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``register(name, cls)``: the callback the ``register_*`` hooks receive.
Register = Callable[[str, type], None]


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler classes: ``register("spf", ShortestPromptFirstScheduler)``.

    Each class implements ``asyncengine.plugins.Scheduler`` (subclassing it is
    optional; every abstract method must be present) and is constructed by the engine as
    ``cls(config, num_blocks)``. Operators select one with ``--scheduler NAME``.
    """


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register structured-output backends: ``register("xgrammar", XGrammarBackend)``.

    Each class compiles JSON schemas, regexes and grammars into matchers that fill the
    per-step token bitmask (the contract is in docs/plugins.md). Operators select one with
    ``--structured-output-backend NAME``.
    """


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register KV connectors: ``register("safetensors", SafetensorsKVConnector)``.

    A connector moves KV-cache blocks, keyed by prefix-cache block hash, between the cache
    and external storage. Each class implements
    ``asyncengine.plugins.KVConnector`` (subclassing it is optional) and is
    constructed as ``cls(config, layout)``. Operators select one with ``--kv-connector NAME``.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model classes by architecture name, as it appears in the ``architectures``
    list of a Hugging Face ``config.json``: ``register("LlamaForCausalLM", LlamaForCausalLM)``.

    The loader picks the class registered under the checkpoint's architecture; names are never
    taken from anywhere else (a model file chooses among registered classes, it cannot name
    code to import).
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: ``register("deepseek_r1", DeepSeekR1ReasoningParser)``.

    Each class reads a reasoning model's output into its thinking span and its answer, as
    ``asyncengine.text.reasoning_parsers.ReasoningParser`` does (subclass it and set the tags:
    its ``feed``/``finish``/``parse`` do the rest). It is constructed per sample as
    ``cls(prompt_text)``. Operators select one with ``--reasoning-parser NAME``.
    """


@hookspec
def add_cli_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add options to the parser of one CLI command (``command`` is ``"serve"``,
    ``"generate"``, ``"bench"``, ...), called before the command line is parsed.

    Flags should be namespaced after the plugin (``--spf-max-skip``) so plugins don't collide;
    the parsed values stay on the ``argparse.Namespace`` the command receives. Return nothing.
    """


@hookspec
def register_http_routes(app: web.Application, engine: Any) -> None:
    """Add routes (or middlewares, startup/cleanup callbacks) to the aiohttp application of
    ``asyncengine serve``, after the built-in OpenAI routes and before the server starts.

    ``engine`` is the running ``asyncengine.AsyncEngine`` (typed ``Any`` here: the contract
    sits below the engine, which imports it through the registry); handlers must not block
    the event loop (it is the same loop that runs the engine). A route must not shadow a
    built-in one. Return nothing.
    """


__all__ = [
    "HOOKS_API_VERSION",
    "PROJECT_NAME",
    "Register",
    "add_cli_arguments",
    "hookimpl",
    "hookspec",
    "register_http_routes",
    "register_kv_connectors",
    "register_models",
    "register_reasoning_parsers",
    "register_schedulers",
    "register_structured_output_backends",
]
