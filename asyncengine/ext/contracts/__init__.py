"""The contracts a plugin implements, and the one table of their versions.

A contract's version is bumped when it changes incompatibly: a method or hook added, removed,
renamed, or its meaning or signature changed, or a name leaving ``asyncengine.plugins``
(``tests/plugins/test_plugins_api.py`` holds a snapshot of the names per version and fails on
a change without a bump). Compatible additions (a new optional argument, a new data-class
field, a new name) keep the version.

A component class may declare ``contract_version``; the engine refuses one written for a
version it no longer accepts, naming both, at start-up. ``ACCEPTED_VERSIONS`` lists the older
versions still accepted (with a ``DeprecationWarning``): those whose change was only where
names are imported from.
"""

from __future__ import annotations

from types import MappingProxyType

from asyncengine.core.sched.interface import SCHEDULER_API_VERSION
from asyncengine.ext.contracts.hooks import HOOKS_API_VERSION
from asyncengine.ext.contracts.kv_connector import KV_CONNECTOR_API_VERSION
from asyncengine.ext.contracts.structured_output import STRUCTURED_OUTPUT_API_VERSION
from asyncengine.text.reasoning_parsers.base import REASONING_PARSER_API_VERSION

#: contract -> its current version. Version 2 of each: the plugin API became one module,
#: ``asyncengine.plugins``; the paths of version 1 still import, with a DeprecationWarning.
CONTRACT_VERSION: MappingProxyType[str, int] = MappingProxyType({
    "hooks": HOOKS_API_VERSION,
    "scheduler": SCHEDULER_API_VERSION,
    "structured_output": STRUCTURED_OUTPUT_API_VERSION,
    "kv_connector": KV_CONNECTOR_API_VERSION,
    "reasoning_parser": REASONING_PARSER_API_VERSION,
})

#: contract -> older versions a component may still declare (deprecated: accepted with a
#: DeprecationWarning, refused from the next version on).
ACCEPTED_VERSIONS: MappingProxyType[str, tuple[int, ...]] = MappingProxyType({
    "hooks": (1,),
    "scheduler": (1,),
    "structured_output": (1,),
    "kv_connector": (1,),
    "reasoning_parser": (),
})

__all__ = ["ACCEPTED_VERSIONS", "CONTRACT_VERSION"]
