"""A Responses WebSocket client for tests: the `websockets` library (an implementation other than
the server's wsproto, so the two check each other), driven from trio through a worker thread."""

from __future__ import annotations

import json
from collections.abc import Sequence

import trio
from websockets.sync.client import ClientConnection, connect

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


class ResponsesClient:
    def __init__(self, connection: ClientConnection):
        self.connection = connection

    @classmethod
    async def open(cls, port: int, headers: Sequence[tuple[str, str]] = (), *, compression: str | None = "deflate",
                   max_size: int | None = 2**26) -> ResponsesClient:
        uri = f"ws://127.0.0.1:{port}/v1/responses"
        connection = await trio.to_thread.run_sync(
            lambda: connect(uri, additional_headers=list(headers), compression=compression, max_size=max_size,
                            open_timeout=10, proxy=None, legacy=True))
        return cls(connection)

    async def send(self, payload: dict | str) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        await trio.to_thread.run_sync(self.connection.send, text)

    async def receive(self, timeout: float = 10) -> dict:
        message = await trio.to_thread.run_sync(lambda: self.connection.recv(timeout=timeout))
        return json.loads(message)

    async def until_terminal(self, timeout: float = 10) -> list[dict]:
        """Every event up to and including the one that ends a response (or an error)."""
        events = []
        while not events or events[-1]["type"] not in TERMINAL:
            events.append(await self.receive(timeout))
        return events

    async def create(self, body: dict, timeout: float = 10) -> list[dict]:
        await self.send({"type": "response.create", **body})
        return await self.until_terminal(timeout)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.connection.close)

    def drop(self) -> None:
        """Gone without a Close frame, as an interrupted Codex turn is."""
        self.connection.socket.close()
