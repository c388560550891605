"""The plugin manager and component lookup: registered name or ``pkg.module:Class``.

Plugins are loaded once per manager: first the built-in plugin
(``asyncengine.builtins``, always), then every entry point of the group ``asyncengine``
that ``ASYNCENGINE_PLUGINS`` allows (a comma-separated list of entry-point names; unset: all;
set but empty: none). A plugin that fails to import is logged by name and skipped; if the
component the configuration asks for turns out to be missing, the error names the plugins that
failed, since one of them may have provided it.

The ``resolve_*`` functions take values from operator configuration only (CLI flags, the YAML
file, ``EngineConfig``): a qualname imports code, so it must never come from a request body or
a model file. ``resolve_model`` therefore accepts registered architecture names only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import pluggy

from asyncengine.config import environment
from asyncengine.ext.contracts import hooks as hookspecs
from asyncengine.ext.kinds import KINDS, check_contract, qualname

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asyncengine"
ALLOWLIST_ENV = "ASYNCENGINE_PLUGINS"
BUILTINS_NAME = "builtins"
BUILTINS_MODULE = "asyncengine.builtins"


@dataclass
class PluginFailure:
    plugin: str
    error: str  # "ImportError: No module named 'x'"
    kind: str | None = None  # None: the plugin failed to load; else: its register hook raised

    def __str__(self) -> str:
        what = "failed to load" if self.kind is None else f"failed to register {self.kind}"
        return f"plugin {self.plugin!r} {what}: {self.error}"


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with the asyncengine hookspecs and a record of what went wrong."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        # Entry points present but left out by ASYNCENGINE_PLUGINS.
        self.excluded: list[str] = []


def new_plugin_manager(*, load_entrypoints: bool = True) -> PluginManager:
    """A fresh manager holding the built-in plugin and, if asked, the installed plugins."""
    pm = PluginManager()
    pm.register(importlib.import_module(BUILTINS_MODULE), name=BUILTINS_NAME)
    if load_entrypoints:
        _load_entrypoints(pm)
    return pm


_global_pm: PluginManager | None = None
_global_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager; plugins are loaded on the first call only."""
    global _global_pm
    with _global_lock:
        if _global_pm is None:
            _global_pm = new_plugin_manager()
        return _global_pm


def _allowlist() -> set[str] | None:
    if not environment.is_set(ALLOWLIST_ENV):
        return None
    value = environment.get(ALLOWLIST_ENV)
    return {name.strip() for name in value.split(",") if name.strip()}


def _load_entrypoints(pm: PluginManager) -> None:
    allowed = _allowlist()
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:
            continue  # the same distribution found twice on sys.path: first one wins
        seen.add(ep.name)
        if ep.name == BUILTINS_NAME:
            if ep.value != BUILTINS_MODULE:
                log.warning("plugin entry point %r (%s) skipped: the name %r is reserved",
                            ep.name, ep.value, BUILTINS_NAME)
            continue
        if allowed is not None and ep.name not in allowed:
            pm.excluded.append(ep.name)
            log.info("plugin %r not loaded: not listed in %s", ep.name, ALLOWLIST_ENV)
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
            try:
                pm.check_pending()  # an @hookimpl whose name matches no hook (a typo)
            except pluggy.PluginValidationError:
                pm.unregister(name=ep.name)
                raise
        except Exception as e:
            failure = PluginFailure(ep.name, f"{type(e).__name__}: {e}")
            pm.failures.append(failure)
            log.warning("%s (entry point %s); skipped", failure, ep.value)
    for name in sorted((allowed or set()) - seen):
        log.warning("%s names %r, but no installed plugin has that entry-point name",
                    ALLOWLIST_ENV, name)


# -- registrations -------------------------------------------------------------------------


@dataclass
class _Registrations:
    impls: tuple[Any, ...]  # the hook implementations these were collected from
    classes: dict[str, type] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)  # name -> plugin name
    failures: list[PluginFailure] = field(default_factory=list)


_cache: weakref.WeakKeyDictionary[pluggy.PluginManager, dict[str, _Registrations]] = (
    weakref.WeakKeyDictionary())


