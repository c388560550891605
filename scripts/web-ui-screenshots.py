"""Screenshots of the chat page for the docs: docs/web-ui-light.png and docs/web-ui-dark.png.

    python scripts/web-ui-screenshots.py [--model MODEL] [--out docs]

Starts ``asyncengine serve`` (the embedded SmolLM2-135M-Instruct unless --model), asks it
two questions in Debian's headless chromium (playwright's client), and saves the page in
the light and the dark theme (the same conversations: the dark context gets the light
one's storage).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playwright.sync_api import sync_playwright  # noqa: E402

from tests.server_utils import ServerProcess  # noqa: E402

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update"]
QUESTIONS = ["What is the capital of France? One sentence.",
             "Write a Python function that reverses a string, with a short explanation."]


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")
    deadline = time.monotonic() + 120
    while page.locator("#stop").is_visible() or not page.locator("#send").is_visible():
        if time.monotonic() > deadline:
            raise TimeoutError("no answer in 120 s")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    server = ServerProcess(args.model)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS)
            size = {"width": 1200, "height": 760}
            light = browser.new_context(viewport=size, color_scheme="light",
                                        device_scale_factor=1)
            page = light.new_page()
            page.goto(server.url("/"))
            page.wait_for_selector("body[data-ready=true]")
            page.click("#toggle-settings")
            page.fill("#max-tokens", "220")
            page.press("#max-tokens", "Tab")
            page.fill("#temperature", "0")
            page.press("#temperature", "Tab")
            page.click("#toggle-settings")
            ask(page, QUESTIONS[0])
            page.click("#new-chat")
            ask(page, QUESTIONS[1])
            out = Path(args.out)
            page.screenshot(path=str(out / "web-ui-light.png"))
            dark = browser.new_context(viewport=size, color_scheme="dark",
                                       device_scale_factor=1,
                                       storage_state=light.storage_state())
            page = dark.new_page()
            page.goto(server.url("/"))
            page.wait_for_selector("body[data-ready=true]")
            page.screenshot(path=str(out / "web-ui-dark.png"))
            browser.close()
    finally:
        server.stop()
    print(f"wrote {out / 'web-ui-light.png'} and {out / 'web-ui-dark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
