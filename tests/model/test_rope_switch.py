"""A RoPE scaling that switches in past the trained context (with_rope_scaling's default): a sequence
within it runs the model as trained, one past it the scaled model over keys rotated once; the
result does not depend on how calls, speculation or caches cut the sequence."""

import pytest
import torch

from dflash.engine.drafters.dflash import DFlashDrafter, random_draft_model
from dflash.engine.generate import Engine
from dflash.engine.model import ModelArgs, build_transformer, with_rope_scaling
from dflash.engine.native import extension
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.quant import quantize_linears
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.test_dflash import tiny_config
from tests.model.test_draft_tree import oracle_trees
from tests.model.tiny import tiny_hf_model

TRAINED = 256  # tiny.py's max_position_embeddings
MAX_CTX = 4 * TRAINED


def models(dtype, static_too: bool = True, **sizes):
    """The switched model, and the static and unscaled ones with the same weights."""
    hf = tiny_hf_model("qwen3", **sizes)
    plain = ModelArgs.from_hf_config(hf.config.to_dict())
    built = [build_transformer(args, hf.state_dict(), dtype) for args in (
        with_rope_scaling(plain, MAX_CTX, "yarn"), with_rope_scaling(plain, MAX_CTX, "yarn", static=True), plain)]
    return built if static_too else built[0]


def exact_model(cache: str = "auto"):
    """The switched model on int4 weights: our kernels compute a row the same way in any call, so
    results can be compared bit for bit whatever cut the sequence (bf16 weights are so only in
    calls of up to FEW_ROWS rows). `cache` "int8": its keys' codes are rotated and quantized again."""
    if extension() is None:
        pytest.skip("needs the native extension")
    if cache == "int8" and not extension().int8_kv_available():
        pytest.skip("an int8 cache needs AVX512-VNNI")
    model = models(torch.bfloat16, static_too=False)
    quantize_linears(model, "int4")
    model.kv_cache = cache
    return model


CACHES = pytest.mark.parametrize("cache", ["auto", "int8"])


def test_a_chosen_scaling_switches_in_past_the_trained_context_unless_static():
    plain = ModelArgs.from_hf_config(tiny_hf_model("llama").config.to_dict())
    assert with_rope_scaling(plain, MAX_CTX, "auto").rope_scaling["plain_within"] == TRAINED
    assert "plain_within" not in with_rope_scaling(plain, MAX_CTX, "auto", static=True).rope_scaling
    assert "plain_within" not in with_rope_scaling(plain, TRAINED, "yarn").rope_scaling  # factor 1: nothing to switch
    declared = ModelArgs.from_hf_config(tiny_hf_model("yarn-rope").config.to_dict())
    assert with_rope_scaling(declared, MAX_CTX, "auto") == declared  # a declared scaling is the model's own


