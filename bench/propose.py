"""What one DFlash proposal costs, next to a plain decode step: the drafter as its checkpoint stores
it (bf16 linears, unfused), with its projections fused, and as the server runs it (fused, and int8
linears, int4 on AVX2 alone, on an int8/int4 target, and on a bf16 one where our int8 kernels run:
loading.serving_draft, quant.draft_linear_kind;
its layers then run as one C++ call, draft_layers), and as served with its draft vocabulary (the checkpoint's draft_vocab.json: the LM
head's rows for those ids only); then the served one's parts.

A proposal of a full block (7 drafts) after 4 new context rows, over 300 rows of context (random
target rows: the cost does not depend on their values); the median of --repeats.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/propose.py [--weights int4] [--threads 2]
        [--draft dflash/drafters/smollm2-135m-instruct-b8]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.drafters.dflash import DFlashDrafter, load_dflash_checkpoint  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, SHIPPED_DRAFTERS, draft_vocabulary, load_model, serving_draft  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402

CONTEXT, NEW_ROWS = 300, 4


def median_ms(function, repeats: int) -> float:
    for _ in range(5):
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1000


def observe(drafter: DFlashDrafter, start: int, hidden: list[torch.Tensor]) -> None:
    """The target's captured rows for positions start.., written where its forward writes them
    (Engine.forward: rows_at, then observed)."""
    drafter.rows_at(start, hidden[0].shape[0]).copy_(torch.cat(hidden, dim=-1))
    drafter.observed(start, hidden[0].shape[0])


def drafter_with_context(draft, target, vocabulary=None) -> tuple[DFlashDrafter, list[torch.Tensor]]:
    drafter = DFlashDrafter(draft, target, 4096, vocabulary)
    rows = [torch.randn(CONTEXT, target.args.hidden_size, dtype=drafter.rows.dtype) for _ in draft.config.target_layer_ids]
    observe(drafter, 0, rows)
    return drafter, rows


def proposal(drafter, rows, tokens):
    """Roll back NEW_ROWS committed rows and observe them again, so every proposal projects them."""
    def propose():
        drafter.crop(CONTEXT - NEW_ROWS)
        observe(drafter, CONTEXT - NEW_ROWS, [r[-NEW_ROWS:] for r in rows])
        return drafter.propose(tokens, drafter.block_size - 1)

    return propose


@torch.inference_mode()  # as DFlashDrafter.propose runs
def parts(drafter, rows, repeats: int) -> dict[str, float]:
    """The served proposal's parts, each timed over `repeats` proposals (medians, ms)."""
    draft, target = drafter.draft, drafter.target
    times: dict[str, list[float]] = {}

    def tick(name, started):
        times.setdefault(name, [0.0] * repeats)
        times[name][repeat] += time.perf_counter() - started
        return time.perf_counter()

    for repeat in range(repeats):
        drafter.crop(CONTEXT - NEW_ROWS)
        observe(drafter, CONTEXT - NEW_ROWS, [r[-NEW_ROWS:] for r in rows])
        t = time.perf_counter()
        context = draft.project_context(drafter.rows[drafter.kv.length : drafter.length])
        ids = torch.full((draft.config.block_size,), draft.config.mask_token_id, dtype=torch.long)
        x = target.embed(ids).to(draft.dtype)
        t = tick("context projection and embedding", t)
        start = drafter.kv.length
        if draft.native_arguments() is not None:  # as served: the layers in one C++ call
            x = draft(context, target.embed(ids), drafter.kv, drafter.cos, drafter.sin)
            t = tick(f"{len(draft.layers)} layers and the final norm (draft_layers: one C++ call)", t)
        else:
            for index, layer in enumerate(draft.layers):
                h = layer.input_layernorm(x)
                x = x + layer.self_attn(h, context, drafter.kv, index, start, drafter.cos, drafter.sin)
                t = tick(f"attention, {len(draft.layers)} layers (norm, projections, RoPE, cache, attention)", t)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                t = tick(f"MLP, {len(draft.layers)} layers", t)
            drafter.kv.length = start + context.shape[0]
            x = draft.norm(x)
        logits = drafter.head(x[1:].to(target.dtype))
        t = tick(f"LM head ({logits.shape[-1]} rows)", t)
        best = logits.float().argmax(dim=-1)
        (best if drafter.vocabulary is None else drafter.vocabulary[best]).tolist()
        tick("argmax", t)
    return {name: sorted(v)[repeats // 2] * 1000 for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTERS[EMBEDDED_DEFAULT]))
    parser.add_argument("--weights", default="int4", help="auto, bf16, fp32, int8, int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    loaded = load_model(args.model, weights=args.weights, max_ctx=4096, threads=args.threads)
    target = loaded.engine.model
    tokens = list(range(100, 100 + CONTEXT)) + [5]
    generation = loaded.engine.start(tokens[:64], SamplingParams(), 64)
    generation.step()  # the first token comes from the prefill
    plain = median_ms(generation.step, 32)
    generation.close()
    dtype = getattr(torch, loaded.dtype)
    variants = {
        "checkpoint layout (bf16 linears, unfused)": (load_dflash_checkpoint(args.draft, dtype), None),
        "projections fused": (load_dflash_checkpoint(args.draft, dtype).fuse_projections(), None),
        "served without its draft vocabulary": (serving_draft(args.draft, loaded.dtype, loaded.weights), None),
        "served (loading.serving_draft, draft_vocabulary)": (serving_draft(args.draft, loaded.dtype, loaded.weights),
                                                             draft_vocabulary(args.draft)),
    }
    print(f"\ncpu={cpu_kind()} weights={loaded.weights} threads={args.threads} draft={args.draft}")
    print(f"plain decode step: {plain:.2f} ms\n")
    print("| drafter | proposal (ms) | in plain steps |\n|---|---|---|")
    for name, (draft, vocabulary) in variants.items():
        drafter, rows = drafter_with_context(draft, target, vocabulary)
        cost = median_ms(proposal(drafter, rows, tokens), args.repeats)
        print(f"| {name} | {cost:.2f} | {cost / plain:.2f} |", flush=True)
    print("\nthe served proposal's parts (ms, medians):\n\n| part | ms |\n|---|---|")
    for name, cost in parts(drafter, rows, args.repeats).items():
        print(f"| {name} | {cost:.2f} |")


if __name__ == "__main__":
    main()
