"""GGUF models with a vision projector file (``--mmproj``, llama-server's ``-mm``): tiny LLaVA,
Idefics3 and Gemma 3 checkpoints converted to a text GGUF and an mmproj file with llama.cpp's
tensor names and metadata (``tests/mmproj_utils.py``) answer with transformers' greedy tokens;
the legacy LLaVA converter's layout and quantized tower matrices load; a file that is no
projector, or a tokenizer without the image token, is a clear error at start-up."""

from __future__ import annotations

import anyio
import pytest

from asyncengine.core.multimodal import ImagePrompt
from tests.mmproj_utils import gguf_pair, write_mmproj
from tests.vision_tiling_utils import greedy, reference
from tests.vision_utils import gemma3_reference, image, image_item, llava_reference, vision_engine

N = 8
LLAVA = "USER: <image>\nWhat is shown here? ASSISTANT:"
IDEFICS3 = "User:<image>and<image>Compare them.<end_of_utterance>\nAssistant:"
GEMMA3 = ("<start_of_turn>user\n<start_of_image>What is shown here?<end_of_turn>\n"
          "<start_of_turn>model\n")


def run(engine, prompt: str, images: list) -> tuple[list[int], list[int], int]:
    async def main():
        async with engine:
            return await greedy(engine, ImagePrompt(prompt, [
                image_item(im, bytes([i + 1])) for i, im in enumerate(images)]), N)

    return anyio.run(main)


@pytest.fixture(scope="module")
def llava_pair(tiny_llava, tmp_path_factory) -> tuple[str, str]:
    return gguf_pair(tiny_llava, tmp_path_factory.mktemp("llava-gguf"), "mlp",
                     "LlavaForConditionalGeneration", legacy_llava=True)


def test_llava_pair_matches_transformers(tiny_llava, llava_pair, tmp_path):
    """The legacy converter's layout (``mm.0``/``mm.2``, FFN names swapped), F32 and with the
    tower's matrices in Q8_0."""
    text, mmproj = llava_pair
    a = image(97, 61, seed=1)
    want_ids, want = llava_reference(tiny_llava, LLAVA, [a], N)
    ids, new, _ = run(vision_engine(text, tokenizer=tiny_llava, mmproj=mmproj), LLAVA, [a])
    assert ids == want_ids and new == want
    # Q8_0 tower matrices: kept as the file's blocks on the CPU, multiplied by the packed
    # kernels; their output is the dequantized weights' to rounding
    import torch

    from asyncengine.executor.models.vision.gguf_mmproj import load_mmproj
    from asyncengine.executor.weights.kquants import GGUFLinear

    q8 = write_mmproj(tiny_llava, tmp_path / "mmproj-q8.gguf", "mlp", quant="Q8_0")
    engine = vision_engine(text, tokenizer=tiny_llava, mmproj=q8)
    packed = engine.runner.model.vision
    q_proj = packed.vision_tower.encoder.layers[0].self_attn.q_proj
    assert isinstance(q_proj, GGUFLinear)
    ids, new, _ = run(engine, LLAVA, [a])
    assert ids == want_ids and len(new) == N
    plain = load_mmproj(q8, 64, engine.tokenizer, torch.float32, torch.device("cpu"),
                        packed=False)
    px = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(packed.encode(px), plain.encode(px), atol=2e-2, rtol=2e-2)


def test_idefics3_pair_matches_transformers(tiny_idefics3, tmp_path):
    text, mmproj = gguf_pair(tiny_idefics3, tmp_path, "idefics3",
                             "Idefics3ForConditionalGeneration")
    a, b = image(97, 61, seed=1), image(40, 130, seed=2)
    want_ids, want = reference("idefics3", tiny_idefics3, IDEFICS3, [a, b], N)
    engine = vision_engine(text, tokenizer=tiny_idefics3, mmproj=mmproj)
    ids, new, _ = run(engine, IDEFICS3, [a, b])
    assert ids == want_ids and new == want


def test_gemma3_pair_matches_transformers(tiny_gemma3, tmp_path):
    """Gemma 3's projector: the soft-embedding norm stored as 1 + w, the pooling from the
    file's scale factor, the image attended both ways."""
    text, mmproj = gguf_pair(tiny_gemma3, tmp_path, "gemma3", "Gemma3ForConditionalGeneration")
    a = image(97, 61, seed=1)
    want_ids, want = gemma3_reference(tiny_gemma3, GEMMA3, [a], N)
    ids, new, _ = run(vision_engine(text, tokenizer=tiny_gemma3, mmproj=mmproj), GEMMA3, [a])
    assert ids == want_ids and new == want


