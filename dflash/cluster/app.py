"""`dflash cluster CONFIG.toml`: the HTTP front of `dflash run` in front of engine replicas on Ray Serve.

Ray places, starts and restarts the replicas (cluster/replica.py); our router (cluster/router.py)
sends each conversation back to the replica holding its caches; the front (cluster/front.py)
stands where the single server's scheduler stands, so the dialects, auth, limits and streaming
are the same code. Serve's own HTTP proxy stays off: clients reach only our front.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio
from prometheus_client import Gauge

from dflash.api import API, ROUTED_PATHS, build_info, wants_html
from dflash.app import ModelLoader, load_served_model, serve_front
from dflash.cluster.front import ClusterScheduler
from dflash.cluster.replica import EngineReplica, ModelFacts
from dflash.cluster.router import ROUTERS, Route
from dflash.config import Config
from dflash.http.server import Request, Response, ResponseWriter
from dflash.logs import get_logger
from dflash.metrics import Metrics
from dflash.reply import ModelText

log = get_logger("dflash.cluster")
APP_NAME = "dflash"
DEPLOYMENT_NAME = "engine"
# Far above any replica's queue: the front admits jobs, and a replica must never refuse one,
# or Serve would route it elsewhere and the router's record would be wrong.
MAX_ONGOING_REQUESTS = 100_000
# The front's model text from the tokenizer (here) and the replicas' facts about the model.
TextLoader = Callable[[Config, ModelFacts], ModelText]


def load_front_text(config: Config, facts: ModelFacts) -> ModelText:
    from dflash.chat.detokenize import IncrementalDetokenizer, token_bytes
    from dflash.chat.template import chat_template_for
    from dflash.engine.loading import load_tokenizer

    tokenizer = load_tokenizer(config.model.source, os.path.expanduser(config.model.cache_dir))
    return ModelText(model_id=facts.model_id, max_ctx=facts.max_ctx, template=chat_template_for(tokenizer),
                     new_detokenizer=partial(IncrementalDetokenizer, tokenizer),
                     token_bytes=partial(token_bytes, tokenizer), vocab_size=facts.vocab_size,
                     aliases=config.model.aliases, weights_format=facts.weights_format)


def connect(config: Config) -> None:
    """Join or start Ray as `cluster.address` says. The dashboard stays off: the front's /metrics
    and / report the replicas."""
    import ray

    address = config.cluster.address
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False if address == "local" else None, logging_level="warning")


def deploy(config: Config, loader: ModelLoader) -> Any:
    """Start the replicas and wait until they have loaded the model; the deployment's handle."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    cluster = config.cluster
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=cluster.replicas,
        ray_actor_options=dict(cluster.ray_actor_options), max_ongoing_requests=MAX_ONGOING_REQUESTS,
        # A job on a dying replica has nowhere to go: it fails, and the client retries.
        graceful_shutdown_timeout_s=config.server.shutdown_grace_s,
        # dflash logs each request at the front; Serve's per-call lines would double them.
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[cluster.router],
            request_router_kwargs={"imbalance_threshold": cluster.imbalance_threshold}
            if cluster.router == "affine" else {}),
    )
    return serve.run(deployment.bind(config, loader), name=APP_NAME, route_prefix=None)


def undeploy(config: Config) -> None:
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        if config.cluster.address == "local":
            serve.shutdown()
    finally:
        ray.shutdown()


class ClusterAPI(API):
    """The single server's endpoints; `/health` and `/` ask the replicas first."""

    def __init__(self, model: ModelText, front: ClusterScheduler, config: Config, metrics: Metrics):
        super().__init__(model, front, config, metrics)
        self._front = front

    async def health(self, request: Request, writer: ResponseWriter) -> Response:
        replicas = await self._front.poll_replicas()
        up = len(replicas.statuses)
        status = "ok" if up >= replicas.expected else "degraded" if up else "unavailable"
        return Response.json(200 if up else 503, {"status": status, "replicas": up, "expected": replicas.expected})

    async def root(self, request: Request, writer: ResponseWriter) -> Response:
        if not wants_html(request):
            await self._front.poll_replicas()
        return await super().root(request, writer)

    def status_body(self) -> dict[str, Any]:
        replicas = self._front.replicas
        return {**super().status_body(), "replicas_expected": replicas.expected,
                "replicas": [attrs.asdict(status) for status in replicas.statuses.values()]}


async def serve_cluster(config: Config, *, loader: ModelLoader = load_served_model,
                        text_loader: TextLoader = load_front_text, handle_signals: bool = True,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Deploy the replicas, serve HTTP in front of them until shutdown, remove them."""
    await trio.to_thread.run_sync(connect, config)
    try:
        handle = await trio.to_thread.run_sync(deploy, config, loader)
        await serve_replicas(config, handle, text_loader=text_loader, handle_signals=handle_signals,
                             task_status=task_status)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(undeploy, config)
    log.info("stopped")


async def serve_replicas(config: Config, handle: Any, *, text_loader: TextLoader = load_front_text,
                         handle_signals: bool = True, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The HTTP front for a deployment that is up (`deploy`'s handle), until shutdown."""
    began = time.perf_counter()
    first = await trio.to_thread.run_sync(
        lambda: handle.options(method_name="status").remote(route=Route(pin=0, generation=False)).result())
    model = await trio.to_thread.run_sync(text_loader, config, first.model)
    metrics = Metrics(build=build_info(config, model), load_seconds=time.perf_counter() - began,
                      endpoints=ROUTED_PATHS)
    front = ClusterScheduler(handle, config.cluster.replicas, queue_max=config.server.queue_max,
                             on_job_end=metrics.job_ended)
    Gauge("dflash_replicas", "engine replicas that answered the last status call",
          registry=metrics.registry).set_function(lambda: len(front.replicas.statuses))
    log.info("replicas_ready", replicas=config.cluster.replicas, address=config.cluster.address,
             router=config.cluster.router)
    await serve_front(config, model, front, metrics, api=ClusterAPI(model, front, config, metrics),
                      handle_signals=handle_signals, task_status=task_status)
