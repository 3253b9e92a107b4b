"""Generation on a tiny random model: chunked prefill, stops, prefix reuse, stats."""

import torch

from dflash.engine.generate import Engine
from dflash.engine.sampling import SamplingParams
from tests.model.tiny import ours_from_hf, tiny_hf_model

PROMPT = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3]


def make_engine(prefill_chunk=4, eos=()):
    return Engine(ours_from_hf(tiny_hf_model("llama")), max_ctx=64, prefill_chunk=prefill_chunk, eos_token_ids=eos)


def reference_greedy(engine, prompt, n):
    """Greedy by full recomputation each step: no KV cache involved."""
    ids = list(prompt)
    for _ in range(n):
        kv = engine.model.new_kv_cache(64)
        logits, _ = engine.model(torch.tensor(ids), 0, kv)
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


def test_chunked_prefill_and_decode_equal_full_recomputation():
    engine = make_engine(prefill_chunk=4)
    generation = engine.start(PROMPT, SamplingParams(), max_tokens=10)
    steps = []
    while generation.finished is None:
        steps.append(generation.step())
    assert [s.phase for s in steps[:3]] == ["prefill"] * 3  # 11 tokens in chunks of 4
    assert steps[0].tokens == [] and len(steps[2].tokens) == 1
    assert generation.output == reference_greedy(engine, PROMPT, 10)
    assert generation.finished == "length"
    stats = generation.stats
    assert (stats.prompt_tokens, stats.prefilled_tokens, stats.generated_tokens) == (11, 11, 10)
    assert stats.prefill_ms > 0 and stats.decode_ms > 0


def test_eos_stops_without_emitting_the_eos_token():
    engine = make_engine()
    expected = reference_greedy(engine, PROMPT, 5)
    engine.eos_token_ids = frozenset({expected[3]})
    generation = engine.start(PROMPT, SamplingParams(), max_tokens=10)
    assert generation.run() == expected[: expected.index(expected[3])]
    assert generation.finished == "stop"


def test_next_prompt_reuses_the_live_prefix_and_gives_the_same_tokens():
    engine = make_engine()
    first = engine.start(PROMPT, SamplingParams(), max_tokens=4)
    first.run()
    follow_up = PROMPT + first.output + [8, 8, 1]
    generation = engine.start(follow_up, SamplingParams(), max_tokens=5)
    out = generation.run()
    assert generation.stats.cached_tokens == len(PROMPT) + 3  # the last generated token was never fed back
    assert generation.stats.prefilled_tokens == len(follow_up) - generation.stats.cached_tokens
    assert out == reference_greedy(engine, follow_up, 5)


def test_with_live_state_reuse_off_the_next_prompt_is_computed_from_scratch():
    engine = make_engine()
    engine.reuse_live_state = False
    first = engine.start(PROMPT, SamplingParams(), max_tokens=4)
    first.run()
    follow_up = PROMPT + first.output + [8, 8, 1]
    generation = engine.start(follow_up, SamplingParams(), max_tokens=5)
    out = generation.run()
    assert (generation.stats.cached_tokens, generation.stats.prefilled_tokens) == (0, len(follow_up))
    assert out == reference_greedy(engine, follow_up, 5)


def test_closing_mid_prefill_leaves_the_engine_ready():
    engine = make_engine(prefill_chunk=2)
    abandoned = engine.start([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), max_tokens=3)
    abandoned.step()
    abandoned.close()
    generation = engine.start(PROMPT, SamplingParams(), max_tokens=3)
    assert generation.run() == reference_greedy(engine, PROMPT, 3)


def test_max_tokens_is_clamped_to_the_room_left_in_the_context():
    engine = make_engine()
    generation = engine.start(list(range(1, 61)), SamplingParams(), max_tokens=100)
    assert len(generation.run()) == 4 and generation.finished == "length"


