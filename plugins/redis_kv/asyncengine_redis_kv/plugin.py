"""The module the entry point names. The connector's module (and redis-py) is imported only
when the connector is looked up, so having the plugin installed costs nothing."""

from __future__ import annotations

from asyncengine.plugins import Register, hookimpl


@hookimpl
def register_kv_connectors(register: Register) -> None:
    from asyncengine_redis_kv.connector import RedisKVConnector

    register("redis", RedisKVConnector)
