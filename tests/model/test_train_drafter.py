"""A tiny end-to-end `train-drafter` run: the loss falls, and the output folder loads as a drafter
that decodes losslessly."""

import attrs
import pytest
import torch

from dflash.engine.drafters.dflash import DFlashDrafter, load_dflash_checkpoint
from dflash.engine.generate import Engine
from dflash.engine.loading import load_model
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from dflash.training.train_drafter import (
    TrainOptions,
    choose_mask_token,
    generate_data,
    generate_data_parallel,
    train,
)
from tests.model.test_loading import write_hf_folder


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target") / "tiny"
    write_hf_folder(folder)
    loaded = load_model(str(folder), dtype="float32", max_ctx=256, threads=1)
    loaded.tokenizer.add_special_tokens({"additional_special_tokens": ["t126"]})
    loaded.tokenizer.chat_template = "{% for m in messages %}t1 {{ m['content'] }} t3 {% endfor %}t4"
    loaded.tokenizer.save_pretrained(folder)  # worker processes load the target from the folder
    return loaded


@pytest.fixture
def cli_main():
    """`dflash.cli.main`, with structlog's configuration put back afterwards: the command points the
    logs at the sys.stderr of the moment, which under capsys is a capture file closed after the test."""
    import structlog

    from dflash.cli import main

    saved = structlog.get_config()
    yield main
    structlog.configure(**saved)


def test_tiny_training_run_learns_and_its_checkpoint_decodes_losslessly(tiny_target, tmp_path):
    loaded = tiny_target
    prompts = [f"t{5 + i} t{9 + i} t{20 + i}" for i in range(10)]
    layer_ids = (0, 2)
    shards = generate_data(loaded, prompts, tmp_path, layer_ids, tokens=24, progress=False)
    assert len(shards) == 10
    again = generate_data(loaded, prompts, tmp_path, layer_ids, tokens=24, progress=False)  # resumable: all done
    assert again == shards
    mask = choose_mask_token(loaded.tokenizer)
    options = TrainOptions(block_size=4, target_layer_ids=layer_ids, steps=60, anchors=8, held_out=2,
                           learning_rate=3e-3)
    summary = train(loaded, shards, tmp_path, options, mask, progress=False)
    losses = summary["history"]["loss"]
    assert sum(losses[-10:]) / 10 < losses[0] * 0.85  # from near-uniform (ln 128 = 4.85) downwards

    draft = load_dflash_checkpoint(tmp_path)
    assert draft.config.mask_token_id == mask and draft.config.target_layer_ids == layer_ids
    # Every norm learned, the first layer's input norm too: its input (the frozen embeddings) needs
    # no gradient, yet the norm's own weight does (it once took the native, gradient-less kernel).
    untrained = [name for name, weight in draft.state_dict().items()
                 if name.endswith("norm.weight") and torch.equal(weight, torch.ones_like(weight))]
    assert untrained == []
    target = loaded.engine.model
    prompt = [1, 5, 9, 20, 3, 4]
    plain = Engine(target, max_ctx=256).start(prompt, SamplingParams(), 16).run()
    drafter = DFlashDrafter(draft.float(), target, 256)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False)
    generation = Engine(target, max_ctx=256, speculation=config, dflash_drafter=drafter).start(prompt, SamplingParams(), 16)
    assert generation.run() == plain and generation.stats.verification_steps > 0


def test_data_from_several_worker_processes_equals_data_from_one(tiny_target, tmp_path):
    prompts = [f"t{5 + i} t{9 + i}" for i in range(5)]
    serial = generate_data(tiny_target, prompts, tmp_path / "one", (0, 2), tokens=12, progress=False)
    parallel = generate_data_parallel(str(tiny_target.folder), "float32", 2, 256, prompts, tmp_path / "two", (0, 2),
                                      tokens=12, workers=2, progress=False)
    assert_same_shards(serial, parallel)


def assert_same_shards(these, those) -> None:
    assert [p.name for p in these] == [p.name for p in those]
    for a, b in zip(these, those):
        one, two = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
        assert one.keys() == two.keys()
        assert all(torch.equal(one[k], two[k]) if isinstance(one[k], torch.Tensor) else one[k] == two[k] for k in one)


