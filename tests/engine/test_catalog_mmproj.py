"""A router's models with a vision projector: the one ``mmproj*.gguf`` beside a subdirectory's
GGUF model is its ``--mmproj`` (as llama-server's router finds it); a preset's ``mmproj`` is
read from inside ``--models-dir`` like its model."""

from __future__ import annotations

import pytest

from asyncengine.config.models_preset import load_presets
from asyncengine.engine.catalog import build_catalog


def test_a_projector_beside_the_model_is_its_mmproj(tmp_path):
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "model-Q4_K_M.gguf").write_bytes(b"")
    (vlm / "mmproj-model-f16.gguf").write_bytes(b"")
    two = tmp_path / "two"
    two.mkdir()
    for f in ("m.gguf", "mmproj-a.gguf", "mmproj-b.gguf"):  # which one: not guessed
        (two / f).write_bytes(b"")
    (tmp_path / "plain.gguf").write_bytes(b"")
    (tmp_path / "mmproj-stray.gguf").write_bytes(b"")
    sources = {s.name: s for s in build_catalog(str(tmp_path), {}, embedded=False)}
    assert sorted(sources) == ["plain", "two", "vlm"]
    assert sources["vlm"].path == str(vlm / "model-Q4_K_M.gguf")
    assert sources["vlm"].options == {"mmproj": str(vlm / "mmproj-model-f16.gguf")}
    assert sources["two"].options == {} and sources["plain"].options == {}


def test_a_presets_mmproj_stays_inside_the_models_dir(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "mmproj-m.gguf").write_bytes(b"")
    ini = tmp_path / "presets.ini"
    ini.write_text("[m]\nmmproj = mmproj-m.gguf\n")
    [source] = build_catalog(str(tmp_path), load_presets(ini), embedded=False)
    assert source.options == {"mmproj": str(tmp_path / "mmproj-m.gguf")}
    ini.write_text("[m]\nmmproj = ../mmproj-m.gguf\n")
    with pytest.raises(ValueError, match="mmproj: .*leaves the models directory"):
        build_catalog(str(tmp_path), load_presets(ini), embedded=False)
