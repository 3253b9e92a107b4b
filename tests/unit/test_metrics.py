"""GET /metrics: the Prometheus text format, scraped after a mix of requests and read with
prometheus_client's own parser; every number moves as the requests say it should."""

from __future__ import annotations

import trio
from prometheus_client.parser import text_string_to_metric_families

from dflash.engine.contract import CacheStats, CacheTier, DraftCounts, GenerationStats
from dflash.metrics import Metrics
from dflash.scheduler import JobRecord
from tests.unit.conftest import wait_until
from tests.unit.fakes import REPLY, FakeEngine
from tests.unit.rawhttp import RawClient, request

CHAT = "/v1/chat/completions"
KEY = "sk-metrics"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of an exposition."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get((name, frozenset(labels.items())), 0.0)


async def scrape(port: int, headers=()) -> dict:
    reply = await request(port, "GET", "/metrics", headers=list(headers))
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(reply.body.decode())


def chat(content: str = "hi", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


async def test_a_mix_of_requests_moves_the_counters(start_server):
    served = await start_server(FakeEngine())
    before = await scrape(served.port)
    assert value(before, "dflash_requests_total", endpoint="/v1/chat/completions", dialect="openai_chat",
                 status="200") == 0
    ok = await request(served.port, "POST", CHAT, json_body=chat(max_tokens=5))
    anthropic = {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "yo"}]}
    streamed = await request(served.port, "POST", "/v1/messages", json_body=anthropic)
    bad = await request(served.port, "POST", CHAT, json_body={"messages": "not a list"})
    unknown = await request(served.port, "GET", "/no/such/path")
    assert (ok.status, streamed.status, bad.status, unknown.status) == (200, 200, 400, 404)
    await wait_until(lambda: served.engine.idle)

    after = await scrape(served.port)
    requests = "dflash_requests_total"
    assert value(after, requests, endpoint="/v1/chat/completions", dialect="openai_chat", status="200") == 1
    assert value(after, requests, endpoint="/v1/messages", dialect="anthropic", status="200") == 1
    assert value(after, requests, endpoint="/v1/chat/completions", dialect="openai_chat", status="400") == 1
    assert value(after, requests, endpoint="other", dialect="none", status="404") == 1
    assert value(after, requests, endpoint="/metrics", dialect="none", status="200") == 1  # the first scrape
    usage = ok.json()["usage"]
    assert value(after, "dflash_tokens_total", kind="generated") == 5 + 8
    prompts = usage["prompt_tokens"] + len(served.engine.generations[1].prompt_ids)
    assert value(after, "dflash_tokens_total", kind="prompt") == prompts
    assert value(after, "dflash_tokens_total", kind="prefilled") == value(after, "dflash_tokens_total", kind="prompt")
    assert value(after, "dflash_jobs_total", outcome="finished") == 2
    assert value(after, "dflash_prefill_seconds_count") == 2
    assert value(after, "dflash_decode_seconds_count") == 2
    assert value(after, "dflash_time_to_first_token_seconds_count", dialect="openai_chat") == 1
    assert value(after, "dflash_time_to_first_token_seconds_count", dialect="anthropic") == 1
    assert value(after, "dflash_time_to_first_token_seconds_sum", dialect="anthropic") > 0
    # The live state holds the last prompt and its reply; the scrape itself is the request in flight.
    last = served.engine.generations[-1]
    assert value(after, "dflash_kv_tokens") == len(last.prompt_ids) + len(last.output)
    assert value(after, "dflash_kv_capacity_tokens") == served.engine.max_ctx
    assert value(after, "dflash_requests_in_flight") == 1
    assert value(after, "dflash_jobs_running") == 0 and value(after, "dflash_jobs_queued") == 0
    (build,) = [labels for (name, labels) in after if name == "dflash_build_info"]
    build = dict(build)
    assert build["model"] == "fake-model" and build["dtype"] == "bfloat16" and build["cpu"] and build["version"]
    assert value(after, "dflash_model_load_seconds") >= 0