def test_teacher_forced_shards_hold_the_targets_rows_and_greedy_predictions(tiny_target, tmp_path):
    from dflash.training.teacher_forcing import planned_windows, prefill_data, prefill_data_parallel

    layer_ids = (0, 2)
    shards = prefill_data(tiny_target, tmp_path / "one", layer_ids, budget_tokens=300, window=128, progress=False)
    plan = planned_windows(tiny_target.tokenizer, 300, 128, None)
    assert len(shards) == len(plan) >= 3 and {kind for kind, _ in plan} == {"source", "docs", "agent"}
    sample = torch.load(shards[0], weights_only=False)
    tokens = sample["tokens"]
    assert tokens.tolist() == plan[0][1]
    # The shard's rows and greedy predictions are those of one plain forward over the window.
    engine = tiny_target.engine
    engine.rollback(0)
    logits, hidden = engine.model(tokens, 0, engine.kv, capture_layers=layer_ids, logits_positions=None)
    engine.rollback(0)
    assert torch.equal(sample["greedy"], logits.argmax(-1).to(torch.int32))
    assert torch.equal(sample["rows"], torch.cat(hidden, -1).to(torch.bfloat16))
    # Resumable, and two worker processes write the same shards.
    first_written = shards[0].stat().st_mtime_ns
    assert prefill_data(tiny_target, tmp_path / "one", layer_ids, 300, 128, progress=False) == shards
    assert shards[0].stat().st_mtime_ns == first_written
    parallel = prefill_data_parallel(str(tiny_target.folder), "float32", None, 2, tiny_target.tokenizer,
                                     tmp_path / "two", layer_ids, 300, 128, workers=2, progress=False)
    assert_same_shards(shards, parallel)


def test_training_mixes_reply_and_teacher_forced_shards_and_measures_unseen_prompts(tiny_target, tmp_path):
    from dflash.training.teacher_forcing import prefill_data
    from dflash.training.unseen import UNSEEN_PROMPTS

    layer_ids = (0, 2)
    replies = generate_data(tiny_target, [f"t{5 + i} t{9 + i}" for i in range(6)], tmp_path, layer_ids, tokens=16,
                            progress=False)
    forced = prefill_data(tiny_target, tmp_path, layer_ids, budget_tokens=400, window=128, progress=False)
    options = TrainOptions(block_size=4, target_layer_ids=layer_ids, steps=40, anchors=8, held_out=2,
                           learning_rate=3e-3, reply_share=0.5, eval_every=20, eval_tokens=8)
    summary = train(tiny_target, replies + forced, tmp_path, options, choose_mask_token(tiny_target.tokenizer),
                    progress=False)
    assert summary["teacher_forced_tokens"] == sum(torch.load(p, weights_only=False)["tokens"].shape[0] for p in forced)
    curve = summary["unseen_acceptance"]
    assert [point["step"] for point in curve] == [20, 40]
    assert all(set(point) == {"step", *UNSEEN_PROMPTS} and all(point[k] >= 1.0 for k in UNSEEN_PROMPTS)
               for point in curve)
    # Resuming keeps the curve and continues it.
    more = attrs.evolve(options, steps=60)
    resumed = train(tiny_target, replies + forced, tmp_path, more, choose_mask_token(tiny_target.tokenizer),
                    resume=True, progress=False)
    assert [point["step"] for point in resumed["unseen_acceptance"]] == [20, 40, 60]


def _tiny_chat_target(folder, architecture: str):
    write_hf_folder(folder, architecture)
    loaded = load_model(str(folder), dtype="float32", max_ctx=256, threads=1)
    loaded.tokenizer.chat_template = "{% for m in messages %}t1 {{ m['content'] }} t3 {% endfor %}t4"
    return loaded


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "yarn-rope"])  # plain; q/k norms; scaled RoPE
def test_batched_replies_are_the_engines_greedy_replies_with_its_rows(architecture, tmp_path):
    from dflash.training.batched_replies import batched_reply_data

    loaded = _tiny_chat_target(tmp_path / "target", architecture)
    # Prompts of different lengths, so rows of a batch are padded differently; t2 (EOS) may end some early.
    prompts = [" ".join(f"t{5 + (i * 7 + j) % 100}" for j in range(2 + 3 * i)) for i in range(5)]
    layer_ids = (0, 2)
    one = generate_data(loaded, prompts, tmp_path / "one", layer_ids, tokens=20, progress=False)
    batched = batched_reply_data(loaded, prompts, tmp_path / "batched", layer_ids, tokens=20, batch=3, progress=False)
    assert [p.name for p in batched] == [p.name for p in one] and len(one) == 5
    for a, b in zip(one, batched):
        engine_shard, batched_shard = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
        assert torch.equal(batched_shard["tokens"], engine_shard["tokens"])
        assert batched_shard["response_start"] == engine_shard["response_start"]
        assert batched_shard["layer_ids"] == list(layer_ids)
        # The same rows up to rounding (other matmul shapes), stored in bf16.
        torch.testing.assert_close(batched_shard["rows"].float(), engine_shard["rows"].float(), atol=2e-2, rtol=2e-2)
    written = batched[0].stat().st_mtime_ns  # resumable: a rerun keeps what exists
    assert batched_reply_data(loaded, prompts, tmp_path / "batched", layer_ids, tokens=20, batch=3,
                              progress=False) == batched
    assert batched[0].stat().st_mtime_ns == written


