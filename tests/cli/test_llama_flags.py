"""llama-server's flags on ``asyncengine serve`` (``entrypoints/flags/llama_server.py``): an
operator's llama-server command line starts the server, each flag read as its asyncengine
counterpart or named as ignored; a value asyncengine cannot honour is an error naming the flag."""

from __future__ import annotations

import json

import pytest

from asyncengine.entrypoints.cli import _subparser, build_parser
from asyncengine.entrypoints.flags.llama_server import translate
from tests.cli.test_cli import run_cli
from tests.server_utils import ServerProcess
from tests.utils import embedded_gguf_path


def _translate(*argv: str) -> tuple[list[str], list[str]]:
    serve = _subparser(build_parser(), "serve")
    own = {s for a in serve._actions for s in a.option_strings}
    said: list[str] = []
    return translate(argv, own, said.append), said


def test_a_llama_server_command_line_reads_as_asyncengines():
    out, said = _translate(
        "-m", "x.gguf", "-c", "4096", "-np", "4", "--host", "0.0.0.0", "--port", "8080",
        "-ngl", "99", "-fa", "on", "--jinja", "-ctk", "q8_0", "-ctv", "q8_0", "-a", "a,b",
        "-t", "2", "--temp=0.7", "--top-k", "20", "-n", "64", "--spec-type", "ngram-simple",
        "--spec-draft-n-max", "8", "--lora", "/a/ad1", "--lora", "/c/ad2.gguf,/d/x/", "-fa",
        "--metrics", "--seed", "3", "--no-webui")
    assert out[:16] == ["--model", "x.gguf", "--max-model-len", "4096", "--max-num-seqs", "4",
                        "--host", "0.0.0.0", "--port", "8080", "--kv-cache-dtype", "fp8",
                        "--served-model-name", "a", "b", "--num-threads"]
    assert out[16:21] == ["2", "--seed", "3", "--no-web-ui", "--enable-lora"]
    assert out[21:25] == ["--lora-modules", "ad1=/a/ad1", "ad2=/c/ad2.gguf", "x=/d/x/"]
    assert out[25] == "--override-generation-config"
    assert json.loads(out[26]) == {"temperature": 0.7, "top_k": 20, "max_new_tokens": 64}
    assert out[27] == "--speculative-config" and len(out) == 29
    assert json.loads(out[28]) == {"method": "ngram", "num_speculative_tokens": 8}
    assert "llama-server flag -ngl 99: ignored (layers are not split" in said[3]
    assert "llama-server flag -c 4096: read as --max-model-len 4096" in said
    # the flags asyncengine has itself (--model, --port, --seed...) are its own, untouched;
    # llama-server's 0 = "the model's own" for the context and "auto" for slots and threads
    assert _translate("--model", "m", "-c", "0", "-np", "-1", "-t", "-1")[0] == [
        "--model", "m", "--port", "8080"]  # llama-server's port, as no --port was given
    assert _translate("--model", "m", "--max-model-len", "64")[0] == [
        "--model", "m", "--max-model-len", "64"]  # no llama-server flag: asyncengine's port
    # a hub repository's GGUF file by its quantization, or by its name (-hff)
    assert _translate("-hf", "user/model-GGUF:Q4_K_M", "--port=1")[0] == [
        "--port=1", "--model", "user/model-GGUF:Q4_K_M"]
    assert _translate("-hf", "user/m-GGUF:Q4_K_M", "-hff", "sub/m.Q8_0.gguf", "--port=1")[0] == [
        "--port=1", "--model", "user/m-GGUF:m.Q8_0.gguf"]
    assert _translate("-hf", "user/m-GGUF", "--port=1")[0] == ["--port=1", "--model", "user/m-GGUF"]
    # a draft model
    out, _ = _translate("-md", "small.gguf", "--draft-max", "4", "--port=9000")
    assert out[0] == "--port=9000"
    assert json.loads(out[2]) == {"model": "small.gguf", "method": "draft_model",
                                  "num_speculative_tokens": 4}


@pytest.mark.parametrize("argv, names", [
    (("-ctk", "q4_0"), "-ctk q4_0"),
    (("-ctk", "f16", "-ctv", "q8_0"), "-ctv q8_0: K and V"),
    (("--temp", "hot"), "--temp: 'hot'"),
    (("--spec-draft-n-max", "4"), "without --spec-type"),
    (("--spec-type", "draft-simple"), "needs the draft model"),
    (("--spec-type", "draft-eagle3,ngram-cache"), None),
    (("--temp", "0.5", "--override-generation-config", "{}"), "give one"),
    (("-c",), "-c: expects a value"),
    (("-hff", "x.Q8_0.gguf"), "without -hf user/repo"),
])
def test_values_asyncengine_cannot_honour_name_the_flag(argv, names):
    if names is None:  # a list of kinds with an n-gram one: drafts by n-gram
        assert json.loads(_translate(*argv)[0][1])["method"] == "ngram"
        return
    with pytest.raises(ValueError, match=names):
        _translate(*argv)


def test_the_cli_exits_2_naming_the_flag():
    r = run_cli("serve", "-m", "x.gguf", "-ctk", "iq4_nl", timeout=120)
    assert r.returncode == 2 and "-ctk iq4_nl" in r.stderr and "Traceback" not in r.stderr


def test_llama_server_command_line_serves(tmp_path):
    """The model from the hub by its quantization (-hf user/repo:QUANT), here from the hub's
    cache, offline, as a second start after the download would find it."""
    from tests.executor.test_hub_gguf import cached_repo

    cache = cached_repo(tmp_path, "someone/SmolLM2-GGUF", {
        "SmolLM2-135M-Instruct.Q4_1.gguf": embedded_gguf_path(),
        "SmolLM2-135M-Instruct.Q8_0.gguf": None, "mmproj-SmolLM2-f16.gguf": None})
    server = ServerProcess(None, "-hf", "someone/SmolLM2-GGUF:q4_1", "-c", "512", "-np", "2",
                           "-ngl", "99", "-fa", "on", "--jinja", "-a", "smol", "--temp", "0",
                           "-n", "5", "--no-mmap", "--no-mmproj",  # (a stand-in projector)
                           env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        models = server.get_json("/v1/models")["data"]
        assert [m["id"] for m in models] == ["smol"] and models[0]["max_model_len"] == 512
        log = server.log()
        assert "llama-server flag -c 512: read as --max-model-len 512" in log
        assert "llama-server flag --no-mmap: ignored" in log
        import urllib.request

        req = urllib.request.Request(
            server.url("/v1/chat/completions"), method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "smol", "messages": [{"role": "user",
                                                             "content": "Hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
        assert body["usage"]["completion_tokens"] == 5  # -n 5: the default max_tokens
    finally:
        assert server.stop() == 0
