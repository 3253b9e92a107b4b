"""One reply's events on their way to a client, with the dialect's keep-alive between them.

While no event has gone out for `keepalive_s` (a job waiting in the queue, a long prefill, a slow
grammar) the stream sends the renderer's keep-alive: proxies and clients drop a silent
connection, and Codex and Claude Code count only events, not comments or pings.

A keep-alive is itself an event of the reply: Responses numbers it (`sequence_number`), Anthropic
may open a content block for it. So it is rendered only when every event rendered before it has
gone out, and sent under the same lock as the reply's own batches; otherwise a keep-alive rendered
while a batch was in hand would overtake it (sequence numbers out of order, a delta before its
block's start). The ticker runs on the clock, not on engine progress, because one prefill chunk
can outlast `keepalive_s`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from dflash.protocols.canonical import SSEEvent
from dflash.reply import Renderer

SendEvents = Callable[[list[SSEEvent]], Awaitable[None]]


async def _nothing() -> None:
    pass


class ReplyStream:
    def __init__(self, render: Renderer, send: SendEvents, keepalive_s: float, *,
                 send_idle: Callable[[], Awaitable[None]] = _nothing):
        self._render = render
        self._send = send
        self._send_idle = send_idle  # when the dialect has no keep-alive event now (SSE: a comment)
        self._keepalive_s = keepalive_s
        self._lock = trio.Lock()  # one send at a time, in the order the events were rendered
        self._holding = False  # a batch is rendered and not yet sent
        self._last_sent = trio.current_time()

    async def run(self, batches: AsyncIterator[list[SSEEvent]]) -> None:
        """Send every batch (Replies.streamed's), keeping the connection alive between them."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_alive)
            async for batch in batches:
                # Set before the first checkpoint after the batch was rendered, so the ticker
                # never renders a keep-alive that would number itself past an unsent batch.
                self._holding = True
                async with self._lock:
                    await self._send(batch)
                    self._last_sent = trio.current_time()
                    self._holding = False
            async with self._lock:  # the ticker is between sends: nothing goes out after the last batch
                nursery.cancel_scope.cancel()

    async def _keep_alive(self) -> None:
        while True:
            await trio.sleep_until(self._last_sent + self._keepalive_s)
            async with self._lock:
                # Holding: the batch goes out as soon as this lock is free (the main flow waits
                # for it) and moves `_last_sent`; no keep-alive is due then.
                if self._holding or trio.current_time() < self._last_sent + self._keepalive_s:
                    continue
                if keepalive := self._render.keepalive():
                    await self._send(keepalive)
                else:
                    await self._send_idle()
                self._last_sent = trio.current_time()
