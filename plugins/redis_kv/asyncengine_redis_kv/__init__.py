"""A Redis/Valkey KV-cache block store for asyncengine: ``--kv-connector redis``.

The class is ``asyncengine_redis_kv.connector.RedisKVConnector`` (not imported here, so that
loading the plugin does not import redis-py).
"""