def _registrations(pm: pluggy.PluginManager, kind: str) -> _Registrations:
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r} (allowed: {', '.join(KINDS)})")
    spec = KINDS[kind]
    impls = tuple(i for i in getattr(pm.hook, spec.hook).get_hookimpls()
                  if not (i.hookwrapper or i.wrapper))
    per_pm = _cache.setdefault(pm, {})
    cached = per_pm.get(kind)
    if cached is not None and cached.impls == impls:
        return cached
    regs = _Registrations(impls)
    # Registration order: the built-ins first, then plugins in load order. A name is owned by
    # the first plugin that registers it, so no installed package can replace a built-in.
    for impl in impls:
        found: list[tuple[str, type]] = []

        def register(name: str, cls: type, _found: list[tuple[str, type]] = found) -> None:
            if not isinstance(name, str) or not name or ":" in name:
                raise ValueError(f"invalid {spec.noun} name {name!r} (a non-empty string "
                                 "without ':')")
            if not isinstance(cls, type):
                raise ValueError(f"{spec.noun} {name!r} must be registered as a class, got "
                                 f"{cls!r}")
            _found.append((name, cls))

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except Exception as e:
            failure = PluginFailure(impl.plugin_name, f"{type(e).__name__}: {e}", kind)
            regs.failures.append(failure)
            log.warning("%s; its %s are skipped", failure, kind)
            continue
        for name, cls in found:
            owner = regs.providers.get(name)
            if owner is None:
                regs.classes[name] = cls
                regs.providers[name] = impl.plugin_name
            elif regs.classes[name] is not cls:
                log.warning("plugin %r registers %s %r (%s), already registered by plugin %r "
                            "(%s); keeping the first", impl.plugin_name, spec.noun, name,
                            qualname(cls), owner, qualname(regs.classes[name]))
    per_pm[kind] = regs
    return regs


def registered(kind: str, pm: pluggy.PluginManager | None = None) -> dict[str, type]:
    """Name -> class of every registered component of ``kind`` (schedulers,
    structured_output_backends, kv_connectors, reasoning_parsers or models)."""
    return dict(_registrations(pm or get_plugin_manager(), kind).classes)


# -- resolution ----------------------------------------------------------------------------


def resolve_scheduler(name: str, pm: pluggy.PluginManager | None = None) -> type:
    """The scheduler class for ``--scheduler``, checked against ``Scheduler``."""
    return _resolve("schedulers", name, pm)


def resolve_structured_output_backend(name: str, pm: pluggy.PluginManager | None = None) -> type:
    return _resolve("structured_output_backends", name, pm)


def resolve_kv_connector(name: str, pm: pluggy.PluginManager | None = None) -> type:
    return _resolve("kv_connectors", name, pm)


def resolve_reasoning_parser(name: str, pm: pluggy.PluginManager | None = None) -> type:
    """The reasoning-parser class for ``--reasoning-parser`` (deepseek_r1, qwen3, a plugin's)."""
    return _resolve("reasoning_parsers", name, pm)


def resolve_model(architecture: str, pm: pluggy.PluginManager | None = None) -> type:
    """The model class registered for a checkpoint's architecture (never a qualname)."""
    return _resolve("models", architecture, pm)


def _resolve(kind: str, name: str, pm: pluggy.PluginManager | None) -> type:
    spec = KINDS[kind]
    prefix = f"{spec.flag}: " if spec.flag else ""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{prefix}expected a {spec.noun} name, got {name!r}")
    name = name.strip()
    if spec.allow_qualname and ":" in name:
        cls = _import_qualname(name, prefix)
        label = name
    else:
        pm = pm or get_plugin_manager()
        regs = _registrations(pm, kind)
        if name not in regs.classes:
            raise ValueError(prefix + _not_registered(kind, name, pm, regs))
        cls = regs.classes[name]
        label = f"{spec.noun} {name!r} ({qualname(cls)})"
    check_contract(kind, cls, prefix + label)
    return cls


def _not_registered(kind: str, name: str, pm: pluggy.PluginManager,
                    regs: _Registrations) -> str:
    spec = KINDS[kind]
    words = "is not supported" if kind == "models" else "is not registered"
    parts = [f"{spec.noun} {name!r} {words}"]
    failures = [*getattr(pm, "failures", []), *regs.failures]
    parts += [str(f) for f in failures]
    excluded = getattr(pm, "excluded", [])
    if excluded:
        parts.append(f"not loaded because {ALLOWLIST_ENV} leaves them out: "
                     f"{', '.join(excluded)}")
    names = ", ".join(sorted(regs.classes)) or "none"
    hint = "; or give pkg.module:Class" if spec.allow_qualname else ""
    return "; ".join(parts) + f" (registered: {names}{hint})"


def _import_qualname(text: str, prefix: str) -> type:
    module_name, _, attr = text.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{prefix}{text!r} is neither a registered name nor of the form "
                         "pkg.module:Class")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"{prefix}cannot import {module_name!r} for {text}: "
                         f"{type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{prefix}{text}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
    return obj
