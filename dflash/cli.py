"""The `dflash` command. Each subcommand is a parser plus one function that returns the exit code.

    dflash run CONFIG.toml [--host HOST] [--port PORT] [--model SOURCE]
    dflash chat "PROMPT" [--model SOURCE] [--dtype bfloat16] [--weights auto] [--max-tokens N] [--threads N]
    dflash train-drafter --target MODEL --out DIR [--layers N] [--block-size B] [--steps N] [--resume] ...

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
    _add_train_drafter(commands)
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
    chat.add_argument("--weights", default=_MODEL_DEFAULTS.weights, choices=["auto", "bf16", "fp32", "int8", "int4"])
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
        loaded = load_model(args.model, dtype=args.dtype, weights=args.weights, threads=args.threads,
                            max_ctx=_MODEL_DEFAULTS.max_ctx)
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


def _add_train_drafter(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    train.add_argument("--target", default=_MODEL_DEFAULTS.source, help="the target model source")
    train.add_argument("--out", required=True, help="output folder (z-lab checkpoint layout + data + state)")
    train.add_argument("--layers", type=int, default=1, help="draft layers")
    train.add_argument("--block-size", type=int, default=8)
    train.add_argument("--target-layer-ids", type=lambda text: tuple(int(x) for x in text.split(",")),
                       help="comma-separated target layers to read (default: the reference rule)")
    train.add_argument("--prompts", help="a text file, one prompt per line (default: the built-in set)")
    train.add_argument("--prompt-count", type=int, default=400, help="prompts taken from the set")
    train.add_argument("--tokens", type=int, default=128, help="reply tokens the target generates per prompt")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--anchors", type=int, default=16, help="blocks per sample per step")
    train.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="target dtype")
    train.add_argument("--threads", type=int, default=_MODEL_DEFAULTS.threads)
    train.add_argument("--data-workers", type=int, default=1,
                       help="processes generating the data, sharing --threads (2 on a 2-core CPU is ~1.7x faster)")
    train.add_argument("--resume", action="store_true", help="continue from the folder's last checkpoint")
    train.set_defaults(handler=_train_drafter)


def _train_drafter(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    logs.configure("warning", "console")
    from dflash.engine.drafters.dflash import build_target_layer_ids
    from dflash.engine.loading import ModelLoadError, load_model
    from dflash.training.train_drafter import (
        TrainOptions,
        choose_mask_token,
        generate_data,
        generate_data_parallel,
        train,
    )
    from dflash.train_prompts import default_prompts

    try:
        loaded = load_model(args.target, dtype=args.dtype, threads=args.threads, max_ctx=_MODEL_DEFAULTS.max_ctx)
    except ModelLoadError as exc:
        print(f"dflash: {exc}", file=sys.stderr)
        return 2
    if args.prompts:
        prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = default_prompts(args.prompt_count)
    layer_ids = args.target_layer_ids or tuple(build_target_layer_ids(loaded.engine.model.args.num_layers, args.layers))
    out = Path(args.out)
    prompts = prompts[: args.prompt_count]
    if args.data_workers > 1:
        shards = generate_data_parallel(args.target, args.dtype, args.threads, _MODEL_DEFAULTS.max_ctx, prompts, out,
                                        layer_ids, args.tokens, args.data_workers)
    else:
        shards = generate_data(loaded, prompts, out, layer_ids, args.tokens)
    options = TrainOptions(layers=args.layers, block_size=args.block_size, target_layer_ids=layer_ids,
                           tokens_per_response=args.tokens, steps=args.steps, anchors=args.anchors)
    summary = train(loaded, shards, out, options, choose_mask_token(loaded.tokenizer), resume=args.resume)
    summary.pop("history")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