def test_within_the_trained_context_the_model_is_as_trained_and_past_it_the_scaled_one():
    """With one layer every key and value below the switch is a function of its token alone, so the
    switched model past it must equal the static one there: the rotation is the scaled RoPE's."""
    switched, static, plain = models(torch.float32, num_hidden_layers=1)
    ids = torch.randint(0, 128, (3 * TRAINED,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, model in (("switched", switched), ("static", static), ("plain", plain)):
        logits[name], _ = model(ids, 0, model.new_kv_cache(MAX_CTX), logits_positions=None)
    assert torch.equal(logits["switched"][:TRAINED], logits["plain"][:TRAINED])
    torch.testing.assert_close(logits["switched"][TRAINED:], logits["static"][TRAINED:], atol=2e-6, rtol=0)
    assert (logits["plain"][TRAINED:] - logits["static"][TRAINED:]).abs().max() > 1e-3  # the scalings differ there


@CACHES
def test_where_calls_begin_and_end_changes_nothing_across_the_switch(cache):
    model = exact_model(cache)
    ids = torch.randint(0, 128, (2 * TRAINED,), generator=torch.Generator().manual_seed(2))
    rows = torch.zeros(len(ids), 2 * model.args.hidden_size, dtype=torch.bfloat16)  # a DFlash drafter's rows
    whole, captured = model(ids, 0, kv := model.new_kv_cache(MAX_CTX), logits_positions=None, capture_layers=(2, 0))
    assert kv.rope_rotated and [c.shape[0] for c in captured] == [len(ids)] * 2
    chunked = model.new_kv_cache(MAX_CTX)
    pieces = [model(ids[s : s + 100], s, chunked, logits_positions=None, capture_layers=(2, 0),
                    capture_into=rows[s : s + 100])[0] for s in range(0, len(ids), 100)]
    assert torch.equal(torch.cat(pieces), whole) and torch.equal(chunked.keys, kv.keys)
    assert torch.equal(rows, torch.cat(captured, dim=-1))
    stepped = model.new_kv_cache(MAX_CTX)
    model(ids[: TRAINED - 3], 0, stepped)
    steps = [model(ids[p : p + 1], p, stepped)[0] for p in range(TRAINED - 3, TRAINED + 5)]
    assert torch.equal(torch.cat(steps), whole[TRAINED - 3 : TRAINED + 5])
    # Rows asked for out of order, on both sides of the switch, come back in that order; by default the last.
    for positions, rows in (([6, 1, 7], [6, 1, 7]), (slice(-1, None), [7])):
        picking = model.new_kv_cache(MAX_CTX)
        model(ids[: TRAINED - 4], 0, picking)
        picked, _ = model(ids[TRAINED - 4 : TRAINED + 4], TRAINED - 4, picking, logits_positions=positions)
        assert torch.equal(picked, whole[[TRAINED - 4 + row for row in rows]])


def speculative_engines(model, tree: bool):
    if tree:
        draft = random_draft_model(tiny_config(block_size=8), seed=3, dtype=torch.bfloat16)
        plain = Engine(model, max_ctx=MAX_CTX, prefill_chunk=64, dflash_drafter=DFlashDrafter(draft, model, MAX_CTX))
        config = SpeculationConfig(drafter="dflash", max_draft_tokens=7, adaptive=False)
        return plain, Engine(model, max_ctx=MAX_CTX, prefill_chunk=64, speculation=config,
                             dflash_drafter=DFlashDrafter(draft, model, MAX_CTX))
    ngram = SpeculationConfig(drafter="ngram", max_draft_tokens=6, ngram_min=1, ngram_max=3, adaptive=False)
    return (Engine(model, max_ctx=MAX_CTX, prefill_chunk=64),
            Engine(model, max_ctx=MAX_CTX, prefill_chunk=64, speculation=ngram))


@CACHES
@pytest.mark.parametrize("tree", [True, False])
def test_speculation_across_the_switch_decodes_plain_greedy(tree, cache):
    """No verification straddles the switch (Engine.draft_room): the rows below it are decoded as
    plain decoding decodes them, and the keys are rotated once, at the same point."""
    model = exact_model(cache)
    prompt = [(7 * i + 3) % 120 for i in range(TRAINED - 22)]
    plain_engine, speculating = speculative_engines(model, tree)
    plain = plain_engine.start(prompt, SamplingParams(), 48).run()
    if tree:
        oracle_trees(speculating, plain, prompt)
    generation = speculating.start(prompt, SamplingParams(), 48)
    assert generation.run() == plain
    assert generation.stats.verification_steps > 0 and generation.stats.accepted_tokens > 0
    length = plain_engine.kv.length
    assert length > TRAINED and speculating.kv.rope_rotated and plain_engine.kv.rope_rotated
    for name in ("keys", "values") + (("key_scales", "value_scales") if cache == "int8" else ()):
        assert torch.equal(getattr(speculating.kv, name)[:, :, :length], getattr(plain_engine.kv, name)[:, :, :length])


@CACHES
def test_a_state_past_the_switch_is_not_reused_below_it_and_caches_keep_each_side_apart(cache):
    model = exact_model(cache)
    long = [(5 * i + 1) % 120 for i in range(TRAINED + 40)]
    shorter = long[:240] + [3, 4, 5]  # shares 240 tokens, all below the switch
    longer = long + [9, 8, 7]  # continues the long one past the switch

    def fresh(prompt):
        return Engine(model, max_ctx=MAX_CTX, prefill_chunk=64).start(prompt, SamplingParams(), 12).run()

    # Prefill chunks of 100: the one from 200 pauses at the switch, so the boundary at 230 is kept
    # before the keys are rotated.
    engine = Engine(model, max_ctx=MAX_CTX, prefill_chunk=100, prefix_cache=PrefixCache(8, 1 << 30))
    first = engine.start(long, SamplingParams(), 12, snapshot_at=[50, 230, TRAINED + 10])
    assert first.run() == fresh(long) and engine.kv.rope_rotated
    # The live state's rotated keys cannot serve `shorter`; the boundary at 230 (kept unrotated) can.
    second = engine.start(shorter, SamplingParams(), 12)
    assert second.run() == fresh(shorter)
    assert second.stats.cached_tokens == 230 and not engine.kv.rope_rotated
    # The snapshot past the switch is restored with its keys rotated.
    third = engine.start(longer, SamplingParams(), 12)
    assert third.run() == fresh(longer)
    assert third.stats.cached_tokens == TRAINED + 10 and engine.kv.rope_rotated
    kv = engine.kv
    with pytest.raises(ValueError, match="rotated"):
        kv.snapshot(TRAINED - 1)
    kv.crop(TRAINED + 1)
    assert kv.length == TRAINED + 1 and kv.rope_rotated
    kv.crop(TRAINED - 1)
    assert kv.length == 0 and not kv.rope_rotated  # nothing of it can be kept


class PythonInt8Kernels:
    """quantize_kv's contract in Python (causal_attention.cpp: check_int8_layer's layout checks, then
    per row a scale of max |x| / 127 and rounded codes; keys stored + 128): where AVX512-VNNI is
    missing, it shows that an Int8KVCache's rotation hands the kernel views it accepts."""

    def int8_kv_available(self) -> bool:
        return True

    def quantize_kv(self, k, v, keys, values, key_scales, value_scales, start):
        assert keys.dim() == 3 and values.shape == keys.shape and keys.dtype == torch.uint8 and values.dtype == torch.int8
        assert keys.stride(2) == 1 and keys.stride(1) == keys.size(2) and values.stride() == keys.stride()
        assert key_scales.shape == keys.shape[:2] and key_scales.stride(1) == 1 and value_scales.stride() == key_scales.stride()
        assert k.dim() == 3 and k.shape[1:] == (keys.size(0), keys.size(2)) and v.shape == k.shape
        end = start + k.shape[0]
        for rows, codes, scales, offset in ((k, keys, key_scales, 128), (v, values, value_scales, 0)):
            x = rows.float().transpose(0, 1)  # [KV, T, D]
            scale = x.abs().amax(-1) / 127
            codes[:, start:end] = (torch.round(x / scale[..., None]).clamp(-127, 127) + offset).to(codes.dtype)
            scales[:, start:end] = scale


def test_an_int8_caches_keys_are_rotated_and_quantized_again_and_its_values_kept():
    from dflash.engine.kv import KEY_OFFSET, Int8KVCache, dequantized
    from dflash.engine.model import apply_rope, rope_rotation_tables

    switched, *_ = models(torch.float32)
    args, switch = switched.args, switched.rope_switch
    cache = Int8KVCache(2, args.num_kv_heads, MAX_CTX, args.head_dim, "cpu", PythonInt8Kernels(), rope_switch=switch)
    generator = torch.Generator().manual_seed(4)
    for layer in range(2):
        cache.write(layer, 0, *torch.randn(2, switch + 8, args.num_kv_heads, args.head_dim, generator=generator))
    cache.length = switch + 8
    keys = dequantized(cache.keys[:, :, :switch], cache.key_scales[:, :, :switch], KEY_OFFSET)
    values = (cache.values.clone(), cache.value_scales.clone(), cache.keys[:, :, switch:].clone())
    cos, sin = rope_rotation_tables(args, "cpu")
    cache.rotate_keys(lambda below: apply_rope(below, cos, sin))
    expected = apply_rope(keys, cos, sin)
    got = dequantized(cache.keys[:, :, :switch], cache.key_scales[:, :, :switch], KEY_OFFSET)
    assert (got - expected).abs().max() <= 0.51 * cache.key_scales[:, :, :switch].max() + 1e-6  # half a code
    assert (got - keys).abs().max() > 0.1  # they did turn
    assert torch.equal(cache.values, values[0]) and torch.equal(cache.value_scales, values[1])
    assert torch.equal(cache.keys[:, :, switch:], values[2]) and cache.rope_rotated
