"""Images through the server: the openai client's data-URL image, the anthropic client's
base64 block, the Responses API's input_image and llama-server's multimodal_data all get
transformers' answer; every bad image is a 400 in the API's shape and changes nothing."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_utils import KEY, shared_server, tiny_server
from tests.vision_utils import image, llava_reference, llava_server

QUESTION = "What is shown here?"
N = 6


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


@pytest.fixture(scope="module")
def server(tiny_llava):
    return llava_server(tiny_llava)


@pytest.fixture(scope="module")
def media_dir(server, tiny_llava):
    return Path(tiny_llava) / "media"


@pytest.fixture(scope="module")
def expected(tiny_llava):
    """transformers' greedy answer to the chat template's prompt with one image."""
    import transformers

    img = image(97, 61, seed=1)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llava)
    text = tok.apply_chat_template([{"role": "user", "content": f"<image>\n{QUESTION}"}],
                                   add_generation_prompt=True, tokenize=False)
    _, new = llava_reference(tiny_llava, text, [img], N)
    return img, text, tok.decode(new, skip_special_tokens=True)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url(path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **server.headers()})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat_body(parts: list[dict], **kw) -> dict:
    return {"model": "llava", "messages": [{"role": "user", "content": parts}],
            "max_tokens": N, "temperature": 0, "ignore_eos": True} | kw


def test_openai_client_data_url(server, expected):
    import openai

    img, _, answer = expected
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    model = "llava"
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=N, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(img)}},
            {"type": "text", "text": QUESTION}]}])
    assert out.choices[0].message.content == answer
    assert out.usage.prompt_tokens > 16  # the image's 16 placeholders are in the prompt
    # the same image again (a PNG file under --allowed-local-media-path is another image)
    again = client.chat.completions.create(
        model=model, temperature=0, max_tokens=N, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(img)}},
            {"type": "text", "text": QUESTION}]}])
    assert again.choices[0].message.content == answer


def test_tokenize_counts_an_image_as_its_placeholders(server, expected):
    """/tokenize renders a conversation with an image as the engine sees it: the image is its
    16 placeholders (not the one token its placeholder text is); a bad image is a 400."""
    img, _, _ = expected
    parts = [{"type": "image_url", "image_url": {"url": data_url(img)}},
             {"type": "text", "text": QUESTION}]
    status, chat = post(server, "/v1/chat/completions", chat_body(parts, max_tokens=1))
    assert status == 200, chat
    status, body = post(server, "/tokenize", {"model": "llava", "messages": [
        {"role": "user", "content": parts}], "add_generation_prompt": True})
    assert status == 200, body
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    assert body["tokens"].count(max(body["tokens"])) == 16
    status, body = post(server, "/tokenize", {"model": "llava", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AAAA"}}]}]})
    assert status == 400, body


def test_anthropic_client_base64_block(server, expected):
    import anthropic

    img, _, answer = expected
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0,
                                 timeout=60)
    out = client.messages.create(
        model="llava", max_tokens=N, extra_body={"temperature": 0, "ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(img)).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert out.content[0].text == answer
    counted = client.messages.count_tokens(model="llava", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png_bytes(img)).decode()}},
        {"type": "text", "text": QUESTION}]}])
    assert counted.input_tokens == out.usage.input_tokens


def test_responses_input_image_and_llama_server_multimodal_data(server, expected):
    img, text, answer = expected
    status, body = post(server, "/v1/responses", {
        "model": "llava", "max_output_tokens": N, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(img)},
            {"type": "input_text", "text": QUESTION}]}]})
    assert status == 200, body
    assert body["output"][-1]["content"][0]["text"] == answer
    status, body = post(server, "/completion", {
        "prompt": {"prompt_string": text.replace("<image>", "<__media__>"),
                   "multimodal_data": [base64.b64encode(png_bytes(img)).decode()]},
        "n_predict": N, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["content"] == answer
    assert server.get_json("/props")["modalities"]["vision"] is True


def test_responses_input_image_by_file_id(server, expected):
    """An image uploaded to /v1/files (purpose vision or user_data) given to /v1/responses
    by its file_id: the same answer as inline; an unknown id, a batch file, both a URL and
    an id are 400s in OpenAI's shape."""
    import openai

    img, _, answer = expected
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    ids = [client.files.create(file=("img.png", png_bytes(img)), purpose=purpose).id
           for purpose in ("vision", "user_data")]
    batch = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch").id

    def ask(part: dict) -> tuple[int, dict]:
        return post(server, "/v1/responses", {
            "model": "llava", "max_output_tokens": N, "temperature": 0,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Look."}, part,
                {"type": "input_text", "text": QUESTION}]}]})

    for file_id in ids:
        out = client.responses.create(model="llava", max_output_tokens=N, temperature=0,
                                      input=[{"role": "user", "content": [
                                          {"type": "input_image", "file_id": file_id},
                                          {"type": "input_text", "text": QUESTION}]}])
        assert out.output_text == answer
    for part, why, code in (
            ({"type": "input_image", "file_id": "file-nope"}, "No such file", "file_not_found"),
            ({"type": "input_image", "file_id": batch}, "purpose 'batch'", None),
            ({"type": "input_image", "file_id": ids[0], "image_url": data_url(img)},
             "not both", None),
            ({"type": "input_image"}, "needs image_url or file_id", None)):
        status, body = ask(part)
        assert status == 400 and why in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"].startswith("input[0].content[1]")
        assert body["error"]["code"] == code
    for file_id in (*ids, batch):
        client.files.delete(file_id)