def test_bad_projector_files(tiny_llava, llava_pair):
    text, mmproj = llava_pair
    with pytest.raises(ValueError, match="not a vision projector file"):
        vision_engine(text, tokenizer=tiny_llava, mmproj=text)
    from tests.utils import embedded_tokenizer_dir

    with pytest.raises(ValueError, match="has no <image> token"):
        vision_engine(text, mmproj=mmproj, tokenizer=str(embedded_tokenizer_dir()))


def test_llama_servers_mm_flag():
    from tests.cli.test_llama_flags import _translate

    out, said = _translate("-m", "x.gguf", "-mm", "mmproj-x.gguf", "--port=1")
    assert out == ["--model", "x.gguf", "--mmproj", "mmproj-x.gguf", "--port=1"]


def test_llava_next_pair_matches_transformers(tiny_llava_next, tmp_path):
    """LLaVA-NeXT's projector file: the grid pinpoints, spatial unpadding, the newline."""
    text, mmproj = gguf_pair(tiny_llava_next, tmp_path, "mlp",
                             "LlavaNextForConditionalGeneration")
    a = image(130, 45, seed=4)
    want_ids, want = reference("llava_next", tiny_llava_next, LLAVA, [a], N)
    engine = vision_engine(text, tokenizer=tiny_llava_next, mmproj=mmproj)
    ids, new, _ = run(engine, LLAVA, [a])
    assert ids == want_ids and new == want


def test_hf_brings_the_repositorys_mmproj(tiny_llava, llava_pair, tmp_path, monkeypatch):
    """A hub GGUF model (``-hf user/repo:quant``) comes with its repository's projector, as
    llama-server's -hf fetches it, and answers with images; ``--no-mmproj`` (llama-server's,
    ``--no-mmproj-auto`` here) fetches the model alone. The hub is a stand-in for its two
    calls (listing, download)."""
    import os

    import huggingface_hub
    from huggingface_hub import constants

    from asyncengine.executor.weights import hub_gguf
    from tests.cli.test_llama_flags import _translate

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty, online
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    text, mmproj = llava_pair
    repo = {"tiny-llava-F32.gguf": text, "mmproj-tiny-llava-f16.gguf": mmproj,
            "mmproj-tiny-llava-Q4_0.gguf": text}  # (f16 is nearer F32's bits)
    fetched = []

    def fake_download(repo_id, filename, **kwargs):
        fetched.append(filename)
        path = tmp_path / "dl" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.symlink(repo[filename], path)
        return str(path)

    monkeypatch.setattr(hub_gguf, "list_files", lambda *a: list(repo))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    out, _ = _translate("-hf", "someone/tiny-llava-GGUF:F32", "--no-mmproj")
    assert out[:3] == ["--no-mmproj-auto", "--model", "someone/tiny-llava-GGUF:F32"], out
    engine = vision_engine("someone/tiny-llava-GGUF:F32", tokenizer=tiny_llava)
    assert fetched == ["tiny-llava-F32.gguf", "mmproj-tiny-llava-f16.gguf"]
    a = image(97, 61, seed=1)
    want_ids, want = llava_reference(tiny_llava, LLAVA, [a], N)
    ids, new, _ = run(engine, LLAVA, [a])
    assert ids == want_ids and new == want
    fetched.clear()
    engine = vision_engine("someone/tiny-llava-GGUF:F32", tokenizer=tiny_llava,
                           mmproj_auto=False)
    assert fetched == ["tiny-llava-F32.gguf"]
    assert getattr(engine.runner.model, "vision", None) is None  # a text model
    # a repository projector that cannot be read stops the start, naming the way out
    repo["mmproj-broken-f32.gguf"] = text
    with pytest.raises(ValueError, match=r"mmproj-broken-f32.gguf: .*not a vision projector "
                                         r"file.*--no-mmproj-auto serves the model without"):
        vision_engine("someone/tiny-llava-GGUF:F32", tokenizer=tiny_llava)
