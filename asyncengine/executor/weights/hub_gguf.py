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
"""

from __future__ import annotations

import contextlib
import os
import re

from asyncengine.executor.weights import hub_access

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


def download(repo: str, tag: str | None, revision: str | None = None,
             cache_dir: str | None = None) -> str:
    """The local path of the GGUF file ``repo:tag`` names (downloaded if not cached)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cached = None
    with contextlib.suppress(LocalEntryNotFoundError, OSError):
        cached = snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                   allow_patterns=["*.gguf"], local_files_only=True)
    if cached is not None:
        local = [os.path.relpath(os.path.join(d, f), cached)
                 for d, _, names in os.walk(cached) for f in names]
        with contextlib.suppress(ValueError):
            return _single(repo, cached, pick(local, tag, repo))
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
                               etag_timeout=5)
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

