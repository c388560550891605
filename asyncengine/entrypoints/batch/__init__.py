"""Batch jobs: OpenAI's Batch API in the server (``/v1/files``, ``/v1/batches``) and
``asyncengine run-batch`` offline.

- ``protocol.py``: the objects, in OpenAI's shapes; ``store.py``: ``--batch-dir``, every
  disk access in a worker thread; ``journal.py``: the blocking disk functions (atomic
  metadata, one-write line appends, recovery of a torn line, the copy in input order).
- ``lines.py``: one line run. A line calls the function of (state, body) that its route's
  HTTP handler calls too (``chat_completion``, ``completion``, ``embeddings``: the handlers
  were split into reading the request and that function). Dispatching a line through the
  aiohttp router instead would need a fake ``web.Request`` per line and would run the
  middlewares (API key, overload 503s, drain) meant for clients; the split keeps one
  implementation per route and hands the batch runner typed results.
- ``runner.py``: a task per running batch in the server's task group; ``Admission`` bounds
  the lines in flight and yields to interactive requests; ``service.py``: the store and the
  runner alive inside ``batch_jobs(app)``, which ``serve`` enters.
- ``offline.py``: ``asyncengine run-batch``, the same lines without an HTTP server.
"""
