"""The `dflash` command. Each subcommand is a parser plus one function that returns the exit code.

    dflash run CONFIG.toml [--host HOST] [--port PORT] [--model SOURCE]
    dflash cluster CONFIG.toml [--host HOST] [--port PORT] [--model SOURCE]   (replicas on Ray Serve)
    dflash chat "PROMPT" [--model SOURCE] [--dtype bfloat16] [--weights auto] [--max-tokens N] [--threads N]
    dflash train-drafter --target MODEL --out DIR [--layers N] [--block-size B] [--steps N] [--resume] ...
    dflash cache ls [CONFIG.toml] [--disk-dir DIR]
    dflash cache clear [CONFIG.toml] [--disk-dir DIR]

Exit codes: 0 after a clean shutdown, 1 if the server failed, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from dflash import __version__, logs
from dflash.config import ConfigError, ModelConfig, load_config, with_overrides


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash", description="An LLM inference server for coding agents.")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    _add_cluster(commands)
    _add_chat(commands)
    _add_train_drafter(commands)
    _add_cache(commands)
    args = parser.parse_args(argv)
    return args.handler(args)


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="serve the model over HTTP until SIGINT/SIGTERM")
    run.add_argument("config", help="TOML config file (see examples/default.toml)")
    run.add_argument("--host", help="listen address; overrides server.host")
    run.add_argument("--port", type=int, help="listen port; overrides server.port")
    run.add_argument("--model", help="model source; overrides model.source")
    run.set_defaults(handler=_run)


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser("cluster", help="serve over HTTP in front of engine replicas on Ray Serve "
                                                  "([cluster] in the config; needs the `cluster` extra)")
    cluster.add_argument("config", help="TOML config file with a [cluster] table")
    cluster.add_argument("--host", help="listen address; overrides server.host")
    cluster.add_argument("--port", type=int, help="listen port; overrides server.port")
    cluster.add_argument("--model", help="model source; overrides model.source")
    cluster.set_defaults(handler=partial(_run, clustered=True))


def _run(args: argparse.Namespace, clustered: bool = False) -> int:
    try:
        config = with_overrides(load_config(args.config), host=args.host, port=args.port, model=args.model)
    except ConfigError as exc:
        print(f"dflash: config error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.logging.level, config.logging.format)
    # Imported after the config is known good: the server pulls in torch, which takes seconds.
    if clustered:
        try:
            from dflash.cluster.app import serve_cluster as serve
        except ImportError as exc:
            print(f"dflash: `dflash cluster` needs Ray Serve: pip install 'dflash[cluster]' ({exc})", file=sys.stderr)
            return 2
    else:
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
    train.add_argument("--out", required=True, help="output folder (z-lab checkpoint layout + data + state; data-runs.jsonl: "
                            "what each sitting's data stages made and how long they took)")
    train.add_argument("--layers", type=int, default=1, help="draft layers")
    train.add_argument("--block-size", type=int, default=8)
    train.add_argument("--target-layer-ids", type=lambda text: tuple(int(x) for x in text.split(",")),
                       help="comma-separated target layers to read (default: the reference rule)")
    train.add_argument("--prompts", help="a text file, one prompt per line (default: the built-in set)")
    train.add_argument("--prompt-count", type=int, default=400, help="prompts taken from the set")
    train.add_argument("--tokens", type=int, default=128, help="reply tokens the target generates per prompt")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--anchors", type=int, default=16, help="blocks per sample per step")
    train.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                       help="target dtype (auto: bfloat16 on CPUs with bf16 hardware, else float32)")
    train.add_argument("--threads", type=int, default=_MODEL_DEFAULTS.threads)
    train.add_argument("--data-workers", type=int, default=1,
                       help="processes generating the data, sharing --threads (2 on a 2-core CPU is ~1.7x faster)")
    train.add_argument("--reply-batch", type=int, default=0,
                       help="decode the replies N prompts at a time in one process (each matmul does N rows' work, "
                            "see README) instead of one prompt at a time per data worker; 0 = off")
    train.add_argument("--corpus-tokens", type=int, default=0,
                       help="teacher-forced tokens of offline text (standard-library sources, docs, agent turns) "
                            "to add to the reply data; 0 = none")
    train.add_argument("--corpus-mix", default="source=0.4,docs=0.2,agent=0.4", help="token shares of the corpus kinds")
    train.add_argument("--window", type=int, default=1024, help="tokens per teacher-forced window")
    train.add_argument("--reply-share", type=float, default=0.3,
                       help="share of training steps on reply data when corpus data exists too")
    train.add_argument("--learning-rate", type=float, default=6e-4)
    train.add_argument("--eval-every", type=int, default=0,
                       help="measure τ on the fixed unseen prompts every N steps (the curve goes to training.json)")
    train.add_argument("--eval-tokens", type=int, default=48, help="tokens decoded per unseen prompt when measuring τ")
    train.add_argument("--init-from-target-layers", type=lambda text: tuple(int(x) for x in text.split(",")),
                       help="comma-separated target layers, one per draft layer, whose weights start the draft "
                            "layers (default: random)")
    train.add_argument("--resume", action="store_true", help="continue from the folder's last checkpoint")
    train.set_defaults(handler=_train_drafter)


def _train_drafter(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    logs.configure("warning", "console")
    from dflash.engine.drafters.dflash import build_target_layer_ids
    from dflash.engine.loading import ModelLoadError, load_model
    from dflash.training.corpus import parse_mix
    from dflash.training.prompts import default_prompts
    from dflash.training.train_drafter import training_dtype

    args.dtype = training_dtype(args.dtype)
    try:
        mix = parse_mix(args.corpus_mix)
    except ValueError as exc:
        print(f"dflash: --corpus-mix: {exc}", file=sys.stderr)
        return 2
    try:
        loaded = load_model(args.target, dtype=args.dtype, threads=args.threads,
                            max_ctx=max(_MODEL_DEFAULTS.max_ctx, args.window))
    except ModelLoadError as exc:
        print(f"dflash: {exc}", file=sys.stderr)
        return 2
    if args.prompts:
        prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = default_prompts(args.prompt_count)
    layer_ids = args.target_layer_ids or tuple(build_target_layer_ids(loaded.engine.model.args.num_layers, args.layers))
    target_layers = loaded.engine.model.args.num_layers
    init = args.init_from_target_layers
    if init is not None and (len(init) != args.layers or not all(0 <= i < target_layers for i in init)):
        # Checked before the data stages, which can take hours.
        print(f"dflash: --init-from-target-layers {','.join(map(str, init))}: give {args.layers} target layers "
              f"(one per --layers), each from 0 to {target_layers - 1}", file=sys.stderr)
        return 2
    try:
        summary, data_runs = _make_data_and_train(args, loaded, prompts, layer_ids, mix)
    except ValueError as exc:  # bad data or settings found on the way (a prompt too long, mismatched shards)
        print(f"dflash: {exc}", file=sys.stderr)
        return 2
    summary.pop("history")
    print(json.dumps({**summary, "data_runs": data_runs}, indent=2))
    return 0


def _make_data_and_train(args: argparse.Namespace, loaded, prompts: list[str], layer_ids, mix) -> tuple[dict, list[dict]]:
    from dflash.training.teacher_forcing import prefill_data, prefill_data_parallel
    from dflash.training.train_drafter import (
        TrainOptions,
        choose_mask_token,
        generate_data,
        generate_data_parallel,
        train,
    )

    out = Path(args.out)
    prompts = prompts[: args.prompt_count]
    existing = set((out / "data").glob("*.pt"))
    started = time.perf_counter()
    if args.reply_batch > 0:
        from dflash.training.batched_replies import batched_reply_data

        shards = batched_reply_data(loaded, prompts, out, layer_ids, args.tokens, args.reply_batch)
    elif args.data_workers > 1:
        shards = generate_data_parallel(args.target, args.dtype, args.threads, _MODEL_DEFAULTS.max_ctx, prompts, out,
                                        layer_ids, args.tokens, args.data_workers)
    else:
        shards = generate_data(loaded, prompts, out, layer_ids, args.tokens)
    data_runs = [_record_data_run(out, "replies", [s for s in shards if s not in existing],
                                  time.perf_counter() - started, args)]
    if args.corpus_tokens > 0:
        started = time.perf_counter()
        if args.data_workers > 1:
            forced = prefill_data_parallel(args.target, args.dtype, None, args.threads, loaded.tokenizer, out,
                                           layer_ids, args.corpus_tokens, args.window, mix, args.data_workers)
        else:
            forced = prefill_data(loaded, out, layer_ids, args.corpus_tokens, args.window, mix)
        data_runs.append(_record_data_run(out, "teacher forcing", [s for s in forced if s not in existing],
                                          time.perf_counter() - started, args))
        shards += forced
    options = TrainOptions(layers=args.layers, block_size=args.block_size, target_layer_ids=layer_ids,
                           tokens_per_response=args.tokens, steps=args.steps, anchors=args.anchors,
                           learning_rate=args.learning_rate, reply_share=args.reply_share,
                           eval_every=args.eval_every, eval_tokens=args.eval_tokens,
                           init_from_target_layers=args.init_from_target_layers)
    summary = train(loaded, shards, out, options, choose_mask_token(loaded.tokenizer), resume=args.resume)
    return summary, data_runs


def _record_data_run(out: Path, stage: str, new_shards: list[Path], seconds: float, args: argparse.Namespace) -> dict:
    """What one data stage of `train-drafter` wrote this time (shards already there are not counted)
    and how long it took: printed, and appended to OUT/data-runs.jsonl, which keeps every sitting's."""
    import json

    from dflash.engine.cpu import cpu_kind
    from dflash.training.train_drafter import data_tally

    out.mkdir(parents=True, exist_ok=True)
    tally = data_tally(new_shards)
    made = tally["reply_tokens"] if stage == "replies" else tally["teacher_forced_tokens"]
    record = {"stage": stage, "shards": len(new_shards), **tally, "seconds": round(seconds, 2),
              "tokens_per_second": round(made / seconds, 1) if new_shards and seconds > 0 else None,
              "cpu": cpu_kind(), "threads": args.threads, "data_workers": args.data_workers,
              "reply_batch": args.reply_batch, "dtype": args.dtype}
    with (out / "data-runs.jsonl").open("a") as runs:
        runs.write(json.dumps(record) + "\n")
    print(f"{stage}: {len(new_shards)} new shards, {tally['prompt_tokens']} prompt + {tally['reply_tokens']} reply "
          f"+ {tally['teacher_forced_tokens']} teacher-forced tokens in {seconds:.1f} s "
          f"({record['tokens_per_second']} tok/s made)", flush=True)
    return record


