"""The chat page at ``/`` (``http/``, entrypoints/http/web.py).

First in-process, without a browser: the routes, their content types and caching, the key
they do not need, ``--root-path`` and ``--no-web-ui``. Then in a real headless Chromium
(Debian's ``chromium``, driven by playwright's Python client; no browser download) against
the tiny test server: the key prompt, typing and sending, streaming, stopping (the server's
running count drops to 0), a conversation surviving a reload, model output that holds HTML
rendering as text, readable errors, regenerate and edit, a phone's width. Every request
every page makes is recorded: none may go to another host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncengine.entrypoints.flags.server import add_serve_arguments, settings_from_args
from asyncengine.entrypoints.http.app import build_app
from asyncengine.entrypoints.http.state import ServerSettings
from asyncengine.entrypoints.http.web import CONTENT_SECURITY_POLICY, load_assets, web_dir
from tests.server_utils import KEY, TOOLS_SERVER_NAMES, tiny_server, tools_server

CHROMIUM = shutil.which("chromium") or next(
    (p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if os.path.exists(p)), None)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
STORE = "asyncengine.webui."


class FakeEngine:
    model_name = "fake"


def serve_args(*argv: str) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return settings_from_args(parser.parse_args(list(argv)))


def fetch_all(settings: ServerSettings, requests: list[tuple[str, dict]]) -> list:
    """(status, headers, body bytes) of each GET, against the app in-process."""

    async def main():
        app = build_app(FakeEngine(), None, settings)
        out = []
        async with TestClient(TestServer(app)) as client:
            for path, headers in requests:
                resp = await client.get(path, headers=headers, allow_redirects=False,
                                        auto_decompress=True)
                out.append((resp.status, resp.headers, await resp.read()))
        return out

    return anyio.run(main)


def test_the_page_and_its_files_are_served_with_types_caching_and_no_key():
    files = load_assets(web_dir())
    assert {"index.html", "app.js", "app.css", "vendor/marked.umd.js", "vendor/purify.min.js",
            "vendor/highlight.min.js", "vendor/LICENSE.marked", "vendor/LICENSE.dompurify",
            "vendor/LICENSE.highlight.js"} <= set(files)
    settings = ServerSettings(api_key="k")
    (page, js, css, vendor, config, missing, models, first) = fetch_all(settings, [
        ("/", {}), ("/webui/app.js", {"Accept-Encoding": "gzip"}), ("/webui/app.css", {}),
        ("/webui/vendor/purify.min.js", {}), ("/webui/config", {}), ("/webui/nope.js", {}),
        ("/v1/models", {}), ("/webui/app.js", {})])
    assert page[0] == 200 and page[1]["Content-Type"] == "text/html; charset=utf-8"
    assert page[2] == files["index.html"].body
    assert page[1]["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert page[1]["X-Content-Type-Options"] == "nosniff"
    assert js[0] == 200 and js[1]["Content-Type"] == "text/javascript; charset=utf-8"
    assert js[1]["Content-Encoding"] == "gzip" and js[2] == files["app.js"].body
    assert css[1]["Content-Type"] == "text/css; charset=utf-8"
    assert vendor[0] == 200 and vendor[2] == files["vendor/purify.min.js"].body
    for _, headers, _ in (page, js, css, vendor):
        assert headers["Cache-Control"] == "no-cache" and headers["ETag"].startswith('"')
    # The page needs no key (it asks for one); the API still does.
    assert json.loads(config[2]) == {"api_key_required": True, "defaults": {
        "temperature": 1.0, "top_p": 1.0, "max_tokens": None}}
    assert missing[0] == 404 and "error" in json.loads(missing[2])
    assert models[0] == 401
    # Revalidation: the same ETag gets 304 and no body.
    etag = first[1]["ETag"]
    (again,) = fetch_all(settings, [("/webui/app.js", {"If-None-Match": etag})])
    assert again[0] == 304 and again[2] == b""


def test_root_path_serves_the_page_under_the_prefix_and_no_web_ui_turns_it_off():
    settings = serve_args("--root-path", "/llm/", "--api-key", "k")
    assert settings.web_ui
    page, bare, asset, vendor = fetch_all(settings, [
        ("/llm/", {}), ("/llm", {}), ("/llm/webui/app.js", {}),
        ("/llm/webui/vendor/marked.umd.js", {})])
    assert page[0] == 200 and b'src="webui/app.js"' in page[2]  # relative: works under /llm/
    assert bare[0] == 308 and bare[1]["Location"] == "/llm/"
    assert asset[0] == 200 and vendor[0] == 200

    off = serve_args("--no-web-ui", "--root-path", "/llm")
    assert not off.web_ui
    results = fetch_all(off, [("/", {}), ("/llm/", {}), ("/llm", {}), ("/webui/app.js", {}),
                              ("/webui/config", {}), ("/health", {})])
    assert [r[0] for r in results[:5]] == [404] * 5
    assert "error" in json.loads(results[0][2])


def test_the_page_is_not_in_the_openapi_document():
    (doc,) = fetch_all(ServerSettings(root_path="/llm"), [("/openapi.json", {})])
    paths = json.loads(doc[2])["paths"]
    assert "/v1/chat/completions" in paths
    assert not [p for p in paths if p in ("/", "/llm/", "/llm") or "webui" in p]


# ------------------------------------------------------------------------- in Chromium


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tiny_llama):
    return tiny_server(tiny_llama)


@pytest.fixture(scope="module")
def model_name(server):
    return server.get_json("/v1/models")["data"][0]["id"]


@pytest.fixture
def new_context(browser, server):
    """Fresh browser contexts (their own storage); every request they make is recorded, and
    each must go to the server's own origin."""
    contexts, requests = [], []

    def make(origin: str = server.base_url, **kwargs):
        context = browser.new_context(**kwargs)
        context.on("request", lambda r: requests.append((origin, r.url)))
        contexts.append(context)
        return context

    yield make
    for context in contexts:
        context.close()
    foreign = [u for origin, u in requests if not u.startswith(origin + "/")
               and not u.startswith(("data:", "blob:"))]
    assert requests and not foreign, foreign


