"""Replicas of the OpenAI server on Ray Serve (``pip install 'asyncengine[ray]'``).

Two deployments (docs/deploy.md has the picture):

* ``OpenAIIngress`` (``Ingress``): receives every HTTP request from Serve's proxy, reads its
  body, takes the prompt's text for routing (``prefix_table.routing_text``) and calls the
  engine deployment through a handle whose router is ``PrefixAffinityRouter``; streams the
  answer back as it comes.
* ``AsyncEngine`` (``replica.EngineReplica``): one engine and its aiohttp server per replica,
  the same routes as ``asyncengine serve``; autoscaled by ``WaitingQueuePolicy`` on the
  engines' waiting queues. With ``--kv-connector safetensors --kv-connector-path DIR`` on a
  directory every replica sees, a prefix computed by one replica is loaded by the others.

``build_app(["MODEL", "--kv-connector", "safetensors", ...], num_replicas=2)`` returns the
application for ``serve.run``; ``python -m asyncengine.deploy.ray --num-replicas 2 MODEL
--port 8000 ...`` runs it (``--host``/``--port`` become the proxy's address).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from asyncengine.deploy.autoscaling import WaitingQueuePolicy
from asyncengine.deploy.prefix_table import routing_text
from asyncengine.deploy.replica import (
    HOP_BY_HOP,
    REPLICA_HEADER,
    EngineReplica,
    check_deployable,
    parse_serve_args,
)
from asyncengine.deploy.router import PrefixAffinityRouter
from asyncengine.entrypoints.http.server import settings_from_args

logger = logging.getLogger("asyncengine.deploy")

__all__ = ["EngineReplica", "Ingress", "PrefixAffinityRouter", "WaitingQueuePolicy",
           "app_builder", "build_app", "main"]

#: Requests one replica takes at once (Serve's default, 5, would starve a batching engine).
DEFAULT_MAX_ONGOING = 1024


class Ingress:
    """The user class of the ingress deployment."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = engine.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = _app_path(request.scope)
        if request.url.query:
            path += f"?{request.url.query}"
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        gen = self._engine.forward.remote(request.method, path, headers, body,
                                          prefix=routing_text(path, body),
                                          replica=request.headers.get(REPLICA_HEADER))
        try:
            status, out_headers = await gen.__anext__()
        except Exception as e:  # the replica died or could not be reached
            logger.warning("no engine replica answered %s %s: %s", request.method, path, e)
            gen.cancel()
            return _error(503, f"No engine replica could serve the request: {e}")
        return StreamingResponse(_rest(gen), status_code=status, headers=dict(out_headers))


