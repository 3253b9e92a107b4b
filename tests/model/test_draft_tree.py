"""Verifying a DFlash draft tree (speculative.DraftTree) in one target pass: every row gets the bits a
decode step of its path gets, so the output is plain greedy's, and the path kept leaves the KV cache,
the drafter's rows and the committed tokens as plain decoding would have."""

import attrs
import pytest
import torch

import dflash.engine.model as model_module
from dflash.engine.drafters.dflash import DFlashDrafter, random_draft_model
from dflash.engine.generate import Engine
from dflash.engine.model import half_linear_rows_invariant
from dflash.engine.native import extension
from dflash.engine.quant import quantize_linears
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import DraftTree, SpeculationConfig
from tests.model.test_dflash import tiny_config
from tests.model.tiny import ours_from_hf, tiny_hf_model

PROMPT = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 5, 9]


def target_model(weights: str, cache: str):
    if weights == "bf16" and not half_linear_rows_invariant():
        pytest.skip("torch's bf16 matmuls are not row-invariant on this CPU: a server there does not speculate on bf16")
    if cache == "int8" and (extension() is None or not extension().int8_kv_available()):
        pytest.skip("an int8 cache needs the native extension and AVX512-VNNI")
    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    if weights != "bf16":
        quantize_linears(model, weights)
    model.kv_cache = cache
    return model


def engines(model, tokens: int, max_ctx: int = 128):
    """Plain greedy (with a drafter capturing rows, never asked) and tree-verifying DFlash."""
    draft = random_draft_model(tiny_config(block_size=8), seed=3, dtype=torch.bfloat16)
    chunk = 8 if max_ctx <= 128 else 64
    plain = Engine(model, max_ctx=max_ctx, prefill_chunk=chunk, dflash_drafter=DFlashDrafter(draft, model, max_ctx))
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, adaptive=False)
    tree = Engine(model, max_ctx=max_ctx, prefill_chunk=chunk, speculation=config,
                  dflash_drafter=DFlashDrafter(draft, model, max_ctx))
    return plain, tree


def oracle_trees(engine, expected: list[int], prompt: list[int] = PROMPT):
    """The drafter proposes trees whose first chain is wrong and whose second holds the next tokens
    of `expected` (a sibling wrong again under it): every step keeps a path off chain 0."""
    drafter = engine.dflash_drafter

    def propose_tree(tokens, rows, depth=None):
        if drafter.length != len(tokens) - 1:
            return DraftTree((), ())
        p = len(tokens) - len(prompt)
        right = (expected + [0] * 8)[p : p + 3]
        wrong = [(t + 1) % 128 for t in right]
        return DraftTree((wrong[0], right[1], right[0], wrong[1], right[1], right[2]), (0, 1, 0, 3, 3, 5))

    drafter.propose_tree = propose_tree


@pytest.mark.parametrize("weights,cache", [("bf16", "auto"), ("int8", "auto"), ("int4", "auto"), ("int4", "int8"),
                                           ("bf16", "int8")])
@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_path_off_the_first_chain_leaves_what_plain_decoding_leaves(weights, cache, loop, monkeypatch):
    model = target_model(weights, cache)
    if loop == "python":
        monkeypatch.setattr(model_module, "native_extension", lambda: None)
    elif extension() is None:
        pytest.skip("needs the native extension")
    plain_engine, tree_engine = engines(model, 24)
    plain = plain_engine.start(PROMPT, SamplingParams(), 24).run()
    oracle_trees(tree_engine, plain)
    generation = tree_engine.start(PROMPT, SamplingParams(), 24)
    assert generation.run() == plain
    assert generation.stats.accepted_tokens >= 2 * generation.stats.verification_steps - 2  # the second chain, kept
    length = plain_engine.kv.length
    assert tree_engine.kv.length == length and tree_engine.committed == plain_engine.committed
    for name in ("keys", "values") + (("key_scales", "value_scales") if cache == "int8" else ()):
        assert torch.equal(getattr(tree_engine.kv, name)[:, :, :length], getattr(plain_engine.kv, name)[:, :, :length]), name
    assert torch.equal(tree_engine.dflash_drafter.rows[:length], plain_engine.dflash_drafter.rows[:length])


@pytest.mark.parametrize("weights", ["bf16", "int4"])
@pytest.mark.parametrize("prompt_length", [240, 530])
def test_trees_past_the_first_chunk_of_keys_leave_what_plain_decoding_leaves(weights, prompt_length):
    """The attention kernel cuts keys into chunks of 256 positions: a tree's rows share the partials
    of the chunks wholly below its first position and attend the rest chain by chain (attend_tree).
    Trees before, across and after a chunk's end (240 + 24 tokens), and with two shared chunks
    (tests/model/test_native.py compares the kernel with the chain-by-chain one, fp32 included)."""
    if extension() is None:
        pytest.skip("needs the native extension")
    model = target_model(weights, "auto")
    prompt = [(7 * i + 3) % 120 for i in range(prompt_length)]
    plain_engine, tree_engine = engines(model, 24, max_ctx=prompt_length + 64)
    plain = plain_engine.start(prompt, SamplingParams(), 24).run()
    oracle_trees(tree_engine, plain, prompt)
    generation = tree_engine.start(prompt, SamplingParams(), 24)
    assert generation.run() == plain
    assert generation.stats.accepted_tokens >= 2 * generation.stats.verification_steps - 2  # the second chain, kept
    length = plain_engine.kv.length
    assert tree_engine.kv.length == length
    for name in ("keys", "values"):
        assert torch.equal(getattr(tree_engine.kv, name)[:, :, :length], getattr(plain_engine.kv, name)[:, :, :length]), name


