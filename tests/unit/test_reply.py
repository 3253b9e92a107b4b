"""The reply pipeline without HTTP, as a WebSocket loop runs it: a parsed Responses request in,
the events the SSE stream carries out, batch by batch; failure events; a stored turn to continue."""

from __future__ import annotations

import json
from contextlib import aclosing

from dflash.chat.parser import new_call_id
from dflash.protocols import responses
from dflash.protocols.response_store import ResponseStore
from dflash.reply import Replies
from dflash.responses_turn import begin_turn
from tests.unit.conftest import wait_until
from tests.unit.fakes import REPLY, FakeEngine, fake_text
from tests.unit.test_scheduler import make_scheduler  # noqa: F401  (the fixture)


async def run_turn(replies: Replies, store: ResponseStore, body: dict) -> tuple[list[dict], str]:
    turn = begin_turn(store, responses.parse_request(json.dumps(body).encode()))
    reply = replies.prepare(turn.request.generation, call_id=new_call_id)
    render = turn.renderer(replies.model.model_id)
    with await replies.submit(reply) as first_job:
        async with aclosing(replies.streamed(reply, render, first_job)) as batches:
            payloads = [payload async for batch in batches for _, payload in batch]
    turn.store(store, render)
    return payloads, render.response_id


async def test_a_responses_turn_runs_without_http_and_a_later_one_continues_it(make_scheduler):  # noqa: F811
    engine = FakeEngine()
    replies = Replies(fake_text(engine.max_ctx), make_scheduler(engine))
    store = ResponseStore()
    events, response_id = await run_turn(replies, store, {"input": "hi", "stream": True})
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta") == REPLY
    assert store.get(response_id).body == events[-1]["response"]
    await run_turn(replies, store, {"input": "more", "previous_response_id": response_id})
    assert engine.generations[-1].prompt_ids[:len(engine.generations[0].prompt_ids)] \
        == engine.generations[0].prompt_ids  # the earlier turn is in the follow-up's prompt


async def test_a_failure_once_begun_ends_the_events_with_the_dialect_failure(make_scheduler):  # noqa: F811
    engine = FakeEngine(fail_on_step=3)
    replies = Replies(fake_text(engine.max_ctx), make_scheduler(engine))
    events, _ = await run_turn(replies, ResponseStore(), {"input": "hi"})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    # The failure reaches the client first; the scheduler closes the generation right after.
    await wait_until(lambda: engine.idle, timeout=2)
    assert all(generation.closed for generation in engine.generations)


async def test_leaving_the_iteration_early_cancels_the_job(make_scheduler):  # noqa: F811
    engine = FakeEngine(endless=True, decode_step_s=0.001)
    replies = Replies(fake_text(engine.max_ctx), make_scheduler(engine))
    turn = begin_turn(ResponseStore(), responses.parse_request(b'{"input": "hi", "max_output_tokens": 4000}'))
    reply = replies.prepare(turn.request.generation, call_id=new_call_id)
    render = turn.renderer("fake-model")
    with await replies.submit(reply) as first_job:
        async with aclosing(replies.streamed(reply, render, first_job)) as batches:
            async for batch in batches:
                if any(event["type"] == "response.output_text.delta" for _, event in batch):
                    break
    assert first_job.cancelled
