"""Component kinds and their contracts: what a registered class must implement.

Each kind of pluggable component (scheduler, structured-output backend, KV connector, model)
names the hook that registers it and the interface it implements. ``check_contract`` runs at
start-up, before the weights load, so an incomplete plugin class fails with the missing method
named ("X does not implement Scheduler.update_from_output"), not mid-request.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

from asyncengine.ext.contracts import ACCEPTED_VERSIONS, CONTRACT_VERSION


@dataclass(frozen=True)
class ComponentKind:
    """One kind of pluggable component: the hook that registers it and its contract."""

    hook: str
    noun: str
    flag: str | None  # the config option that selects it; None: not operator-selectable
    contract: tuple[str, str] | None = None  # (module, class) of the interface, if one exists
    version: str | None = None  # its key in asyncengine.ext.contracts.CONTRACT_VERSION
    allow_qualname: bool = True


KINDS: dict[str, ComponentKind] = {
    "schedulers": ComponentKind(
        "register_schedulers", "scheduler", "--scheduler",
        ("asyncengine.core.sched.interface", "Scheduler"), "scheduler"),
    "structured_output_backends": ComponentKind(
        "register_structured_output_backends", "structured-output backend",
        "--structured-output-backend",
        ("asyncengine.ext.contracts.structured_output", "StructuredOutputBackend"),
        "structured_output"),
    "kv_connectors": ComponentKind(
        "register_kv_connectors", "KV connector", "--kv-connector",
        ("asyncengine.ext.contracts.kv_connector", "KVConnector"), "kv_connector"),
    "reasoning_parsers": ComponentKind(
        "register_reasoning_parsers", "reasoning parser", "--reasoning-parser",
        ("asyncengine.text.reasoning_parsers.base", "ReasoningParser"), "reasoning_parser"),
    # Architecture names come from model files, so they never resolve to a qualname.
    "models": ComponentKind("register_models", "model architecture", None,
                            allow_qualname=False),
}


def qualname(obj: Any) -> str:
    """``pkg.module:Class``, the form the config accepts."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"



def check_contract(kind: str, cls: Any, label: str | None = None) -> None:
    """Refuse a class that lacks a method of its kind's interface (subclassing the interface
    is optional), or that declares a ``contract_version`` other than the current one."""
    spec = KINDS[kind]
    label = label or qualname(cls)
    if not isinstance(cls, type):
        raise ValueError(f"{label} is not a class (got {cls!r})")
    if spec.contract is None:
        return
    module = importlib.import_module(spec.contract[0])
    interface = getattr(module, spec.contract[1])
    missing = [m for m in _abstract_methods(interface) if not _implements(cls, interface, m)]
    if missing:
        names = ", ".join(f"{interface.__name__}.{m}" for m in missing)
        raise ValueError(f"{label} does not implement {names}")
    declared = getattr(cls, "contract_version", None)
    if declared is None or spec.version is None:
        return
    current = CONTRACT_VERSION[spec.version]
    if declared == current:
        return
    if declared in ACCEPTED_VERSIONS[spec.version]:
        warnings.warn(f"{label} was written for {interface.__name__} version {declared}; this "
                      f"asyncengine implements version {current} and accepts {declared} until "
                      "the next version (see docs/plugins.md)", DeprecationWarning, stacklevel=2)
        return
    raise ValueError(f"{label} was written for {interface.__name__} version {declared}; "
                     f"this asyncengine implements version {current} (see docs/plugins.md)")


def _abstract_methods(interface: type) -> list[str]:
    """The interface's abstract methods, in definition order."""
    abstract = getattr(interface, "__abstractmethods__", frozenset())
    ordered: list[str] = []
    for base in reversed(interface.__mro__):
        ordered += [n for n in vars(base) if n in abstract and n not in ordered]
    return ordered


def _implements(cls: type, interface: type, name: str) -> bool:
    try:
        attr = inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    if getattr(attr, "__isabstractmethod__", False):
        return False
    if name == "__init__" and attr is object.__init__:
        return False
    if isinstance(inspect.getattr_static(interface, name), property):
        return True
    return callable(attr) or isinstance(attr, (staticmethod, classmethod, property))
