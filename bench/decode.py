"""Prefill and decode speed of our engine next to transformers, on the same prompt and threads.

Prints one table: for each weight format (`--weights`, default fp32,bf16,int8,int4) and thread count
(`--threads`, default 1,2): prefill and plain greedy decode tok/s of our decoder, the cost of a
speculative verification forward (1 pending + 7 draft rows) over a 1-row decode step, the decode
limit implied by weight bytes / measured memory read bandwidth, and for fp32 and bf16 transformers
`generate` on the same prompt (`--no-transformers` skips it).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/decode.py [--threads 1,2] [--tokens 128]

With `--contexts 1024,8192,16384,32768` it prints instead our speed at those depths of context, for
each KV dtype in `--kv-dtypes` ("auto" = the one the engine picks for this CPU): one 256-token
prefill chunk and `--tokens` plain greedy decode steps, each attending to the whole context. The
context is filled cheaply and honestly for speed: 1024 tokens of real text (the standard library's
argparse.py) are prefilled once and their keys/values tiled to the depth; attention reads every row whatever it
holds, so a step costs what it costs after a real prefill of that length (the tokens it produces
are not meaningful).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402

PROMPT = (
    "Here is a Python module:\n\n"
    + "\n".join(f"def helper_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))
    + "\nExplain what these helpers do and suggest a cleaner design."
)


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Best-of-N read bandwidth: summing a 512 MiB fp32 tensor is bound by DRAM reads."""
    data = torch.ones(128 * 1024 * 1024)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def decode_weight_bytes(model) -> int:
    """Bytes one decode step reads: every weight once, the embedding table not at all (one row is
    looked up), except where it is tied to an unquantized LM head, which reads it whole. The prefill
    copy of int4 codes (`nibbles`) is not read while decoding."""
    head = getattr(model.lm_head, "weight", None)
    skip = {id(model.embed.weight)} - ({id(head)} if head is not None else set())
    total, seen = 0, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or id(t) in skip or name.endswith("nibbles") or name == "inv_freq":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def verification_ratio(engine, repeats: int = 15) -> float:
    """Best-of-N seconds of one forward over 1 pending + 7 draft rows, over one 1-row decode step,
    both appended after the committed tokens and rolled back."""
    base = engine.kv.length
    pending = engine.committed[-1:]

    def best(rows: list[int]) -> float:
        fastest = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            engine.forward(rows, logits_positions=None)
            fastest = min(fastest, time.perf_counter() - started)
            engine.rollback(base)
        return fastest

    return best(pending * 8) / best(pending)


def ours(source, weights, tokens, threads):
    loaded = load_model(source, weights=weights, max_ctx=4096, prefill_chunk=512, threads=threads)
    prompt_ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    engine = loaded.engine
    engine.eos_token_ids = frozenset()  # decode exactly `tokens` tokens
    engine.start(prompt_ids[:16], SamplingParams(), max_tokens=4).run()  # warm-up
    engine.rollback(0)
    generation = engine.start(prompt_ids, SamplingParams(), max_tokens=tokens)
    generation.run()
    s = generation.stats
    ratio = verification_ratio(engine)
    return len(prompt_ids) / (s.prefill_ms / 1000), (tokens - 1) / (s.decode_ms / 1000), ratio, loaded, prompt_ids


FILL_TOKENS = 1024
CHUNK_TOKENS = 256


