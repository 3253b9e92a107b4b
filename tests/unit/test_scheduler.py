"""The scheduler on its own: FIFO, queue limit, cancellation at step boundaries, failures, close."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import trio

from dflash.scheduler import EngineFailed, EngineWorker, QueueFull, Scheduler, ShuttingDown
from tests.unit.conftest import now, wait_until
from tests.unit.fakes import FakeEngine


@pytest.fixture
async def make_scheduler():
    # The scheduler tasks end before their worker threads stop, as in dflash.app.
    with ExitStack() as workers:
        async with trio.open_nursery() as nursery:
            def make(engine: FakeEngine, queue_max: int = 8) -> Scheduler:
                scheduler = Scheduler(engine, workers.enter_context(EngineWorker()), queue_max=queue_max)
                nursery.start_soon(scheduler.run)
                return scheduler

            yield make
            nursery.cancel_scope.cancel()


async def drain(job) -> list[int]:
    tokens = []
    while (step := await job.next_step()) is not None:
        tokens += step.tokens
    return tokens


async def test_jobs_run_one_at_a_time_in_arrival_order(make_scheduler):
    engine = FakeEngine(decode_step_s=0.005)
    scheduler = make_scheduler(engine)
    jobs = [scheduler.submit([index], None, 3) for index in range(3)]
    assert scheduler.state == "busy"
    for job in jobs:
        with job:
            assert len(await drain(job)) == 3
    assert [generation.prompt_ids for generation in engine.generations] == [[0], [1], [2]]
    await wait_until(lambda: scheduler.state == "idle")


async def test_queue_max_counts_the_jobs_waiting_behind_the_running_one(make_scheduler):
    scheduler = make_scheduler(FakeEngine(decode_step_s=0.05, endless=True), queue_max=2)
    running = scheduler.submit([1], None, 100)
    await running.wait_started()
    waiting = [scheduler.submit([2], None, 1), scheduler.submit([3], None, 1)]
    assert scheduler.queue_depth == 2
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        scheduler.submit([4], None, 1)
    for job in [running, *waiting]:
        job.cancel()


async def test_a_cancelled_queued_job_leaves_the_queue_and_never_runs(make_scheduler):
    engine = FakeEngine(decode_step_s=0.02, endless=True)
    scheduler = make_scheduler(engine)
    running = scheduler.submit([1], None, 20)
    queued = scheduler.submit([2], None, 20)
    await running.wait_started()
    queued.cancel()
    assert scheduler.queue_depth == 0
    assert await queued.next_step() is None
    with running:
        await drain(running)
    await wait_until(lambda: engine.idle)
    assert [generation.prompt_ids for generation in engine.generations] == [[1]]


async def test_a_cancelled_running_job_stops_at_the_next_step_and_frees_the_engine(make_scheduler):
    engine = FakeEngine(decode_step_s=0.05, endless=True)
    scheduler = make_scheduler(engine)
    with scheduler.submit([1], None, 10_000) as job:
        for _ in range(3):
            await job.next_step()
    cancelled_at = now()
    await wait_until(lambda: engine.idle, timeout=1)
    assert engine.generations[0].steps_started_after(cancelled_at) <= 1
    with scheduler.submit([2], None, 2) as job:
        assert len(await drain(job)) == 2


async def test_an_engine_error_fails_the_job_and_leaves_the_engine_ready(make_scheduler):
    engine = FakeEngine(fail_on_step=2)
    scheduler = make_scheduler(engine)
    with scheduler.submit([1], None, 10) as job:
        with pytest.raises(EngineFailed, match="fake engine failure"):
            await drain(job)
    engine.fail_on_step = None
    with scheduler.submit([2], None, 3) as job:
        assert len(await drain(job)) == 3
    assert all(generation.closed for generation in engine.generations)


async def test_close_refuses_new_jobs_fails_queued_ones_and_lets_the_running_one_finish(make_scheduler):
    engine = FakeEngine(decode_step_s=0.01)
    scheduler = make_scheduler(engine)
    running = scheduler.submit([1], None, 10)
    queued = scheduler.submit([2], None, 10)
    await running.wait_started()
    scheduler.close()
    with pytest.raises(ShuttingDown):
        await queued.wait_started()
    with pytest.raises(ShuttingDown):
        scheduler.submit([3], None, 1)
    with running:
        assert len(await drain(running)) == 10
    with trio.fail_after(1):
        await scheduler.wait_idle()
