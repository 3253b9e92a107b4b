"""One engine replica of a cluster: the engine and its scheduler, behind a Ray Serve deployment.

The scheduler is the single-server one (dflash/scheduler.py), unchanged, on its own trio loop in
a thread of the replica: Serve calls the replica's methods on asyncio, and the scheduler's
cancellation at step boundaries, FIFO queue and turn checkpoints are trio code worth keeping
whole. The two loops meet in three places: submitting a job (a quick call into trio), the job's
items (trio pushes them onto an asyncio queue) and cancelling it (a call scheduled on trio).

A generation's stream is `Queued`, `Started`, its `JobStep`s, an `EngineFailed` if the engine
failed, and always last its `JobRecord`, so the front learns how the job ended and what it cost;
or `Refused` alone when the replica is shutting down.
When the front cancels the stream (its client went away), Serve cancels `generate` here and the
job stops at its next step.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from dflash import logs
from dflash.config import Config
from dflash.engine import contract
from dflash.engine.grammar import GrammarError
from dflash.logs import get_logger
from dflash.reply import ModelText
from dflash.sampling_params import SamplingParams
from dflash.scheduler import EngineFailed, EngineWorker, Job, JobRecord, Scheduler, ShuttingDown

log = get_logger("dflash.cluster.replica")
# The front admits jobs (server.queue_max per replica); a replica queues whatever it is sent,
# because the router, not the replica, decides where a job waits.
REPLICA_QUEUE_MAX = 1_000_000
RECENT_JOBS_KEPT = 64  # jobs a turn checkpoint may still name (it arrives just after its job ends)
# dflash.app's loader type, not imported from there: a replica has no use for the HTTP side.
ModelLoader = Callable[[Config], tuple[contract.Engine, ModelText]]


@attrs.frozen
class JobRequest:
    """What Scheduler.submit takes, as one picklable value."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    request_id: str
    snapshot_at: tuple[int, ...] = ()
    top_logprobs: int | None = None
    grammar: str | None = None
    conversation: str | None = None
    protected: tuple[tuple[int, int], ...] = ()  # prompt spans that prompt compression must keep


@attrs.frozen
class Queued:
    replica: str  # the replica's unique id: where its turn checkpoint must go


@attrs.frozen
class Refused:
    """The replica is shutting down (Serve is replacing or removing it): the front answers 503.
    A value rather than ShuttingDown itself, which does not survive pickling."""


@attrs.frozen
class Started:
    queue_ms: float  # in the replica's queue


@attrs.frozen
class ModelFacts:
    """What the front needs of the loaded model besides its tokenizer."""

    model_id: str
    max_ctx: int
    vocab_size: int
    weights_format: str


@attrs.frozen
class ReplicaStatus:
    replica: str
    node: str
    pid: int
    state: str  # "idle" or "busy"
    queue_depth: int
    running: int
    cache_stats: contract.CacheStats
    model: ModelFacts


