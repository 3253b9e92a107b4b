"""The cluster's scheduler as the HTTP front sees it: the single server's Scheduler interface,
with each job forwarded to an engine replica through a Ray Serve deployment handle.

reply.py and api.py drive a `RemoteJob` exactly as they drive a local `Job`: submit, wait for the
start, read steps, cancel by leaving `with job:`. Behind it a task streams the replica's items
over the handle (cluster/replica.py: Queued, Started, JobSteps, maybe EngineFailed, the JobRecord).
Leaving the job cancels that stream, which Serve turns into a cancellation of the replica's
`generate`, which cancels the replica's job: the engine stops at its next step. A replica that
dies breaks the stream with a Ray error, which fails the job with EngineFailed (the dialect's
500 error), never a hang; Serve starts a replacement.

Ray's handles are asyncio objects; from trio they are used through their blocking calls in
worker threads, one per stream read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

from dflash.cluster.replica import JobRequest, Queued, Refused, ReplicaStatus, Started
from dflash.cluster.router import Route
from dflash.engine import contract
from dflash.engine.grammar import GrammarError
from dflash.logs import get_logger
from dflash.sampling_params import SamplingParams
from dflash.scheduler import EngineFailed, JobRecord, JobStep, JobStream, QueueFull, ShuttingDown, job_progress

log = get_logger("dflash.cluster.front")
STATUS_TIMEOUT_S = 5.0  # a replica that cannot answer this fast is counted as down
STATUS_POLL_S = 2.0  # how fresh /metrics' cache gauges are
CONTROL_THREADS = 16  # status calls, grammar checks and turn checkpoints waiting at once


class RemoteJob(JobStream):
    """A job running on some replica, fed by the replica's stream (`_take`)."""

    def __init__(self, request: JobRequest):
        super().__init__(request.request_id, request.conversation)
        self.request = request
        self.replica: str | None = None  # where it waits and runs, once the replica has it
        self.last: JobStep | None = None
        self._stream_scope = trio.CancelScope()

    def _cancelled(self) -> None:
        if self.last is None or self.last.finished is None:
            # A finished job's stream is left to end by itself: its record is on the way.
            self._stream_scope.cancel()

    def _take(self, item: Any) -> None:
        """One item of the replica's stream."""
        if isinstance(item, Queued):
            self.replica = item.replica
        elif isinstance(item, Started):
            self._start()
        elif isinstance(item, JobStep):
            self.last = item
            self._deliver(item)
        elif isinstance(item, Refused):
            self._fail(ShuttingDown())
        elif isinstance(item, Exception):
            self._fail(item)

    @property
    def phase(self) -> str:
        if self.started_at is None:
            return "queued"
        return "decode" if self.last is not None and self.last.stats.generated_tokens else "prefill"


@attrs.define
class Replicas:
    """The replicas' last answers to `status`, by replica id, and how many there should be."""

    statuses: dict[str, ReplicaStatus] = attrs.field(factory=dict)
    expected: int = 0

    @property
    def cache_stats(self) -> contract.CacheStats:
        """The replicas' caches added up (for /metrics)."""
        tiers: dict[str, contract.CacheTier] = {}
        kv_tokens = kv_capacity = 0
        for status in self.statuses.values():
            kv_tokens += status.cache_stats.kv_tokens
            kv_capacity += status.cache_stats.kv_capacity
            for name, tier in status.cache_stats.tiers.items():
                total = tiers.get(name, contract.CacheTier())
                tiers[name] = contract.CacheTier(total.entries + tier.entries, total.bytes + tier.bytes,
                                                 total.hits + tier.hits)
        return contract.CacheStats(kv_tokens=kv_tokens, kv_capacity=kv_capacity, tiers=tiers)


