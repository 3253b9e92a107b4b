"""Does the DFlash drafter see in serving what it was trained on? For a few prompts, compares the
training data's path (`batched_replies.batched_greedy`: the target's rows at the drafter's layers
and its greedy reply) with the engine's (the rows the served drafter captured while decoding), and
the drafter's teacher-forced τ estimate (what training logs as held-out acceptance) with the τ it
gets decoding, a full block every step. A mismatch between the paths (rows that disagree over the
prompt, an estimate far above the decoded τ on the engine's own rows) would be a bug between
training and serving; a low τ on both is the drafter's own.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/drafter_paths.py --kind chat --source pool \\
        dflash/drafters/smollm2-135m-instruct-b8

bf16 weights on both paths (the data path multiplies plain weights only).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dflash.chat.template import render_prompt  # noqa: E402
from dflash.engine.cpu import cpu_kind  # noqa: E402
from dflash.engine.drafters.dflash import load_dflash_checkpoint  # noqa: E402
from dflash.engine.loading import EMBEDDED_DEFAULT, load_model  # noqa: E402
from dflash.engine.sampling import SamplingParams  # noqa: E402
from dflash.training.batched_replies import batched_greedy  # noqa: E402
from dflash.training.objective import (  # noqa: E402
    acceptance_estimate,
    batched_training_forward,
    decoded_acceptance,
)
from dflash.training.prompt_pool import KINDS, scaled_conversations  # noqa: E402
from dflash.training.unseen import UNSEEN_PROMPTS, full_block_engine  # noqa: E402


def teacher_forced_tau(draft, target, tokens: list[int], rows: torch.Tensor, first: int) -> tuple[float, float]:
    """Two estimates from every anchor of the reply (positions first..end-2), each anchor's run
    being the leading slots whose argmax is the reply's token: their mean + 1 over every anchor (the
    training logs' held-out acceptance before session 31, on random anchors), and the tokens per
    verification of a decode through them (objective.decoded_acceptance, the held-out acceptance
    since). `rows` are those of tokens[:-1]."""
    c = draft.config
    length = len(tokens)
    rows = torch.cat([rows, rows[-1:]])[:length]  # the last token's row is never made; no anchor sees it
    anchors = torch.arange(first, length - 1)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        out = batched_training_forward(draft, target.embed, rows[None].to(torch.bfloat16), ids[None],
                                       torch.tensor([length]), anchors[None], c.block_size, c.mask_token_id)
    head = target.lm_head.weight
    logits = F.linear(out[0].to(head.dtype), head).float()
    targets = anchors[:, None] + torch.arange(1, c.block_size)
    labels = ids[targets.clamp(max=length - 1)].masked_fill(targets >= length, -1)
    committed, verifications = decoded_acceptance(logits, labels)
    return acceptance_estimate(logits, labels), committed / verifications


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", help="a DFlash checkpoint folder for the target")
    parser.add_argument("--model", default=EMBEDDED_DEFAULT)
    parser.add_argument("--kind", default="chat", help=f"prompt kind: {', '.join(KINDS)}")
    parser.add_argument("--source", default="pool", choices=("pool", "unseen"),
                        help="the training pool's first prompts of the kind (seed 0), or the unseen prompts")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.kind not in KINDS:
        raise SystemExit(f"--kind {args.kind!r}: one of {', '.join(KINDS)}")
    if args.source == "pool":
        conversations = [m for kind, m in scaled_conversations(100 * args.count, seed=0) if kind == args.kind]
    else:
        conversations = UNSEEN_PROMPTS[args.kind]
    conversations = conversations[: args.count]

    loaded = load_model(args.model, dtype="bfloat16", weights=None, max_ctx=2048, threads=args.threads)
    target = loaded.engine.model
    draft = load_dflash_checkpoint(args.drafter, torch.bfloat16)
    layers = draft.config.target_layer_ids
    eos = set(loaded.engine.eos_token_ids)
    engine = full_block_engine(target, draft, eos_token_ids=eos)
    print(f"\ncpu={cpu_kind()} model={args.model} weights=bf16 drafter={args.drafter} kind={args.kind} "
          f"source={args.source} tokens={args.tokens}")
    print("| prompt | prompt rows cos (min) | replies agree for | τ estimate, data path (every anchor / walked) "
          "| τ estimate, engine rows (every anchor / walked) | τ decoding |")
    print("|---|---|---|---|---|---|")
    for messages in conversations:
        prompt = render_prompt(loaded.tokenizer, messages)
        (data_reply, data_rows), = batched_greedy(target, [prompt], args.tokens, eos, layers)
        engine.rollback(0)
        generation = engine.start(prompt, SamplingParams(), args.tokens)
        generation.run()
        reply, stats = list(generation.output), generation.stats
        engine_rows = engine.dflash_drafter.context_rows()
        generation.close()
        decoded = (stats.accepted_tokens + stats.verification_steps) / max(stats.verification_steps, 1)
        cos = F.cosine_similarity(data_rows[: len(prompt)].float(), engine_rows[: len(prompt)].float(), dim=-1)
        agree = next((i for i, (a, b) in enumerate(zip(data_reply, reply)) if a != b), min(len(data_reply), len(reply)))
        on_data = teacher_forced_tau(draft, target, list(prompt) + data_reply, data_rows, len(prompt))
        on_engine = teacher_forced_tau(draft, target, list(prompt) + reply, engine_rows, len(prompt))
        text = messages[-1]["content"].splitlines()[0][:48]
        print(f"| {text} | {float(cos.min()):.4f} | {agree} of {len(reply)} tokens | {on_data[0]:.2f} / {on_data[1]:.2f} "
              f"| {on_engine[0]:.2f} / {on_engine[1]:.2f} | {decoded:.2f} |", flush=True)


if __name__ == "__main__":
    main()
