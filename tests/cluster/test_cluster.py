"""`dflash cluster` on fake-engine replicas in a local Ray: routing, cancellation, a dying replica."""

from __future__ import annotations

import json
import os
import signal
from functools import partial

import httpx
import pytest
import trio

from dflash.cluster.app import serve_replicas
from dflash.engine.grammar import GrammarError
from dflash.sampling_params import SamplingParams
from tests.unit.conftest import wait_until
from tests.unit.fakes import fake_text

PROMPT = [65] * 100


def submit(front, conversation: str | None, max_tokens: int = 5, prompt=PROMPT):
    return front.submit(list(prompt), SamplingParams(), max_tokens, request_id=f"{conversation}-{trio.current_time()}",
                        conversation=conversation)


async def run_to_end(job) -> list:
    with job:
        await job.wait_started()
        steps = []
        while (step := await job.next_step()) is not None:
            steps.append(step)
        return steps


async def test_conversations_stay_on_their_replica_and_spread(front):
    homes: dict[str, set[str]] = {}
    for turn in range(3):
        for conversation in ("a", "b", "c", "d"):
            job = submit(front, conversation)
            steps = await run_to_end(job)
            assert steps[-1].finished == "length"
            homes.setdefault(conversation, set()).add(job.replica)
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert len(set.union(*homes.values())) == 2


async def test_without_a_key_a_shared_prefix_finds_its_replica(front):
    """The router reads the prompt from the job itself (the Route leaves it out)."""
    shared = list(range(200))
    first, second = submit(front, None, prompt=shared + [1]), submit(front, None, prompt=shared + [2, 3])
    await run_to_end(first)
    await run_to_end(second)
    assert first.replica == second.replica


async def test_an_overloaded_owner_hands_the_conversation_to_the_idle_replica(front):
    jobs = []
    for _ in range(3):  # imbalance_threshold = 1: the third is 2 past the idle replica
        jobs.append(submit(front, "busy", max_tokens=100_000))
        await wait_until(lambda: jobs[-1].replica is not None, timeout=10)
    try:
        assert jobs[0].replica == jobs[1].replica != jobs[2].replica
    finally:
        for job in jobs:
            job.cancel()
    await wait_until(lambda: front.state == "idle", timeout=10)


async def test_grammars_are_checked_by_a_replica(front):
    await front.check_grammar('start: "yes" | "no"')
    with pytest.raises(GrammarError, match="no start rule"):
        await front.check_grammar('stort: "yes" | "no"')


async def test_cancelling_reaches_the_replicas_engine(front):
    records = []
    front._on_job_end = records.append
    job = submit(front, "cancelled", max_tokens=100_000)
    with job:
        await job.wait_started()
        while not (await job.next_step()).tokens:
            pass  # through the prefill, into the decode
    began = trio.current_time()

    async def replicas_idle() -> bool:
        replicas = await front.poll_replicas()
        return all(status.state == "idle" for status in replicas.statuses.values())

    with trio.fail_after(5):
        while not await replicas_idle():
            await trio.sleep(0.02)
    assert trio.current_time() - began < 2  # the engine stopped at a step boundary, not at max_tokens
    await wait_until(lambda: records, timeout=5)
    assert records[0].outcome == "cancelled" and records[0].phase == "decode"


async def test_a_client_that_goes_away_stops_the_replicas_engine(fake_deployment, nursery):
    app = await nursery.start(partial(serve_replicas, fake_deployment.config, fake_deployment.handle,
                                      handle_signals=False, text_loader=lambda config, facts: fake_text(facts.max_ctx)))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}", timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if '"content"' in line:
                    break  # leaving the block closes the connection mid-stream
    began = trio.current_time()
    await wait_until(lambda: app.scheduler.state == "idle", timeout=5)
    with trio.fail_after(5):
        while any(status.state != "idle" for status in (await app.scheduler.poll_replicas()).statuses.values()):
            await trio.sleep(0.02)
    assert trio.current_time() - began < 2
    app.shutdown()


async def test_a_killed_replica_fails_its_requests_in_the_dialect_and_is_replaced(fake_deployment, nursery):
    config = fake_deployment.config
    app = await nursery.start(partial(serve_replicas, config, fake_deployment.handle, handle_signals=False,
                                      text_loader=lambda config, facts: fake_text(facts.max_ctx)))
    base = f"http://127.0.0.1:{app.port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        health = (await client.get("/health")).json()
        assert health == {"status": "ok", "replicas": 2, "expected": 2}
        status = (await client.get("/")).json()
        pids = {replica["replica"]: replica["pid"] for replica in status["replicas"]}
        assert len(pids) == 2 and status["replicas_expected"] == 2

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
        headers = {"session_id": "doomed"}
        anthropic_result = {}

        async def anthropic_request():
            response = await client.post("/v1/messages", headers=headers, json={
                "model": "m", "max_tokens": 100_000, "messages": [{"role": "user", "content": "hi"}]})
            anthropic_result["response"] = response

        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    break
            # The same conversation, so the same replica; it waits behind the stream.
            nursery.start_soon(anthropic_request)
            jobs = app.scheduler._jobs
            await wait_until(lambda: len(jobs) == 2 and all(job.replica for job in jobs), timeout=10)
            assert app.scheduler.queue_depth == 1
            (doomed,) = {job.replica for job in jobs}
            os.kill(pids[doomed], signal.SIGKILL)
            with trio.fail_after(30):  # never a hang
                rest = [line async for line in lines if line.startswith("data: ")]
        errors = [json.loads(line[6:]) for line in rest if line != "data: [DONE]" and '"error"' in line]
        assert errors and "replica failed" in errors[-1]["error"]["message"]
        await wait_until(lambda: "response" in anthropic_result, timeout=30)
        failed = anthropic_result["response"]
        assert failed.status_code == 500 and failed.json()["type"] == "error"

        async def replaced() -> bool:
            health = (await client.get("/health")).json()
            ids = {replica["replica"] for replica in (await client.get("/")).json()["replicas"]}
            return health["replicas"] == 2 and doomed not in ids

        with trio.fail_after(90):
            while not await replaced():
                await trio.sleep(0.5)
        again = await client.post("/v1/chat/completions", headers=headers,
                                  json={**body, "stream": False, "max_tokens": 3})
        assert again.status_code == 200
        metrics = (await client.get("/metrics")).text
        assert "dflash_replicas 2.0" in metrics
    app.shutdown()
