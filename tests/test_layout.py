"""The source tree shows the architecture, and this test keeps it that way.

Every import in the package is read from the AST, including imports inside functions and under
``TYPE_CHECKING`` (they are real dependencies even when deferred). Then:

* each folder imports only itself and the layers below it (``LAYERS``, bottom first): nothing
  under ``core/`` imports torch or anything above it, ``executor/`` never imports
  ``entrypoints/``, and so on;
* there is no import circle anywhere in the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import asyncengine

ROOT = Path(asyncengine.__file__).parent

#: Bottom first: a module may import its own layer's modules and those of lower layers only.
LAYERS: list[tuple[str, ...]] = [
    ("asyncengine.config",),
    ("asyncengine.core",),
    ("asyncengine.text",),
    ("asyncengine.ext",),
    ("asyncengine.plugins",),  # the plugin API: re-exports core/ and ext/ for plugin authors
    ("asyncengine.executor",),
    ("asyncengine.engine",),
    ("asyncengine.builtins",),
    ("asyncengine.entrypoints",),
    ("asyncengine.deploy",),  # serving beyond one process (Ray Serve), on top of entrypoints
    ("asyncengine", "asyncengine.__main__"),  # the package's public face sits on top
]
#: Third-party modules a layer must never import.
FORBIDDEN = {"asyncengine.core": ("torch", "numpy", "aiohttp", "transformers")}
#: Inside the executor: the ways a step runs (``paths/``) sit on the model and its weights,
#: and the runner and start-up on the paths; never the reverse.
BELOW = {
    "asyncengine.executor.models": ("asyncengine.executor.paths", "asyncengine.executor.runner",
                                    "asyncengine.executor.build"),
    "asyncengine.executor.weights": ("asyncengine.executor.paths",
                                     "asyncengine.executor.runner",
                                     "asyncengine.executor.build"),
    "asyncengine.executor.paths": ("asyncengine.executor.runner", "asyncengine.executor.build"),
}
#: One concept per file: a module past this many lines is split.
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``path`` imports, anywhere in the file; for ``from X import y`` the
    submodule ``X.y`` when it is one, else ``X``."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in known else mod)
    return found


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[0]:
                    best = (len(p), i)
    return None if best is None else best[1]


def import_graph() -> dict[str, set[str]]:
    mods = all_modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_every_module_has_a_layer() -> None:
    missing = [m for m in all_modules() if layer_of(m) is None]
    assert not missing


def test_layers_import_only_downwards() -> None:
    bad = []
    for mod, deps in import_graph().items():
        mine = layer_of(mod)
        for dep in deps:
            if dep.split(".")[0] == "asyncengine":
                theirs = layer_of(dep)
                if theirs is not None and theirs > mine:
                    bad.append(f"{mod} imports {dep}")
            for prefix, banned in FORBIDDEN.items():
                if mod.startswith(prefix) and dep.split(".")[0] in banned:
                    bad.append(f"{mod} imports {dep}")
    assert not bad, "layering broken:\n" + "\n".join(sorted(bad))


def test_the_executor_s_parts_import_downwards() -> None:
    bad = sorted(f"{mod} imports {dep}" for mod, deps in import_graph().items()
                 for below, banned in BELOW.items() if mod.startswith(below)
                 for dep in deps if dep.startswith(banned))
    assert not bad, "executor layering broken:\n" + "\n".join(bad)


def test_no_module_is_past_the_line_limit() -> None:
    long = sorted(f"{name}: {n} lines" for name, path in all_modules().items()
                  if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES)
    assert not long, "split these:\n" + "\n".join(long)


def test_the_environment_is_read_in_one_place() -> None:
    """``config/environment.py`` lists every variable the package reads, with what it does;
    nothing else reads ``os.environ`` (passing it on to a child process, or setting a
    variable for a library, is fine)."""
    from asyncengine.config.environment import VARIABLES

    reads, unknown = [], []
    for name, path in all_modules().items():
        text = path.read_text(encoding="utf-8")
        if name != "asyncengine.config.environment":
            reads += [f"{name}: {m}" for m in re.findall(
                r"os\.environ\.get\([^)]*|os\.environ\[[^\]]*\](?!\s*=)|in os\.environ", text)]
        for var in re.findall(r"environment\.(?:get|on|is_set)\(\s*\"(\w+)\"", text):
            if var not in VARIABLES:
                unknown.append(f"{name}: {var}")
    assert not reads, "read these through config/environment.py:\n" + "\n".join(reads)
    assert not unknown, "not in config/environment.VARIABLES:\n" + "\n".join(unknown)


#: Where the package may ask what kind of device it runs on. The device (``runtime/``) and the
#: ways a step runs (``paths/``) are made of such choices; an op asks ``kernels/where.py``; the
#: attention backend is chosen by the device's name in one factory; the tensor-parallel
#: workers set up their own device; two flags are checked against it.
DEVICE_CHECKS_LIVE_IN = (
    "asyncengine.executor.runtime", "asyncengine.executor.paths", "asyncengine.executor.kernels",
    "asyncengine.executor.attention", "asyncengine.executor.parallel",
    "asyncengine.executor.kv.dtype", "asyncengine.config",
)
DEVICE_CHECK = re.compile(
    r"""device\.type\s*[!=]=|\.is_cuda\b|\b(?:device|device_type)\s*[!=]=\s*["'](?:cpu|cuda)""")


def test_device_checks_live_in_the_device_the_paths_and_the_kernels() -> None:
    """Elsewhere a module asks the device (``Device.computes_on_host``, its start-up hooks) or
    the kernels' rule (``kernels/where.on_host``, ``host_kernel``), never ``x.device.type``."""
    found = []
    for name, path in all_modules().items():
        if name.startswith(DEVICE_CHECKS_LIVE_IN):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DEVICE_CHECK.search(line.split("#")[0]):
                found.append(f"{name}:{n}: {line.strip()}")
    assert not found, "ask the device or kernels/where.py:\n" + "\n".join(found)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-import): Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles() -> None:
    assert find_cycles(import_graph()) == []


# -- the checks themselves catch what they claim to ---------------------------------------------
def test_the_cycle_finder_sees_a_circle_through_deferred_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize(("source", "banned"), [
    ("import torch\n", "torch"),
    ("def f():\n    from asyncengine.executor import runner\n", "asyncengine.executor.runner"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from asyncengine.engine import x\n",
     "asyncengine.engine"),
])
def test_an_upward_import_in_core_is_seen(tmp_path: Path, source: str, banned: str) -> None:
    path = tmp_path / "mod.py"
    path.write_text(source)
    deps = imports_of("asyncengine.core.mod", path, {"asyncengine.executor.runner"})
    assert banned in deps
    assert layer_of(banned) is None or layer_of(banned) > layer_of("asyncengine.core.mod") \
        or banned.split(".")[0] in FORBIDDEN["asyncengine.core"]
