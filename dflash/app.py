"""One trio nursery: the engine scheduler and the HTTP server; signals; graceful drain.

Shutdown (SIGINT/SIGTERM or `App.shutdown`): stop accepting, answer queued jobs with 503, let
the running job finish within `shutdown_grace_s` (then stop it at its next step), give the
handlers a moment to write their last bytes, and return so the process exits 0. A second signal
skips the wait.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from functools import partial
import attrs
import trio

from dflash import __version__
from dflash.api import API, ROUTED_PATHS, build_info, exposure_warnings, error_response
from dflash.config import Config
from dflash.engine import contract
from dflash.http.server import HTTPServer, Limits
from dflash.logs import config_summary, get_logger
from dflash.metrics import Metrics
from dflash.reply import ModelText
from dflash.scheduler import EngineWorker, Scheduler

# After the running job is done or stopped, how long its handler may take to write the end.
LAST_WRITES_S = 2.0

log = get_logger("dflash.app")

# Config -> (engine, its text side). Runs in the engine thread.
ModelLoader = Callable[[Config], tuple[contract.Engine, ModelText]]


def load_served_model(full_config: Config) -> tuple[contract.Engine, ModelText]:
    # Imported here, not at the top: they pull in transformers and the model code, which a server
    # on a fake engine (unit tests, bench --fake) never needs.
    from dflash.chat.detokenize import IncrementalDetokenizer, token_bytes
    from dflash.chat.template import chat_template_for
    from dflash.engine.cpu import cpu_kind
    from dflash.engine.loading import load_model as load_engine_model, weights_format

    config, spec, cache = full_config.model, full_config.speculative, full_config.cache
    loaded = load_engine_model(
        config.source, dtype=config.dtype, weights=config.weights, kv_cache=config.kv_cache, max_ctx=config.max_ctx,
        threads=config.threads,
        rope_scaling=config.rope_scaling, rope_scaling_factor=config.rope_scaling_factor,
        rope_attention_factor=config.rope_attention_factor, rope_scaling_static=config.rope_scaling_static,
        prefill_chunk=config.prefill_chunk, cache_dir=os.path.expanduser(config.cache_dir),
        speculation=speculation_settings(spec),
        draft_model=spec.draft_model,
        prefix_cache_slots=cache.prefix_cache_slots, prefill_cache_slots=cache.prefill_cache_slots,
        cache_budget_mib=cache.memory_budget_mib,
        disk_cache_dir=os.path.expanduser(cache.disk_dir) if cache.disk_dir else None,
        disk_cache_mib=cache.disk_max_mib,
        agent_turn_cache=cache.agent_turn_cache,
        reuse_live_state=cache.reuse_live_state,
        compression=compression_settings(full_config.prefill),
    )
    text = ModelText(
        model_id=loaded.model_id,
        max_ctx=loaded.max_ctx,
        template=chat_template_for(loaded.tokenizer),
        new_detokenizer=partial(IncrementalDetokenizer, loaded.tokenizer),
        token_bytes=partial(token_bytes, loaded.tokenizer),
        vocab_size=loaded.engine.vocab_size,
        aliases=config.aliases,
        compresses_to_fit=full_config.prefill.compression != "off",
        weights_format=weights_format(config.source),
        weights=loaded.weights,
        kv_cache=loaded.kv_cache,
        cpu=cpu_kind(),
    )
    return loaded.engine, text


def speculation_settings(spec):
    """The engine's SpeculationConfig for the `[speculative]` table (`tree_rows = 0`: chains)."""
    from dflash.engine.speculative import SpeculationConfig

    return SpeculationConfig(drafter=spec.drafter, max_draft_tokens=spec.max_draft_tokens, ngram_min=spec.ngram_min,
                             ngram_max=spec.ngram_max, adaptive=spec.adaptive, tree_rows=spec.tree_rows)


