"""The keep-alive between a reply's events, on trio's autojump clock: when it goes out, and that
a numbered keep-alive never overtakes events rendered before it (no engine, no sockets)."""

from __future__ import annotations

import trio

from dflash.protocols import anthropic, responses
from dflash.protocols.canonical import Finished, TextDelta, Usage
from dflash.reply_stream import ReplyStream

KEEPALIVE_S = 15


class NumberingRender:
    """Numbers every event it renders, as Responses does; its keep-alive is an event too."""

    def __init__(self):
        self.numbered = 0
        self.finished = False

    def event(self, kind: str):
        event = (kind, {"type": kind, "sequence_number": self.numbered})
        self.numbered += 1
        return event

    def keepalive(self):
        return [] if self.finished else [self.event("keepalive")]


class SlowClient:
    """Takes `send_s` to accept each event (a slow reader, a full socket buffer)."""

    def __init__(self, send_s: float = 0.0):
        self.send_s = send_s
        self.received: list[tuple[float, dict]] = []
        self.comments: list[float] = []

    async def send(self, batch) -> None:
        for _, payload in batch:
            await trio.sleep(self.send_s)
            self.received.append((trio.current_time(), payload))

    async def comment(self) -> None:
        self.comments.append(trio.current_time())


async def run(render, client: SlowClient, batches) -> float:
    start = trio.current_time()
    await ReplyStream(render, client.send, KEEPALIVE_S, send_idle=client.comment).run(batches)
    return start


async def test_keep_alives_only_while_nothing_goes_out(autojump_clock):
    render, client = NumberingRender(), SlowClient()

    async def batches():
        await trio.sleep(40)  # queued, or one long prefill chunk: keep-alives at 15 and 30
        yield [render.event("created")]  # at 40
        for _ in range(5):  # events every 10 s: no keep-alive needed
            await trio.sleep(10)
            yield [render.event("delta")]
        await trio.sleep(20)  # silent again: one keep-alive, 15 s after the last event
        render.finished = True
        yield [render.event("completed")]

    start = await run(render, client, batches())
    kinds = [(round(at - start), payload["type"]) for at, payload in client.received]
    assert [at for at, kind in kinds if kind == "keepalive"] == [15, 30, 105]
    assert kinds[-1] == (110, "completed")


async def test_a_keep_alive_never_overtakes_a_batch_in_hand(autojump_clock):
    """The client reads slower than `keepalive_s`: a keep-alive due while a batch is being sent
    waits for the whole batch (and then is no longer due), so numbers arrive in order."""
    render, client = NumberingRender(), SlowClient(send_s=KEEPALIVE_S + 5)

    async def batches():
        yield [render.event("created"), render.event("in_progress")]
        await trio.sleep(KEEPALIVE_S * 3)  # a long prefill: keep-alives are due
        yield [render.event("delta"), render.event("delta"), render.event("delta")]
        render.finished = True
        yield [render.event("completed")]

    await run(render, client, batches())
    numbers = [payload["sequence_number"] for _, payload in client.received]
    assert numbers == sorted(numbers) == list(range(render.numbered))
    kinds = [payload["type"] for _, payload in client.received]
    assert kinds[:2] == ["created", "in_progress"] and "keepalive" in kinds
    assert kinds[-1] == "completed"  # nothing after the last batch, though a keep-alive was due during it


async def test_nothing_after_the_last_batch(autojump_clock):
    render, client = NumberingRender(), SlowClient(send_s=KEEPALIVE_S * 2)

    async def batches():
        yield [render.event("created")]
        yield [render.event("completed")]  # a keep-alive falls due while this one is sent

    await run(render, client, batches())
    assert [payload["type"] for _, payload in client.received] == ["created", "completed"]


async def test_a_dialect_without_a_keep_alive_event_gets_the_transport_idle_send(autojump_clock):
    render, client = NumberingRender(), SlowClient()
    render.finished = True  # keepalive() is []: queued, finished, or a dialect that has none

    async def batches():
        await trio.sleep(KEEPALIVE_S * 2 + 1)
        yield [render.event("chunk")]

    start = await run(render, client, batches())
    assert [round(at - start) for at in client.comments] == [15, 30]


def test_a_finished_response_has_no_in_progress_keep_alive():
    request = responses.parse_request(b'{"input": "hi", "stream": true}')
    render = responses.ResponseRender(request, model="m", created_at=0)
    assert render.keepalive() == []  # before response.created: a comment only
    render.opening()
    assert [name for name, _ in render.keepalive()] == ["response.in_progress"]
    render.events(Finished("stop", Usage(prompt_tokens=1, completion_tokens=1)))
    assert render.keepalive() == []


def test_a_finished_anthropic_message_keeps_alive_with_pings_only():
    render = anthropic.MessageRender("msg_1", "m", prompt_tokens=1)
    render.opening()
    render.events(TextDelta("hi"))
    assert [name for name, _ in render.keepalive()] == ["content_block_delta"]
    render.events(Finished("stop", Usage(prompt_tokens=1, completion_tokens=1)))
    assert render.keepalive() == [("ping", {"type": "ping"})]  # no block may open after message_delta
