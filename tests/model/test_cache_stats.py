"""What the engine reports for metrics: the live KV state, each cache tier's entries, bytes and
the hits that really supplied a prefix, and speculation counted per drafter."""

from dflash.engine.disk_cache import DiskCache
from dflash.engine.generate import EXACT_PROMPT_SLACK, Engine
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.sampling import SamplingParams
from dflash.engine.speculative import SpeculationConfig
from tests.model.test_disk_cache import BOUNDARY, CONVERSATION, IDENTITY, model  # noqa: F401  (the fixture)

def engine_over(model, folder=None) -> tuple[Engine, DiskCache]:
    disk = DiskCache(folder, max_bytes=1 << 30, identity=IDENTITY, model="tiny-llama")
    engine = Engine(model, max_ctx=128, prefill_chunk=4, prefix_cache=PrefixCache(4, 1 << 30),
                    prompt_cache=PrefixCache(2, 1 << 30), disk_cache=disk)
    return engine, disk


def test_kv_tokens_and_tiers_follow_the_requests(model, tmp_path):
    engine, disk = engine_over(model, tmp_path)
    empty = engine.cache_stats()
    assert empty.kv_tokens == 0 and empty.kv_capacity == 128
    assert {name: (tier.entries, tier.hits) for name, tier in empty.tiers.items()} == {
        "prefix": (0, 0), "exact": (0, 0), "disk": (0, 0)}

    # A boundary far enough from the prompt's end that the exact prompt gets a snapshot too.
    prompt = CONVERSATION + list(range(100, 100 + EXACT_PROMPT_SLACK))
    engine.start(prompt, SamplingParams(), max_tokens=3, snapshot_at=(BOUNDARY,)).run()
    disk.flush()
    first = engine.cache_stats()
    assert first.kv_tokens == len(prompt) + 2  # the last generated token has no KV yet
    assert first.tiers["prefix"].entries == 1 and first.tiers["exact"].entries == 1
    assert first.tiers["prefix"].bytes > 0 and first.tiers["disk"].entries == 2  # both snapshots go to disk
    assert first.tiers["disk"].bytes == sum(path.stat().st_size for path in tmp_path.iterdir())

    # Another conversation takes the live state; the first one's boundary snapshot serves it again.
    engine.start([44, 45, 46, 47], SamplingParams(), max_tokens=1).run()
    engine.start(CONVERSATION[:BOUNDARY] + [70, 71], SamplingParams(), max_tokens=1).run()
    again = engine.cache_stats()
    assert again.tiers["prefix"].hits == 1 and again.tiers["exact"].hits == 0
    disk.close()

    restarted, restarted_disk = engine_over(model, tmp_path)
    restarted.start(CONVERSATION[:BOUNDARY] + [70, 72], SamplingParams(), max_tokens=1).run()
    assert restarted.cache_stats().tiers["disk"].hits == 1
    restarted_disk.close()


def test_speculation_is_counted_per_drafter(model):
    speculation = SpeculationConfig(drafter="ngram", max_draft_tokens=4, ngram_min=1, ngram_max=3, adaptive=False)
    engine = Engine(model, max_ctx=128, prefill_chunk=8, speculation=speculation)
    generation = engine.start([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(), max_tokens=24)
    generation.run()
    stats = generation.stats
    assert set(stats.drafters) == {"ngram"}
    ngram = stats.drafters["ngram"]
    assert ngram.verification_steps == stats.verification_steps > 0
    assert (ngram.draft_tokens, ngram.accepted_tokens) == (stats.draft_tokens, stats.accepted_tokens)
    assert ngram.acceptance_length == stats.acceptance_length