class ClusterScheduler:
    """Scheduler-like front to the replicas: admission (server.queue_max per replica), the jobs'
    streams, turn checkpoints and grammar checks forwarded, and the replicas' status."""

    def __init__(self, handle: Any, replicas: int, *, queue_max: int,
                 on_job_end: Callable[[JobRecord], None] = lambda record: None):
        self._generate = handle.options(method_name="generate", stream=True)
        self._checkpoint = handle.options(method_name="checkpoint_turn")
        self._check_grammar = handle.options(method_name="check_grammar")
        self._status = handle.options(method_name="status")
        # What one server admits (one running, queue_max waiting), once per replica.
        self.capacity = replicas * (queue_max + 1)
        self.queue_max = queue_max
        self.replicas = Replicas(expected=replicas)
        self._on_job_end = on_job_end
        self._jobs: set[RemoteJob] = set()
        # A thread waits on each stream. Their own limiters, not trio's default one of 40
        # threads: a full queue of streams must not keep /health from asking the replicas.
        self._stream_threads = trio.CapacityLimiter(self.capacity)
        self._control_threads = trio.CapacityLimiter(CONTROL_THREADS)
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self._all_ended = trio.Event()

    # ---- what reply.py, api.py and app.py use ------------------------------------------------

    @property
    def state(self) -> str:
        return "busy" if self._jobs else "idle"

    @property
    def queue_depth(self) -> int:
        return sum(job.started_at is None for job in self._jobs)

    @property
    def running(self) -> int:
        return sum(job.started_at is not None for job in self._jobs)

    @property
    def cache_stats(self) -> contract.CacheStats:
        return self.replicas.cache_stats

    def running_jobs(self) -> list[dict]:
        """The jobs running on the replicas, as of each one's last step."""
        return [{**job_progress(job.request_id, len(job.request.prompt_ids), job.last.stats if job.last else None,
                                job.started_at), "replica": job.replica}
                for job in self._jobs if job.started_at is not None]

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, *, request_id: str = "",
               snapshot_at: tuple[int, ...] = (), top_logprobs: int | None = None,
               grammar: str | None = None, conversation: str | None = None,
               protected: tuple[tuple[int, int], ...] = ()) -> RemoteJob:
        if self._closed or self._nursery is None:
            raise ShuttingDown()
        if len(self._jobs) >= self.capacity:
            raise QueueFull(self.queue_max)
        job = RemoteJob(JobRequest(tuple(prompt_ids), sampling, max_tokens, request_id, tuple(snapshot_at),
                                    top_logprobs, grammar, conversation, tuple(protected)))
        self._jobs.add(job)
        self._nursery.start_soon(self._stream, job)
        return job

    async def check_grammar(self, grammar: str) -> None:
        problem = await self._call(self._check_grammar, grammar, route=Route(generation=False))
        if problem is not None:
            raise GrammarError(problem)

    def checkpoint_turn(self, job: RemoteJob, turn_ids: tuple[int, ...]) -> None:
        """Sent to the replica the job ran on; it runs there once the job is over."""
        if job.replica is not None and self._nursery is not None:
            self._nursery.start_soon(self._send_checkpoint, job, turn_ids)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._poll_status)
            await trio.sleep_forever()

    def close(self) -> None:
        self._closed = True
        for job in list(self._jobs):
            if job.started_at is None:
                job._fail(ShuttingDown())
                job.cancel("shutdown")

    def cancel_running(self) -> None:
        for job in list(self._jobs):
            job._fail(ShuttingDown())
            job.cancel("shutdown")

    async def wait_idle(self) -> None:
        while self._jobs:
            await self._all_ended.wait()

    async def poll_replicas(self) -> Replicas:
        """Ask every replica for its status now. Serve has no public list of a deployment's
        replicas, so status calls pin replica indexes 0..n-1 (the router sorts replica ids) and
        the answers are told apart by the replica id in them."""
        answers: dict[str, ReplicaStatus] = {}

        async def ask(index: int) -> None:
            with trio.move_on_after(STATUS_TIMEOUT_S):
                try:
                    status = await self._call(self._status, route=Route(pin=index, generation=False))
                except Exception as exc:
                    log.warning("replica_status_failed", index=index, error=str(exc))
                    return
                answers[status.replica] = status

        async with trio.open_nursery() as nursery:
            for index in range(self.replicas.expected):
                nursery.start_soon(ask, index)
        self.replicas = Replicas(answers, self.replicas.expected)
        return self.replicas

    # ---- behind the jobs ---------------------------------------------------------------------

    async def _stream(self, job: RemoteJob) -> None:
        route = Route(conversation=job.conversation)
        record: JobRecord | None = None
        stream = None
        try:
            with job._stream_scope:
                stream = self._generate.remote(job.request, route=route)
                while (item := await trio.to_thread.run_sync(_next_item, stream, abandon_on_cancel=True,
                                                             limiter=self._stream_threads)) is not None:
                    if isinstance(item, JobRecord):
                        record = item
                    else:
                        job._take(item)
        except Exception as exc:  # the replica died, or Serve could not reach one
            log.warning("replica_stream_failed", request_id=job.request_id, replica=job.replica, error=str(exc))
            job._fail(EngineFailed(f"the engine replica failed: {type(exc).__name__}"))
            record = JobRecord(job.request_id, "failed", job.phase, None, job.queue_ms / 1000,
                               job.last.stats if job.last else None)
        finally:
            if stream is not None and record is None:
                stream.cancel()  # Serve cancels the replica's generate: its job stops at the next step
            job._end()
            self._jobs.discard(job)
            if not self._jobs:
                self._all_ended.set()
                self._all_ended = trio.Event()
        if record is None:  # cancelled here before the replica's record came, or refused there
            reason = "shutdown" if isinstance(job._failure, ShuttingDown) else job.cancel_reason or "abandoned"
            record = JobRecord(job.request_id, "cancelled", job.phase, reason, job.queue_ms / 1000,
                               job.last.stats if job.last else None)
        try:
            self._on_job_end(record)
        except Exception:
            log.exception("job_record_failed", request_id=job.request_id)

    async def _send_checkpoint(self, job: RemoteJob, turn_ids: tuple[int, ...]) -> None:
        try:
            await self._call(self._checkpoint, job.request_id, turn_ids, route=Route(pin=job.replica, generation=False))
        except Exception as exc:
            log.warning("turn_checkpoint_failed", request_id=job.request_id, replica=job.replica, error=str(exc))

    async def _poll_status(self) -> None:
        while True:
            await self.poll_replicas()
            await trio.sleep(STATUS_POLL_S)

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        response = method.remote(*args, **kwargs)
        try:
            return await trio.to_thread.run_sync(response.result, abandon_on_cancel=True,
                                                 limiter=self._control_threads)
        except trio.Cancelled:
            response.cancel()
            raise


def _next_item(stream: Any) -> Any:
    """In a worker thread: the stream's next item, or None at its end."""
    try:
        return next(stream)
    except StopIteration:
        return None
