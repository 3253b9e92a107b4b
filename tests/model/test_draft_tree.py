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


def engines(model, tokens: int):
    """Plain greedy (with a drafter capturing rows, never asked) and tree-verifying DFlash."""
    draft = random_draft_model(tiny_config(block_size=8), seed=3, dtype=torch.bfloat16)
    plain = Engine(model, max_ctx=128, prefill_chunk=8, dflash_drafter=DFlashDrafter(draft, model, 128))
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, adaptive=False)
    tree = Engine(model, max_ctx=128, prefill_chunk=8, speculation=config, dflash_drafter=DFlashDrafter(draft, model, 128))
    return plain, tree


def oracle_trees(engine, expected: list[int]):
    """The drafter proposes trees whose first chain is wrong and whose second holds the next tokens
    of `expected` (a sibling wrong again under it): every step keeps a path off chain 0."""
    drafter = engine.dflash_drafter

    def propose_tree(tokens, rows):
        if drafter.length != len(tokens) - 1:
            return DraftTree((), ())
        p = len(tokens) - len(PROMPT)
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


@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_the_drafters_own_trees_decode_plain_greedy_and_seeded_sampling(weights):
    model = target_model(weights, "auto")
    plain_engine, tree_engine = engines(model, 32)
    for sampling in (SamplingParams(repetition_penalty=1.2), SamplingParams(temperature=0.8, seed=7)):
        plain = plain_engine.start(PROMPT, sampling, 32).run()
        trees = []
        propose_tree = tree_engine.dflash_drafter.propose_tree
        tree_engine.dflash_drafter.propose_tree = lambda tokens, rows: trees.append(out := propose_tree(tokens, rows)) or out
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


def test_a_chain_costs_more_the_deeper_the_context():
    """One more attention call reads the cache once more: its share of a decode step's reads
    (weights and cache, as bytes) grows with the committed context."""
    model = target_model("int4", "auto")
    _, engine = engines(model, 8)
    assert engine.chain_cost() == pytest.approx(Engine.ATTENTION_CALL)
    weights, per_token = engine._step_bytes
    assert per_token == 2 * model.args.num_layers * model.args.num_kv_heads * model.args.head_dim * 2  # bf16 keys, values
    engine.kv.length = 64
    cache = 64 * per_token
    assert engine.chain_cost() == pytest.approx(Engine.ATTENTION_CALL + cache / (weights + cache))
    engine.kv.length = 120
    assert engine.chain_cost() > Engine.ATTENTION_CALL + cache / (weights + cache)
    engine.kv.length = 0
