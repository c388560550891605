"""The plugin API's old import paths, kept working for one contract version.

Plugin API 2 gathered everything a plugin imports into one module, :mod:`asyncengine.plugins`,
and sorted ``asyncengine/ext`` by role. The modules plugins used to import from (the hook
specs, the contracts, the built-ins) moved; their old names stay importable until the next
contract version, as modules registered in ``sys.modules`` (no files are left at the old
paths). Each attribute read from one warns with a ``DeprecationWarning`` that names the new
place; the attribute itself is the new module's, so classes and markers are the same objects.

The new modules are imported by name on first attribute access (``importlib``), so importing
this module costs nothing and loads no layer above ``ext/``.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

#: The plugin API version that moved these paths; they go away in the next one.
MOVED_IN = 2

#: old module -> the modules its names now come from, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    # The paths before the core/ext layout (plugin API 0.x).
    "asyncengine.hookspecs": ("asyncengine.ext.contracts.hooks",),
    "asyncengine.scheduling": ("asyncengine.core.sched.interface",),
    "asyncengine.schedulers": ("asyncengine.core.sched",),
    "asyncengine.schedulers.fcfs": ("asyncengine.core.sched.fcfs",),
    "asyncengine.schedulers.priority": ("asyncengine.core.sched.priority",),
    # The paths of plugin API 1.
    "asyncengine.ext.hookspecs": ("asyncengine.ext.contracts.hooks",),
    "asyncengine.ext.kv_connector": (),
    "asyncengine.ext.kv_connector.contract": ("asyncengine.ext.contracts.kv_connector",),
    "asyncengine.ext.kv_connector.safetensors": ("asyncengine.builtins.safetensors_connector",),
    "asyncengine.ext.kv_connector.transfer": ("asyncengine.engine.kv_transfer",),
    "asyncengine.ext.structured_output": ("asyncengine.ext.contracts.structured_output",
                                          "asyncengine.engine.structured_output"),
    "asyncengine.ext.structured_output.contract": (
        "asyncengine.ext.contracts.structured_output",),
    "asyncengine.ext.structured_output.manager": ("asyncengine.engine.structured_output",),
    "asyncengine.ext.structured_output.xgrammar": ("asyncengine.builtins.xgrammar",),
}

#: Names that changed along with their module (old -> new).
RENAMED = {"SchedulerInterface": "Scheduler"}


class _MovedModule(types.ModuleType):
    """An old module path: reading a name warns and returns the new module's object."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Deprecated alias (plugin API {MOVED_IN}); import from "
                               "asyncengine.plugins.")
        self.__path__: list[str] = []  # a package, so its old submodules import too
        self._targets = targets

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = sys.modules.get(f"{self.__name__}.{attr}")
        if isinstance(sub, _MovedModule):
            return sub
        new_name = RENAMED.get(attr, attr)
        for target in self._targets:
            module = importlib.import_module(target)
            try:
                value = getattr(module, new_name)
            except AttributeError:
                continue
            public = importlib.import_module("asyncengine.plugins")
            instead = (f"import {new_name} from asyncengine.plugins"
                       if getattr(public, new_name, None) is value
                       else f"it is internal now ({target}.{new_name})")
            warnings.warn(f"{self.__name__}.{attr} is deprecated since asyncengine plugin API "
                          f"{MOVED_IN} and will be removed in the next: {instead}",
                          DeprecationWarning, stacklevel=2)
            # Kept, so the import machinery's second look (``from x import y`` of a package
            # checks hasattr first) does not warn twice.
            setattr(self, attr, value)
            return value
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._targets:
            names.update(n for n in dir(importlib.import_module(target)) if not n.startswith("_"))
        return sorted(names)


def install() -> None:
    """Register the old paths in ``sys.modules`` (idempotent; never replaces a real module)."""
    for name, targets in MOVED.items():
        if name in sys.modules:
            continue
        alias = _MovedModule(name, targets)
        sys.modules[name] = alias
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, alias)
