"""The ``vllm serve`` flags asyncengine does not define (``entrypoints/flags/vllm.py``):
tuning knobs accepted and named as ignored, equivalents rewritten, and what would change the
answers without asyncengine honouring it refused, naming the flag."""

from __future__ import annotations

import pytest

from asyncengine.entrypoints.cli import _subparser, build_parser
from asyncengine.entrypoints.flags import vllm as vllm_flags
from tests.cli.test_cli import run_cli


def _translate(*argv: str) -> tuple[list[str], list[str]]:
    serve = _subparser(build_parser(), "serve")
    own = {s for a in serve._actions for s in a.option_strings}
    said: list[str] = []
    return vllm_flags.translate(argv, own, said.append), said


def test_tuning_knobs_are_ignored_and_equivalents_rewritten():
    out, said = _translate(
        "--swap-space", "16", "--disable-custom-all-reduce", "-O3", "-O", "2",
        "--compilation-config", '{"level": 3}', "--cuda-graph-sizes", "1", "2", "4",
        "--max-num-seqs", "8", "--async-scheduling", "--distributed-executor-backend=mp",
        "--structured-outputs-config", '{"backend": "xgrammar"}', "--tokenizer-mode", "hf",
        "-dp", "1", "--hf-overrides", "{}", "--enable-prompt-tokens-details")
    assert out == ["--max-num-seqs", "8", "--structured-output-backend", "xgrammar",
                   "--hf-overrides", "{}", "--enable-prompt-tokens-details"]  # asyncengine's
    assert said[0] == ("vLLM flag --swap-space 16: ignored (preempted requests are "
                       "recomputed, never swapped)")
    assert "vLLM flag --cuda-graph-sizes 1 2 4: ignored" in said[5]
    assert any(s.startswith("vLLM flag --structured-outputs-config") for s in said)
    assert len(said) == 9  # every one read is said, except those that mean what asyncengine does


def test_a_reranker_command_line_runs_unchanged():
    """vLLM's Qwen3-Reranker line: ``--hf-overrides`` (either spelling) is asyncengine's own
    flag, ``--runner pooling`` / ``--task score`` are ignored (the kind follows from the
    architecture), and the overrides that make a reranker pass the config's check."""
    from asyncengine.config import EngineConfig

    reranker = ('{"architectures": ["Qwen3ForSequenceClassification"], '
                '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}')
    out, said = _translate("--runner", "pooling", "--task", "score", "--hf_overrides", reranker)
    assert out == ["--hf_overrides", reranker]
    assert [s.split(":")[0] for s in said] == ["vLLM flag --runner pooling",
                                                "vLLM flag --task score"]
    args = build_parser().parse_args(["serve", *out])
    assert EngineConfig.from_cli(args).model.hf_overrides["is_original_qwen3_reranker"] is True
    with pytest.raises(ValueError, match="--hf-overrides: overriding rope_theta is not"):
        EngineConfig.from_dict({"hf_overrides": '{"rope_theta": 1}'})
    with pytest.raises(ValueError, match="--hf-overrides: must be a JSON object"):
        EngineConfig.from_dict({"hf_overrides": "[1]"})


@pytest.mark.parametrize("argv, names", [
    (("--tokenizer-mode", "mistral"), "--tokenizer-mode mistral: the Mistral tokenizer"),
    (("-dp", "2"), "-dp 2: one engine a process"),
    (("--logits-processors", "pkg.mod:Proc"), "--logits-processors pkg.mod:Proc: vLLM's"),
    (("--convert", "classify"), "--convert classify: a classifier made of a causal LM"),
    (("--disable-sliding-window",), "--disable-sliding-window: the model's sliding window"),
    (("--response-role", "bot"), "--response-role bot"),
    (("--structured-outputs-config", '{"backend": "x", "disable_any_whitespace": true}'),
     "its backend only"),
    (("--swap-space",), "--swap-space: expects a value"),
])
def test_what_cannot_be_honoured_names_the_flag(argv, names):
    with pytest.raises(ValueError, match=names):
        _translate(*argv)


def test_the_cli_exits_2_naming_the_flag():
    r = run_cli("serve", "--tokenizer-mode", "mistral", timeout=120)
    assert r.returncode == 2 and "--tokenizer-mode mistral" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("serve", "--mm-processor-kwargs", '{"do_pan_and_scan": true, "crop": 1}',
                timeout=120)  # vLLM's flag, read here (Gemma 3's pan-and-scan)
    assert r.returncode == 2 and "--mm-processor-kwargs: unknown key 'crop'" in r.stderr
    assert "Traceback" not in r.stderr


def test_tracing_flags_are_asyncengines_own():
    argv = ("--otlp-traces-endpoint", "http://collector:4317", "--collect-detailed-traces",
            "model,worker")
    out, said = _translate(*argv)
    assert out == list(argv) and said == []
    args = build_parser().parse_args(["serve", *argv])
    assert args.otlp_traces_endpoint == "http://collector:4317"
    assert args.collect_detailed_traces == ["model,worker"]