def test_replies_that_stop_early_leave_the_batch_and_the_rest_decode_unchanged(tmp_path):
    from dflash.training.batched_replies import batched_greedy

    model = _tiny_chat_target(tmp_path / "target", "qwen3").engine.model  # the tiny llama repeats one token
    prompts = [[5 + (i * 7 + j) % 100 for j in range(2 + 3 * i)] for i in range(5)]
    endless = batched_greedy(model, prompts, 12, set(), (0, 2))
    first = endless[0][0]
    at = next(i for i, token in enumerate(first) if i > 0 and token not in first[:i])
    stop = first[at]  # the first prompt stops there and leaves the batch
    stopped = batched_greedy(model, prompts, 12, {stop}, (0, 2))
    longer = 0
    for prompt, (full, full_rows), (output, rows) in zip(prompts, endless, stopped):
        assert output == (full[: full.index(stop) + 1] if stop in full else full)
        assert rows.shape == (len(prompt) + len(output) - 1, 2 * model.args.hidden_size)
        torch.testing.assert_close(rows, full_rows[: len(rows)], atol=1e-4, rtol=1e-4)
        longer += len(output) > at + 1
    assert len(stopped[0][0]) == at + 1 < 12 and longer >= 1  # someone decoded on after the first row left


def test_batched_replies_refuse_what_they_cannot_do(tiny_target, tmp_path):
    from dflash.engine.quant import quantize_linears
    from dflash.training.batched_replies import batched_greedy, batched_reply_data

    with pytest.raises(ValueError, match="at least one token, got max_new=0"):
        batched_greedy(tiny_target.engine.model, [[5, 9]], 0, set(), (0,))
    with pytest.raises(ValueError, match="reply batch must be at least 1, got 0"):
        batched_reply_data(tiny_target, ["t5"], tmp_path, (0, 2), tokens=8, batch=0, progress=False)
    with pytest.raises(ValueError, match="prompt 1 has .* tokens: more than the 156"):
        batched_reply_data(tiny_target, ["t5", " ".join(["t7"] * 200)], tmp_path, (0, 2), tokens=100, progress=False)
    quantized = load_model(str(tiny_target.folder), dtype="bfloat16", max_ctx=64, threads=1)
    quantize_linears(quantized.engine.model, "int8")
    with pytest.raises(ValueError, match="need the target's float weights, but layers.0.attention.wqkv is Int8Linear"):
        batched_greedy(quantized.engine.model, [[5, 9]], 4, set(), (0,))