def test_file_urls_and_two_images(server, media_dir):
    ok = (media_dir / "ok.png").as_uri()
    status, body = post(server, "/v1/chat/completions", chat_body([
        {"type": "image_url", "image_url": {"url": ok}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": ok}]))
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 32


def bad_cases(media_dir) -> list[tuple[str, list[dict], str]]:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1100, 1000)).save(buf, format="PNG")
    big = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    good = data_url(image(20, 20, seed=0))
    corrupt = "data:image/png;base64," + base64.b64encode(
        png_bytes(image(30, 30, seed=0))[:50]).decode()

    def img(url):
        return {"type": "image_url", "image_url": {"url": url}}

    return [
        ("outside domains", [img("http://localhost:9/a.png")], "allowed-media-domains"),
        ("link-local", [img("http://169.254.169.254/latest/meta-data")],
         "allowed-media-domains"),
        ("file outside", [img((media_dir.parent / "x.png").as_uri())], "allowed-local"),
        ("pixels", [img(big)], "max-image-pixels"),
        ("corrupt", [img(corrupt)], "corrupt|decoded"),
        ("count", [img(good), img(good), img(good)], "limit-mm-per-prompt"),
        ("context", [img(good), {"type": "text", "text": "word " * 245}], "context length"),
    ]


def test_bad_images_are_400s_and_change_nothing(server, media_dir, expected):
    for name, parts, why in bad_cases(media_dir):
        status, body = post(server, "/v1/chat/completions", chat_body(parts))
        assert status == 400, (name, body)
        assert body["error"]["type"] == "invalid_request_error"
        import re

        assert re.search(why, body["error"]["message"]), (name, body)
    # Anthropic's shape on /v1/messages
    status, body = post(server, "/v1/messages", {
        "model": "llava", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://10.1.2.3/a.png"}}]}]})
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error"
    # and the server serves on, every block free again
    test_openai_client_data_url(server, expected)
    metrics = server.metrics()
    assert "asyncengine" in metrics or "vllm" in metrics


def test_fetched_urls_redirects_and_timeouts(server, expected):
    """http(s) URLs from a local server: fetched by the server; a redirect to a host not in
    --allowed-media-domains and a fetch past --media-fetch-timeout are 400s."""
    from tests.vision_utils import serve_media

    img, _, answer = expected
    with serve_media(png_bytes(img)) as (base, by_name):
        status, body = post(server, "/v1/chat/completions", chat_body([
            {"type": "image_url", "image_url": {"url": f"{base}/redirect?to=/img"}},
            {"type": "text", "text": QUESTION}]))
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == answer
        for url, why in ((f"{base}/redirect?to={by_name}/img", "allowed-media-domains"),
                         (f"{base}/slow", "media-fetch-timeout")):
            status, body = post(server, "/v1/chat/completions", chat_body(
                [{"type": "image_url", "image_url": {"url": url}}]))
            assert status == 400 and why in body["error"]["message"], body


def test_an_image_to_a_text_only_model_is_a_400(tiny_llama):
    server = tiny_server(tiny_llama)
    status, body = post(server, "/v1/chat/completions", chat_body(
        [{"type": "image_url", "image_url": {"url": data_url(image(20, 20, seed=0))}},
         {"type": "text", "text": "hi"}], model=None))
    assert status == 400 and "text-only" in body["error"]["message"], body


def test_gemma3_through_the_openai_client(tiny_gemma3):
    """Gemma 3: the chat template sees ``<start_of_image>``, the engine expands it as
    Gemma3Processor does; two images of different sizes get transformers' answer."""
    import openai
    import transformers

    from tests.vision_utils import gemma3_processor_reference, gemma3_reference

    a, b = image(97, 61, seed=1), image(20, 50, seed=2)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_gemma3)
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"<start_of_image>\nand\n<start_of_image>\n{QUESTION}"}],
        add_generation_prompt=True, tokenize=False)
    _, new = gemma3_reference(tiny_gemma3, text, [a, b], N, add_special_tokens=False)
    server = shared_server(tiny_gemma3, "--num-gpu-blocks-override", "64", "--max-model-len",
                           "256", "--served-model-name", "gemma3", api_key=KEY)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model="gemma3", temperature=0, max_tokens=N, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(a)}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_url(b)}},
            {"type": "text", "text": QUESTION}]}])
    assert out.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
    # A request's mm_processor_kwargs (vLLM's extra parameter): Gemma 3's pan-and-scan.
    wide = image(900, 300, seed=4)
    one = tok.apply_chat_template([{"role": "user", "content": "<start_of_image>\nhi"}],
                                  add_generation_prompt=True, tokenize=False)
    ids, new, crops = gemma3_processor_reference(tiny_gemma3, one, [wide], N,
                                                 do_pan_and_scan=True)
    assert crops == 4
    parts = [{"type": "image_url", "image_url": {"url": data_url(wide)}},
             {"type": "text", "text": "hi"}]
    out = client.chat.completions.create(
        model="gemma3", temperature=0, max_tokens=N, messages=[{"role": "user", "content": parts}],
        extra_body={"ignore_eos": True, "mm_processor_kwargs": {"do_pan_and_scan": True}})
    assert out.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    for bad, why in (({"do_pan_and_scan": True, "crop": 2}, "unknown key 'crop'"),
                     ({"pan_and_scan_max_num_crops": 0}, "must be a positive int")):
        status, body = post(server, "/v1/chat/completions", {
            "model": "gemma3", "max_tokens": 2, "mm_processor_kwargs": bad,
            "messages": [{"role": "user", "content": parts}]})
        assert status == 400 and why in body["error"]["message"], body
        assert body["error"]["param"] == "mm_processor_kwargs"


def test_the_openapi_document_has_image_parts_only_for_a_vision_model(server, tiny_llama):
    def refs(doc) -> set[str]:
        text = json.dumps(doc["components"]["schemas"]["ChatMessage"])
        return {name for name in ("TextPart", "ImageURLPart") if f"/{name}\"" in text}

    assert refs(server.get_json("/openapi.json")) == {"TextPart", "ImageURLPart"}
    assert refs(tiny_server(tiny_llama).get_json("/openapi.json")) == {"TextPart"}
