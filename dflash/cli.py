"""The `dflash` command. Each subcommand is a parser plus one function that returns the exit code.

    dflash run CONFIG.toml [--host HOST] [--port PORT] [--model SOURCE]
    dflash chat "PROMPT" [--model SOURCE] [--dtype bfloat16] [--max-tokens N] [--threads N]

Exit codes: 0 after a clean shutdown, 1 if the server failed, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import trio

from dflash import __version__, logs
from dflash.config import ConfigError, ModelConfig, load_config, with_overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash", description="An LLM inference server for coding agents.")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    _add_chat(commands)
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


_MODEL_DEFAULTS = ModelConfig()


def _add_chat(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="print the model's greedy reply to one prompt, token by token")
    chat.add_argument("prompt")
    chat.add_argument("--model", default=_MODEL_DEFAULTS.source, help="model source (default: the embedded model)")
    chat.add_argument("--dtype", default=_MODEL_DEFAULTS.dtype, choices=["bfloat16", "float32"])
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--threads", type=int, default=_MODEL_DEFAULTS.threads)
    chat.set_defaults(handler=_chat)


def _chat(args: argparse.Namespace) -> int:
    logs.configure("warning", "console")
    from dflash.chat.detokenize import IncrementalDetokenizer
    from dflash.chat.template import render_prompt
    from dflash.engine.loading import ModelLoadError, load_model
    from dflash.engine.sampling import SamplingParams

    try:
        loaded = load_model(args.model, dtype=args.dtype, threads=args.threads, max_ctx=_MODEL_DEFAULTS.max_ctx)
    except ModelLoadError as exc:
        print(f"dflash: {exc}", file=sys.stderr)
        return 2
    prompt_ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": args.prompt}])
    generation = loaded.engine.start(prompt_ids, SamplingParams(), max_tokens=args.max_tokens)
    detokenizer = IncrementalDetokenizer(loaded.tokenizer)
    while generation.finished is None:
        sys.stdout.write(detokenizer.push(generation.step().tokens))
        sys.stdout.flush()
    sys.stdout.write(detokenizer.flush() + "\n")
    generation.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
