"""A hub repository's GGUF file by its quantization (``executor/weights/hub_gguf.py``):
``user/repo:Q4_K_M`` as llama-server's ``-hf`` and vLLM's ``repo:quant_type`` take it. No hub is
reachable here: the choice is tested on file lists, the download through a stand-in for the
hub's two calls, and resolution through a real hub cache, offline."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from asyncengine.executor.weights import hub_gguf
from asyncengine.executor.weights.loader import resolve_model
from tests.utils import embedded_gguf_path

FILES = ["README.md", "SmolLM2-Q4_K_M.gguf", "SmolLM2-Q4_K_S.gguf", "SmolLM2.Q8_0.gguf",
         "mmproj-SmolLM2-f16.gguf", "big/Big-Q4_K_M-00001-of-00002.gguf",
         "big/Big-Q4_K_M-00002-of-00002.gguf"]


def cached_repo(root: Path, repo: str, files: dict[str, str | None]) -> Path:
    """A hub cache under ``root`` holding ``repo`` at one commit: each file a copy of its
    source path (None: a stand-in of a few bytes). Returns the cache directory."""
    cache = root / "hub"
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    for name, source in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        if source is None:
            (snap / name).write_bytes(b"GGUF")
        else:
            os.symlink(source, snap / name)
    return cache


@pytest.mark.parametrize("tag, chosen", [
    ("Q4_K_M", ["SmolLM2-Q4_K_M.gguf"]),
    ("q4_k_s", ["SmolLM2-Q4_K_S.gguf"]),  # case-insensitive
    ("Q8_0", ["SmolLM2.Q8_0.gguf"]),
    (None, ["SmolLM2-Q4_K_M.gguf"]),  # llama-server's default
    ("SmolLM2.Q8_0.gguf", ["SmolLM2.Q8_0.gguf"]),  # a file by its name (-hff)
])
def test_the_quantization_picks_the_file(tag, chosen):
    files = [f for f in FILES if not f.startswith("big/")]
    assert hub_gguf.pick(files, tag, "u/r") == chosen


def test_what_cannot_be_picked_is_named():
    with pytest.raises(ValueError, match=r"no GGUF file for Q4_K; the repository offers: "
                                         r"Big-Q4_K_M.gguf, SmolLM2-Q4_K_M.gguf"):
        hub_gguf.pick(FILES, "Q4_K", "u/r")  # a whole name part: Q4_K is not Q4_K_M
    with pytest.raises(ValueError, match="Q4_K_M matches several files"):
        hub_gguf.pick(FILES, "Q4_K_M", "u/r")
    with pytest.raises(ValueError, match=r"Q4_K_M \(the default\) matches several files"):
        hub_gguf.pick(FILES, None, "u/r")
    with pytest.raises(ValueError, match="holds no GGUF model file"):
        hub_gguf.pick(["README.md", "mmproj-x-f16.gguf"], None, "u/r")
    # without Q4_K_M, a repository's only model is the one (its projector is not a model)
    assert hub_gguf.pick(["a.Q8_0.gguf", "mmproj-a.gguf"], None, "u/r") == ["a.Q8_0.gguf"]
    with pytest.raises(ValueError, match=r"Q4_K_M \(the default\)"):
        hub_gguf.pick(["a.Q8_0.gguf", "a.Q6_K.gguf"], None, "u/r")
    # the parts of a split model, in order
    assert hub_gguf.pick(FILES[5:], "q4_k_m", "u/r") == FILES[5:]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


def test_one_file_is_downloaded_and_loads(empty_cache, monkeypatch):
    """Only the chosen file is fetched; a split model is refused before anything is."""
    import huggingface_hub

    fetched = []

    def fake_download(repo, filename, **kwargs):
        fetched.append((repo, filename))
        path = empty_cache / "dl" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.symlink(embedded_gguf_path(), path)
        return str(path)

    monkeypatch.setattr(hub_gguf, "list_files", lambda repo, revision, cache_dir: (
        FILES[:5] if repo == "someone/SmolLM2-GGUF" else FILES[5:]))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    source = resolve_model("someone/SmolLM2-GGUF:Q8_0")
    assert fetched == [("someone/SmolLM2-GGUF", "SmolLM2.Q8_0.gguf")]
    assert source.gguf_file == "SmolLM2.Q8_0.gguf" and source.name == "someone/SmolLM2-GGUF:Q8_0"
    assert source.hf_config.architectures == ["LlamaForCausalLM"]
    fetched.clear()
    with pytest.raises(ValueError, match=r"split into 2 files.*llama-gguf-split --merge"):
        hub_gguf.download("someone/Big-GGUF", "Q4_K_M")
    with pytest.raises(ValueError, match="the repository offers"):
        hub_gguf.download("someone/Big-GGUF", "IQ2_XS")
    assert fetched == []


def test_a_cached_repository_resolves_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = cached_repo(tmp_path, "someone/SmolLM2-GGUF", {
        "SmolLM2-135M-Instruct.Q4_1.gguf": embedded_gguf_path(), "README.md": None,
        "mmproj-SmolLM2-f16.gguf": None})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("someone/SmolLM2-GGUF:Q4_1")
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # no quantization named: the repository's only model (there is no Q4_K_M)
    assert resolve_model("someone/SmolLM2-GGUF").gguf_file == source.gguf_file
    with pytest.raises(ValueError, match="not in the hub cache and HF_HUB_OFFLINE is set"):
        resolve_model("someone/SmolLM2-GGUF:Q8_0")


def test_an_unreachable_hub_fails_fast_with_a_clear_message(empty_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refuses connections
    start = time.monotonic()
    with pytest.raises(ValueError, match="'someorg/m-GGUF:Q4_K_M'.*no model hub is reachable"):
        resolve_model("someorg/m-GGUF:Q4_K_M")
    assert time.monotonic() - start < 10


def test_the_projector_that_goes_with_the_model():
    """llama-server's choice: an ``mmproj*`` file beside the model or above it, the deepest,
    then the nearest quantization in bits."""
    files = ["a-Q4_K_M.gguf", "a-Q8_0.gguf", "mmproj-a-f16.gguf", "mmproj-a-Q8_0.gguf",
             "sub/b-Q4_K_M.gguf", "sub/mmproj-b-f32.gguf", "other/mmproj-c-Q4_0.gguf"]
    assert hub_gguf.pick_mmproj(files, "a-Q4_K_M.gguf") == "mmproj-a-Q8_0.gguf"  # 8 near 4
    assert hub_gguf.pick_mmproj(files[:3], "a-Q8_0.gguf") == "mmproj-a-f16.gguf"
    assert hub_gguf.pick_mmproj(files, "sub/b-Q4_K_M.gguf") == "sub/mmproj-b-f32.gguf"
    assert hub_gguf.pick_mmproj(files[4:6] + files[2:3], "sub/b-Q4_K_M.gguf") == \
        "sub/mmproj-b-f32.gguf"  # its own directory first, however far the bits
    assert hub_gguf.pick_mmproj(["sub/mmproj-x.gguf", "a-Q4_K_M.gguf"], "a-Q4_K_M.gguf") \
        is None  # a projector below the model's directory is not its
    assert hub_gguf.pick_mmproj(FILES, "SmolLM2-Q4_K_M.gguf") == "mmproj-SmolLM2-f16.gguf"
    assert hub_gguf.pick_mmproj(["a.gguf", "README.md"], "a.gguf") is None
