"""Prefill and decode speed of our engine next to transformers, on the same prompt and threads.

Prints one table: prefill tok/s and decode tok/s for our decoder and transformers `generate` (fp32
and bf16), the ratio, and the decode limit implied by weight bytes / measured memory read bandwidth.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/decode.py [--threads 2] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.chat.template import render_prompt  # noqa: E402
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
    """Bytes one decode step reads: every weight once (a tied embedding is read once, by the LM head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def ours(source, dtype, tokens, threads):
    loaded = load_model(source, dtype=dtype, max_ctx=4096, prefill_chunk=512, threads=threads)
    prompt_ids = render_prompt(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    engine = loaded.engine
    engine.eos_token_ids = frozenset()  # decode exactly `tokens` tokens
    engine.start(prompt_ids[:16], SamplingParams(), max_tokens=4).run()  # warm-up
    engine.rollback(0)
    generation = engine.start(prompt_ids, SamplingParams(), max_tokens=tokens)
    generation.run()
    s = generation.stats
    return len(prompt_ids) / (s.prefill_ms / 1000), (tokens - 1) / (s.decode_ms / 1000), loaded, prompt_ids


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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs()
    rows = []
    for dtype in args.dtypes.split(","):
        our_prefill, our_decode, loaded, prompt_ids = ours(args.model, dtype, args.tokens, args.threads)
        torch.set_num_threads(args.threads)
        hf_prefill, hf_decode = transformers_speed(loaded.folder, dtype, prompt_ids, args.tokens)
        limit = bandwidth * 1e9 / decode_weight_bytes(loaded.engine.model)
        rows.append((dtype, len(prompt_ids), our_prefill, hf_prefill, our_decode, hf_decode, limit))
    print(f"\nthreads={args.threads}  decode tokens={args.tokens}  read bandwidth={bandwidth:.1f} GB/s  torch {torch.__version__}")
    header = ("dtype", "prompt", "prefill ours", "prefill hf", "decode ours", "decode hf", "ours/hf", "limit", "% of limit")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for dtype, n, op, hp, od, hd, limit in rows:
        print(f"| {dtype} | {n} | {op:.0f} tok/s | {hp:.0f} tok/s | {od:.1f} tok/s | {hd:.1f} tok/s | "
              f"{od / hd:.2f}x | {limit:.0f} tok/s | {100 * od / limit:.0f}% |")


if __name__ == "__main__":
    main()