def open_page(context, server, key: str | None = KEY):
    """The page, with ``key`` already stored (as after the prompt), ready to chat."""
    if key:
        context.add_init_script(
            f"localStorage.getItem('{STORE}apiKey') || "
            f"localStorage.setItem('{STORE}apiKey', {json.dumps(json.dumps(key))});")
    page = context.new_page()
    page.goto(server.url("/"))
    page.wait_for_selector("body[data-ready=true]", timeout=15_000)
    return page


def wait_js(page, expression: str, timeout: float = 10.0) -> None:
    """Poll ``expression`` in the page until it is true. (playwright's wait_for_function
    evaluates a string, which the page's Content-Security-Policy forbids.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s: {expression}\n"
                                 + page.evaluate("document.getElementById('app').innerHTML"))
        time.sleep(0.02)


def running(server) -> int:
    return server.get_json("/health")["num_requests_running"]


def answer_text(page) -> str:
    return page.locator(".msg.assistant .body").last.inner_text()


def test_the_key_prompt_asks_again_for_a_refused_key(new_context, server, model_name):
    page = new_context().new_page()
    page.goto(server.url("/"))
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    page.fill("#key-input", "wrong-key")
    page.press("#key-input", "Enter")
    wait_js(page, "document.getElementById('key-message').textContent.includes('401')")
    assert dialog.is_visible()
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("body[data-ready=true]")
    assert not dialog.is_visible()
    assert page.locator("#model option").all_inner_texts() == [model_name]
    assert page.evaluate(f"localStorage.getItem('{STORE}apiKey')") == json.dumps(KEY)


def test_typing_sending_streaming_and_stop_frees_the_request(new_context, server):
    page = open_page(new_context(), server)
    sent = []

    def endless(route):  # a long answer: no EOS, many tokens
        body = json.loads(route.request.post_data)
        sent.append(body)
        route.continue_(post_data=json.dumps({**body, "max_tokens": 3000, "ignore_eos": True}))

    page.route("**/v1/chat/completions", endless)
    box = page.locator("#input")
    box.click()
    box.type("one")
    box.press("Shift+Enter")  # a new line, nothing sent
    box.type("two")
    assert box.input_value() == "one\ntwo" and page.locator(".msg").count() == 0
    box.press("Enter")
    assert page.locator(".msg.user .body").inner_text() == "one\ntwo"
    assert box.input_value() == ""

    wait_js(page, "document.querySelector('.msg.assistant .body')"
                           "?.textContent.length > 0", timeout=20)
    first = len(answer_text(page))
    wait_js(page, f"document.querySelector('.msg.assistant .body').textContent.length"
                           f" > {first}", timeout=20)
    assert page.locator("#stop").is_visible()  # still streaming: the text grew before the end
    assert running(server) == 1
    assert sent[0]["stream"] is True and sent[0]["stream_options"] == {"include_usage": True}
    assert sent[0]["messages"] == [{"role": "user", "content": "one\ntwo"}]

    page.click("#stop")
    page.locator("#send").wait_for(state="visible")
    deadline = time.monotonic() + 10
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(server) == 0
    stopped_at = len(answer_text(page))
    assert stopped_at > 0
    assert page.locator(".msg.assistant .stats").inner_text().startswith("stopped")
    time.sleep(0.3)
    assert len(answer_text(page)) == stopped_at


def test_a_conversation_survives_a_reload_rename_export_delete(new_context, server):
    context = new_context()
    page = open_page(context, server)
    page.click("#toggle-settings")
    page.fill("#max-tokens", "6")
    page.press("#max-tokens", "Tab")  # "change"
    page.fill("#input", "Hello there")
    page.press("#input", "Enter")
    stats = page.locator(".msg.assistant .stats")
    wait_js(page, "document.querySelector('.msg.assistant .stats')"
                           "?.textContent.includes('tokens')", timeout=20)
    tokens = int(stats.inner_text().split(" tokens")[0])
    assert 1 <= tokens <= 6 and "prompt" in stats.inner_text()
    answer = answer_text(page)

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".msg.user .body").inner_text() == "Hello there"
    assert answer_text(page) == answer
    assert page.locator(".msg.assistant .stats").inner_text() == stats.inner_text()
    assert page.locator("#conversations li").all_inner_texts()[0].startswith("Hello there")
    assert page.locator("#max-tokens").input_value() == "6"  # the settings too

    page.click("#conversations li .rename")
    page.fill(".rename-input", "Greetings")
    page.press(".rename-input", "Enter")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#conversations .conv-title").all_inner_texts() == ["Greetings"]

    with page.expect_download() as info:
        page.click("#export-chat")
    exported = json.loads(open(info.value.path()).read())
    assert exported["title"] == "Greetings"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["content"].strip() == answer.strip()
    with page.expect_download() as info:
        page.click("#export-all")
    everything = json.loads(open(info.value.path()).read())
    assert [c["title"] for c in everything["conversations"]] == ["Greetings"]

    page.click("#conversations li .delete")
    assert page.locator("#conversations li").count() == 0
    assert page.locator(".msg").count() == 0
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#conversations li").count() == 0


def sse(*chunks: dict) -> str:
    events = [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
               "model": "m", "choices": [], **c} for c in chunks]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


HOSTILE = ('Look: <img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>'
           "\n\n**bold** and `inline`\n\n```python\nprint('hi')\n```\n\n"
           "![pic](http://evil.example/x.png) [bad](javascript:window.__pwned=3)\n\n"
           "<iframe src=\"http://evil.example/\"></iframe>\n")


def test_model_output_with_html_renders_as_text(new_context, server):
    context = new_context()
    urls = []
    context.on("request", lambda r: urls.append(r.url))
    page = open_page(context, server)
    body = sse(delta(role="assistant", content=""),
               delta(reasoning_content="I think <b>hard</b>"),
               *(delta(content=HOSTILE[i:i + 17]) for i in range(0, len(HOSTILE), 17)),
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               {"usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}})
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, body=body, headers={"Content-Type": "text/event-stream"}))
    page.fill("#input", "say something nasty")
    page.press("#input", "Enter")
    wait_js(page, "document.querySelector('.msg.assistant .stats')"
                           "?.textContent.includes('40 tokens')")
    shown = answer_text(page)
    assert '<img src=x onerror="window.__pwned=1">' in shown
    assert "<script>window.__pwned=2</script>" in shown
    assert '<iframe src="http://evil.example/"></iframe>' in shown
    messages = page.locator("#messages")
    assert messages.locator("img, script, iframe").count() == 0
    assert page.evaluate("window.__pwned") is None
    # Markdown still renders, code is highlighted, the image is only a link.
    assert messages.locator("strong").inner_text() == "bold"
    assert messages.locator("pre code.hljs span").count() > 0
    assert messages.locator("a", has_text="[image: pic]").get_attribute("href") == (
        "http://evil.example/x.png")
    assert messages.locator("a", has_text="bad").get_attribute("href") is None
    page.locator("a", has_text="bad").click()
    assert page.evaluate("window.__pwned") is None
    # The reasoning: a collapsible block, text only.
    reasoning = messages.locator("details.reasoning")
    assert reasoning.locator("summary").inner_text() == "Reasoning"
    assert reasoning.locator(".reasoning-text").text_content() == "I think <b>hard</b>"
    assert reasoning.locator("b").count() == 0
    # Nothing was fetched on the output's say-so: every request went to the server.
    assert urls and all(u.startswith(server.base_url + "/") for u in urls), urls


def test_server_errors_are_readable_and_401_asks_for_the_key(new_context, server):
    page = open_page(new_context(), server)
    replies = [
        (503, {"Retry-After": "7"}, "The server is shutting down."),
        (400, {}, "max_tokens must be at least 1"),
        (401, {}, "Invalid or missing API key"),
    ]

    def refuse(route):
        if not replies:  # then the server answers, briefly
            body = {**json.loads(route.request.post_data), "max_tokens": 4}
            return route.continue_(post_data=json.dumps(body))
        status, headers, message = replies.pop(0)
        route.fulfill(status=status, headers={**headers, "Content-Type": "application/json"},
                      body=json.dumps({"error": {"message": message, "type": "x",
                                                 "param": None, "code": None}}))

    page.route("**/v1/chat/completions", refuse)
    page.fill("#input", "hi")
    page.press("#input", "Enter")
    error = page.locator("#error-text")
    error.wait_for(state="visible")
    assert "503" in error.inner_text() and "shutting down" in error.inner_text()
    assert "Try again in 7 s" in error.inner_text()
    assert page.locator(".msg.user").count() == 1 and page.locator(".msg.assistant").count() == 0
    page.click("#error-retry")
    wait_js(page, "document.getElementById('error-text').textContent.includes('400')")
    assert "max_tokens must be at least 1" in error.inner_text()
    page.click("#error-retry")  # 401: the key prompt, then the same request again
    page.locator("#key-dialog").wait_for(state="visible")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    wait_js(page, "document.querySelector('.msg.assistant .stats')"
                           "?.textContent.includes('tokens')", timeout=20)
    assert not page.locator("#error").is_visible()


def test_regenerate_and_edit_resend_the_right_messages(new_context, server):
    page = open_page(new_context(), server)
    bodies = []

    def answer(route):
        bodies.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body=sse(delta(content=f"answer {len(bodies)}")))

    page.route("**/v1/chat/completions", answer)
    page.click("#toggle-settings")
    page.fill("#system", "Be brief.")
    page.fill("#input", "first")
    page.press("#input", "Enter")
    wait_js(page, "document.querySelector('.msg.assistant .body')"
                           "?.textContent.trim() === 'answer 1'")
    page.click(".msg.assistant .regenerate")
    wait_js(page, "document.querySelector('.msg.assistant .body')"
                           "?.textContent.trim() === 'answer 2'")
    assert page.locator(".msg.assistant").count() == 1
    system = {"role": "system", "content": "Be brief."}
    assert bodies[1]["messages"] == bodies[0]["messages"] == [
        system, {"role": "user", "content": "first"}]

    page.click(".msg.user .edit")
    page.fill(".edit-text", "changed")
    page.click(".edit-box .save")
    wait_js(page, "document.querySelector('.msg.assistant .body')"
                           "?.textContent.trim() === 'answer 3'")
    assert page.locator(".msg.user .body").inner_text() == "changed"
    assert page.locator(".msg").count() == 2
    assert bodies[2]["messages"] == [system, {"role": "user", "content": "changed"}]


def test_a_phone_width_and_the_dark_theme(new_context, server):
    context = new_context(viewport={"width": 390, "height": 844}, color_scheme="dark")
    page = open_page(context, server)
    sidebar = page.locator("#sidebar")
    assert sidebar.bounding_box()["x"] + sidebar.bounding_box()["width"] <= 0  # slid away
    page.click("#open-sidebar")
    wait_js(page, "document.getElementById('sidebar').getBoundingClientRect().x >= 0")
    page.click("#close-sidebar")
    composer = page.locator("#composer").bounding_box()
    assert composer["x"] >= 0 and composer["x"] + composer["width"] <= 390
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    channels = [int(c) for c in background[background.index("(") + 1:-1].split(",")[:3]]
    assert max(channels) < 60, background  # dark


def test_the_page_under_root_path_uses_the_prefix(new_context, tiny_llama):
    server = tools_server(tiny_llama)  # --root-path /llm, two served names, --api-key KEY
    context = new_context(server.base_url)
    seen = []
    context.on("request", lambda r: seen.append(r.url))
    page = context.new_page()
    page.goto(server.url("/llm"))  # redirected to /llm/
    page.locator("#key-dialog").wait_for(state="visible")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("body[data-ready=true]")
    assert page.url == server.url("/llm/")
    assert page.locator("#model option").all_inner_texts() == list(TOOLS_SERVER_NAMES)
    page.select_option("#model", TOOLS_SERVER_NAMES[1])
    page.click("#toggle-settings")
    page.fill("#max-tokens", "3")
    page.press("#max-tokens", "Tab")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.fill("#input", "hi")
        page.press("#input", "Enter")
    wait_js(page, "document.querySelector('.msg.assistant .stats')"
                  "?.textContent.includes('tokens')", timeout=20)
    assert json.loads(sent.value.post_data)["model"] == TOOLS_SERVER_NAMES[1]
    assert all(u.startswith(server.url("/llm")) for u in seen), seen
    assert server.url("/llm/v1/chat/completions") in seen
    assert server.url("/llm/webui/vendor/purify.min.js") in seen


def test_a_router_lists_models_with_their_status_and_loads_one(new_context, tiny_models):
    """--models-dir: the picker shows each model's status; Load loads the chosen one."""
    from pathlib import Path

    from tests.server_utils import shared_server

    router = shared_server(None, "--models-dir", str(Path(tiny_models["llama"]).parent),
                           "--dtype", "float32", "--num-gpu-blocks-override", "64",
                           api_key=KEY)
    page = open_page(new_context(router.base_url), router)
    wait_js(page, "[...document.querySelectorAll('#model option')].some("
                  "o => o.textContent === 'qwen2 (unloaded)')")
    page.select_option("#model", "qwen2")
    button = page.locator("#load-model")
    assert button.is_visible() and button.inner_text() == "Load"
    button.click()
    wait_js(page, "[...document.querySelectorAll('#model option')].some("
                  "o => o.textContent === 'qwen2 (loaded)')", timeout=60)
    assert not button.is_visible()
    statuses = {m["id"]: m["status"]["value"] for m in router.get_json("/models")["data"]}
    assert statuses["qwen2"] == "loaded" and statuses["llama"] == "unloaded"


