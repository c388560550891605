"""``asyncengine run-batch``: a batch file from stdin to stdout, offline, in the input's order,
a bad line answered with its error; a file that is not a batch refused before the model
loads; vLLM's run-batch flags accepted."""

from __future__ import annotations

import json
import subprocess
import sys

from asyncengine.entrypoints import cli
from asyncengine.entrypoints.cli import build_parser


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4,
            "temperature": 0, **extra}


def test_stdin_to_stdout_in_the_input_s_order(tiny_llama):
    lines = [line("a", "/v1/chat/completions", chat("Hello there")),
             line("b", "/v1/completions", {"prompt": "Once upon", "max_tokens": 3,
                                           "temperature": 0}),
             line("c", "/v1/chat/completions", chat("Hello", max_tokens=-1)),
             line("d", "/v1/embeddings", {"input": "some text"}),
             line("e", "/v1/chat/completions", chat("Hello there"))]
    r = subprocess.run([sys.executable, "-m", "asyncengine", "run-batch", tiny_llama, "-i", "-",
                        "-o", "-", "--max-num-seqs", "4", "--num-gpu-blocks-override", "256",
                        "--enable-metrics", "--swap-space", "4"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--swap-space" in r.stderr and "--enable-metrics" in r.stderr  # said, ignored
    assert "5 requests, 4 answered, 1 failed" in r.stderr
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b", "c", "d", "e"]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 400, 200, 200]
    assert out[2]["error"]["message"] == "max_tokens must be at least 1"
    assert all(o["error"] is None for o in out if o["custom_id"] != "c")
    chats = [o["response"]["body"]["choices"][0]["message"]["content"] for o in (out[0], out[4])]
    assert chats[0] == chats[1]  # greedy: the same request, the same answer
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert len(out[3]["response"]["body"]["data"][0]["embedding"]) == 64


def test_a_bad_file_is_refused_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line("a", "/v1/chat/completions", chat("hi")) + "\nnot json\n")
    code = cli.main(["run-batch", str(tmp_path / "no-such-model"), "-i", str(bad), "-o",
                     str(tmp_path / "out.jsonl")])
    assert code == 1
    assert "line 2 is not JSON" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    twice = tmp_path / "twice.jsonl"
    twice.write_text(line("a", "/v1/chat/completions", chat("hi")) + "\n"
                     + line("a", "/v1/responses", chat("hi")) + "\n")
    assert cli.main(["run-batch", "-i", str(twice), "-o", str(tmp_path / "o.jsonl")]) == 1
    assert "line 2: url '/v1/responses' is not allowed" in capsys.readouterr().err


def test_vllm_s_run_batch_flags():
    args = build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl",
                                      "--output-tmp-dir", "/tmp", "--model", "m",
                                      "--max-num-seqs", "8", "--response-role", "assistant"])
    assert (args.input_file, args.output_file, args.output_tmp_dir) == ("in.jsonl",
                                                                        "out.jsonl", "/tmp")
    assert args.model_flag == "m" and args.max_num_seqs == 8
