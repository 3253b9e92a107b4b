"""The DFlash drafter: z-lab checkpoint layout, incremental context cache, lossless decoding."""

import json

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.engine.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DraftLoadError,
    build_target_layer_ids,
    load_dflash_checkpoint,
    random_draft_model,
    save_dflash_checkpoint,
)
from dflash.engine.generate import Engine
from dflash.engine.model import rope_tables
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.tiny import ours_from_hf, tiny_hf_model


def tiny_config(block_size=4, **overrides):
    fields = dict(hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  block_size=block_size, mask_token_id=127, target_layer_ids=(0, 2), num_target_layers=3,
                  vocab_size=128, rope_theta=10000.0)
    fields.update(overrides)
    return DFlashConfig(**fields)


@pytest.fixture(scope="module")
def target():
    return ours_from_hf(tiny_hf_model("qwen3"))


def test_default_target_layer_ids_follow_the_reference_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 4) == [1, 10, 18, 27]
    assert build_target_layer_ids(30, 1) == [15]


def test_checkpoint_round_trips_in_the_zlab_layout(tmp_path):
    model = random_draft_model(tiny_config(), seed=3)
    save_dflash_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 4 and config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 2]}
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    loaded = load_dflash_checkpoint(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_missing_tensor_or_wrong_shape_is_a_clear_error(tmp_path):
    save_dflash_checkpoint(random_draft_model(tiny_config()), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["layers.0.self_attn.q_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="missing.*layers.0.self_attn.q_norm.weight"):
        load_dflash_checkpoint(tmp_path)
    save_dflash_checkpoint(random_draft_model(tiny_config()), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["fc.weight"] = torch.zeros(64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftLoadError, match=r"fc.weight.*\(64, 64\).*\(64, 128\)"):
        load_dflash_checkpoint(tmp_path)


def test_mismatched_target_is_refused(target):
    with pytest.raises(DraftLoadError, match="hidden_size 32"):
        DFlashDrafter(random_draft_model(tiny_config(hidden_size=32, head_dim=8)), target, 64)


def test_incremental_context_equals_one_shot_context(target):
    """Feeding context in pieces (with a rollback) proposes what one fresh pass proposes."""
    draft = random_draft_model(tiny_config(block_size=5), seed=1)
    ids = [5, 9, 33, 2, 7, 100, 4, 61]

    def captured(tokens):
        kv = target.new_kv_cache(64)
        _, hidden = target(torch.tensor(tokens), 0, kv, capture_layers=(0, 2))
        return hidden

    def observe(drafter, start, hidden):  # as Engine.forward feeds it, from states given as tensors
        drafter.rows_at(start, hidden[0].shape[0]).copy_(torch.cat(hidden, dim=-1))
        drafter.observed(start, hidden[0].shape[0])

    fresh = DFlashDrafter(draft, target, 64)
    observe(fresh, 0, captured(ids))
    expected = fresh.propose(ids + [11], 4)

    stepwise = DFlashDrafter(draft, target, 64)
    full = captured(ids + [50, 51])
    observe(stepwise, 0, [h[:3] for h in full])
    stepwise.propose(ids[:3] + [ids[3]], 4)  # projects the first three rows into its cache
    observe(stepwise, 3, [h[3:] for h in full])  # ... then rows 3..9, of which 8 and 9 get rejected
    stepwise.crop(8)
    assert stepwise.propose(ids + [11], 4) == expected
    assert len(expected) == 4


def test_a_windowed_drafter_drafts_from_its_last_rows_as_a_drafter_given_only_those(target):
    """With a window of W rows, a proposal over a longer context is bit for bit what a drafter that
    was given only the last W rows proposes (positions shifted: RoPE sees distances); the cache
    starts afresh once it would hold more than 2W rows, and after a rollback below its start."""
    draft = random_draft_model(tiny_config(block_size=4), seed=2)
    ids = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 17, 44, 3, 8, 21, 55, 6]
    kv = target.new_kv_cache(64)
    _, hidden = target(torch.tensor(ids), 0, kv, capture_layers=(0, 2))
    rows = torch.cat(hidden, dim=-1)

    def observe(drafter, start, end):
        drafter.rows_at(start, end - start).copy_(rows[start:end])
        drafter.observed(start, end - start)

    windowed = DFlashDrafter(draft, target, 64, window=4)
    observe(windowed, 0, 12)
    assert windowed.pending_rows() == 4
    logits = windowed._slot_logits(ids[:12] + [11], 3)
    assert (windowed.offset, windowed.kv.length) == (8, 4)
    given = DFlashDrafter(draft, target, 64, window=None)
    given.rows_at(0, 4).copy_(rows[8:12])
    given.observed(0, 4)
    assert torch.equal(logits, given._slot_logits(ids[8:12] + [11], 3))

    observe(windowed, 12, 16)  # 8 rows from the start: still one cache
    assert windowed.pending_rows() == 4
    windowed._slot_logits(ids[:16] + [11], 3)
    assert (windowed.offset, windowed.kv.length) == (8, 8)
    observe(windowed, 16, 17)  # 9: afresh at the last 4
    assert windowed.pending_rows() == 4
    windowed._slot_logits(ids + [11], 3)
    assert (windowed.offset, windowed.kv.length) == (13, 4)
    windowed.crop(12)  # below the cache's start: nothing of it is kept
    assert (windowed.offset, windowed.kv.length, windowed.pending_rows()) == (0, 0, 4)
    assert windowed.propose(ids[:12] + [11], 3) == greedy_ids(logits)


def greedy_ids(logits):
    return logits.float().argmax(-1).tolist()


def test_a_drafter_with_a_short_window_still_decodes_plain_greedy(target):
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 17, 44, 3, 8, 21, 55]
    plain = Engine(target, max_ctx=128, prefill_chunk=4).start(prompt, SamplingParams(), 40).run()
    drafter = DFlashDrafter(random_draft_model(tiny_config(block_size=4), seed=4), target, 128, window=3)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False)
    engine = Engine(target, max_ctx=128, prefill_chunk=4, speculation=config, dflash_drafter=drafter)
    generation = engine.start(prompt, SamplingParams(), 40)
    assert generation.run() == plain
    assert generation.stats.verification_steps > 5 and drafter.offset > len(prompt)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_dflash_greedy_equals_plain_greedy(target, block_size):
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90]
    sampling = SamplingParams(repetition_penalty=1.2)
    plain = Engine(target, max_ctx=128, prefill_chunk=4).start(prompt, sampling, 20).run()
    drafter = DFlashDrafter(random_draft_model(tiny_config(block_size=block_size), seed=block_size), target, 128)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=block_size - 1, adaptive=False)
    engine = Engine(target, max_ctx=128, prefill_chunk=4, speculation=config, dflash_drafter=drafter)
    generation = engine.start(prompt, sampling, 20)
    assert generation.run() == plain
    assert generation.stats.verification_steps > 0
    assert generation.stats.draft_tokens >= generation.stats.verification_steps


