"""The real server (`dflash.app.serve`) in a thread of the test process, on a free loopback port.

In-process rather than a `dflash run` subprocess (conftest.py) so that a test can read what the
server did: the engine object it was given (the scripted engine records every prompt) and the
server's log events, captured as dicts instead of printed.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from functools import partial

import attrs
import structlog
import trio

from dflash.app import App, ModelLoader, serve
from dflash.config import Config, ModelConfig, ServerConfig

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


@attrs.frozen
class ThreadServer:
    app: App
    log: list[dict]  # every log event of the server so far (structlog's event dicts)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.app.port}"

    def requests(self, path: str | None = None) -> list[dict]:
        """The server's request log lines, of one path if given (the query string is not part of it)."""
        return [event for event in self.log
                if event["event"] == "request" and (path is None or event.get("path") == path)]


@contextlib.contextmanager
def serving(loader: ModelLoader, max_ctx: int) -> Iterator[ThreadServer]:
    config = Config(server=ServerConfig(host="127.0.0.1", port=0), model=ModelConfig(max_ctx=max_ctx))
    started: queue.Queue = queue.Queue()
    with structlog.testing.capture_logs() as log:
        thread = threading.Thread(target=_run, args=(config, loader, started), name="dflash-test-server", daemon=True)
        thread.start()
        outcome = started.get(timeout=START_TIMEOUT_S)
        if isinstance(outcome, BaseException):
            raise RuntimeError("the server did not start") from outcome
        app, trio_token = outcome
        try:
            yield ThreadServer(app, log)
        finally:
            trio.from_thread.run_sync(app.shutdown, trio_token=trio_token)
            thread.join(STOP_TIMEOUT_S)
    if thread.is_alive():
        raise RuntimeError(f"the server thread did not stop within {STOP_TIMEOUT_S}s")


def _run(config: Config, loader: ModelLoader, started: queue.Queue) -> None:
    try:
        trio.run(_serve_and_report, config, loader, started)
    except BaseException as exc:  # handed to the test thread, which is waiting for the start
        started.put(exc)


async def _serve_and_report(config: Config, loader: ModelLoader, started: queue.Queue) -> None:
    async with trio.open_nursery() as nursery:
        app = await nursery.start(partial(serve, config, loader=loader, handle_signals=False))
        started.put((app, trio.lowlevel.current_trio_token()))
