"""A GGUF file from a hub repository, chosen by its quantization: ``user/repo:Q4_K_M``.

llama-server's ``-hf user/repo[:quant]`` (and vLLM's ``repo:quant_type`` model form) name a
repository of GGUF files and the quantization to take from it. The tag is matched against
the repository's ``.gguf`` file names, case-insensitively, as a whole name part (``Q4_K_M``
matches ``model-Q4_K_M.gguf`` and ``model.q4_k_m.gguf``, not ``model-Q4_K_M_L.gguf``);
without a tag the default is ``Q4_K_M``, else the repository's only model file. Projector
files (``mmproj*``) are never the model. A tag ending in ``.gguf`` names the file itself
(llama-server's ``-hff``).

The chosen file is downloaded into the hub cache (a cached copy is used without a request,
and is all that is looked at when ``HF_HUB_OFFLINE`` is set). A model split into several
files (``-00001-of-00003.gguf``) is refused with the command that merges it.

With the model comes the repository's vision projector, as llama-server's ``-hf`` fetches it
(``--no-mmproj-auto``, llama-server's ``--no-mmproj``: not): of the ``.gguf`` files named
``mmproj*``, one in the model's directory or a directory above it, the deepest, then the one
whose quantization's bits are nearest the model's (``Q4_K_M``: 4, ``Q8_0``: 8, ``f16``: 16),
as llama.cpp chooses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

from asyncengine.executor.weights import hub_access

logger = logging.getLogger("asyncengine")

#: The quantization llama-server takes when the tag is left out.
DEFAULT_TAG = "Q4_K_M"
_TAGGED = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+):([\w.-]+)$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def parse(model: str) -> tuple[str, str] | None:
    """``(repo, tag)`` of a ``user/repo:TAG`` model name; None for anything else."""
    m = _TAGGED.match(model)
    return (m.group(1), m.group(2)) if m else None


def _model_files(files: list[str]) -> list[str]:
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and not os.path.basename(f).lower().startswith("mmproj"))


def _has_tag(file: str, tag: str) -> bool:
    stem = _SPLIT.sub("", os.path.basename(file))
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    return re.search(rf"(^|[-_.]){re.escape(tag)}$", stem, re.IGNORECASE) is not None


def pick(files: list[str], tag: str | None, repo: str) -> list[str]:
    """The repository file(s) of the model that ``tag`` names (several: the parts of a
    split model, in order). ValueError naming what the repository offers otherwise."""
    models = _model_files(files)
    if not models:
        raise ValueError(f"model {repo!r}: the repository holds no GGUF model file")
    if tag is not None and tag.lower().endswith(".gguf"):
        chosen = [f for f in models if f == tag or os.path.basename(f) == tag]
    else:
        chosen = [f for f in models if _has_tag(f, tag or DEFAULT_TAG)]
        if not chosen and tag is None and len({_SPLIT.sub("", f) for f in models}) == 1:
            chosen = models  # the only model in the repository
    what = tag if tag is not None else f"{DEFAULT_TAG} (the default)"
    if not chosen:
        offered = sorted({_SPLIT.sub(".gguf", os.path.basename(f)) for f in models})
        raise ValueError(f"model {repo!r}: no GGUF file for {what}; the repository offers: "
                         f"{', '.join(offered)} (name one as {repo}:QUANT)")
    stems = {_SPLIT.sub("", f) for f in chosen}
    if len(stems) > 1:
        raise ValueError(f"model {repo!r}: {what} matches several files ({', '.join(chosen)}); "
                         f"name one as {repo}:FILE.gguf")
    return chosen


def _bits(file: str) -> int:
    """The bits of a GGUF file's quantization, from its name's last part (0: none)."""
    stem = _SPLIT.sub("", os.path.basename(file))
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    digits = re.search(r"\d+", m.group(1)) if m else None
    return int(digits.group()) if digits else 0


def pick_mmproj(files: list[str], model_file: str) -> str | None:
    """The projector file (``mmproj*.gguf``) that goes with ``model_file`` (a path inside
    the repository, as ``files`` are), None where the repository has none for it."""
    model_dir = model_file.split("/")[:-1]
    best: tuple[int, int] | None = None
    chosen = None
    for f in sorted(files):
        parts = f.split("/")
        if not (f.lower().endswith(".gguf") and parts[-1].lower().startswith("mmproj")):
            continue
        if parts[:-1] != model_dir[:len(parts) - 1]:
            continue  # not beside the model, nor above it
        rank = (-(len(parts) - 1), abs(_bits(f) - _bits(model_file)))
        if best is None or rank < best:
            best, chosen = rank, f
    return chosen


def _cached(repo: str, revision: str | None, cache_dir: str | None
            ) -> tuple[str, list[str]] | None:
    """The cached snapshot of ``repo`` and its GGUF files (None: nothing cached)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    with contextlib.suppress(LocalEntryNotFoundError, OSError):
        root = snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=["*.gguf"], local_files_only=True)
        return root, [os.path.relpath(os.path.join(d, f), root)
                      for d, _, names in os.walk(root) for f in names]
    return None


