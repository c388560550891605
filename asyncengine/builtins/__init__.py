"""The default plugin: the built-in components, registered through the same hooks and
written against the same API (``asyncengine.plugins``) as any third-party plugin.

* ``xgrammar.py``: the default structured-output backend;
* ``safetensors_connector.py``: the KV connector that stores blocks as files;
* the schedulers ``fcfs`` and ``priority`` (``asyncengine/core/sched/``, which every
  scheduler builds on) and the model classes (``asyncengine/executor/models/``) stay with the
  engine code they belong to and are registered from here.

Declared in asyncengine's own pyproject.toml (entry point ``builtins`` in the group
``asyncengine``) and always registered first by ``asyncengine.ext.registry``, whatever
``ASYNCENGINE_PLUGINS`` says. Imports happen inside the hooks, so loading this module is cheap
and a component whose module cannot be imported only fails the lookup of its own kind.
"""

from __future__ import annotations

from asyncengine.plugins import Register, hookimpl


@hookimpl
def register_schedulers(register: Register) -> None:
    from asyncengine.core.sched import BUILTIN_SCHEDULERS

    for name, cls in BUILTIN_SCHEDULERS.items():
        register(name, cls)


@hookimpl
def register_structured_output_backends(register: Register) -> None:
    from asyncengine.builtins.xgrammar import XGrammarBackend

    register("xgrammar", XGrammarBackend)
    from asyncengine.builtins.auto_structured_output import AutoBackend

    register("auto", AutoBackend)


@hookimpl
def register_models(register: Register) -> None:
    from asyncengine.executor.models.registry import BUILTIN_MODELS

    for architecture, cls in BUILTIN_MODELS.items():
        register(architecture, cls)


@hookimpl
def register_kv_connectors(register: Register) -> None:
    from asyncengine.builtins.safetensors_connector import SafetensorsKVConnector

    register("safetensors", SafetensorsKVConnector)


@hookimpl
def register_reasoning_parsers(register: Register) -> None:
    from asyncengine.text.reasoning_parsers import BUILTIN_REASONING_PARSERS

    for name, cls in BUILTIN_REASONING_PARSERS.items():
        register(name, cls)