def _add_cache(commands: argparse._SubParsersAction) -> None:
    cache = commands.add_parser("cache", help="list or remove the disk cache's snapshots (the server need not run)")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, handler, help_text in (("ls", _cache_ls, "list the snapshots: model, tokens, size, last use"),
                                     ("clear", _cache_clear, "remove every snapshot")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("config", nargs="?", help="TOML config file whose [cache] disk_dir names the folder")
        action.add_argument("--disk-dir", help="the disk cache folder; overrides the config's")
        action.set_defaults(handler=handler)


def _disk_dir(args: argparse.Namespace) -> Path | None:
    """The folder the arguments name, or None after printing why there is none."""
    if args.disk_dir:
        folder = args.disk_dir
    elif args.config:
        try:
            folder = load_config(args.config).cache.disk_dir
        except ConfigError as exc:
            print(f"dflash: config error: {exc}", file=sys.stderr)
            return None
        if not folder:
            print(f"dflash: {args.config} sets no [cache] disk_dir (the caches stay in memory); "
                  "pass --disk-dir DIR", file=sys.stderr)
            return None
    else:
        print("dflash: name the disk cache folder: --disk-dir DIR, or a config file with [cache] disk_dir",
              file=sys.stderr)
        return None
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        print(f"dflash: disk cache folder {str(path)!r} is not a folder", file=sys.stderr)
        return None
    return path


def _cache_ls(args: argparse.Namespace) -> int:
    from dflash.engine.disk_cache import stored_snapshots

    folder = _disk_dir(args)
    if folder is None:
        return 2
    if not folder.exists():
        print(f"{folder}: no snapshots (the folder does not exist yet)")
        return 0
    snapshots = stored_snapshots(folder)
    print(f"{folder}: {len(snapshots)} snapshots, {_size(sum(s.nbytes for s in snapshots))}")
    if snapshots:
        now = time.time()
        rows = [("MODEL", "DTYPE", "TOKENS", "SIZE", "LAST USED", "FILE")]
        rows += [(s.model or "-", s.dtype or "-", str(s.tokens) if s.problem is None else "-", _size(s.nbytes),
                  _age(now - s.last_used), s.path.name + (f"  (unreadable: {s.problem})" if s.problem else ""))
                 for s in snapshots]
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0


def _cache_clear(args: argparse.Namespace) -> int:
    from dflash.engine.disk_cache import remove_snapshots

    folder = _disk_dir(args)
    if folder is None:
        return 2
    removed, removed_bytes = remove_snapshots(folder)
    print(f"{folder}: removed {removed} snapshots, {_size(removed_bytes)}")
    return 0


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds // length}{unit} ago"
    return f"{seconds}s ago"


if __name__ == "__main__":
    sys.exit(main())