def _app_path(scope: dict[str, Any]) -> str:
    """The request's path inside the application (without the Serve route prefix)."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root):]
    return path or "/"


async def _rest(gen: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in gen:
            yield chunk
    finally:
        gen.cancel()  # the client left: the replica's request is aborted


def _error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                      "code": status}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def build_app(serve_argv: Sequence[str], *, num_replicas: int | None = 2,
              min_replicas: int = 1, max_replicas: int = 4, target_waiting: float = 4.0,
              replica_actor_options: dict[str, Any] | None = None,
              max_ongoing_requests: int = DEFAULT_MAX_ONGOING,
              router_kwargs: dict[str, Any] | None = None,
              autoscaling_kwargs: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application: the ingress and the engine deployment.

    ``serve_argv``: ``asyncengine serve``'s flags, checked here (a ``ValueError`` names the
    bad one) and parsed again by each replica. ``num_replicas``: a fixed count; ``None``
    autoscales between ``min_replicas`` and ``max_replicas`` on the waiting queues
    (``target_waiting`` waiting requests per replica; ``autoscaling_kwargs`` are more
    ``AutoscalingConfig`` fields, e.g. delays). ``router_kwargs``: ``PrefixAffinityRouter``'s
    (``chunk_chars``, ``min_match_chars``, ``imbalance_threshold``, ``max_entries``).
    """
    argv = list(serve_argv)
    args, _ = parse_serve_args(argv)  # fail here, not in every replica
    check_deployable(settings_from_args(args))
    if num_replicas is not None and num_replicas < 1:
        raise ValueError(f"--num-replicas must be at least 1, not {num_replicas}")
    if num_replicas is None and not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"--min-replicas {min_replicas} / --max-replicas {max_replicas}: need "
                         "1 <= min <= max")
    scaling: dict[str, Any]
    if num_replicas is not None:
        scaling = {"num_replicas": num_replicas}
    else:
        policy = AutoscalingPolicy(policy_function=WaitingQueuePolicy,
                                   policy_kwargs={"target_waiting": target_waiting})
        WaitingQueuePolicy(target_waiting)  # a bad value fails here
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=min_replicas, max_replicas=max_replicas,
            initial_replicas=min_replicas, policy=policy, **(autoscaling_kwargs or {}))}
    engine = serve.deployment(EngineReplica).options(
        name="AsyncEngine", max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=replica_actor_options or {"num_cpus": 1},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs=dict(router_kwargs or {})),
        health_check_period_s=5, **scaling)
    ingress = serve.deployment(Ingress).options(
        name="OpenAIIngress", num_replicas=1, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(argv))


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: ``serve run asyncengine.deploy.ray:app_builder
    serve_args="MODEL --kv-connector ..." num_replicas=2``, or ``import_path`` + ``args`` in a
    Serve config file (a KubeRay ``RayService``). ``serve_args``: the serve flags, one string
    or a list; ``num_replicas``: a count, or ``auto`` to autoscale; the other keys are
    ``build_app``'s (``min_replicas``, ``max_replicas``, ``target_waiting``...)."""
    kw = dict(args)
    serve_argv = kw.pop("serve_args", [])
    if isinstance(serve_argv, str):
        serve_argv = shlex.split(serve_argv)
    replicas = kw.pop("num_replicas", 2)
    kw["num_replicas"] = None if str(replicas) == "auto" else int(replicas)
    for key, cast in (("min_replicas", int), ("max_replicas", int), ("target_waiting", float),
                      ("max_ongoing_requests", int)):
        if key in kw:
            kw[key] = cast(kw[key])
    return build_app(serve_argv, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncengine.deploy.ray [deploy flags] MODEL [serve flags]``."""
    import ray

    p = argparse.ArgumentParser(
        prog="python -m asyncengine.deploy.ray", allow_abbrev=False,
        description="Serve replicas of asyncengine on Ray Serve; every other flag is an "
                    "`asyncengine serve` flag (--host/--port: the Serve proxy's address).")
    p.add_argument("--ray-address", default=None, help="the Ray cluster (default: start a "
                   "local one, or $RAY_ADDRESS)")
    p.add_argument("--num-replicas", type=int, default=None, help="a fixed replica count "
                   "(default: autoscale between --min-replicas and --max-replicas)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--target-waiting", type=float, default=4.0, help="waiting requests per "
                   "replica above which the deployment scales up")
    p.add_argument("--replica-num-cpus", type=float, default=1.0, help="CPUs Ray reserves "
                   "per engine replica")
    p.add_argument("--replica-num-gpus", type=float, default=0.0, help="GPUs Ray reserves "
                   "per engine replica (the tensor-parallel size on CUDA)")
    ours, serve_argv = p.parse_known_args(argv)
    try:
        args, _ = parse_serve_args(serve_argv)
        app = build_app(serve_argv, num_replicas=ours.num_replicas,
                        min_replicas=ours.min_replicas, max_replicas=ours.max_replicas,
                        target_waiting=ours.target_waiting,
                        replica_actor_options={"num_cpus": ours.replica_num_cpus,
                                               "num_gpus": ours.replica_num_gpus})
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(address=ours.ray_address)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own;
        signal.signal(signum, lambda *_: stop.set())  # SIGINT too in a background job
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="asyncengine", route_prefix="/")
        logger.info("serving on http://%s:%s", args.host, args.port)
        stop.wait()
        logger.info("stopping: the replicas drain (up to --shutdown-timeout)")
        serve.delete("asyncengine")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
