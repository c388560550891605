"""Speculative decoding: the config, the n-gram index, and exactness (greedy output identical
with and without drafts; sampled output following the target distribution)."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.config.speculative import DEFAULT_MAX_BATCH, parse_speculative
from asyncengine.core.spec.ngram import NgramIndex
from asyncengine.executor.sampler import SamplingBatch, sample_ids
from asyncengine.executor.spec.accept import accepted
from tests.spec_utils import NGRAM, Oracle, SpecCounter, generate_all, make_engine, pool_is_free

PROMPTS = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2", "The capital of France is",
           "a b c a b c a b", "def f(x): return x; def f(x):"]


# -- turning it on ---------------------------------------------------------------------------
def test_speculative_config_reads_vllms_json_and_names_bad_keys():
    s = parse_speculative('{"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min) == \
        ("ngram", 3, 5, 2)
    # Default: on up to DEFAULT_MAX_BATCH running requests with fewer drafts as the batch
    # grows, off above (concurrency 32).
    assert s.k_for_batch(1) == 3 and s.k_for_batch(DEFAULT_MAX_BATCH) == 3
    assert s.k_for_batch(DEFAULT_MAX_BATCH + 1) == 0 and s.k_for_batch(32) == 0
    s8 = parse_speculative('{"method": "ngram", "num_speculative_tokens": 8}')
    assert [s8.k_for_batch(n) for n in range(1, 7)] == [8, 4, 3, 3, 0, 0]
    s = parse_speculative({"method": "ngram", "num_speculative_tokens": 4,
                           "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 16, 2],
                                                                     [17, 64, 0]]})
    assert [s.k_for_batch(n) for n in (1, 2, 3, 16, 17, 100)] == [4, 4, 2, 2, 0, 0]
    d = parse_speculative('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}')
    assert d.model == "/m"
    for bad, key in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                     ('{"method": "ngram"}', "num_speculative_tokens"),
                     ('{"method": "ngram", "num_speculative_tokens": 0}',
                      "num_speculative_tokens"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,'
                      ' "prompt_lookup_max": 3}', "prompt_lookup_min"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, "colour": 1}', "colour"),
                     ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, '
                      '"num_speculative_tokens_per_batch_size": [[1, 4, 3]]}',
                      "num_speculative_tokens_per_batch_size"),
                     ('{"method": "ngram", "num_speculative_tokens": 2, '
                      '"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}',
                      "num_speculative_tokens_per_batch_size"),
                     ("not json", "JSON")]:
        with pytest.raises(ValueError, match="--speculative-config") as e:
            EngineConfig.from_dict({"speculative_config": bad})
        assert key in str(e.value)


def test_cli_refuses_a_bad_speculative_config_naming_the_flag():
    r = subprocess.run([sys.executable, "-m", "asyncengine", "serve", "--speculative-config",
                        '{"method": "medusa", "num_speculative_tokens": 2}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--speculative-config" in r.stderr and "method" in r.stderr
    assert "Traceback" not in r.stderr


# -- the n-gram index --------------------------------------------------------------------------
def test_ngram_index_proposes_the_latest_continuation_of_the_longest_match():
    ix = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 0, 2, 3]
    # (2, 3) last occurred before 4 (latest occurrence wins over the one before 9).
    assert ix.propose(tokens, 3) == [4, 5, 0]
    tokens += [4, 7]
    assert ix.propose(tokens, 2) == []  # (4, 7), (7) never seen before
    tokens += [1, 2]
    assert ix.propose(tokens, 2) == [3, 4]  # (7, 1, 2) unseen: (1, 2) -> 3
    # A repeating run: the copy continues past the end from its own start.
    assert NgramIndex(1, 2).propose([5, 6, 5, 6, 5], 5) == [6, 5, 6, 5, 6]


def test_adaptive_ngram_index_drafts_nothing_after_an_ambiguous_match():
    """(2, 3) was followed by 9, then by 4: the index that skips ambiguous matches (the
    adaptive proposers') drafts nothing there, while an n-gram always followed by the same
    token still drafts."""
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 0, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, 3) == [4, 5, 0]
    ix = NgramIndex(1, 3, skip_ambiguous=True)
    assert ix.propose(tokens, 3) == []
    tokens += [4, 5]  # (4, 5) was followed by 0 only
    assert ix.propose(tokens, 2) == [0, 2]
    tokens += [7]  # now (4, 5) was followed by 0 and 7: ambiguous from here on
    tokens += [4, 5]
    assert ix.propose(tokens, 2) == []


def test_ngram_index_work_is_the_new_tokens_only():
    ix = NgramIndex(2, 4)
    tokens = list(range(50)) * 20  # 1,000 tokens
    ix.propose(tokens, 4)
    size = len(ix.table)
    calls = []
    for step in range(30):
        tokens.append(step % 50)
        before = ix.upto
        ix.propose(tokens, 4)
        calls.append(ix.upto - before)  # positions indexed by this proposal
    assert calls == [1] * 30  # one new position per new token, never a rescan
    assert len(ix.table) <= size + 30 * 3


def test_ngram_probe_and_the_pause_after_empty_verifications():
    """``probe`` (a token in flight) says whether the known tokens end with an n-gram seen
    before: only then does the request wait for its token to get drafts; otherwise its steps
    stay overlapped. Three verifications in a row that accept nothing pause the proposals."""
    from types import SimpleNamespace

    from asyncengine.core.spec.ngram import PAUSE_AFTER, NgramProposer

    proposer = NgramProposer(2, 3)
    req = SimpleNamespace(spec_state=None, all_token_ids=[1, 2, 3, 4, 5, 6])
    assert not proposer.probe(req)  # (5, 6) never seen before
    for i in range(PAUSE_AFTER):
        req.all_token_ids += [1, 2]
        assert proposer.probe(req)  # (1, 2) seen before
        assert proposer.propose(req, 3)
        req.all_token_ids += [100 + i]  # its first draft rejected: the step made one token
        assert proposer.propose(req, 3) == []  # (2, 100 + i) unseen; the miss is counted
    req.all_token_ids += [1, 2]
    assert not proposer.probe(req) and proposer.propose(req, 3) == []  # paused
    req.all_token_ids += [7] * 4 * PAUSE_AFTER + [1, 2]
    assert proposer.probe(req) and proposer.propose(req, 3)  # resumed


def test_adaptive_ngram_drafts_follow_the_last_acceptance():
    """Adaptive (the CPU's default): after a partial acceptance of a drafts the next proposal
    has at most max(2, a + 1); after a full one, twice as many as it had (up to k)."""
    from types import SimpleNamespace

    from asyncengine.core.spec.ngram import NgramProposer

    text = list(range(10, 40))
    fixed, adaptive = NgramProposer(2, 3), NgramProposer(2, 3, adaptive=True)
    for proposer in (fixed, adaptive):
        req = SimpleNamespace(spec_state=None, all_token_ids=text + [10, 11])
        assert proposer.propose(req, 8) == text[2:10]
        req.all_token_ids += text[2:5] + [99]  # 3 of 8 accepted, then a correction
        assert proposer.propose(req, 8) == []  # (12, 99) unseen; the outcome is learnt
        req.all_token_ids += [20, 21]  # (20, 21) seen: drafts again
        drafts = proposer.propose(req, 8)
        assert drafts == text[12:12 + (8 if proposer is fixed else 4)]
    req = SimpleNamespace(spec_state=None, all_token_ids=text + [10, 11])
    assert adaptive.propose(req, 2) == [12, 13]
    req.all_token_ids += [12, 13, 14]  # all accepted (and the bonus token): cap 4
    assert adaptive.propose(req, 8) == text[5:9]


# -- exactness ---------------------------------------------------------------------------------
async def _greedy_outputs(engine, prompts, n):
    outs = await generate_all(engine, prompts, SamplingParams(temperature=0, max_tokens=n,
                                                              ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_output_is_identical_with_drafts_accepted_and_rejected(tiny_llama):
    """Drafts that are right in part (an oracle of the reference run, one token in two
    drafts corrupted): every position of the drafts is accepted sometimes and rejected
    sometimes, in a batch of four; the tokens equal the run without speculation."""
    async def main():
        base = make_engine(tiny_llama, spec=None)
        async with base:
            ref = await _greedy_outputs(base, PROMPTS, 40)
        engine = make_engine(tiny_llama)
        oracle = Oracle([])
        engine.loop.drafting.proposer = oracle
        tok = engine.tokenizer
        oracle.references = [tok.encode(p) + r for p, r in zip(PROMPTS, ref, strict=True)]
        counter = SpecCounter(engine)
        async with engine:
            got = await _greedy_outputs(engine, PROMPTS, 40)
            assert pool_is_free(engine)
        assert got == ref
        assert counter.steps > 10 and 0 < counter.accepted < counter.drafts

    anyio.run(main)


def test_greedy_output_is_identical_on_the_embedded_model_with_ngram_drafts(monkeypatch):
    """Also: the verification steps (one request, 1 + drafts query tokens) run through the
    C++ decode stack, every draft a query row of its own, with no fallback."""
    from asyncengine.executor.paths.cpu_stack import DecodeStack
    from tests.utils import embedded_gguf_path

    real_run = DecodeStack.run
    verified: list[tuple[int, bool]] = []

    def run(self, h, *args):
        out = real_run(self, h, *args)
        if 1 < h.shape[0] <= 9:  # 1 + up to 8 drafts (a prompt is longer)
            verified.append((h.shape[0], out is not None))
        return out

    monkeypatch.setattr(DecodeStack, "run", run)

    prompt = ("<|im_start|>user\nRepeat this sentence exactly: The river rose slowly "
              "through the night, and by morning the low fields were under water."
              "<|im_end|>\n<|im_start|>assistant\n")

    async def main():
        outs = []
        for spec in (None, NGRAM):
            engine = make_engine(embedded_gguf_path(), spec=spec, max_model_len=512,
                                 num_gpu_blocks_override=None, block_size=16,
                                 max_num_batched_tokens=512, dtype="auto")
            counter = SpecCounter(engine) if spec else None
            async with engine:
                outs.append(await _greedy_outputs(engine, [prompt], 24))
                assert pool_is_free(engine)
        assert outs[0] == outs[1]
        assert counter.accepted >= 8  # the copy is drafted and accepted
        assert len(verified) >= counter.steps > 0 and all(ok for _, ok in verified), verified

    anyio.run(main)


def test_greedy_output_is_identical_in_bfloat16_with_ngram_drafts():
    """The bfloat16 model (the CPU default where the CPU has bf16 dot products): its int4
    layers and int8 head take ``int4_bf16.cpp`` / ``int8_bf16.cpp`` for a step's few rows,
    whose row results do not depend on the row count, so the drafts change nothing."""
    from asyncengine.executor.kernels import packed
    from tests.utils import embedded_gguf_path

    if not packed.int4_bf16_available():
        pytest.skip("no AVX-512 BF16 here")
    prompt = ("<|im_start|>user\nRepeat this sentence exactly: The library will be closed on "
              "Monday for the installation of new shelves.<|im_end|>\n<|im_start|>assistant\n")

    async def main():
        outs = []
        for spec in (None, NGRAM):
            engine = make_engine(embedded_gguf_path(), spec=spec, max_model_len=512,
                                 num_gpu_blocks_override=None, block_size=16,
                                 max_num_batched_tokens=512, dtype="bfloat16")
            counter = SpecCounter(engine) if spec else None
            async with engine:
                outs.append(await _greedy_outputs(engine, [prompt], 24))
        assert outs[0] == outs[1]
        assert counter.accepted >= 8

    anyio.run(main)


def test_drafts_past_tile_requests_rows_keep_the_row_kernel_in_bfloat16(monkeypatch):
    """Two requests verifying 16 drafts each: steps of 34 rows but two requests. The byte
    tiles (int4.TILE_REQUESTS) are for steps of that many requests, so these rows keep the row
    kernels, the layers' and the int8 head's, and are computed as the one-token steps compute
    them: the same tokens, and the same logprobs to the bit, with and without the drafts."""
    from asyncengine.executor.kernels import packed
    from asyncengine.executor.paths.cpu_stack import DecodeStack
    from asyncengine.executor.weights.int4 import TILE_REQUESTS
    from tests.utils import embedded_gguf_path

    if not (packed.int4_bf16_available() and packed.int4_tile8_available()):
        pytest.skip("no AVX-512 BF16 / VNNI tiles here")
    real_run = DecodeStack.run
    wide: list[int] = []

    def run(self, h, *args):
        out = real_run(self, h, *args)
        if out is not None and h.shape[0] >= TILE_REQUESTS:
            wide.append(h.shape[0])
        return out

    monkeypatch.setattr(DecodeStack, "run", run)
    prompts = ["<|im_start|>user\nCount from one to twenty in words.<|im_end|>\n"
               "<|im_start|>assistant\n",
               "<|im_start|>user\nName the planets of the solar system.<|im_end|>\n"
               "<|im_start|>assistant\n"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    spec = ('{"method": "ngram", "num_speculative_tokens": 16, '
            '"num_speculative_tokens_per_batch_size": [[1, 8, 16]]}')

    def summary(outs):
        return [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in pos.items()]
                                          for pos in o.outputs[0].logprobs]) for o in outs]

    async def main():
        options = dict(max_model_len=512, num_gpu_blocks_override=None, block_size=16,
                       max_num_batched_tokens=512, dtype="bfloat16")
        base = make_engine(embedded_gguf_path(), spec=None, **options)
        async with base:
            ref = await generate_all(base, prompts, params)
        engine = make_engine(embedded_gguf_path(), spec=spec, **options)
        tok = engine.tokenizer
        engine.loop.drafting.proposer = Oracle(
            [tok.encode(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, ref,
                                                                          strict=True)])
        counter = SpecCounter(engine)
        async with engine:
            got = await generate_all(engine, prompts, params)
            assert pool_is_free(engine)
        assert summary(got) == summary(ref)
        assert counter.accepted > 0 and wide and max(wide) >= 2 * 17 - 4, wide

    anyio.run(main)


def test_rejection_sampling_follows_the_target_distribution():
    """Point-mass drafts verified by sampling every row: the first two tokens' joint
    distribution is p1(t1) * p2(t2 | t1), whether t2 came from the draft's row (t1 was the
    draft) or from the next step. Chi-square over all 64 pairs."""
    torch.manual_seed(7)
    V, n = 8, 40000
    logits1 = torch.tensor([1.0, 0.2, 1.5, -0.5, 0.0, 0.7, -1.0, 0.4])
    logits2 = torch.randn(V, V)  # row t: the logits after token t
    draft = [2, 5]  # d1 likely, d2 whatever
    params = SamplingParams(temperature=0.9, top_k=6)

    def probs(lg):
        x = lg / 0.9
        kth = x.topk(6, dim=-1).values[..., -1:]
        return torch.softmax(x.masked_fill(x < kth, float("-inf")), -1)

    rows = torch.stack([logits1, logits2[draft[0]], logits2[draft[1]]])  # verification rows
    batch = SamplingBatch.build([(params, [], [])] * (3 * n), vocab_size=V)
    ids = sample_ids(rows.repeat(n, 1), batch).tolist()
    t1, t2 = [], []
    redo = []
    for g in range(n):
        toks = accepted(ids, 3 * g, draft)
        t1.append(toks[0])
        if len(toks) >= 2:
            t2.append(toks[1])
        else:
            t2.append(None)
            redo.append(g)
    # Rejected at d1: the next step samples after the token actually kept.
    nxt = torch.stack([logits2[t1[g]] for g in redo])
    more = sample_ids(nxt, SamplingBatch.build([(params, [], [])] * len(redo),
                                               vocab_size=V)).tolist()
    for g, t in zip(redo, more, strict=True):
        t2[g] = t
    counts = torch.zeros(V, V, dtype=torch.float64)
    for a, b in zip(t1, t2, strict=True):
        counts[a, b] += 1
    expected = (probs(logits1)[:, None] * probs(logits2)).double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0
    chi2 = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
    assert chi2 < 100, chi2  # df = 35 (6 x 6 cells): p ~ 1e-8
    assert 0.2 < sum(a == draft[0] for a in t1) / n < 0.6  # the draft was both kept and not


def test_bench_serve_reports_acceptance_from_the_servers_counters():
    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.entrypoints.bench import serve as bench_serve
    from asyncengine.entrypoints.bench import spec_metrics

    m = EngineMetrics("m")
    m.on_spec(4, 1)
    before = spec_metrics.parse(m.render().decode())
    m.on_spec(4, 4)
    m.on_spec(4, 0)
    m.on_spec(2, 2)
    after = spec_metrics.parse(m.render().decode())
    s = spec_metrics.summarize(before, after)
    assert (s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]) \
        == (3, 10, 6)
    assert s["spec_acceptance_rate"] == pytest.approx(0.6)
    assert s["spec_acceptance_length"] == pytest.approx(3.0)
    assert s["spec_per_position_acceptance_rate"] == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    summary = {"completed": 1, "failed": 0, "max_concurrency": 1, "request_rate": "inf",
               "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
               "request_throughput": 1.0, "output_throughput": 1.0,
               "total_token_throughput": 2.0, **s}
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            summary[f"{stat}_{key}_ms"] = 1.0
    report = bench_serve.format_report(summary)
    lines = [" ".join(line.split()) for line in report.splitlines()]
    assert "Acceptance rate (%): 60.00" in lines and "Acceptance length: 3.00" in lines
    assert spec_metrics.summarize(after, after) == {}  # nothing drafted: no section
