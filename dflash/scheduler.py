"""The only code that touches the engine: FIFO jobs, one at a time, one bounded step at a time.

A handler submits a job and reads its steps. Leaving `with job:` for any reason (finished, stop
string, peer closed, write stalled, shutdown) cancels it: a queued job leaves the queue, a
running one stops at its next step boundary, where the scheduler closes the generation so the
engine is ready for the next job at once. Generation is never left half-closed because `close`
runs shielded in the same `finally` that ends every job.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from dflash.engine import contract
from dflash.logs import get_logger
from dflash.sampling_params import SamplingParams

log = get_logger("dflash.scheduler")
T = TypeVar("T")
# How long stopping the engine thread may wait for a step still running (after a forced stop).
JOIN_TIMEOUT_S = 30.0
MIN_LOGPROB = -9999.0  # OpenAI's floor for "practically impossible"


class QueueFull(Exception):
    def __init__(self, queue_max: int):
        super().__init__(f"the server is busy: {queue_max} requests are already waiting")


class ShuttingDown(Exception):
    def __init__(self):
        super().__init__("the server is shutting down")


class EngineFailed(Exception):
    """The engine raised; the job ends, and the generation was closed so the next job can run."""


class EngineWorker:
    """One long-lived OS thread that runs every engine call, from model loading on.

    A dedicated thread rather than `trio.to_thread.run_sync`: trio's thread cache runs each call on
    whichever idle thread it has, while torch keeps per-thread state (grad and inference mode, the
    current CUDA stream, OpenMP's thread count) and the KV cache wants a single owner. With one
    thread for the life of the process all of that stays put."""

    def __init__(self, name: str = "dflash-engine"):
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._stopped = False

    def __enter__(self) -> EngineWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        # Calls already queued still run, then the thread ends. Joined: a thread still alive when
        # the interpreter exits has torch's C++ state torn down under it, and the process aborts
        # ("terminate called without an active exception") instead of exiting 0.
        self._stopped = True
        self._calls.put(None)
        self._thread.join(timeout=JOIN_TIMEOUT_S)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            call()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the engine thread. Shielded: a step that has begun runs to its end;
        cancellation takes effect at the step boundary, which is the point of stepping."""
        if self._stopped:
            # Queued behind the stop, the call would never run and its shielded wait never end.
            raise RuntimeError(f"engine worker stopped; cannot run {fn!r}")
        trio_token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: T | None = None
        error: BaseException | None = None

        def run() -> None:
            nonlocal result, error
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, raised in its task
                error = exc
            try:
                trio_token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._calls.put(run)
        with trio.CancelScope(shield=True):
            await done.wait()
        if error is not None:
            raise error
        return result


@attrs.frozen
class TokenChoice:
    """A generated token's log-probability under the sampling distribution, and the best alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@attrs.frozen
class JobStep:
    tokens: list[int]  # committed in this step; empty for a prefill chunk
    finished: contract.FinishReason | None  # on the last step
    stats: contract.GenerationStats  # after this step (a copy)
    logprobs: list[TokenChoice] | None = None  # one per token in `tokens`, when the job asked for them


@attrs.frozen
class JobRecord:
    """How a job ended, for metrics: the numbers of its last step (None if it never ran)."""

    request_id: str
    outcome: str  # "finished", "cancelled" or "failed"
    phase: str  # where it was when it ended: "queued", "prefill" or "decode"
    cancel_reason: str | None  # "abandoned" (its handler left), "stop" (a stop string), "shutdown"
    queue_s: float
    stats: contract.GenerationStats | None


class JobStream:
    """A job as its reply handler sees it: queued, started, its steps, its end. Use as
    `with ... as job:` (leaving cancels it). Subclasses say what cancelling does (`_cancelled`):
    a local job leaves the scheduler's queue, a remote one (dflash.cluster) stops its stream."""

    def __init__(self, request_id: str, conversation: str | None):
        self.request_id = request_id
        self.conversation = conversation  # the client's session id, when it sent one (a cluster routes by it)
        self.queued_at = trio.current_time()
        self.started_at: float | None = None
        self.cancelled_at: float | None = None
        self.cancel_reason: str | None = None
        self._started = trio.Event()
        self._failure: Exception | None = None
        self._ended = False
        self._send, self._receive = trio.open_memory_channel[JobStep | Exception](math.inf)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()

    @property
    def cancelled(self) -> bool:
        return self.cancelled_at is not None

    @property
    def queue_ms(self) -> float:
        waited_until = self.started_at if self.started_at is not None else trio.current_time()
        return (waited_until - self.queued_at) * 1000

    def cancel(self, reason: str = "abandoned") -> None:
        """Idempotent. A queued job leaves the queue now; a running one stops at its next step.
        `reason`: "abandoned" (its handler left: client gone, write stalled), "stop" (the reply
        needs nothing more: a stop string), "shutdown"."""
        if self.cancelled_at is None:
            self.cancelled_at = trio.current_time()
            self.cancel_reason = reason
            self._cancelled()

    def _cancelled(self) -> None:
        raise NotImplementedError

    async def wait_started(self) -> None:
        """Return once the engine has taken the job; raise if it never will (shutdown)."""
        await self._started.wait()
        if self.started_at is None and self._failure is not None:
            raise self._failure

    async def next_step(self) -> JobStep | None:
        """The next step, or None after the last one."""
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def _start(self) -> None:
        self.started_at = trio.current_time()
        self._started.set()

    def _deliver(self, step: JobStep) -> None:
        if not self._ended and not self.cancelled:
            self._send.send_nowait(step)

    def _fail(self, failure: Exception) -> None:
        if not self._ended:
            self._failure = failure
            self._send.send_nowait(failure)
        self._end()

    def _end(self) -> None:
        self._ended = True
        self._started.set()  # nobody waits for a start that will not come
        self._send.close()


class Job(JobStream):
    """One request's generation in this process's scheduler, queued or running."""

    def __init__(self, scheduler: Scheduler, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                 request_id: str, snapshot_at: tuple[int, ...] = (), top_logprobs: int | None = None,
                 grammar: str | None = None, conversation: str | None = None,
                 protected: tuple[tuple[int, int], ...] = ()):
        super().__init__(request_id, conversation)
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.snapshot_at = snapshot_at  # message boundaries, where the engine keeps prefix-cache snapshots
        self.top_logprobs = top_logprobs  # None: no logprobs; n: each token's and the n best alternatives
        self.grammar = grammar  # an llguidance grammar the output must follow (checked by check_grammar)
        self.protected = protected  # prompt token spans that prompt compression must keep
        self.progress: contract.GenerationStats | None = None  # as of the last step taken
        self._scheduler = scheduler

    def _cancelled(self) -> None:
        self._scheduler._forget(self)


class Scheduler:
    def __init__(self, engine: contract.Engine, worker: EngineWorker, *, queue_max: int,
                 on_job_end: Callable[[JobRecord], None] = lambda record: None):
        self._engine = engine
        self._worker = worker
        self.queue_max = queue_max
        self._on_job_end = on_job_end
        # The engine's caches as of the last job's end (read in the engine thread, between steps).
        self.cache_stats = contract.CacheStats()
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self._job_arrived = trio.Event()
        self._job_ended = trio.Event()
        # The job whose tokens the engine's live state still holds, and a turn checkpoint asked for.
        self._live_job: Job | None = None
        self._checkpoint: tuple[Job, tuple[int, ...]] | None = None

    @property
    def state(self) -> str:
        return "busy" if self._running is not None or self._queue else "idle"

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    def running_jobs(self) -> list[dict]:
        """Where the running job stands (none or one), for operators watching a long prefill."""
        job = self._running
        if job is None:
            return []
        return [job_progress(job.request_id, len(job.prompt_ids), job.progress, job.started_at or job.queued_at)]

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int, *, request_id: str = "",
               snapshot_at: tuple[int, ...] = (), top_logprobs: int | None = None,
               grammar: str | None = None, conversation: str | None = None,
               protected: tuple[tuple[int, int], ...] = ()) -> Job:
        """Queue a job; raise QueueFull or ShuttingDown at once rather than make the client wait."""
        if self._closed:
            raise ShuttingDown()
        # queue_max counts jobs waiting behind a running one; when idle, the head of the queue is
        # about to run and is not waiting.
        waiting = len(self._queue) - (0 if self._running is not None else 1)
        if waiting >= self.queue_max:
            raise QueueFull(self.queue_max)
        job = Job(self, prompt_ids, sampling, max_tokens, request_id, snapshot_at, top_logprobs, grammar, conversation,
                  protected)
        self._queue.append(job)
        self._job_arrived.set()
        return job

    async def check_grammar(self, grammar: str) -> None:
        """Raise the engine's GrammarError if `grammar` is invalid or unsupported. In the engine
        thread, between two steps of a running job: the first check builds the tokenizer's grammar
        tables (about a second), which must not stall the event loop's other streams."""
        await self._worker.call(lambda: self._engine.grammar_tokenizer().validate(grammar))

    def checkpoint_turn(self, job: Job, turn_ids: tuple[int, ...]) -> None:
        """Agent turn cache: once `job` (a tool-call reply) is over, and if no other job has run
        since, have the engine hold `turn_ids` (the prompt plus the generated turn as the next
        request will render it) and keep a snapshot. Done between jobs; a job that arrives first
        takes precedence."""
        self._checkpoint = (job, turn_ids)
        self._job_arrived.set()

    async def _run_checkpoint(self) -> None:
        job, turn_ids = self._checkpoint
        self._checkpoint = None
        if self._live_job is not job or not turn_ids:
            return
        try:
            await self._worker.call(self._engine.checkpoint_prefix, list(turn_ids))
        except Exception:
            log.exception("turn_checkpoint_failed", request_id=job.request_id)
        await self._read_cache_stats()

    async def _read_cache_stats(self) -> None:
        try:
            self.cache_stats = await self._worker.call(self._engine.cache_stats)
        except Exception:
            log.exception("cache_stats_failed")

    async def run(self) -> None:
        await self._read_cache_stats()
        while True:
            job = await self._next_job()
            if job is None:
                await self._run_checkpoint()
                continue
            self._live_job = None
            self._running = job
            try:
                await self._run_job(job)
            finally:
                self._running = None
                self._job_ended.set()
                self._job_ended = trio.Event()

    def close(self) -> None:
        """Refuse new jobs and answer every queued one with ShuttingDown; the running one goes on."""
        self._closed = True
        while self._queue:
            job = self._queue.popleft()
            job._fail(ShuttingDown())
            self._ended(job, "cancelled", "queued", None, reason="shutdown")

    def cancel_running(self) -> None:
        """Past the shutdown grace: stop the running job at its next step, telling its handler why."""
        job = self._running
        if job is not None:
            job._fail(ShuttingDown())
            job.cancel("shutdown")

    async def wait_idle(self) -> None:
        while self._running is not None:
            await self._job_ended.wait()

    def _forget(self, job: Job) -> None:
        if job in self._queue:
            self._queue.remove(job)
            job._end()
            log.info("job_cancelled", request_id=job.request_id, queued=True, stop_ms=0.0, reason=job.cancel_reason)
            self._ended(job, "cancelled", "queued", None)

    def _ended(self, job: Job, outcome: str, phase: str, stats: contract.GenerationStats | None, *,
               reason: str | None = None) -> None:
        record = JobRecord(request_id=job.request_id, outcome=outcome, phase=phase,
                           cancel_reason=(reason or job.cancel_reason) if outcome == "cancelled" else None,
                           queue_s=job.queue_ms / 1000, stats=stats)
        try:
            self._on_job_end(record)
        except Exception:
            log.exception("job_record_failed", request_id=job.request_id)

    async def _next_job(self) -> Job | None:
        """The next queued job, or None when only a turn checkpoint is waiting."""
        while not self._queue and self._checkpoint is None:
            self._job_arrived = trio.Event()
            await self._job_arrived.wait()
        if self._queue:
            self._checkpoint = None  # the engine's live state goes to the new job
            return self._queue.popleft()
        return None

    def _start_generation(self, job: Job) -> contract.Generation:
        """In the engine thread."""
        generation = self._engine.start(job.prompt_ids, job.sampling, job.max_tokens, snapshot_at=job.snapshot_at,
                                        grammar=job.grammar, protected=job.protected)
        if job.top_logprobs is not None:
            generation.sampler = LogprobRecorder(generation.sampler, job.top_logprobs)
        return generation

    async def _run_job(self, job: Job) -> None:
        job._start()
        try:
            generation = await self._worker.call(self._start_generation, job)
        except Exception as exc:
            log.exception("engine_start_failed", request_id=job.request_id)
            job._fail(EngineFailed(f"the engine could not start the generation: {exc}"))
            self._ended(job, "failed", "prefill", None)
            return
        finished = failed = False
        last: JobStep | None = None
        try:
            while not job.cancelled and not finished:
                last = await self._worker.call(_take_step, generation)
                job.progress = last.stats
                job._deliver(last)
                finished = last.finished is not None
        except Exception as exc:
            failed = True
            log.exception("engine_step_failed", request_id=job.request_id)
            job._fail(EngineFailed(f"generation failed: {exc}"))
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._worker.call(generation.close)
                except Exception:
                    log.exception("engine_close_failed", request_id=job.request_id)
            self._live_job = job
            job._end()
            if job.cancelled and not finished:
                # The number operators (and bench/stress_cancel.py) watch: cancel -> engine ready.
                log.info("job_cancelled", request_id=job.request_id, queued=False,
                         stop_ms=round((trio.current_time() - job.cancelled_at) * 1000, 1), reason=job.cancel_reason)
            stats = last.stats if last is not None else None
            phase = "decode" if stats is not None and stats.generated_tokens else "prefill"
            outcome = "failed" if failed else "finished" if finished or not job.cancelled else "cancelled"
            self._ended(job, outcome, phase, stats)
        await self._read_cache_stats()


