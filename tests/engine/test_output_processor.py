"""Emission (``engine/output_processor.py``) on its own, with the embedded model's tokenizer:
what it does with the tokens a step appended is where a bug would hide behind end-to-end runs.
A stop string inside a burst of tokens (speculative decoding) ends the output at the token
that completes it; a stop token's text is left out; one request's fault ends that request's
stream alone; the samples of an n > 1 request close together."""

from __future__ import annotations

import asyncio

import pytest

from asyncengine.core.request import Request, RequestStatus
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.errors import RequestFailed
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.streams import RequestStream
from asyncengine.text.tokenizer import load_tokenizer
from tests.utils import embedded_gguf_path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_gguf_path())


def stream_of(op: OutputProcessor, rid: str, params: SamplingParams, n: int = 1,
              eos: frozenset[int] = frozenset()) -> RequestStream:
    prompt = [1, 2, 3]
    samples = [op.make_sample(Request(f"{rid}-{i}" if n > 1 else rid, prompt, params,
                                      eos_token_ids=eos, index=i), params) for i in range(n)]
    stream = RequestStream(rid, None, prompt, samples, on_abort=lambda _: None,
                           deltas_only=False)
    op.add(stream)
    return stream


def test_a_stop_string_inside_a_burst_ends_at_its_token(tokenizer):
    op = OutputProcessor(tokenizer)
    stream = stream_of(op, "a", SamplingParams(max_tokens=50, stop=["river"]))
    req = stream.samples[0].request
    req.output_token_ids += tokenizer.encode("The river rose", add_special_tokens=False) + \
        tokenizer.encode(" slowly all night", add_special_tokens=False)
    done = op.emit([req])
    sample = stream.samples[0]
    assert done.stopped == ["a"] and done.failed == []
    assert sample.finish_reason == "stop" and sample.stop_reason == "river"
    through = len(tokenizer.encode("The river", add_special_tokens=False))
    assert sample.num_emitted == through  # not the tokens after it
    assert stream.take().outputs[0].text == "The "
    assert "a" not in op.streams  # closed


def test_a_stop_token_s_text_is_left_out(tokenizer):
    op = OutputProcessor(tokenizer)
    eos = tokenizer.eos_token_ids
    stream = stream_of(op, "a", SamplingParams(max_tokens=50), eos=eos)
    req = stream.samples[0].request
    req.output_token_ids += tokenizer.encode("Hello", add_special_tokens=False)
    op.emit([req])
    req.output_token_ids.append(min(eos))
    req.status = RequestStatus.FINISHED_STOPPED
    assert op.emit([req]).stopped == []  # the scheduler ended it already
    out = stream.take().outputs[0]
    assert out.text == "Hello" and out.finish_reason == "stop"


def test_one_request_s_fault_ends_its_stream_alone(tokenizer):
    op = OutputProcessor(tokenizer)
    good = stream_of(op, "good", SamplingParams(max_tokens=50))
    bad = stream_of(op, "bad", SamplingParams(max_tokens=50))
    broken = stream_of(op, "broken", SamplingParams(max_tokens=50))

    def boom(*a, **k):
        raise UnicodeError("a detokenizer bug")

    bad.samples[0].detokenizer.update = boom
    broken.samples[0].request.status = RequestStatus.FINISHED_ERROR
    broken.samples[0].request.error = "no valid token"
    reqs = [s.samples[0].request for s in (good, bad, broken)]
    for r in reqs:
        r.output_token_ids += tokenizer.encode(" yes", add_special_tokens=False)
    done = op.emit(reqs)
    assert done.failed == ["bad"]  # the scheduler ended "broken" itself
    for s in (bad, broken):
        with pytest.raises(RequestFailed):
            asyncio.run(s.__anext__())
    assert good.take().outputs[0].text == " yes" and "good" in op.streams
    assert set(op.streams) == {"good"}


def test_the_samples_of_one_request_close_together(tokenizer):
    op = OutputProcessor(tokenizer)
    stream = stream_of(op, "n", SamplingParams(max_tokens=2, n=2), n=2)
    a, b = (s.request for s in stream.samples)
    a.output_token_ids += [300, 301]
    a.status = RequestStatus.FINISHED_LENGTH
    b.output_token_ids += [302]
    op.emit([a, b])
    assert not stream.finished and "n" in op.streams
    b.output_token_ids += [303]
    b.status = RequestStatus.FINISHED_LENGTH
    op.emit([b])
    assert stream.finished and "n" not in op.streams
    out = stream.take()
    assert [o.finish_reason for o in out.outputs] == ["length", "length"]
    assert [len(o.token_ids) for o in out.outputs] == [2, 2]