def test_train_drafter_records_what_each_sitting_made_and_how_long_it_took(tiny_target, tmp_path, capsys, cli_main):
    import json

    main = cli_main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"t{5 + i} t{9 + i} t{30 + i}" for i in range(4)) + "\n")
    out = tmp_path / "run"
    command = ["train-drafter", "--target", str(tiny_target.folder), "--out", str(out), "--prompts", str(prompts),
               "--prompt-count", "3", "--tokens", "10", "--reply-batch", "2", "--corpus-tokens", "300",
               "--window", "128", "--steps", "2", "--anchors", "2", "--block-size", "4", "--dtype", "float32",
               "--threads", "1", "--target-layer-ids", "0,2"]
    assert main(command) == 0
    printed = capsys.readouterr().out
    replies, forced = [json.loads(line) for line in (out / "data-runs.jsonl").read_text().splitlines()]
    reply_shards = [torch.load(p, weights_only=False) for p in sorted((out / "data").glob("sample-*.pt"))]
    forced_shards = [torch.load(p, weights_only=False) for p in sorted((out / "data").glob("prefill-*.pt"))]
    assert len(reply_shards) == 3 and len(forced_shards) >= 3
    assert replies["stage"] == "replies" and replies["shards"] == replies["reply_prompts"] == 3
    assert replies["prompt_tokens"] == sum(s["response_start"] for s in reply_shards)
    # Each shard stores its reply but the last generated token.
    assert replies["reply_tokens"] == sum(len(s["tokens"]) - s["response_start"] + 1 for s in reply_shards)
    assert replies["teacher_forced_tokens"] == 0 and replies["seconds"] > 0
    seconds = replies["seconds"]  # rounded to 0.01 s
    assert replies["reply_tokens"] / (seconds + 0.006) <= replies["tokens_per_second"] <= replies["reply_tokens"] / (seconds - 0.006) + 0.1
    assert replies["reply_batch"] == 2 and replies["threads"] == 1 and replies["cpu"]
    assert forced["stage"] == "teacher forcing" and forced["shards"] == len(forced_shards)
    assert forced["teacher_forced_tokens"] == sum(len(s["tokens"]) for s in forced_shards) and forced["reply_tokens"] == 0
    assert f"replies: 3 new shards, {replies['prompt_tokens']} prompt + {replies['reply_tokens']} reply" in printed
    assert json.loads(printed[printed.index("{"):])["data_runs"] == [replies, forced]

    # A later sitting with one prompt more counts only what it made, and keeps the earlier records.
    assert main([*command[:command.index("--prompt-count") + 1], "4", *command[command.index("--tokens"):],
                 "--resume"]) == 0
    records = [json.loads(line) for line in (out / "data-runs.jsonl").read_text().splitlines()]
    assert records[:2] == [replies, forced] and len(records) == 4
    newest = torch.load(out / "data" / "sample-00003.pt", weights_only=False)
    assert records[2]["shards"] == 1 and records[2]["prompt_tokens"] == newest["response_start"]
    assert records[3]["shards"] == 0 and records[3]["teacher_forced_tokens"] == 0
    assert records[3]["tokens_per_second"] is None

    # Settings that contradict the folder's data end the command with the reason, not a traceback.
    mismatched = [*command[:command.index("--target-layer-ids") + 1], "0,1"]
    assert main(mismatched) == 2
    assert "holds target layers [0, 2], not [0, 1]: delete its data folder" in capsys.readouterr().err


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])  # without and with q/k norms
def test_draft_layers_can_start_from_the_targets_layers(architecture, tmp_path):
    import torch.nn.functional as F

    from dflash.engine.drafters.dflash import random_draft_model
    from dflash.engine.kv import KVCache
    from dflash.engine.model import rope_tables
    from dflash.training.train_drafter import copy_target_layers, draft_config

    loaded = _tiny_chat_target(tmp_path / "target", architecture)
    target = loaded.engine.model
    a = target.args
    draft = random_draft_model(draft_config(a, 2, 4, (0, 2), 126))
    copy_target_layers(draft, target, (2, 1))
    attention, mine = target.layers[2].attention, draft.layers[0].self_attn
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    assert torch.equal(mine.q_proj.weight, attention.wqkv.weight[:q_size])
    assert torch.equal(mine.k_proj.weight, attention.wqkv.weight[q_size:q_size + kv_size])
    assert torch.equal(draft.layers[1].mlp.up_proj.weight, target.layers[1].feed_forward.w13.weight[a.intermediate_size:])
    if attention.q_norm is not None:
        assert torch.equal(mine.k_norm.weight, attention.k_norm.weight)

    # One row with no context attends to itself alone, as the target's first token does: a draft of
    # the target's layer 2 alone maps it as target layer 2 does (then the target's final norm).
    single = random_draft_model(draft_config(a, 1, 4, (0, 2), 126))
    copy_target_layers(single, target, (2,))
    x = target.embed(torch.tensor([7]))
    layer = target.layers[2]
    v = layer.attention.wqkv(layer.attention_norm(x))[:, q_size + kv_size:].view(a.num_kv_heads, a.head_dim)
    heads = v.repeat_interleave(a.num_heads // a.num_kv_heads, dim=0).reshape(1, -1)
    h = x + layer.attention.wo(heads)
    gate, up = layer.feed_forward.w13(layer.ffn_norm(h)).split(a.intermediate_size, dim=-1)
    expected = target.norm(h + layer.feed_forward.w2(F.silu(gate) * up))
    kv = KVCache(1, a.num_kv_heads, 8, a.head_dim, torch.float32, torch.device("cpu"))
    cos, sin = rope_tables(single.inv_freq.float(), 8, 1.0, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        got = single(torch.zeros(0, a.hidden_size), x, kv, cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match=r"1 target layers \[2\] for 2 draft layers"):
        copy_target_layers(draft, target, (2,))
    with pytest.raises(ValueError, match=f"target layer {a.num_layers} does not exist"):
        copy_target_layers(draft, target, (0, a.num_layers))


def test_a_training_run_starts_from_the_named_target_layers(tiny_target, tmp_path):
    from dflash.engine.drafters.dflash import load_dflash_checkpoint

    shards = generate_data(tiny_target, ["t5 t9 t20", "t6 t10 t21"], tmp_path, (0, 2), tokens=12, progress=False)
    options = TrainOptions(block_size=4, target_layer_ids=(0, 2), layers=2, steps=0, init_from_target_layers=(1, 2))
    train(tiny_target, shards, tmp_path, options, choose_mask_token(tiny_target.tokenizer), progress=False)
    draft = load_dflash_checkpoint(tmp_path)  # saved in bf16
    target = tiny_target.engine.model
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, target.layers[1].feed_forward.w2.weight.to(torch.bfloat16))
    assert torch.equal(draft.norm.weight, target.norm.weight.to(torch.bfloat16))


def test_unseen_verifications_are_every_verification_of_the_run(tiny_target):
    from dflash.engine.drafters.dflash import DFlashDrafter, random_draft_model
    from dflash.engine.generate import Engine
    from dflash.engine.sampling import SamplingParams
    from dflash.engine.speculative import SpeculationConfig
    from dflash.chat.template import render_prompt
    from dflash.training.train_drafter import draft_config
    from dflash.training.unseen import UNSEEN_PROMPTS, unseen_verifications

    target = tiny_target.engine.model
    draft = random_draft_model(draft_config(target.args, 1, 4, (0, 2), choose_mask_token(tiny_target.tokenizer)))
    verifications = unseen_verifications(target, tiny_target.tokenizer, draft, tokens=12)
    assert set(verifications) == set(UNSEEN_PROMPTS)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False, tree_rows=0)  # chains, as measured
    engine = Engine(target, max_ctx=2048, speculation=config, dflash_drafter=DFlashDrafter(draft, target, 2048))
    for kind, conversations in UNSEEN_PROMPTS.items():
        totals = [0, 0, 0]
        for messages in conversations:
            engine.rollback(0)
            generation = engine.start(render_prompt(tiny_target.tokenizer, messages), SamplingParams(), 12)
            generation.run()
            stats = generation.stats
            totals = [totals[0] + stats.verification_steps, totals[1] + stats.draft_tokens,
                      totals[2] + stats.accepted_tokens]
        steps = verifications[kind]
        assert totals == [len(steps), sum(p for p, _ in steps), sum(a for _, a in steps)] and totals[0] > 0