def test_images_attach_by_button_drop_and_paste(new_context, tiny_llava, tmp_path):
    """A vision model's page: an image chosen with the button, one dropped on the page and
    one pasted into the message box show as thumbnails (one removed again); sent, they go as
    data-URL image parts before the text, show in the conversation, and the answer streams."""
    import base64
    import io

    from tests.vision_utils import image, llava_server

    llava = llava_server(tiny_llava)
    page = open_page(new_context(origin=llava.base_url), llava)
    sent = []

    def short(route):
        body = json.loads(route.request.post_data)
        sent.append(body)
        route.continue_(post_data=json.dumps({**body, "max_tokens": 4, "ignore_eos": True}))

    page.route("**/v1/chat/completions", short)

    def png(seed: int) -> bytes:
        buf = io.BytesIO()
        image(30 + seed, 20 + seed, seed=seed).save(buf, format="PNG")
        return buf.getvalue()

    path = tmp_path / "chosen.png"
    path.write_bytes(png(1))
    page.set_input_files("#image-input", str(path))
    wait_js(page, "document.querySelectorAll('#attachments img').length === 1")
    make_file = ("const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));"
                 "const dt = new DataTransfer();"
                 "dt.items.add(new File([bytes], 'x.png', { type: 'image/png' }));")
    page.evaluate("(b64) => {" + make_file + "document.querySelector('main').dispatchEvent("
                  "new DragEvent('drop', { dataTransfer: dt, bubbles: true, cancelable: true }));}",
                  base64.b64encode(png(2)).decode())
    wait_js(page, "document.querySelectorAll('#attachments img').length === 2")
    page.evaluate("(b64) => {" + make_file + "document.getElementById('input').dispatchEvent("
                  "new ClipboardEvent('paste', { clipboardData: dt, bubbles: true, "
                  "cancelable: true }));}", base64.b64encode(png(3)).decode())
    wait_js(page, "document.querySelectorAll('#attachments img').length === 3")
    page.click("#attachments .thumb:nth-child(3) button")  # the pasted one, removed
    wait_js(page, "document.querySelectorAll('#attachments img').length === 2")

    box = page.locator("#input")
    box.click()
    box.type("What are these?")
    box.press("Enter")
    wait_js(page, "document.querySelector('#attachments').hidden")
    assert page.locator(".msg.user .images img").count() == 2
    wait_js(page, "document.querySelector('.msg.assistant .stats')?.textContent.length > 0",
            timeout=30)
    assert answer_text(page)
    parts = sent[0]["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    urls = [p["image_url"]["url"] for p in parts[:2]]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    assert base64.b64decode(urls[0].split(",", 1)[1]) == png(1)
    assert base64.b64decode(urls[1].split(",", 1)[1]) == png(2)
    assert parts[2] == {"type": "text", "text": "What are these?"}