def test_drafter_context_is_restored_with_a_prefix_cache_hit(target):
    """The drafter's rows of a boundary built on the one before are that one's rows and a copy of
    the rest (not a second copy of all); restored after the live state moved elsewhere, the drafter
    has its whole context back and the output is plain greedy's."""
    from dflash.engine.prefix_cache import PrefixCache

    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90]
    plain = Engine(target, max_ctx=128).start(prompt + [3, 3], SamplingParams(), 12).run()
    drafter = DFlashDrafter(random_draft_model(tiny_config(block_size=4), seed=9), target, 128)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False)
    engine = Engine(target, max_ctx=128, speculation=config, dflash_drafter=drafter,
                    prefix_cache=PrefixCache(4, 1 << 30))
    engine.start(prompt + [1, 2], SamplingParams(), 4, snapshot_at=[4, len(prompt)]).run()
    entries = {len(key): entry for key, entry in engine.prefix_cache._entries.items()}
    shallow, deep = entries[4].draft_rows, entries[len(prompt)].draft_rows
    assert len(shallow) == 1 and len(deep) == 2 and deep[0] is shallow[0] and deep[1].shape[0] == len(prompt) - 4
    whole = drafter.rows[: len(prompt)].clone()
    engine.start([7, 7, 7, 7], SamplingParams(), 4).run()  # the live state moves elsewhere
    generation = engine.start(prompt + [3, 3], SamplingParams(), 12)
    assert generation.stats.cached_tokens == len(prompt)
    assert torch.equal(drafter.rows[: len(prompt)], whole)
    assert generation.run() == plain
    assert generation.stats.draft_tokens > 0  # the drafter had its context back at once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_propose_what_the_checkpoint_layout_proposes(target, dtype):
    """Serving fuses each layer's k/v and gate/up projections (fewer calls a proposal); the fused
    drafter's outputs are the unfused ones (bit for bit in fp32, where the sums are the same)."""
    def hidden(tokens):
        _, rows = target(torch.tensor(tokens), 0, target.new_kv_cache(64), capture_layers=(0, 2))
        return [r.to(dtype) for r in rows]

    ids = [5, 9, 33, 2, 7, 100, 4, 61, 12]
    plain = random_draft_model(tiny_config(block_size=6), seed=4, dtype=dtype)
    fused = random_draft_model(tiny_config(block_size=6), seed=4, dtype=dtype).fuse_projections()
    assert "kv_proj" in fused.layers[0].self_attn._modules and "k_proj" not in fused.layers[0].self_attn._modules
    assert "gate_up_proj" in fused.layers[1].mlp._modules
    kv = [DFlashDrafter(model, target, 64).kv for model in (plain, fused)]
    cos, sin = rope_tables(plain.inv_freq.float(), 64, 1.0, dtype, "cpu")
    block = target.embed(torch.tensor([11, 127, 127, 127, 127, 127])).to(dtype)
    for start, end in ((0, 5), (5, 9)):  # a first proposal, then one with more context
        outs = [model(model.project_context(torch.cat(hidden(ids), -1)[start:end]), block, cache,
                      cos.unsqueeze(1), sin.unsqueeze(1)) for model, cache in zip((plain, fused), kv)]
        if dtype == torch.float32:
            torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_a_draft_vocabulary_limits_the_drafts_and_greedy_stays_plain_greedy(target, weights):
    """Drafts scored against a subset of the LM head's rows are always ids of that subset (the argmax
    over those rows, mapped back), and the target still decides every token."""
    from dflash.engine.quant import quantize_linears

    model = ours_from_hf(tiny_hf_model("qwen3"), dtype=torch.bfloat16)
    quantize_linears(model, weights)
    prompt = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90]
    plain = Engine(model, max_ctx=128).start(prompt, SamplingParams(), 24).run()
    vocabulary = list(range(0, 128, 2))  # 64 ids: a multiple of the int8 kernel's 16 rows
    draft = random_draft_model(tiny_config(block_size=4), seed=4, dtype=torch.bfloat16)
    drafter = DFlashDrafter(draft, model, 128, vocabulary=vocabulary)
    assert drafter.head.out_features == 64
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False)
    engine = Engine(model, max_ctx=128, speculation=config, dflash_drafter=drafter)
    proposed = []
    propose, propose_tree = drafter.propose, drafter.propose_tree
    drafter.propose = lambda tokens, n: proposed.extend(out := propose(tokens, n)) or out
    drafter.propose_tree = lambda tokens, n, depth=None: proposed.extend((out := propose_tree(tokens, n, depth)).tokens) or out
    for rows in (7, 0):  # a tree's every candidate, and a chain
        engine.speculation = attrs.evolve(config, tree_rows=rows)
        generation = engine.start(prompt, SamplingParams(), 24)
        assert generation.run() == plain
        assert proposed and set(proposed) <= set(vocabulary)
        proposed.clear()
    with pytest.raises(DraftLoadError, match="outside the target's 128"):
        DFlashDrafter(draft, model, 128, vocabulary=[0, 128])