def test_prefix_cache_restores_the_deepest_boundary_and_outputs_stay_the_same(monkeypatch):
    from dflash.engine import generate
    from dflash.engine.prefix_cache import PrefixCache

    monkeypatch.setattr(generate, "EXACT_PROMPT_SLACK", 0)  # the exact prompt's snapshot, 4 tokens past a boundary
    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    engine.prompt_cache = PrefixCache(slots=2, budget_bytes=1 << 30)
    conversation = PROMPT + [44, 45, 46, 47]
    first = engine.start(conversation, SamplingParams(), max_tokens=3, snapshot_at=[5, 11])
    first.run()
    assert len(engine.prefix_cache) == 2 and len(engine.prompt_cache) == 1
    engine.rollback(0)  # forget the live state: only snapshots can help now
    other = engine.start(PROMPT[:11] + [9, 9, 9], SamplingParams(), max_tokens=4)
    out = other.run()
    assert other.stats.cached_tokens == 11 and other.stats.prefilled_tokens == 3
    assert out == reference_greedy(engine, PROMPT[:11] + [9, 9, 9], 4)
    engine.rollback(0)
    same = engine.start(conversation, SamplingParams(), max_tokens=3)
    assert same.run() == first.output
    assert same.stats.cached_tokens == len(conversation) - 1 and same.stats.prefilled_tokens == 1


def test_an_exact_prompt_just_past_a_boundary_gets_no_copy_of_its_own():
    """A chat prompt's last boundary closes its last message a few tokens short of the prompt's end;
    a second snapshot there was a near-identical copy of the whole cache (460 MB at 20K tokens) every
    turn. An identical request restores the boundary and computes the rest."""
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    engine.prompt_cache = PrefixCache(slots=2, budget_bytes=1 << 30)
    conversation = PROMPT + [44, 45, 46, 47]
    first = engine.start(conversation, SamplingParams(), max_tokens=3, snapshot_at=[len(conversation) - 3])
    first.run()
    assert len(engine.prefix_cache) == 1 and len(engine.prompt_cache) == 0
    engine.rollback(0)
    same = engine.start(conversation, SamplingParams(), max_tokens=3)
    assert same.run() == first.output
    assert (same.stats.cached_tokens, same.stats.prefilled_tokens) == (len(conversation) - 3, 3)


def test_prefix_cache_respects_its_slot_count_and_memory_budget():
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    per_token = engine.kv.snapshot(1).nbytes
    engine.prefix_cache = PrefixCache(slots=3, budget_bytes=per_token * 20)
    for offset in range(6):
        prompt = [offset + 1] * 12
        engine.start(prompt, SamplingParams(), max_tokens=1, snapshot_at=[4, 8]).run()
        assert len(engine.prefix_cache) <= 3 and engine.prefix_cache.nbytes <= per_token * 20


def test_a_checkpoint_recomputes_a_turn_rendered_with_other_tokens():
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    turn = engine.start(PROMPT, SamplingParams(), max_tokens=5).run()
    rendered = PROMPT + [turn[0], 77, 78] + [2, 7]  # the next request will tokenize the turn this way
    engine.checkpoint_prefix(rendered)
    assert len(engine.prefix_cache) == 0  # replaying a differing turn is opt-in
    engine.agent_turn_replay = True
    engine.checkpoint_prefix(rendered)
    engine.start([100, 101], SamplingParams(), max_tokens=1).run()
    follow_up = engine.start(rendered + [40], SamplingParams(), max_tokens=3)
    out = follow_up.run()
    assert follow_up.stats.cached_tokens == len(rendered) and follow_up.stats.agent_turn_cache_hit
    assert out == reference_greedy(engine, rendered + [40], 3)


def test_a_checkpointed_turn_serves_the_follow_up_after_another_request():
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    first = engine.start(PROMPT, SamplingParams(), max_tokens=5)
    turn = first.run()
    closing = [2, 7]  # what the template writes after the turn
    engine.checkpoint_prefix(PROMPT + turn + closing)
    engine.start([100, 101, 102], SamplingParams(), max_tokens=2).run()  # someone else ran meanwhile
    follow_up = PROMPT + turn + closing + [40, 41]  # + the tool result
    generation = engine.start(follow_up, SamplingParams(), max_tokens=4)
    out = generation.run()
    assert generation.stats.cached_tokens == len(PROMPT) + len(turn) + len(closing)
    assert generation.stats.prefilled_tokens == 2 and generation.stats.agent_turn_cache_hit
    assert out == reference_greedy(engine, follow_up, 4)


def test_continuing_the_live_state_through_a_generated_turn_counts_as_an_agent_turn_hit():
    engine = make_engine()
    turn = engine.start(PROMPT, SamplingParams(), max_tokens=5).run()
    follow_up = engine.start(PROMPT + turn + [2, 40], SamplingParams(), max_tokens=2)
    assert follow_up.stats.agent_turn_cache_hit and follow_up.stats.cached_tokens == len(PROMPT) + 4
    fresh = engine.start([9, 9, 9], SamplingParams(), max_tokens=2)
    assert not fresh.stats.agent_turn_cache_hit


