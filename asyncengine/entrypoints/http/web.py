"""The built-in chat page: ``GET /`` and its assets under ``/webui/`` (``--no-web-ui``: off).

The page is static HTML, CSS and JavaScript (no build step) in the repository's top-level
``http/`` folder; a wheel carries a copy as ``asyncengine/_http/`` (``setup.py``), which
:func:`web_dir` looks at first. Its libraries (marked, DOMPurify, highlight.js) are vendored
under ``http/vendor/`` (``scripts/refresh-web-vendor.sh``), so nothing comes from another host.

The files are read once, when the app is built, and answered from memory with an ``ETag``
(a hash of the content) and ``Cache-Control: no-cache``: a browser revalidates and gets 304
until the files change. The page talks to the API with URLs relative to its own, so it works
under ``--root-path`` (and behind a proxy that strips the prefix) unchanged.

``GET /webui/config`` tells the page what it cannot find out by itself: whether an API key
is needed (it asks for one before the first 401) and the server's sampling defaults (the
generation config's, else OpenAI's). The page, its assets and this route need no key.
"""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from asyncengine.entrypoints.http.errors import APIError
from asyncengine.entrypoints.http.state import STATE, ServerSettings

_PACKAGE = Path(__file__).resolve().parents[2]  # .../asyncengine
#: Where the assets are served under (besides the page itself at ``/``).
ASSET_PREFIX = "/webui/"
CONFIG_PATH = "/webui/config"

_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
          ".json": "application/json", ".svg": "image/svg+xml", ".png": "image/png"}
#: The page's policy: scripts, styles, images and fetches from this server only; nothing
#: inline (model output is sanitized besides; this is the second fence).
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; "
                           "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                           "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
_SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def web_dir() -> Path:
    """The folder of the page: ``asyncengine/_http`` in an installed wheel, else the
    ``http/`` beside the package in a checkout (an editable install)."""
    for candidate in (_PACKAGE / "_http", _PACKAGE.parent / "http"):
        if (candidate / "index.html").is_file():
            return candidate
    raise FileNotFoundError(f"the web UI's files are neither in {_PACKAGE / '_http'} nor in "
                            f"{_PACKAGE.parent / 'http'} (or start with --no-web-ui)")


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str

    @classmethod
    def read(cls, path: Path) -> Asset:
        body = path.read_bytes()
        kind = _TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "text/plain"
        if kind.startswith("text/") or kind == "application/json":
            kind += "; charset=utf-8"
        return cls(body, kind, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


def load_assets(directory: Path) -> dict[str, Asset]:
    """Every file under ``directory`` by its relative path (``app.js``, ``vendor/...``)."""
    return {p.relative_to(directory).as_posix(): Asset.read(p)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _answer(request: web.Request, asset: Asset, headers: dict[str, str]) -> web.Response:
    headers = {**_SECURITY_HEADERS, **headers, "ETag": asset.etag, "Cache-Control": "no-cache"}
    if asset.etag in request.headers.get("If-None-Match", ""):
        return web.Response(status=304, headers=headers)
    response = web.Response(body=asset.body, headers={**headers,
                                                      "Content-Type": asset.content_type})
    if len(asset.body) > 1024:
        response.enable_compression()  # when the client accepts gzip/deflate
    return response


def add_web_routes(app: web.Application, settings: ServerSettings) -> None:
    """``/``, ``/webui/config`` and ``/webui/<asset>``; nothing with ``--no-web-ui``. They are
    left out of /openapi.json (not API) and need no key (auth.py asks :func:`is_web_path`)."""
    if not settings.web_ui:
        return
    assets = load_assets(web_dir())
    index = assets["index.html"]

    async def web_index(request: web.Request) -> web.Response:
        return _answer(request, index, {"Content-Security-Policy": CONTENT_SECURITY_POLICY})

    def asset_handler(folder: str):
        async def web_asset(request: web.Request) -> web.Response:
            asset = assets.get(folder + request.match_info["name"])
            if asset is None:
                raise APIError(404, f"No such file: {request.path}")
            return _answer(request, asset, {})

        return web_asset

    # One level of folders (vendor/), each its own route: --root-path mirrors a route by its
    # canonical path, which would drop a {name:.+} pattern.
    web_asset, web_vendor_asset = asset_handler(""), asset_handler("vendor/")

    async def web_config(request: web.Request) -> web.Response:
        state = request.app[STATE]
        defaults = state.generation_defaults
        return web.json_response({
            "api_key_required": state.settings.api_key is not None,
            "defaults": {"temperature": defaults.get("temperature", 1.0),
                         "top_p": defaults.get("top_p", 1.0),
                         "max_tokens": defaults.get("max_tokens")},
        }, headers={**_SECURITY_HEADERS, "Cache-Control": "no-store"})

    for handler in (web_index, web_asset, web_vendor_asset, web_config):
        handler.openapi_hidden = True  # type: ignore[attr-defined]
    app.router.add_get("/", web_index)
    app.router.add_get(CONFIG_PATH, web_config)
    app.router.add_get(ASSET_PREFIX + "vendor/{name}", web_vendor_asset)
    app.router.add_get(ASSET_PREFIX + "{name}", web_asset)


def add_root_redirect(app: web.Application, settings: ServerSettings) -> None:
    """Under ``--root-path /llm``, ``/llm`` redirects to ``/llm/`` (the page's relative URLs
    need the slash). Called after the routes are mirrored under the prefix."""
    if not settings.web_ui or not settings.root_path:
        return
    target = settings.root_path + "/"

    async def web_root_redirect(request: web.Request) -> web.Response:
        raise web.HTTPPermanentRedirect(target)

    web_root_redirect.openapi_hidden = True  # type: ignore[attr-defined]
    app.router.add_get(settings.root_path, web_root_redirect)


def is_web_path(path: str) -> bool:
    """The page and its files (no API key needed), given a path without --root-path ("" is
    the prefix itself, which redirects to the page)."""
    return path in ("", "/") or path.startswith(ASSET_PREFIX)
