"""structlog set-up: one JSON object per line for operators, or a console renderer for humans.

Logs carry numbers, never prompt or completion text, unless `[logging] log_text` is set: prompts
hold the user's code and secrets.
"""

from __future__ import annotations

import logging
import sys

import structlog

from dflash.config import Config


def configure(level: str = "info", fmt: str = "json") -> None:
    renderer = (
        structlog.dev.ConsoleRenderer()
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    # The console renderer prints tracebacks itself; JSON gets them as structured data.
    tracebacks = [] if fmt == "console" else [structlog.processors.dict_tracebacks]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    # A lazy proxy (binding would build the logger now): modules take their logger at import,
    # before `configure` has run. The key is not "logger", which get_logger reserves.
    return structlog.get_logger(component=name)


def config_summary(config: Config) -> dict:
    """The start-up line's view of the config: everything but the API keys themselves."""
    server = config.server
    return {
        "host": server.host,
        "port": server.port,
        "api_keys": len(server.api_keys),
        "cors_origins": list(server.cors_origins),
        "max_body_bytes": server.max_body_bytes,
        "header_timeout_s": server.header_timeout_s,
        "body_timeout_s": server.body_timeout_s,
        "idle_timeout_s": server.idle_timeout_s,
        "keepalive_s": server.keepalive_s,
        "queue_max": server.queue_max,
        "shutdown_grace_s": server.shutdown_grace_s,
        "max_ctx": config.model.max_ctx,
        "threads": config.model.threads,
        "prefill_chunk": config.model.prefill_chunk,
        "compression": config.prefill.compression,
        "log_text": config.logging.log_text,
    }