def test_the_turn_cache_keeps_the_last_turn_of_each_of_two_interleaved_conversations():
    """Two agent conversations on one engine, with no turn checkpoint (the scheduler skips it when
    the other conversation's request is already waiting as a turn ends): each follow-up still
    restores its own generated turn, and computes only what it does not share with it."""
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    engine.agent_turn_cache = True
    system = PROMPT[:4]
    prompts = {"a": system + [7, 100, 4, 61, 12], "b": system + [8, 50, 51, 52, 53, 54]}
    turns = {name: engine.start(prompt, SamplingParams(), max_tokens=5, snapshot_at=[len(system)]).run()
             for name, prompt in prompts.items()}
    closing = [2, 7]  # what the template writes after a turn
    # a's follow-up renders its turn as generated; b's tokenizes the turn's end differently
    rendered = {"a": turns["a"], "b": turns["b"][:2] + [77, 78]}
    assert turns["b"][2] != 77
    for name, tool_result in (("a", [40, 41]), ("b", [42, 43, 44])):  # the other one ran in between
        follow_up = prompts[name] + rendered[name] + closing + tool_result
        generation = engine.start(follow_up, SamplingParams(), max_tokens=4)
        out = generation.run()
        assert generation.stats.agent_turn_cache_hit
        # a: all but the last generated token, which was never fed back; b: up to the difference
        assert generation.stats.cached_tokens == len(prompts[name]) + (4 if name == "a" else 2)
        assert out == reference_greedy(engine, follow_up, 4)
    assert len(engine.prefix_cache) <= 4


def test_a_boundary_snapshot_copies_only_the_positions_past_the_snapshot_it_extends():
    """A conversation's next boundary is built on the one before (an agent's turn 2 copied the whole
    20K-token cache, 460 MB, at each of its boundaries); restored from scratch it gives what the
    whole copy gave, and the memory counted is each position once."""
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.prefix_cache = PrefixCache(slots=4, budget_bytes=1 << 30)
    conversation = PROMPT + [44, 45, 46, 47]
    engine.start(conversation, SamplingParams(), max_tokens=2, snapshot_at=[5, 11]).run()
    entries = {len(key): entry for key, entry in engine.prefix_cache._entries.items()}
    shallow, deep = entries[5].snapshot, entries[11].snapshot
    assert deep.base is shallow and deep.keys.shape[2] == 6 and shallow.keys.shape[2] == 5
    per_token = engine.kv.snapshot(1).nbytes
    assert engine.prefix_cache.nbytes == 11 * per_token
    whole = engine.kv.snapshot(11)
    engine.rollback(0)
    engine.kv.keys.fill_(float("nan"))  # nothing of the live state may survive into the restore
    engine.kv.values.fill_(float("nan"))
    other = engine.start(PROMPT[:11] + [9, 9, 9], SamplingParams(), max_tokens=4)
    out = other.run()
    assert other.stats.cached_tokens == 11
    assert torch.equal(engine.kv.keys[:, :, :11], whole.keys) and torch.equal(engine.kv.values[:, :, :11], whole.values)
    assert out == reference_greedy(engine, PROMPT[:11] + [9, 9, 9], 4)


def test_a_restore_copies_only_the_positions_the_live_state_does_not_share():
    engine = make_engine()
    engine.start(PROMPT, SamplingParams(), max_tokens=1).run()
    snapshot = engine.kv.snapshot(10)
    engine.kv.keys[:, :, :4] = 7.0  # stands for positions the caller says the cache holds already
    engine.kv.restore(snapshot, held=4)
    assert (engine.kv.keys[:, :, :4] == 7.0).all()
    assert torch.equal(engine.kv.keys[:, :, 4:10], snapshot.keys[:, :, 4:10]) and engine.kv.length == 10


def test_an_evicted_base_is_counted_while_a_snapshot_built_on_it_stays():
    from dflash.engine.prefix_cache import PrefixCache

    engine = make_engine()
    engine.start(PROMPT, SamplingParams(), max_tokens=1).run()
    cache = PrefixCache(slots=1, budget_bytes=1 << 30)
    base = engine.kv.snapshot(5)
    cache.store(PROMPT[:5], base)
    cache.store(PROMPT[:9], engine.kv.snapshot(9, base=base))  # evicts the base's entry (one slot)
    assert len(cache) == 1 and cache.nbytes == 9 * engine.kv.snapshot(1).nbytes  # its memory is still held
