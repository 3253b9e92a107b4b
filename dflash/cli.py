"""The `dflash` command. Each subcommand is a parser plus one function that returns the exit code.

    dflash run CONFIG.toml [--host HOST] [--port PORT] [--model SOURCE]

Exit codes: 0 after a clean shutdown, 1 if the server failed, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import trio

from dflash import __version__, logs
from dflash.config import ConfigError, load_config, with_overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash", description="An LLM inference server for coding agents.")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    args = parser.parse_args(argv)
    return args.handler(args)


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="serve the model over HTTP until SIGINT/SIGTERM")
    run.add_argument("config", help="TOML config file (see examples/default.toml)")
    run.add_argument("--host", help="listen address; overrides server.host")
    run.add_argument("--port", type=int, help="listen port; overrides server.port")
    run.add_argument("--model", help="model source; overrides model.source")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        config = with_overrides(load_config(args.config), host=args.host, port=args.port, model=args.model)
    except ConfigError as exc:
        print(f"dflash: config error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.logging.level, config.logging.format)
    # Imported after the config is known good: the server pulls in torch, which takes seconds.
    from dflash.app import serve

    try:
        trio.run(serve, config)
    except KeyboardInterrupt:  # before the signal handlers are installed (during the model load)
        return 130
    except Exception:
        logs.get_logger("dflash.cli").exception("server_failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
