"""Our engine next to transformers and llama.cpp: decode and prefill tok/s, same model, same prompts.

For each thread count (`--threads`, default 1,2) one table row per runner:

- ours, per weight format (`--weights`, default bf16,int8,int4; `load_model(..., weights=...)`),
  plain greedy decode and, with `--ngram` (default on), greedy decode with the n-gram drafter;
- transformers (bf16, the dequantized folder our loader makes from the GGUF, as bench/decode.py);
- llama.cpp (llama-cpp-python) on the SAME GGUF file the embedded model is read from (Q4_1 layers,
  Q8_0 tied embedding), in a subprocess with its own cached interpreter and our environment
  (OMP_WAIT_POLICY=PASSIVE like ours; llama.cpp's ggml uses OpenMP too), llama-cpp-python's
  defaults otherwise (n_batch 512, flash attention off: `--llama-flash-attn` turns it on).

Every runner gets the same token ids (our tokenizer, chat template applied): decode is `--tokens`
greedy tokens after the short prompt (end-of-sequence ignored), prefill is one forward over a ~2K-token
prompt (the standard library's argparse.py, `--prefill-tokens`), timed alone, best of `--repeats`.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/peers.py [--threads 1,2] [--tokens 128]
    .venv/bin/python bench/peers.py --build-llama-cpp      # once per machine (~15 min on 2 cores)

`make bench-peers` does both. llama.cpp is built from llama-cpp-python's SOURCE distribution into
~/.cache/dflash-bench-peers/<version>-<instruction sets>/venv (never into .venv), with explicit
instruction sets instead of -march=native (a native build crashed with "Illegal instruction" on an
AMX VM): AVX2+FMA+F16C+BMI2 always, AVX512 (F/BW/DQ/VL/CD), VBMI, VNNI, BF16 and AVX-VNNI only
where /proc/cpuinfo lists them, AMX never. The folder name carries the instruction sets, so a home
folder shared by an AVX2 and an AVX512 machine keeps one build per kind and never runs the wrong one.
Without a build the llama.cpp rows say how to make one and the other rows still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

LLAMA_CPP_VERSION = "0.3.36"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-bench-peers"

# (cpuinfo flags that must all be present, CMake option) beyond the AVX2 baseline.
OPTIONAL_ISAS = (
    (("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"), "GGML_AVX512"),
    (("avx512f", "avx512vbmi"), "GGML_AVX512_VBMI"),
    (("avx512f", "avx512_vnni"), "GGML_AVX512_VNNI"),
    (("avx512f", "avx512_bf16"), "GGML_AVX512_BF16"),
    (("avx_vnni",), "GGML_AVX_VNNI"),
)
BASELINE = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")
BASELINE_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


def isa_options(flags: frozenset[str]) -> list[str]:
    """The GGML_* instruction-set options to turn on for a CPU with these flags."""
    return list(BASELINE) + [option for needed, option in OPTIONAL_ISAS if all(f in flags for f in needed)]


def cache_dir(flags: frozenset[str]) -> Path:
    extras = [o.removeprefix("GGML_").lower() for o in isa_options(flags) if o not in BASELINE]
    return CACHE_ROOT / "-".join([f"llama-cpp-python-{LLAMA_CPP_VERSION}", "avx2", *extras])


def cmake_args(flags: frozenset[str]) -> str:
    on = isa_options(flags)
    off = [o for _, o in OPTIONAL_ISAS if o not in on] + ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]
    args = ["-DGGML_NATIVE=OFF", *(f"-D{o}=ON" for o in on), *(f"-D{o}=OFF" for o in off),
            "-DGGML_BLAS=OFF", "-DLLAVA_BUILD=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    return " ".join(args)


def build_llama_cpp() -> int:
    """Build llama-cpp-python from source into this machine's cache folder (a venv of its own)."""
    flags = cpu_flags()
    missing = [f for f in BASELINE_FLAGS if f not in flags]
    if missing:
        print(f"this CPU lacks {', '.join(missing)}: the llama.cpp build needs AVX2, FMA, F16C and BMI2")
        return 1
    folder = cache_dir(flags)
    python = folder / "venv" / "bin" / "python"
    if (folder / "built.json").is_file() and python.is_file():
        print(f"llama.cpp already built: {folder}")
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    if not python.is_file():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(folder / "venv")], check=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args(flags), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    command = [str(python), "-m", "pip", "install", "-v", "--no-cache-dir", "--no-binary", "llama-cpp-python",
               f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
    log = folder / "build.log"
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source into {folder}\n"
          f"  CMAKE_ARGS={env['CMAKE_ARGS']}\n  log: {log}", flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        out.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\n$ {shlex.join(command)}\n")
        out.flush()
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if code != 0:
        print(f"build failed after {seconds:.0f} s (exit {code}); see {log}")
        return code
    (folder / "built.json").write_text(json.dumps(
        {"version": LLAMA_CPP_VERSION, "cmake_args": env["CMAKE_ARGS"], "seconds": round(seconds)}))
    print(f"built in {seconds / 60:.1f} min")
    return 0


def llama_cpp_python() -> Path | None:
    """This machine's built llama.cpp interpreter, or None."""
    folder = cache_dir(cpu_flags())
    python = folder / "venv" / "bin" / "python"
    return python if (folder / "built.json").is_file() and python.is_file() else None


def llama_cpp_worker() -> None:
    """Run inside the cached interpreter: read a job as JSON on stdin, print results as JSON."""
    import llama_cpp
    import numpy as np

    job = json.load(sys.stdin)
    results = []
    for threads in job["threads"]:
        llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=job["n_batch"],
                              n_threads=threads, n_threads_batch=threads, flash_attn=job["flash_attn"],
                              verbose=False)
        n_vocab = llm.n_vocab()

        def greedy() -> int:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            return int(logits.argmax())

        def prefill(ids: list[int]) -> float:
            llm.reset()
            started = time.perf_counter()
            llm.eval(ids)
            return time.perf_counter() - started

        prefill(job["decode_prompt"][:16])  # warm-up
        prefill_s = min(prefill(job["prefill_prompt"]) for _ in range(job["repeats"]))
        decode_s, output = float("inf"), []
        for _ in range(job["repeats"]):
            prefill(job["decode_prompt"])
            tokens = [greedy()]
            started = time.perf_counter()
            for _ in range(job["tokens"] - 1):
                llm.eval(tokens[-1:])
                tokens.append(greedy())
            decode_s = min(decode_s, time.perf_counter() - started)
            output = tokens
        results.append({"threads": threads, "prefill": len(job["prefill_prompt"]) / prefill_s,
                        "decode": (job["tokens"] - 1) / decode_s, "output": output})
        del llm
    json.dump({"version": llama_cpp.__version__, "results": results}, sys.stdout)