def test_a_malformed_draft_vocabulary_is_refused_naming_its_file(tmp_path):
    from dflash.engine.loading import draft_vocabulary

    assert draft_vocabulary(tmp_path) is None
    (tmp_path / "draft_vocab.json").write_text('{"ids": [1, -2]}')
    with pytest.raises(DraftLoadError, match="draft_vocab.json.*token ids"):
        draft_vocabulary(tmp_path)
    (tmp_path / "draft_vocab.json").write_text("not json")
    with pytest.raises(DraftLoadError, match="draft_vocab.json: not a draft vocabulary"):
        draft_vocabulary(tmp_path)
    (tmp_path / "draft_vocab.json").write_text('{"ids": [3, 1, 2]}')
    assert draft_vocabulary(tmp_path) == [3, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_on_the_native_kernel_matches_torch(dtype):
    """The drafter's attention (every block row sees every key) through causal_attention.cpp, with
    the rows as query heads of one row at the last position, equals torch's unmasked SDPA."""
    from dflash.engine.drafters.dflash import block_attention
    from dflash.engine.model import grouped_query_attention
    from dflash.engine.native import extension

    if extension() is None or not extension().causal_attention_available():
        pytest.skip("the native kernels are not built here")
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(8, 9, 64, generator=generator).to(dtype)
    keys, values = (torch.randn(3, 300, 64, generator=generator).to(dtype) for _ in range(2))
    expected = grouped_query_attention(q.float(), keys.float(), values.float(), None).reshape(8, 9, 64)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(block_attention(q, keys, values).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kind", ["Int8Linear", "Int4Linear"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_served_drafter_s_native_layers_equal_its_python_layers_bit_for_bit(target, cache_dtype, kind, monkeypatch):
    """draft_layers (decode_layers.cpp) runs DFlashDraftModel.forward as served (bf16, fused, int8
    linears, or int4 ones where the CPU has AVX2 alone: quant.draft_linear_kind): the same block
    outputs and cache rows as the Python layers, with new context rows and without, over an fp32
    or a bf16 cache."""
    import dflash.engine.drafters.dflash as dflash_module
    import dflash.engine.quant as quant
    from dflash.engine.kv import KVCache
    from dflash.engine.native import extension

    if extension() is None or not extension().int8dot_available():
        pytest.skip("the native kernels are not built here")
    c = tiny_config(block_size=8, hidden_size=64, intermediate_size=96, head_dim=16)
    draft = random_draft_model(c, seed=5, dtype=torch.bfloat16).fuse_projections()
    monkeypatch.setattr(quant, "draft_linear_kind", lambda: getattr(quant, kind))
    quant.quantize_draft_linears(draft)
    assert all(type(m) is getattr(quant, kind) for m in draft.modules() if isinstance(m, quant.QuantizedLinear))
    assert draft.native_arguments() is not None
    cos, sin = rope_tables(draft.inv_freq.float(), 64, 1.0, torch.bfloat16, "cpu")
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    generator = torch.Generator().manual_seed(2)
    context = torch.randn(12, 64, generator=generator).bfloat16()
    block = torch.randn(8, 64, generator=generator).bfloat16()

    def run(native: bool):
        kv = KVCache(c.num_layers, c.num_kv_heads, 64, c.head_dim, cache_dtype, "cpu")
        outs = []
        with monkeypatch.context() as patch, torch.inference_mode():
            if not native:
                patch.setattr(dflash_module, "native_extension", lambda: None)
            outs.append(draft(context[:9], block, kv, cos, sin))  # 9 new context rows
            outs.append(draft(context[9:], block, kv, cos, sin))  # 3 more
            outs.append(draft(context[:0], block, kv, cos, sin))  # none
        return outs, kv.keys[:, :, :20].clone(), kv.values[:, :, :20].clone()

    native, python = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(native[0], python[0]))
    assert torch.equal(native[1], python[1]) and torch.equal(native[2], python[2])


def test_the_served_drafter_is_int4_where_our_kernels_run_on_avx2_alone_and_int8_elsewhere(target, monkeypatch):
    """quant.draft_linear_kind: AVX2 without VNNI splits an int8 weight into two nibbles, so a
    drafter's rows cost twice an int4 one's there; with VNNI (or torch's kernels) int8 stays. The
    head's draft-vocabulary rows follow the layers."""
    import dflash.engine.quant as quant
    from dflash.engine.native import extension

    if extension() is None or not extension().int8dot_available():
        pytest.skip("the native kernels are not built here")
    monkeypatch.delenv("DFLASH_KERNELS", raising=False)  # our kernels, whatever the run forces
    c = tiny_config(block_size=4, hidden_size=64, intermediate_size=96, head_dim=16)
    expected = {"avx2": quant.Int4Linear}
    if extension().vnni_available():
        expected["vnni"] = quant.Int8Linear
    for isa, kind in expected.items():
        monkeypatch.setenv("DFLASH_INT8DOT_ISA", isa)
        assert quant.draft_linear_kind() is kind
        draft = random_draft_model(c, seed=5, dtype=torch.bfloat16).fuse_projections()
        quant.quantize_draft_linears(draft)
        assert {type(m) for m in draft.modules() if isinstance(m, quant.QuantizedLinear)} == {kind}
        drafter = DFlashDrafter(draft, target, 64, vocabulary=list(range(0, 64, 2)))
        assert type(drafter.head) is kind and drafter.head.out_features == 32
        # a draft vocabulary of rows that int4's blocks of 16 do not fit keeps an int8 head
        assert type(DFlashDrafter(draft, target, 64, vocabulary=list(range(0, 48, 2))).head) is quant.Int8Linear
    monkeypatch.setenv("DFLASH_KERNELS", "torch")
    assert quant.draft_linear_kind() is quant.Int8Linear


def test_a_proposal_after_a_long_prompt_says_how_long_its_context_took_to_catch_up(target):
    """The rows a prompt left pending (more than CATCH_UP_ROWS) are timed apart, for the policy to
    leave out: their projection and their share of the drafter's layers by rows; a proposal after a
    verified step has none."""
    import time

    from dflash.engine.drafters.dflash import CATCH_UP_ROWS

    class SlowLayers:  # the drafter's layers take 50 ms a call whatever its rows
        def __init__(self, draft):
            self.draft = draft

        def __getattr__(self, name):
            return getattr(self.draft, name)

        def __call__(self, *args):
            time.sleep(0.05)
            return self.draft(*args)

    drafter = DFlashDrafter(random_draft_model(tiny_config(block_size=4), seed=9), target, 256)
    drafter.draft = SlowLayers(drafter.draft)
    config = SpeculationConfig(drafter="dflash", max_draft_tokens=3, adaptive=False)
    engine = Engine(target, max_ctx=256, speculation=config, dflash_drafter=drafter)
    prompt = [5 + i % 90 for i in range(CATCH_UP_ROWS + 20)]
    generation = engine.start(prompt, SamplingParams(), 8)
    generation.step()  # the prefill, and the first token
    pending = drafter.pending_rows()
    assert pending > CATCH_UP_ROWS
    assert drafter.propose(engine.committed + generation.output[-1:], 3)
    assert drafter.catch_up_seconds >= 0.05 * pending / (pending + 4) and drafter.pending_rows() == 0
    generation.step()  # a verified step: the drafter's context follows it
    drafter.propose(engine.committed + generation.output[-1:], 3)
    assert drafter.catch_up_seconds == 0.0


def test_the_proposal_bench_drives_the_drafter_as_the_engine_does(target):
    """bench/propose.py writes the drafter's context rows where the target's forward writes them
    (rows_at, observed); it called a method that had moved into a test and stopped running unnoticed."""
    from bench.propose import CONTEXT, drafter_with_context, proposal

    drafter, rows = drafter_with_context(random_draft_model(tiny_config(), seed=1), target)
    tokens = [i % 100 for i in range(CONTEXT)] + [5]  # the committed tokens and the pending one
    drafts = proposal(drafter, rows, tokens)()
    assert len(drafts) == drafter.block_size - 1 and all(0 <= t < 128 for t in drafts)


@pytest.mark.parametrize("dtype,weights", [("bfloat16", "bf16"), ("float32", "fp32"), ("bfloat16", "int4")])
def test_the_served_drafter_is_quantized_where_our_kernels_run_with_bf16_activations(dtype, weights):
    """loading.serving_draft: int8 linears (int4 on AVX2 alone: quant.draft_linear_kind; its layers
    then one C++ call) on a quantized target, and on a bf16 one where our int8 kernels run; fp32
    activations keep the checkpoint's linears."""
    from dflash.engine.loading import SHIPPED_DRAFTERS, serving_draft
    from dflash.engine.quant import draft_linear_kind, kernels

    draft = serving_draft(SHIPPED_DRAFTERS["embedded:smollm2-135m-instruct"], dtype, weights)
    quantized = weights == "int4" or (dtype == "bfloat16" and kernels() == "int8-dot")
    assert isinstance(draft.layers[0].mlp.down_proj, draft_linear_kind()) == quantized
    assert isinstance(draft.fc, draft_linear_kind()) == quantized
