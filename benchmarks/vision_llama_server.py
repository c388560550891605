"""Image prompts against llama.cpp's llama-server, both serving the same GGUF model and mmproj
file on the CPU (``python benchmarks/vision.py --llama-server PATH --llama-cpp DIR``).

A random Gemma 3 (SigLIP --image-size / 14 px patches, --vision-layers of width
--vision-hidden; a Gemma 3 decoder of --text-layers, width --text-hidden; the embedded
tokenizer plus Gemma 3's image tokens) is converted by llama.cpp's own
``convert_hf_to_gguf.py`` into a text GGUF and, with ``--mmproj``, a projector file (F16,
256 tokens per image as the converter writes Gemma 3's). asyncengine (``serve MODEL --mmproj
FILE``) and llama-server (``-m MODEL --mmproj FILE``) then answer the same chat requests over
HTTP, each with its own image (200 to 400 px; no image or prefix is shared between requests,
nor between the runs at each concurrency), --max-tokens greedy tokens (EOS ignored),
--concurrency at a time, one server after the other, each warmed by one request first; the
best of --rounds (a server restarts each round, so its caches start empty).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# llama.cpp's converter, patched as benchmarks/kquants.py patches it (the embedded
# tokenizer's pre-tokenizer named, the Gemma 3 embedding kept whole): its own script.
from kquants import _CONVERT  # noqa: E402  (beside this script)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-server", help="llama-server built with libmtmd: compare with it")
    ap.add_argument("--llama-cpp", help="llama.cpp's sources (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--convert-path", default="",
                    help="a folder added to PYTHONPATH for the converter (sentencepiece)")
    ap.add_argument("--work", default="/tmp/asyncengine-vision-bench",
                    help="where the model and its GGUF files are made (reused when there)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)


def make_gguf_pair(args: argparse.Namespace) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of a random Gemma 3, made once under --work."""
    work = Path(args.work)
    text, mmproj = work / "gemma3-f16.gguf", work / "mmproj-gemma3-f16.gguf"
    if text.is_file() and mmproj.is_file():
        return text, mmproj
    hf = work / "hf"
    _make_hf_gemma3(hf, args)
    llama_cpp = Path(args.llama_cpp)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        args.convert_path, str(llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH")])))
    for out, extra in ((text, []), (mmproj, ["--mmproj"])):
        subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp / "convert_hf_to_gguf.py"),
                        str(hf), *extra, "--outtype", "f16", "--outfile", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
    return text, mmproj


def _make_hf_gemma3(directory: Path, args: argparse.Namespace) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.utils import embedded_tokenizer_dir
    from tests.vision_utils import GEMMA3_TOKENS

    directory.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS)})
    boi, eoi, soft = (tok.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS)
    text = transformers.Gemma3TextConfig(
        hidden_size=args.text_hidden, intermediate_size=4 * args.text_hidden,
        num_hidden_layers=args.text_layers, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, vocab_size=soft + 64, max_position_embeddings=4096, sliding_window=512)
    vision = transformers.SiglipVisionConfig(
        hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
        num_hidden_layers=args.vision_layers, num_attention_heads=4,
        image_size=args.image_size, patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, boi_token_index=boi, eoi_token_index=eoi,
        image_token_index=soft, mm_tokens_per_image=(args.image_size // 14) ** 2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():  # a projection of the text's scale (it starts at zeros)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    Gemma3ImageProcessorPil(size={"height": args.image_size, "width": args.image_size}
                            ).save_pretrained(str(directory))
    # the converter reads the tower under its checkpoints' name (vision_tower.vision_model.)
    path = directory / "model.safetensors"
    tensors = {(k.replace("vision_tower.", "vision_tower.vision_model.", 1)
                if k.startswith("vision_tower.") else k): v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def _image_url(i: int) -> str:
    from tests.vision_utils import image

    buf = io.BytesIO()
    image(200 + (37 * i) % 200, 200 + (53 * i) % 200, seed=i).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(port: int, url: str, text: str, max_tokens: int) -> int:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def _start(cmd: list[str], port: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: see {log}") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not start: see {log}")


def _load(port: int, requests: list[tuple[str, str]], concurrency: int,
          max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda r: _ask(port, r[0], r[1], max_tokens), requests))
    return time.perf_counter() - t0, tokens


def compare(args: argparse.Namespace) -> None:
    text, mmproj = make_gguf_pair(args)
    n = args.requests
    # each concurrency its own images, the same for both servers (no cache hits across runs)
    loads = {c: [(_image_url(1000 * c + i), f"Picture {i}: what is in it?") for i in range(n)]
             for c in args.concurrency}
    peers = {
        "asyncengine": [sys.executable, "-m", "asyncengine", "serve", str(text), "--mmproj",
                        str(mmproj), "--num-threads", str(args.threads), "--max-model-len",
                        "4096", "--port", "18761"],
        "llama-server": [args.llama_server, "-m", str(text), "--mmproj", str(mmproj), "-t",
                         str(args.threads), "-c", str(4096 * max(args.concurrency)), "-np",
                         str(max(args.concurrency)), "--port", "18762"],
    }
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(args.llama_server).parent))
    results: dict[str, dict[int, tuple[float, int]]] = {p: {} for p in peers}
    for _ in range(args.rounds):
        for k, (peer, cmd) in enumerate(peers.items()):
            port = int(cmd[-1])
            proc = _start(cmd, port, Path(args.work) / f"{peer}.log", env)
            try:
                _ask(port, _image_url(10_000 + k), "Warm up.", 2)  # untimed
                for c in args.concurrency:
                    run = _load(port, loads[c], c, args.max_tokens)
                    best = results[peer].get(c)
                    if best is None or run[0] < best[0]:
                        results[peer][c] = run
            finally:
                proc.terminate()
                proc.wait(30)
    for c in args.concurrency:
        (s, toks), (ls, ltoks) = results["asyncengine"][c], results["llama-server"][c]
        print(f"c={c}, {n} image requests: asyncengine {toks / s:.1f} tok/s "
              f"({s / n:.2f} s/request); llama-server {ltoks / ls:.1f} tok/s "
              f"({ls / n:.2f} s/request); ratio {(toks / s) / (ltoks / ls):.2f}")
