"""The plugin machinery behind :mod:`asyncengine.plugins` (plugins import only that module).

* ``contracts/``: what a plugin implements: the hook specs (``hooks.py``), the
  structured-output backend (``structured_output.py``) and the KV connector
  (``kv_connector.py``) contracts, and the table of contract versions (``__init__.py``). The
  scheduler contract lives with the schedulers, in ``asyncengine/core/sched/interface.py``.
* ``registry.py``: the plugin manager (entry points, the allowlist) and component lookup.
* ``kinds.py``: the kinds of component and the start-up check of a class against its contract.
* ``deprecated.py``: the old import paths, kept for one contract version.

The built-in components are the default plugin, ``asyncengine/builtins/``; the engine-side
code that drives them lives with the engine (``engine/kv_transfer.py``,
``engine/structured_output.py``).
"""
