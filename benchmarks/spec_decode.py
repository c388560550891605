"""Speculative decoding on grounded work: n-gram drafts against the same server without
them, and against llama-server's own n-gram speculation, on the embedded SmolLM2 GGUF.

Chat prompts that copy their context ("repeat this passage", "copy this code with one
change"), greedy, streamed. The servers run side by side; at each concurrency the same load
goes to each in turn, round after round (the order rotating), so a busy machine's drift hits
them alike. Prints output tok/s, the acceptance rate and length (from each
asyncengine server's /metrics) and the ratios, all measured in this run; also each server's
best round (on a shared machine a load spike can slow one round tenfold: the best rounds are
the closest to a quiet machine's figures).

    python benchmarks/spec_decode.py [--concurrency 1 8 32] [--max-tokens 160] [--rounds 3]
        [--spec '{"method": "ngram", ...}'] [--llama-server PATH] [--threads 2] [--warmups 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from asyncengine.entrypoints.bench.peers import _free_port, _wait_ready
from asyncengine.entrypoints.bench.serve import BenchConfig, run_benchmark
from asyncengine.executor.weights.loader import embedded_model_path

SPEC = ('{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}')
LLAMA_SERVER = "/work/peers/build/bin/llama-server"
LLAMA_SPEC = "--spec-type ngram-simple"

PASSAGES = [
    "The river rose slowly through the night, and by morning the low fields along the eastern "
    "bank were under water. Farmers moved their animals to the ridge, and the school in the "
    "village opened its doors to families whose houses stood too close to the bank.",
    "Our support team answers every message within one business day. If your order arrived "
    "damaged, reply to the confirmation email with a photo of the package and the order "
    "number, and we will send a replacement at no cost to you.",
    "The library will be closed on Monday for the installation of new shelves. Books that are "
    "due that day may be returned on Tuesday without a fine, and the reading room on the "
    "second floor will reopen on Wednesday morning at nine.",
    "To reset the router, hold the small button on the back for ten seconds until the light "
    "turns orange. Wait two minutes, then connect to the network named on the label and open "
    "the setup page in your browser to choose a new password.",
]
CODE = [
    ("count_words", "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
     "        word = word.lower().strip('.,!?')\n        counts[word] = counts.get(word, 0) + 1\n"
     "    return counts\n"),
    ("moving_average", "def moving_average(values, window):\n    result = []\n"
     "    total = 0.0\n    for i, value in enumerate(values):\n        total += value\n"
     "        if i >= window:\n            total -= values[i - window]\n"
     "        if i >= window - 1:\n            result.append(total / window)\n"
     "    return result\n"),
    ("merge_sorted", "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n"
     "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
     "            out.append(a[i])\n            i += 1\n        else:\n"
     "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
     "    out.extend(b[j:])\n    return out\n"),
    ("parse_config", "def parse_config(lines):\n    config = {}\n    for line in lines:\n"
     "        line = line.strip()\n        if not line or line.startswith('#'):\n"
     "            continue\n        key, _, value = line.partition('=')\n"
     "        config[key.strip()] = value.strip()\n    return config\n"),
]


def grounded_prompts(n: int, offset: int = 0) -> list[str]:
    """n chat prompts, alternately a passage to repeat and code to copy with one change."""
    out = []
    for i in range(offset, offset + n):
        if i % 2 == 0:
            text = PASSAGES[(i // 2) % len(PASSAGES)]
            out.append(f"(request {i}) Repeat this passage exactly, word for word:\n\n{text}")
        else:
            name, code = CODE[(i // 2) % len(CODE)]
            out.append(f"(request {i}) Copy this Python function exactly, but rename it to "
                       f"{name}_v2:\n\n```python\n{code}```")
    return out


def command(kind: str, args: argparse.Namespace, port: int) -> list[str]:
    gguf = embedded_model_path()
    if kind.startswith("asyncengine"):
        cmd = [sys.executable, "-m", "asyncengine", "serve", gguf, "--port", str(port),
               "--disable-access-log", "--num-threads", str(args.threads),
               "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "2048"]
        if kind == "asyncengine+ngram":
            cmd += ["--speculative-config", args.spec]
        return cmd
    ctx = max(args.concurrency) * 1024
    cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-np", str(max(args.concurrency)), "-c", str(ctx)]
    if kind == "llama-server+ngram":
        cmd += shlex.split(args.llama_spec)
    return cmd


def start(kind: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, Any]:
    port = _free_port()
    log = open(os.path.join(args.log_dir, f"spec_decode_{kind}.log"), "w+b")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command(kind, args, port), stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    return proc, f"http://127.0.0.1:{port}", log


def stop(proc: subprocess.Popen, log: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


async def measure(args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    """All servers up at once; at each concurrency, rounds of the same load sent to each
    server in turn (the order rotating), so that they share the machine's conditions."""
    servers = {kind: start(kind, args) for kind in kinds}
    results: dict[str, Any] = {}
    try:
        live = []
        for kind, (proc, url, log) in servers.items():
            try:
                await _wait_ready(proc, url, log, 600)
                live.append(kind)
                results[kind] = {}
            except RuntimeError as e:
                results[kind] = f"failed: {e}"
        for kind in live:  # first-request costs (lazy set-up) stay out of round 0
            for _ in range(args.warmups):
                cfg = BenchConfig(base_url=servers[kind][1], endpoint="chat", num_prompts=1,
                                  concurrency=1, max_tokens=16, temperature=0.0)
                await run_benchmark(cfg, grounded_prompts(1, offset=7))
        for c in args.concurrency:
            n = max(c, 2)
            totals = {k: dict.fromkeys(("tokens", "duration", "drafts", "draft_tokens",
                                        "accepted", "best"), 0.0) for k in live}
            for r in range(args.rounds):
                # Round r starts r * n prompts further on, so that the rounds cover
                # different passages and functions (the four-digit request numbers keep
                # each prompt's token count).
                prompts = grounded_prompts(n, offset=(r + 1) * 1000 + c + r * n)
                order = live[r % len(live):] + live[:r % len(live)]
                for kind in order:
                    cfg = BenchConfig(base_url=servers[kind][1], endpoint="chat", num_prompts=n,
                                      concurrency=c, max_tokens=args.max_tokens,
                                      temperature=0.0)
                    try:
                        s = await run_benchmark(cfg, prompts)
                    except RuntimeError as e:
                        log = servers[kind][2]
                        log.seek(0)
                        raise RuntimeError(f"{kind}: {e}\n{log.read().decode()[-3000:]}") from e
                    if s["failed"]:
                        print(f"[{kind}] {s['failed']} failed: {s['errors'][:2]}",
                              file=sys.stderr)
                    t = totals[kind]
                    t["tokens"] += s["total_output_tokens"]
                    t["duration"] += s["duration"]
                    t["drafts"] += s.get("spec_num_drafts", 0)
                    t["draft_tokens"] += s.get("spec_num_draft_tokens", 0)
                    t["accepted"] += s.get("spec_num_accepted_tokens", 0)
                    t["best"] = max(t["best"], s["output_throughput"])
                    acc = (f", acceptance {100 * s['spec_acceptance_rate']:.1f}%, length "
                           f"{s['spec_acceptance_length']:.2f}" if "spec_num_drafts" in s
                           else "")
                    print(f"[{kind}] c={c} round {r}: {s['output_throughput']:.2f} tok/s"
                          f"{acc}; ttft {s['mean_ttft_ms']:.0f} ms, tpot "
                          f"{s['mean_tpot_ms']:.2f} ms, {s['total_output_tokens']} tokens in "
                          f"{s['duration']:.2f} s", file=sys.stderr, flush=True)
            for kind in live:
                t = totals[kind]
                out = {"output_throughput": t["tokens"] / t["duration"],
                       "best_round_throughput": t["best"],
                       "total_output_tokens": int(t["tokens"]), "duration": t["duration"]}
                if t["drafts"]:
                    out["spec_acceptance_rate"] = t["accepted"] / t["draft_tokens"]
                    out["spec_acceptance_length"] = 1 + t["accepted"] / t["drafts"]
                results[kind][c] = out
    finally:
        for proc, _, log in servers.values():
            stop(proc, log)
    return results