def test_unseen_verifications_stop_at_the_end_of_turn(tiny_target):
    """A reply ends at an end-of-turn token, as a server's does: past it the model writes a turn
    no client sees, and the drafter's misses there must not count."""
    from dflash.engine.generate import Engine
    from dflash.engine.sampling import SamplingParams
    from dflash.engine.drafters.dflash import random_draft_model
    from dflash.chat.template import render_prompt
    from dflash.training.train_drafter import draft_config
    from dflash.training.unseen import UNSEEN_PROMPTS, unseen_verifications

    target = tiny_target.engine.model
    draft = random_draft_model(draft_config(target.args, 1, 4, (0, 2), choose_mask_token(tiny_target.tokenizer)))
    plain = Engine(target, max_ctx=2048)
    reply = plain.start(render_prompt(tiny_target.tokenizer, UNSEEN_PROMPTS["chat"][0]), SamplingParams(), 12)
    reply.run()
    # This random target answers every unseen prompt with the same token: as an end token, every
    # reply ends before its first verification.
    end = reply.output[0]
    assert unseen_verifications(target, tiny_target.tokenizer, draft, tokens=12, eos_token_ids=[end]) == {
        kind: [] for kind in UNSEEN_PROMPTS}


@pytest.mark.parametrize("layers", ["1", "0,99"])
def test_train_drafter_refuses_bad_starting_layers_before_making_data(tiny_target, tmp_path, capsys, layers, cli_main):
    main = cli_main

    out = tmp_path / "run"
    assert main(["train-drafter", "--target", str(tiny_target.folder), "--out", str(out), "--layers", "2",
                 "--init-from-target-layers", layers, "--threads", "1", "--dtype", "float32"]) == 2
    last = tiny_target.engine.model.args.num_layers - 1
    assert f"--init-from-target-layers {layers}: give 2 target layers (one per --layers), each from 0 to {last}" \
        in capsys.readouterr().err
    assert not out.exists()