async def test_queued_running_and_cancellations_by_phase(start_server):
    engine = FakeEngine(decode_step_s=0.02, endless=True)
    served = await start_server(engine)
    running = await RawClient.open(served.port)
    await running.send_request("POST", CHAT, json_body=chat(stream=True, max_tokens=100_000))
    assert (await running.read_head())[0] == 200
    queued = await RawClient.open(served.port)
    await queued.send_request("POST", CHAT, json_body=chat(stream=True, max_tokens=100_000))
    await wait_until(lambda: served.app.scheduler.queue_depth == 1)
    await wait_until(lambda: engine.generations and engine.generations[0].stats.generated_tokens > 2)

    busy = await scrape(served.port)
    assert value(busy, "dflash_jobs_running") == 1 and value(busy, "dflash_jobs_queued") == 1
    assert value(busy, "dflash_requests_in_flight") == 3

    await queued.aclose()  # leaves while queued
    await wait_until(lambda: served.app.scheduler.queue_depth == 0)
    await running.aclose()  # leaves during decode
    await wait_until(lambda: engine.idle and engine.generations[0].closed)
    await trio.sleep(0.05)
    after = await scrape(served.port)
    cancelled = "dflash_cancellations_total"
    assert value(after, cancelled, phase="queued", reason="abandoned") == 1
    assert value(after, cancelled, phase="decode", reason="abandoned") == 1
    assert value(after, "dflash_jobs_total", outcome="cancelled") == 2
    assert value(after, "dflash_requests_total", endpoint="/v1/chat/completions", dialect="openai_chat",
                 status="200") == 2


async def test_a_stop_string_is_a_cancellation_for_reason_stop(start_server):
    served = await start_server(FakeEngine())
    stop = REPLY.split()[2]  # a word in the middle of the scripted reply
    reply = await request(served.port, "POST", CHAT, json_body=chat(stop=[stop]))
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    await wait_until(lambda: served.engine.idle)
    await trio.sleep(0.05)
    after = await scrape(served.port)
    assert value(after, "dflash_cancellations_total", phase="decode", reason="stop") == 1


async def test_metrics_need_the_key_when_api_keys_are_set(start_server):
    served = await start_server(api_keys=[KEY])
    assert (await request(served.port, "GET", "/metrics")).status == 401
    await scrape(served.port, [("authorization", f"Bearer {KEY}")])


async def test_metrics_auth_off_opens_metrics_only(start_server):
    served = await start_server(api_keys=[KEY], metrics_auth=False)
    await scrape(served.port)
    assert (await request(served.port, "GET", "/v1/models")).status == 401


async def test_two_servers_keep_their_own_numbers(start_server):
    first = await start_server(FakeEngine())
    second = await start_server(FakeEngine())
    assert (await request(first.port, "POST", CHAT, json_body=chat(max_tokens=3))).status == 200
    await wait_until(lambda: first.engine.idle)
    assert value(await scrape(first.port), "dflash_tokens_total", kind="generated") == 3
    assert value(await scrape(second.port), "dflash_tokens_total", kind="generated") == 0


def test_drafts_by_drafter_and_cache_tiers():
    metrics = Metrics(build={"version": "v"}, load_seconds=1.5, endpoints=("/",))
    stats = GenerationStats(prompt_tokens=10, cached_tokens=6, prefilled_tokens=4, generated_tokens=9,
                            drafters={"ngram": DraftCounts(draft_tokens=12, accepted_tokens=6, verification_steps=3),
                                      "dflash": DraftCounts(draft_tokens=2, accepted_tokens=0, verification_steps=2)})
    metrics.job_ended(JobRecord("r1", "finished", "decode", None, 0.0, stats))
    caches = CacheStats(kv_tokens=19, kv_capacity=64,
                        tiers={"prefix": CacheTier(2, 4096, 1), "exact": CacheTier(1, 1024, 0),
                               "disk": CacheTier(3, 9000, 2)})
    metrics.watch(queued=lambda: 0, running=lambda: 0, in_flight=lambda: 0, cache_stats=lambda: caches)
    body, _ = metrics.exposition(None)
    scraped = samples(body.decode())
    assert value(scraped, "dflash_draft_tokens_total", drafter="ngram") == 12
    assert value(scraped, "dflash_accepted_tokens_total", drafter="ngram") == 6
    assert value(scraped, "dflash_verification_steps_total", drafter="dflash") == 2
    assert value(scraped, "dflash_acceptance_length_sum", drafter="ngram") == 3.0  # (6 + 3) / 3
    assert value(scraped, "dflash_acceptance_length_sum", drafter="dflash") == 1.0
    assert value(scraped, "dflash_tokens_total", kind="cached") == 6
    assert value(scraped, "dflash_cache_entries", tier="prefix") == 2
    assert value(scraped, "dflash_cache_bytes", tier="disk") == 9000
    assert value(scraped, "dflash_cache_hits_total", tier="disk") == 2
    assert value(scraped, "dflash_kv_tokens") == 19
    assert value(scraped, "dflash_model_load_seconds") == 1.5
    assert metrics.endpoint("/v1/responses/resp_1") == "/v1/responses/{id}"
    assert metrics.endpoint("/wp-admin") == "other"
