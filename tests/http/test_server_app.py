"""The aiohttp application in-process (no model): plugin routes, the 500 path."""

from __future__ import annotations

import anyio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from asyncengine.entrypoints.http.app import build_app
from asyncengine.entrypoints.http.errors import error_middleware
from asyncengine.entrypoints.http.state import ServerSettings
from asyncengine.plugins import hookimpl


def test_plugin_routes_are_served_and_documented(monkeypatch):
    from asyncengine.ext import registry

    seen = {}

    class Plugin:
        @hookimpl
        def register_http_routes(self, app, engine):
            seen["engine"] = engine

            async def hello(request):
                return web.json_response({"hello": engine.model_name})

            app.router.add_get("/plugin/hello", hello)

    pm = registry.new_plugin_manager(load_entrypoints=False)
    pm.register(Plugin())
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)

    class FakeEngine:
        model_name = "fake"

    engine = FakeEngine()
    app = build_app(engine, None, ServerSettings(api_key="k"))
    assert seen["engine"] is engine

    async def main():
        async with TestClient(TestServer(app)) as client:
            auth = {"Authorization": "Bearer k"}
            hello = await (await client.get("/plugin/hello", headers=auth)).json()
            denied = (await client.get("/plugin/hello")).status
            doc = await (await client.get("/openapi.json", headers=auth)).json()
            return hello, denied, doc

    hello, denied, doc = anyio.run(main)
    assert hello == {"hello": "fake"} and denied == 401
    assert "get" in doc["paths"]["/plugin/hello"]
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_unexpected_errors_are_a_500_without_traceback():
    async def boom(request):
        raise RuntimeError("secret internal detail")

    async def main():
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/boom", boom)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/boom")
            return resp.status, await resp.json()

    status, body = anyio.run(main)
    assert status == 500
    err = body["error"]
    assert err["type"] == "server_error" and "secret" not in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