def compression_settings(prefill):
    from dflash.engine.pflash import CompressionSettings

    return CompressionSettings(mode=prefill.compression, threshold_tokens=prefill.threshold_tokens,
                               keep_ratio=prefill.keep_ratio, chunk_tokens=prefill.chunk_tokens, scorer=prefill.scorer,
                               scorer_window=prefill.scorer_window)


def limits_of(config: Config) -> Limits:
    server = config.server
    return Limits(max_header_bytes=server.max_header_bytes, max_body_bytes=server.max_body_bytes,
                  header_timeout_s=server.header_timeout_s, body_timeout_s=server.body_timeout_s,
                  idle_timeout_s=server.idle_timeout_s)


@attrs.define(eq=False)
class App:
    """A running server: where it listens, and how to stop it."""

    config: Config
    port: int
    scheduler: Scheduler
    http: HTTPServer
    _shutdown_requested: trio.Event = attrs.field(factory=trio.Event)
    _drain_waits: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    def shutdown(self) -> None:
        """Begin the graceful drain; a second call skips its waits."""
        if self._shutdown_requested.is_set():
            self._drain_waits.cancel()
        self._shutdown_requested.set()

    async def _drain(self) -> None:
        log.info("shutting_down", running=self.scheduler.state == "busy", queued=self.scheduler.queue_depth)
        self.http.stop_accepting()
        self.scheduler.close()
        with self._drain_waits:
            with trio.move_on_after(self.config.server.shutdown_grace_s):
                await self.scheduler.wait_idle()
            self.scheduler.cancel_running()
            with trio.move_on_after(LAST_WRITES_S):
                await self.http.wait_no_requests()


async def serve(config: Config, *, loader: ModelLoader = load_served_model, handle_signals: bool = True,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, listen, serve until shutdown. `task_status.started` gets the App."""
    with EngineWorker() as worker:
        loading_began = time.perf_counter()
        engine, model = await worker.call(loader, config)
        metrics = Metrics(build=build_info(config, model), load_seconds=time.perf_counter() - loading_began,
                          endpoints=ROUTED_PATHS)
        scheduler = Scheduler(engine, worker, queue_max=config.server.queue_max, on_job_end=metrics.job_ended)
        await serve_front(config, model, scheduler, metrics, api=API(model, scheduler, config, metrics),
                          handle_signals=handle_signals, task_status=task_status)
        with trio.CancelScope(shield=True):  # snapshots still queued for the disk cache get written
            await worker.call(engine.close)
    log.info("stopped")


async def serve_front(config: Config, model: ModelText, scheduler: Scheduler, metrics: Metrics, *, api: API,
                      handle_signals: bool, task_status) -> None:
    """Run `scheduler` and the HTTP server until shutdown, then drain. Shared by `dflash run` and
    `dflash cluster`, whose scheduler forwards jobs to replicas (dflash/cluster/front.py)."""
    router = api.router()
    http = HTTPServer(router, limits_of(config), common_headers=router.common_headers,
                      error_response=error_response, on_request=metrics.request_done)
    metrics.watch(queued=lambda: scheduler.queue_depth, running=lambda: scheduler.running,
                  in_flight=lambda: http.active_requests, cache_stats=lambda: scheduler.cache_stats)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        listeners = await trio.open_tcp_listeners(config.server.port, host=config.server.host)
        await nursery.start(http.serve, listeners)
        port = listeners[0].socket.getsockname()[1]
        app = App(config=config, port=port, scheduler=scheduler, http=http)
        if handle_signals:
            nursery.start_soon(_shutdown_on_signals, app)
        log.info("started", version=__version__, model=model.model_id, source=config.model.source,
                 dtype=config.model.dtype, weights=model.weights, cpu=model.cpu,
                 listening=f"http://{config.server.host}:{port}",
                 config=config_summary(config))
        for warning in exposure_warnings(config.server):
            log.warning("exposed", message=warning)
        task_status.started(app)
        await app._shutdown_requested.wait()
        await app._drain()
        nursery.cancel_scope.cancel()


async def _shutdown_on_signals(app: App) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("signal", signal=signal.Signals(signum).name)
            app.shutdown()
