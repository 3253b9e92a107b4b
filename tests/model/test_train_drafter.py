"""A tiny end-to-end `train-drafter` run: the loss falls, and the output folder loads as a drafter
that decodes losslessly."""

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
    assert [p.name for p in parallel] == [p.name for p in serial]
    for a, b in zip(serial, parallel):
        one, two = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
        assert torch.equal(one["tokens"], two["tokens"]) and torch.equal(one["rows"], two["rows"])