@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_the_drafters_own_trees_decode_plain_greedy_and_seeded_sampling(weights):
    model = target_model(weights, "auto")
    plain_engine, tree_engine = engines(model, 32)
    for sampling in (SamplingParams(repetition_penalty=1.2), SamplingParams(temperature=0.8, seed=7)):
        plain = plain_engine.start(PROMPT, sampling, 32).run()
        trees = []
        propose_tree = tree_engine.dflash_drafter.propose_tree
        tree_engine.dflash_drafter.propose_tree = lambda tokens, rows, depth=None: trees.append(out := propose_tree(tokens, rows, depth)) or out
        generation = tree_engine.start(PROMPT, sampling, 32)
        assert generation.run() == plain
        assert trees and any(tree.chains() > 1 for tree in trees)  # branched trees were verified
        del tree_engine.dflash_drafter.propose_tree


def test_a_constrained_generation_proposes_chains():
    """A grammar's matcher checks drafts as a chain (Generation._decode_one)."""
    from dflash.engine.generate import Generation

    model = target_model("int4", "auto")
    _, engine = engines(model, 8)
    assert Generation(engine, PROMPT, SamplingParams(), 4).speculation.trees
    assert not Generation(engine, PROMPT, SamplingParams(), 4, constraint=object()).speculation.trees
    engine.speculation = attrs.evolve(engine.speculation, tree_rows=0)
    assert not Generation(engine, PROMPT, SamplingParams(), 4).speculation.trees


@pytest.mark.parametrize("one_call", [True, False])
def test_a_chain_costs_the_share_of_a_step_of_the_keys_it_reads_again(one_call, monkeypatch):
    """One more attention call reads the cache once more: its share of a decode step's reads
    (weights and cache, as bytes) grows with the committed context. Where a tree's chains are
    attended in one call, a chain reads again only the keys of the chunk (KEY_CHUNK) the tree
    starts in."""
    if one_call and extension() is None:
        pytest.skip("needs the native extension")
    if not one_call:
        monkeypatch.setattr(model_module, "native_extension", lambda: None)
    model = target_model("int4", "auto")
    _, engine = engines(model, 8, max_ctx=640)
    assert model.attends_trees_in_one_call(engine.kv) == one_call
    own = Engine.CHAIN_IN_ONE_CALL if one_call else Engine.ATTENTION_CALL
    assert engine.chain_cost() == pytest.approx(own)
    weights, per_token = engine._step_bytes
    assert per_token == 2 * model.args.num_layers * model.args.num_kv_heads * model.args.head_dim * 2  # bf16 keys, values
    for length, read in ((64, 64), (120, 120), (600, 600 - model_module.KEY_CHUNK * 2 if one_call else 600)):
        engine.kv.length = length
        assert engine.chain_cost() == pytest.approx(own + read * per_token / (weights + length * per_token))
    engine.kv.length = 0


def test_short_blocks_propose_trees_within_their_depth_and_decode_plain_greedy():
    """The adaptive policy asks an unsure drafter for short blocks (SpeculationPolicy._next_depth):
    their trees stay within the drafts asked for, and the tokens are still plain greedy's."""
    model = target_model("int4", "auto")
    plain_engine, tree_engine = engines(model, 48)
    plain = plain_engine.start(PROMPT, SamplingParams(), 48).run()
    tree_engine.speculation = attrs.evolve(tree_engine.speculation, adaptive=True)
    drafter, asked, slots = tree_engine.dflash_drafter, [], []
    propose_tree, slot_logits = drafter.propose_tree, drafter._slot_logits

    def recording(tokens, rows, depth=None):
        tree = propose_tree(tokens, rows, depth)
        asked.append((depth, tree.depth))
        return tree

    def block_slots(tokens, drafts):
        logits = slot_logits(tokens, drafts)
        slots.append(None if logits is None else logits.shape[0])
        return logits

    drafter.propose_tree, drafter._slot_logits = recording, block_slots
    assert tree_engine.start(PROMPT, SamplingParams(), 48).run() == plain
    assert any(depth is not None for depth, _ in asked)  # a random-weight drafter is unsure
    for (depth, got), drafts in zip(asked, slots):  # the drafter ran a block of `depth` drafts
        assert drafts == (drafter.block_size - 1 if depth is None else depth) and 0 < got <= drafts