def table(results: dict[str, Any], concurrency: list[int]) -> str:
    lines = [f"{'server':20s} {'conc':>4s} {'out tok/s':>10s} {'accept %':>9s} {'acc len':>8s} "
             f"{'vs no spec':>10s} {'vs llama+ngram':>14s} | {'best round':>10s} "
             f"{'vs no spec':>10s} {'vs llama+ngram':>14s}"]
    for kind, res in results.items():
        if isinstance(res, str):
            lines.append(f"{kind:20s} {res}")
            continue
        base = results.get(kind.split("+")[0])
        llama = results.get("llama-server+ngram")
        for c in concurrency:
            if c not in res:
                continue
            s = res[c]
            acc = f"{100 * s['spec_acceptance_rate']:.1f}" if "spec_acceptance_rate" in s else ""
            alen = f"{s['spec_acceptance_length']:.2f}" if "spec_acceptance_length" in s else ""
            tputs, ratios = [], []
            for key in ("output_throughput", "best_round_throughput"):
                tput = s[key]
                vs = (f"{tput / base[c][key]:.2f}x"
                      if "+" in kind and isinstance(base, dict) else "")
                vl = (f"{tput / llama[c][key]:.2f}x"
                      if kind == "asyncengine+ngram" and isinstance(llama, dict) else "")
                tputs.append(f"{tput:10.1f}")
                ratios.append(f"{vs:>10s} {vl:>14s}")
            lines.append(f"{kind:20s} {c:4d} {tputs[0]} {acc:>9s} {alen:>8s} {ratios[0]} | "
                         f"{tputs[1]} {ratios[1]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per concurrency level; a round sends max(c, 2) requests "
                             "to each server in turn (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--warmups", type=int, default=1,
                        help="requests sent to each server before the rounds, not counted "
                             "(default 1)")
    parser.add_argument("--spec", default=SPEC, help="asyncengine's --speculative-config")
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--llama-spec", default=LLAMA_SPEC,
                        help=f"llama-server's speculation flags (default: {LLAMA_SPEC!r})")
    parser.add_argument("--servers", nargs="+",
                        default=["asyncengine", "asyncengine+ngram", "llama-server+ngram"],
                        help="of asyncengine, asyncengine+ngram, llama-server, "
                             "llama-server+ngram")
    parser.add_argument("--save-result", metavar="FILE.json", default=None)
    parser.add_argument("--log-dir", default=tempfile.gettempdir(),
                        help="where the servers' logs go (spec_decode_<server>.log)")
    args = parser.parse_args()
    # A SIGTERM (timeout, kill) unwinds through the servers' clean-up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = []
    results: dict[str, Any] = {}
    for kind in args.servers:
        if kind.startswith("llama") and not os.access(args.llama_server, os.X_OK):
            results[kind] = f"not installed ({args.llama_server})"
        else:
            kinds.append(kind)
    results.update(asyncio.run(measure(args, kinds)))
    print(f"grounded chat prompts (repeat a passage / copy code with one change), greedy, "
          f"max_tokens {args.max_tokens}, {args.threads} threads per server, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"asyncengine --speculative-config {args.spec}; llama-server {args.llama_spec}")
    print(table(results, args.concurrency))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