def download_mmproj(repo: str, model_file: str, revision: str | None = None,
                    cache_dir: str | None = None) -> str | None:
    """The local path of the projector that goes with the repository's ``model_file``
    (downloaded if not cached); None when the repository has none, or when it is not cached
    and the hub cannot be asked (the model is served without images, with a warning)."""
    from huggingface_hub import hf_hub_download

    cached = _cached(repo, revision, cache_dir)
    if cached is not None and (chosen := pick_mmproj(cached[1], model_file)) is not None:
        return os.path.join(cached[0], chosen)
    if hub_access.offline():
        return None
    try:
        with hub_access.errors_named(repo, repo, revision, "no model hub is reachable"):
            chosen = pick_mmproj(list_files(repo, revision, cache_dir), model_file)
            if chosen is None:
                return None
            return hf_hub_download(repo, chosen, revision=revision, cache_dir=cache_dir,
                                   etag_timeout=5)
    except ValueError as e:
        logger.warning("model %s: its vision projector (mmproj) was not fetched: %s; "
                       "serving it without images", repo, e)
        return None


def download(repo: str, tag: str | None, revision: str | None = None,
             cache_dir: str | None = None) -> str:
    """The local path of the GGUF file ``repo:tag`` names (downloaded if not cached)."""
    return download_file(repo, tag, revision, cache_dir)[0]


def download_file(repo: str, tag: str | None, revision: str | None = None,
                  cache_dir: str | None = None) -> tuple[str, str]:
    """``(local path, path inside the repository)`` of the GGUF file ``repo:tag`` names."""
    from huggingface_hub import hf_hub_download

    cached = _cached(repo, revision, cache_dir)
    if cached is not None:
        with contextlib.suppress(ValueError):
            chosen = pick(cached[1], tag, repo)
            return _single(repo, cached[0], chosen), chosen[0]
    name = f"{repo}:{tag}" if tag else repo
    if hub_access.offline():
        raise ValueError(f"model {name!r}: not in the hub cache and HF_HUB_OFFLINE is set; "
                         "pass a local .gguf file")
    unreachable = (f"model {name!r} is not a local file and no model hub is reachable to "
                   "download it; pass a local .gguf file")
    with hub_access.errors_named(name, repo, revision, unreachable):
        chosen = pick(list_files(repo, revision, cache_dir), tag, repo)
        _single(repo, "", chosen)  # a split model is refused before anything is fetched
        return hf_hub_download(repo, chosen[0], revision=revision, cache_dir=cache_dir,
                               etag_timeout=5), chosen[0]
    raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises


def list_files(repo: str, revision: str | None, cache_dir: str | None) -> list[str]:
    """The repository's GGUF file names (a dry run of the download: one listing request,
    failing fast where the hub cannot be reached)."""
    from huggingface_hub import snapshot_download

    infos = snapshot_download(repo, revision=revision, cache_dir=cache_dir, dry_run=True,
                              allow_patterns=["*.gguf", "*.GGUF"], etag_timeout=5)
    return [info.filename for info in infos]


def _single(repo: str, root: str, chosen: list[str]) -> str:
    if len(chosen) > 1:
        raise ValueError(f"model {repo!r}: {os.path.basename(chosen[0])} is split into "
                         f"{len(chosen)} files, which asyncengine does not read as one; "
                         f"download them, merge them with `llama-gguf-split --merge "
                         f"{os.path.basename(chosen[0])} merged.gguf` and pass merged.gguf")
    return os.path.join(root, chosen[0])

