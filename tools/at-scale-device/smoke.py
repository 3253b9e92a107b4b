"""A device smoke run and calibration (tools/at-scale-device/pack.sh): the at-scale stages with a
random-weight target of the embedded model's shape, timed; no weights needed. CUDA only. The first
training configuration's steps also pay the kernels' first-call costs: its time overstates (in
session 20, 629 ms a step here against 58 ms in the real run)."""
import json
import os
import sys
import time

import torch

from dflash.engine.model import ModelArgs, build_transformer
from dflash.engine.drafters.dflash import random_draft_model
from dflash.training.at_scale import ReplyStore, generate_replies, held_out_acceptance, sampled_user_turns, training_batch
from dflash.training.objective import batched_training_forward, slot_loss, slot_weights
from dflash.training.train_drafter import draft_config

t0 = time.perf_counter()
dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
spec = json.load(open(os.path.join(os.path.dirname(__file__), "shapes.json")))
state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s) * 0.05) for k, s in spec["shapes"].items()}
target = build_transformer(ModelArgs.from_hf_config(spec["config"]), state, torch.bfloat16, str(dev))
target.requires_grad_(False)
print("built", round(time.perf_counter() - t0, 1), flush=True)
meta = {"user_prefix": [1, 9690, 198, 2683, 359, 253, 1, 4093, 198], "user_suffix": [2, 198, 1, 520, 9531, 198],
        "eos_ids": [2]}
B = int(sys.argv[1]) if len(sys.argv) > 1 else 512
t = time.perf_counter()
turns = sampled_user_turns(target, {**meta, "eos_ids": [7]}, B, B, 48, 0, time.perf_counter() + 1)
torch.cuda.synchronize()
print(f"sampled {B} turns x 48 tokens: {time.perf_counter() - t:.2f} s ({len(turns)} whole)", flush=True)
layer_ids = (1, 10, 18, 27)
store = ReplyStore(2_000_000, 4 * 576, dev)
prompts = [list(torch.randint(100, 40000, (200 + i % 300,)).tolist()) for i in range(B)]
t = time.perf_counter()
n = generate_replies(target, store, prompts, [i % 6 for i in range(B)], layer_ids, {7}, 128, B,
                     time.perf_counter() + 120, print)
torch.cuda.synchronize()
dt = time.perf_counter() - t
print(f"replies: {n} x 128 in {dt:.2f} s = {n * 128 / dt:.0f} reply tok/s; max mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
      flush=True)
torch.cuda.empty_cache()
for layers in (2, 4):
    for S, N in ((16, 256), (32, 128)):
        draft = random_draft_model(draft_config(target.args, layers, 8, layer_ids, 16), dtype=torch.float32).to(dev).train()
        opt = torch.optim.AdamW(draft.parameters(), lr=6e-4, fused=True)
        w = slot_weights(8, 4.0)
        g = torch.Generator(device=dev).manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        for i in range(13):
            if i == 3:
                torch.cuda.synchronize()
                t = time.perf_counter()
            idx = torch.randint(len(store.starts), (S,)).tolist()
            rows, tokens, lengths, anchors, labels = training_batch(store, idx, N, 8, g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = batched_training_forward(draft, target.embed, rows, tokens, lengths, anchors, 8, 16)
                loss = slot_loss(out, labels, target.lm_head.weight, w)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t) / 10
        print(f"train layers {layers} S {S} N {N}: {per * 1000:.1f} ms/step, {int((labels >= 0).sum())} slots, "
              f"loss {float(loss):.3f}, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
t = time.perf_counter()
draft.eval()
print(held_out_acceptance(draft, target.embed, target.lm_head.weight, store, list(range(min(64, len(store.starts)))), 8, 16),
      f"{time.perf_counter() - t:.2f} s")
print("smoke total", round(time.perf_counter() - t0, 1))