def job_progress(request_id: str, prompt_tokens: int, stats: contract.GenerationStats | None,
                 started_at: float) -> dict:
    """A running job's numbers as of its last step (an entry of `running` on GET /)."""
    stats = stats or contract.GenerationStats()
    return {"request_id": request_id, "prompt_tokens": prompt_tokens, "cached_tokens": stats.cached_tokens,
            "prefilled_tokens": stats.prefilled_tokens, "generated_tokens": stats.generated_tokens,
            "running_s": round(trio.current_time() - started_at, 3)}


def _take_step(generation: contract.Generation) -> JobStep:
    """In the engine thread: one step, and a copy of the stats taken before the next step moves them."""
    output = generation.step()
    tokens = list(output.tokens)
    recorder = generation.sampler if isinstance(generation.sampler, LogprobRecorder) else None
    # The recorder saw every sampled token, an end-of-sequence one too, which is not in `tokens`.
    logprobs = recorder.take()[:len(tokens)] if recorder is not None else None
    return JobStep(tokens=tokens, finished=output.finished, stats=copy.deepcopy(generation.stats), logprobs=logprobs)


class LogprobRecorder:
    """Stands in for a generation's sampler and records, for each token it samples, the token's
    log-probability under the distribution it was drawn from (after penalties, top-k, temperature
    and top-p; at temperature 0, the softmax of the processed logits) and the best alternatives.

    The engine's step output carries no probabilities, so they are taken here, at the one call
    every sampled token passes through: prefill's last chunk, plain decode and each position a
    speculative step verifies all go through `sample`, in order."""

    def __init__(self, sampler: contract.TokenSampler, top: int):
        self._sampler = sampler
        self._top = top
        self._recorded: list[TokenChoice] = []

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)

    def sample(self, logits, history) -> int:
        import torch

        token = self._sampler.sample(logits, history)
        processed = self._sampler.process(logits, history)
        if self._sampler.params.greedy:
            logprobs = torch.log_softmax(processed.float(), dim=-1)
        else:
            logprobs = torch.log(self._sampler.probabilities(processed).float())
        # A token the distribution excludes has log-probability -inf, which JSON cannot carry.
        logprobs = logprobs.clamp(min=MIN_LOGPROB)
        top = torch.topk(logprobs, self._top) if self._top else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        self._recorded.append(TokenChoice(token, float(logprobs[token]), alternatives))
        return token

    def take(self) -> list[TokenChoice]:
        recorded, self._recorded = self._recorded, []
        return recorded