class EngineReplica:
    """The class Serve deploys (see cluster/app.py); `config` and `loader` come pickled from the front."""

    def __init__(self, config: Config, loader: ModelLoader):
        from ray import serve

        logs.configure(config.logging.level, config.logging.format)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._config = config
        self._loader = loader
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._streams: dict[str, Callable[[Any], None]] = {}  # request id -> its push
        self._recent_jobs: OrderedDict[str, Job] = OrderedDict()  # request id -> job, newest last
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), name="dflash-replica", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure  # Serve reports the replica as failed to start, and retries it
        log.info("replica_ready", replica=self.replica_id, model=self.model.model_id)

    async def _serve(self) -> None:
        with EngineWorker() as worker:
            try:
                engine, text = await worker.call(self._loader, self._config)
            except BaseException as exc:
                self._failure = exc
                self._ready.set()
                return
            self.model = ModelFacts(text.model_id, text.max_ctx, text.vocab_size, text.weights_format)
            self.scheduler = Scheduler(engine, worker, queue_max=REPLICA_QUEUE_MAX, on_job_end=self._job_ended)
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.scheduler.run)
                self._ready.set()
                await self._stop.wait()
                self.scheduler.close()
                self.scheduler.cancel_running()
                await self.scheduler.wait_idle()
                nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await worker.call(engine.close)

    # ---- called by Serve, on asyncio ------------------------------------------------------

    async def generate(self, job: JobRequest, route: Any = None) -> AsyncIterator[Any]:
        """The job's stream (see the module doc). `route` is the router's, unused here."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()

        def push(item: Any) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        try:
            submitted = trio.from_thread.run_sync(self._submit, job, push, trio_token=self._token)
        except (ShuttingDown, trio.RunFinishedError):
            yield Refused()
            return
        try:
            while True:
                item = await items.get()
                yield item
                if isinstance(item, JobRecord):
                    return
        finally:
            try:
                self._token.run_sync_soon(submitted.cancel)  # a no-op for a job that has ended
            except trio.RunFinishedError:
                pass  # the replica is stopping; its jobs are over

    async def checkpoint_turn(self, request_id: str, turn_ids: tuple[int, ...], route: Any = None) -> None:
        trio.from_thread.run_sync(self._checkpoint_turn, request_id, turn_ids, trio_token=self._token)

    async def check_grammar(self, grammar: str, route: Any = None) -> str | None:
        """The grammar's problem, or None when it is valid (an error message travels more simply
        than an exception through Ray)."""
        try:
            await asyncio.to_thread(trio.from_thread.run, self.scheduler.check_grammar, grammar,
                                    trio_token=self._token)
        except GrammarError as exc:
            return str(exc)
        return None

    def check_health(self) -> None:
        """Serve calls this periodically: a replica whose engine loop has ended is replaced."""
        if not self._thread.is_alive():
            raise RuntimeError(f"replica {self.replica_id}: the engine loop has stopped")

    async def status(self, route: Any = None) -> ReplicaStatus:
        scheduler = self.scheduler
        return ReplicaStatus(replica=self.replica_id, node=socket.gethostname(), pid=os.getpid(),
                             state=scheduler.state, queue_depth=scheduler.queue_depth, running=scheduler.running,
                             cache_stats=scheduler.cache_stats, model=self.model)

    def __del__(self) -> None:
        # Serve's graceful shutdown: the running job stops at its next step, snapshots still
        # queued for the disk tier are written, then the thread ends.
        token = getattr(self, "_token", None)
        if token is not None:
            try:
                token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                return
            self._thread.join(timeout=30)

    # ---- on the replica's trio loop -------------------------------------------------------

    def _submit(self, request: JobRequest, push: Callable[[Any], None]) -> Job:
        job = self.scheduler.submit(list(request.prompt_ids), request.sampling, request.max_tokens,
                                    request_id=request.request_id, snapshot_at=request.snapshot_at,
                                    top_logprobs=request.top_logprobs, grammar=request.grammar,
                                    conversation=request.conversation, protected=request.protected)
        self._streams[job.request_id] = push
        push(Queued(self.replica_id))
        self._recent_jobs[job.request_id] = job
        if len(self._recent_jobs) > RECENT_JOBS_KEPT:
            self._recent_jobs.popitem(last=False)
        self._nursery.start_soon(self._pump, job, push)
        return job

    async def _pump(self, job: Job, push: Callable[[Any], None]) -> None:
        try:
            await job.wait_started()
            push(Started(job.queue_ms))
            while (step := await job.next_step()) is not None:
                push(step)
        except ShuttingDown:  # the record follows
            push(Refused())
        except EngineFailed as exc:
            push(exc)

    def _job_ended(self, record: JobRecord) -> None:
        push = self._streams.pop(record.request_id, None)
        if push is not None:
            push(record)

    def _checkpoint_turn(self, request_id: str, turn_ids: tuple[int, ...]) -> None:
        job = self._recent_jobs.get(request_id)
        if job is not None:
            self.scheduler.checkpoint_turn(job, turn_ids)
