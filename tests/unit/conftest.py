from __future__ import annotations

import time
from functools import partial

import attrs
import pytest
import trio

from dflash.app import App, serve
from dflash.config import Config, LoggingConfig, ModelConfig, ServerConfig
from tests.unit.fakes import FakeEngine, fake_loader

DEFAULT_LOGGING = LoggingConfig()


@attrs.frozen
class Served:
    app: App
    engine: FakeEngine

    @property
    def port(self) -> int:
        return self.app.port


@pytest.fixture
def start_server(nursery):
    """`await start_server(engine=..., **server_settings)` -> Served, on a free loopback port."""

    async def start(engine: FakeEngine | None = None, *, logging: LoggingConfig = DEFAULT_LOGGING,
                    **server_settings) -> Served:
        engine = engine or FakeEngine()
        config = Config(server=ServerConfig(port=0, **server_settings),
                        model=ModelConfig(max_ctx=engine.max_ctx), logging=logging)
        app = await nursery.start(partial(serve, config, loader=fake_loader(engine), handle_signals=False))
        return Served(app, engine)

    return start


async def wait_until(condition, timeout: float = 5.0, poll: float = 0.005) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(poll)


def now() -> float:
    """The fake engine's clock."""
    return time.monotonic()