def run_llama_cpp(python: Path, job: dict) -> dict:
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "--llama-cpp-worker"], input=json.dumps(job),
                          capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")})
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


DECODE_PROMPT = (  # bench/decode.py's prompt
    "Here is a Python module:\n\n"
    + "\n".join(f"def helper_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))
    + "\nExplain what these helpers do and suggest a cleaner design."
)


def ours(source, weights, threads, decode_ids, prefill_ids, tokens, repeats, ngram):
    """(prefill tok/s, plain decode tok/s, plain output, n-gram decode tok/s, τ, n-gram output)."""
    from dflash.engine.loading import load_model
    from dflash.engine.sampling import SamplingParams
    from dflash.engine.speculative import SpeculationConfig

    ngram_config = SpeculationConfig(drafter="ngram", max_draft_tokens=8)
    # Loaded as a server would be, so that where it would not speculate (speculation_off: rows not
    # invariant on this CPU for these weights) the bench does not either.
    loaded = load_model(source, weights=weights, max_ctx=len(prefill_ids) + tokens + 512, threads=threads,
                        speculation=ngram_config if ngram else SpeculationConfig())
    engine = loaded.engine
    speculates = engine.speculation.drafter != "none"
    engine.speculation = SpeculationConfig()
    engine.eos_token_ids = frozenset()  # decode exactly `tokens` tokens

    def run(ids, max_tokens):
        engine.rollback(0)  # no reuse of the previous run's keys/values
        generation = engine.start(ids, SamplingParams(), max_tokens=max_tokens)
        generation.run()
        assert generation.stats.prefilled_tokens == len(ids), "the bench must prefill the whole prompt"
        return generation

    run(decode_ids[:16], 4)  # warm-up
    prefill = max(len(prefill_ids) / (run(prefill_ids, 1).stats.prefill_ms / 1000) for _ in range(repeats))

    def decode():
        best, output, tau = 0.0, [], 0.0
        for _ in range(repeats):
            generation = run(decode_ids, tokens)
            rate = (tokens - 1) / (generation.stats.decode_ms / 1000)
            if rate > best:
                best, output, tau = rate, list(generation.output), generation.stats.acceptance_length
        return best, output, tau

    plain, plain_output, _ = decode()
    spec = (None, None, [])
    if ngram and speculates:
        engine.speculation = ngram_config
        spec = decode()
    return prefill, plain, plain_output, spec[0], spec[2], spec[1], ngram and not speculates


def transformers_speed(folder, decode_ids, prefill_ids, tokens, repeats):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([decode_ids[:16]]), max_new_tokens=4, do_sample=False)  # warm-up

        def seconds(call) -> float:
            started = time.perf_counter()
            call()
            return time.perf_counter() - started

        prefill_s = min(seconds(lambda: model(torch.tensor([prefill_ids]))) for _ in range(repeats))
        ids = torch.tensor([decode_ids])
        short_prefill_s = min(seconds(lambda: model(ids)) for _ in range(repeats))
        total_s = min(seconds(lambda: model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False))
                      for _ in range(repeats))
    return len(prefill_ids) / prefill_s, (tokens - 1) / max(total_s - short_prefill_s, 1e-9)


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct", help="a GGUF source (embedded:NAME or a .gguf)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--weights", default="bf16,int8,int4", help="our weight formats (empty: none)")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="length of the prefill prompt")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings")
    parser.add_argument("--no-ngram", action="store_true", help="skip our n-gram speculative decode")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp with flash attention")
    parser.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp into the cache folder and exit")
    parser.add_argument("--llama-cpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_cpp_worker:
        llama_cpp_worker()
        return
    if args.build_llama_cpp:
        sys.exit(build_llama_cpp())

    import torch

    from dflash.chat.template import render_prompt
    from dflash.engine.cpu import cpu_kind
    from dflash.engine.loading import DEFAULT_CACHE_DIR, _gguf_path, load_tokenizer, resolve_source

    thread_counts = [int(t) for t in args.threads.split(",")]
    gguf = _gguf_path(args.model)
    if gguf is None:
        sys.exit(f"{args.model!r} is not a GGUF source: llama.cpp needs the same file")
    tokenizer = load_tokenizer(args.model)
    decode_ids = render_prompt(tokenizer, [{"role": "user", "content": DECODE_PROMPT}])
    prefill_ids = tokenizer(Path(argparse.__file__).read_text())["input_ids"][: args.prefill_tokens]
    load_start = os.getloadavg()

    llama = {}
    python = None if args.no_llama_cpp else llama_cpp_python()
    llama_note = "llama.cpp skipped (--no-llama-cpp)"
    if not args.no_llama_cpp and python is None:
        llama_note = (f"llama.cpp not built for this CPU (no {cache_dir(cpu_flags())}): run `make bench-peers` or "
                      f"`.venv/bin/python bench/peers.py --build-llama-cpp` (~15 min on 2 cores)")
        print(llama_note, file=sys.stderr)
    elif python is not None:  # first, while the load is what it was when we started
        built = json.loads((python.parents[2] / "built.json").read_text())
        reply = run_llama_cpp(python, {
            "gguf": str(gguf), "threads": thread_counts, "tokens": args.tokens, "repeats": args.repeats,
            "decode_prompt": decode_ids, "prefill_prompt": prefill_ids, "n_ctx": len(prefill_ids) + args.tokens + 512,
            "n_batch": 512, "flash_attn": args.llama_flash_attn})
        llama = {r["threads"]: r for r in reply["results"]}
        llama_note = (f"llama.cpp: llama-cpp-python {reply['version']}, {built['cmake_args']}, "
                      f"n_batch 512, flash_attn {'on' if args.llama_flash_attn else 'off'}")

    rows, outputs = [], {}
    for threads in thread_counts:
        for weights in filter(None, args.weights.split(",")):
            prefill, plain, plain_out, spec, tau, spec_out, spec_off = ours(
                args.model, weights, threads, decode_ids, prefill_ids, args.tokens, args.repeats, not args.no_ngram)
            outputs[(threads, weights)] = plain_out
            if spec_off:
                ngram = "— (speculation_off here: rows not invariant)"
            else:
                ngram = "—" if spec is None else f"{spec:.1f} tok/s (τ {tau:.2f}{'' if spec_out == plain_out else ', output differs!'})"
            rows.append((threads, "ours", weights, prefill, plain, ngram))
        if not args.no_transformers:
            folder = resolve_source(args.model, DEFAULT_CACHE_DIR)[1]
            torch.set_num_threads(threads)
            hf_prefill, hf_decode = transformers_speed(folder, decode_ids, prefill_ids, args.tokens, args.repeats)
            rows.append((threads, "transformers", "bf16", hf_prefill, hf_decode, "—"))
        if threads in llama:
            r = llama[threads]
            rows.append((threads, "llama.cpp", "GGUF Q4_1 (as shipped)", r["prefill"], r["decode"], "—"))
    load_end = os.getloadavg()

    print(f"\ncpu={cpu_kind()}  torch {torch.__version__}  load average {load_start[0]:.2f} at start, "
          f"{load_end[0]:.2f} at end  decode: {args.tokens} greedy tokens after a {len(decode_ids)}-token prompt  "
          f"prefill: {len(prefill_ids)} tokens  best of {args.repeats}")
    print(llama_note)
    header = ("cpu", "threads", "runner", "weights", f"prefill {len(prefill_ids)}", "decode", "decode, n-gram drafter",
              "decode vs llama.cpp")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for threads, runner, weights, prefill, decode, ngram in rows:
        versus = f"{decode / llama[threads]['decode']:.2f}x" if threads in llama else "—"
        print(f"| {cpu_kind()} | {threads} | {runner} | {weights} | {prefill:.0f} tok/s | {decode:.1f} tok/s | {ngram} | "
              f"{versus} |")
    for threads, r in llama.items():
        agreement = ", ".join(f"{w} {same_prefix(r['output'], out)}" for (t, w), out in outputs.items() if t == threads)
        if agreement:
            print(f"greedy tokens equal to llama.cpp's before the first difference ({threads} thread(s)): {agreement}")


if __name__ == "__main__":
    main()