def filled_to(engine, filler: list[int], depth: int) -> None:
    """Make the engine hold `depth` committed tokens: `filler` prefilled, its keys/values tiled."""
    prefilled = filler[:depth]
    engine.rollback(0)
    for start in range(0, len(prefilled), CHUNK_TOKENS):
        engine.forward(prefilled[start : start + CHUNK_TOKENS])
    kv = engine.kv
    for start in range(len(prefilled), depth, len(prefilled)):
        end = min(start + len(prefilled), depth)
        kv.keys[:, :, start:end] = kv.keys[:, :, : end - start]
        kv.values[:, :, start:end] = kv.values[:, :, : end - start]
        if kv.quantized:  # an int8 cache's scales, tiled alike
            kv.key_scales[:, :, start:end] = kv.key_scales[:, :, : end - start]
            kv.value_scales[:, :, start:end] = kv.value_scales[:, :, : end - start]
    kv.length = depth
    engine.prefix_reuse.committed[:] = (prefilled * (depth // len(prefilled) + 1))[:depth]


def speed_at_contexts(source, dtype, kv_dtypes, contexts, tokens, threads):
    """Rows (KV dtype, context, chunk prefill tok/s, decode tok/s) at each depth of context.
    `dtype`: bfloat16 or float32, or a weight format (bf16, fp32, int8, int4)."""
    max_ctx = max(contexts) + CHUNK_TOKENS + tokens + 1
    weights = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    loaded = load_model(source, weights=weights, max_ctx=max_ctx, prefill_chunk=CHUNK_TOKENS, threads=threads)
    engine = loaded.engine
    engine.eos_token_ids = frozenset()  # decode exactly `tokens` tokens
    text = loaded.tokenizer(Path(argparse.__file__).read_text())["input_ids"]
    filler, chunk = text[:FILL_TOKENS], text[FILL_TOKENS : FILL_TOKENS + CHUNK_TOKENS]
    rows = []
    for kv_name in kv_dtypes:
        kv_dtype = engine.model.kv_dtype if kv_name == "auto" else getattr(torch, kv_name)
        engine.kv = engine.prefix_reuse.kv = None  # free the previous cache before allocating the next
        engine.kv = engine.prefix_reuse.kv = engine.model.new_kv_cache(max_ctx, kv_dtype)
        engine.rollback(0)
        engine.start(filler[:16], SamplingParams(), max_tokens=4).run()  # warm-up
        for depth in contexts:
            filled_to(engine, filler, depth)
            generation = engine.start(engine.committed + chunk, SamplingParams(), max_tokens=tokens)
            generation.run()
            s = generation.stats
            label = f"{str(kv_dtype).removeprefix('torch.')}{' (auto)' if kv_name == 'auto' else ''}"
            rows.append((label, depth, s.prefilled_tokens / (s.prefill_ms / 1000), (tokens - 1) / (s.decode_ms / 1000)))
    return rows


def print_context_table(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    kind = cpu_kind()
    print(f"\ncpu={kind}  threads={args.threads}  decode tokens={args.tokens}  torch {torch.__version__}")
    header = ("cpu", "dtype", "KV dtype", "context", f"prefill ({CHUNK_TOKENS}-token chunk)", "decode")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for dtype in args.dtypes.split(","):
        for kv_dtype, depth, prefill, decode in speed_at_contexts(
            args.model, dtype, args.kv_dtypes.split(","), contexts, args.tokens, args.threads
        ):
            print(f"| {kind} | {dtype} | {kv_dtype} | {depth} | {prefill:.0f} tok/s | {decode:.1f} tok/s |", flush=True)


def transformers_speed(folder, dtype, prompt_ids, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids[:, :16], max_new_tokens=4, do_sample=False)  # warm-up
        started = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total_s = time.perf_counter() - started
    return len(prompt_ids) / prefill_s, (tokens - 1) / max(total_s - prefill_s, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--weights", default="fp32,bf16,int8,int4", help="weight formats (auto, fp32, bf16, int8, int4)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers columns")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="with --contexts: model dtypes or weight formats (bfloat16, float32, int8, int4)")
    parser.add_argument("--contexts", default="", help="e.g. 1024,8192,16384,32768: speed at these depths instead")
    parser.add_argument("--kv-dtypes", default="auto", help="with --contexts: auto, float32, bfloat16, int8")
    args = parser.parse_args()
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    if args.contexts:
        args.threads = thread_counts[-1]
        torch.set_num_threads(args.threads)
        print_context_table(args)
        return
    bandwidth = read_bandwidth_gbs()
    header = ("cpu", "weights", "threads", "prompt", "prefill ours", "decode ours", "verify 1+7 / 1 row",
              "limit", "% of limit", "prefill hf", "decode hf", "ours/hf")
    print(f"\ncpu={cpu_kind()}  decode tokens={args.tokens}  read bandwidth={bandwidth:.1f} GB/s  "
          f"torch {torch.__version__}  load {os.getloadavg()[0]:.2f}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for threads in thread_counts:
        for weights in args.weights.split(","):
            prefill, decode, ratio, loaded, prompt_ids = ours(args.model, weights, args.tokens, threads)
            limit = bandwidth * 1e9 / decode_weight_bytes(loaded.engine.model)
            hf = "| — | — | — |"
            if loaded.weights in ("fp32", "bf16") and not args.no_transformers:
                torch.set_num_threads(threads)
                hf_prefill, hf_decode = transformers_speed(loaded.folder, loaded.dtype, prompt_ids, args.tokens)
                hf = f"| {hf_prefill:.0f} tok/s | {hf_decode:.1f} tok/s | {decode / hf_decode:.2f}x |"
            name = loaded.weights + (" (auto)" if weights == "auto" else "")
            print(f"| {cpu_kind()} | {name} | {threads} | {len(prompt_ids)} | {prefill:.0f} tok/s | {decode:.1f} tok/s | "
                  f"{ratio:.2f}x | {limit:.0f} tok/s | {100 * decode / limit:.0f}% {hf}", flush=True)
            del loaded


if __name__ == "__main__":
    main()
