"""Prometheus metrics (prometheus_client) and the last requests for the status page.

Fed with the numbers the log lines carry: each finished request (the HTTP server's and the
Responses WebSocket's `request` line, `RequestDone`) and each ended job (the scheduler's
`JobRecord`: tokens, timings, drafts, how it ended). Gauges read the scheduler and the HTTP server
when scraped. Each server has its own registry, so several servers in one process (tests) keep
their numbers apart.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from dflash.engine.contract import CacheStats
from dflash.http.server import RequestDone
from dflash.scheduler import JobRecord

RECENT_REQUESTS = 20
# Seconds: a short chat turn's first token on a GPU to a 32K-token prefill on a small CPU.
TIME_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ACCEPTANCE_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)
TOKEN_KINDS = ("prompt", "cached", "prefilled", "generated")
JOB_OUTCOMES = ("finished", "cancelled", "failed")
OTHER_ENDPOINT = "other"  # any path that is not a route, so scanners cannot grow the label set


class Metrics:
    """One server's metrics. `watch` attaches the gauges once the scheduler and HTTP server exist."""

    def __init__(self, *, build: Mapping[str, str], load_seconds: float, endpoints: Collection[str] = (),
                 recent: int = RECENT_REQUESTS):
        self.registry = CollectorRegistry()
        self._endpoints = frozenset(endpoints)
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        registry = self.registry
        self.requests = Counter("dflash_requests", "HTTP requests and WebSocket responses answered",
                                ["endpoint", "dialect", "status"], registry=registry)
        self.in_flight = Gauge("dflash_requests_in_flight", "HTTP requests being answered", registry=registry)
        self.jobs_queued = Gauge("dflash_jobs_queued", "generation jobs waiting for the engine", registry=registry)
        self.jobs_running = Gauge("dflash_jobs_running", "generation jobs on the engine (0 or 1)", registry=registry)
        self.jobs = Counter("dflash_jobs", "generation jobs ended, by outcome (finished, cancelled, failed)",
                            ["outcome"], registry=registry)
        self.ttft = Histogram("dflash_time_to_first_token_seconds",
                              "request received to the first generated output, queue wait included",
                              ["dialect"], buckets=TIME_BUCKETS, registry=registry)
        self.queue_wait = Histogram("dflash_queue_wait_seconds", "time a job waited for the engine",
                                    buckets=TIME_BUCKETS, registry=registry)
        self.prefill = Histogram("dflash_prefill_seconds", "prefill time of a job", buckets=TIME_BUCKETS,
                                 registry=registry)
        self.decode = Histogram("dflash_decode_seconds", "decode time of a job", buckets=TIME_BUCKETS,
                                registry=registry)
        self.tokens = Counter("dflash_tokens", "tokens by kind: prompt, cached (reused KV state), prefilled "
                                               "(computed), generated", ["kind"], registry=registry)
        self.draft_tokens = Counter("dflash_draft_tokens", "tokens a drafter proposed", ["drafter"],
                                    registry=registry)
        self.accepted_tokens = Counter("dflash_accepted_tokens", "proposed tokens the target accepted", ["drafter"],
                                       registry=registry)
        self.verification_steps = Counter("dflash_verification_steps", "speculative verification forwards",
                                          ["drafter"], registry=registry)
        self.acceptance_length = Histogram("dflash_acceptance_length",
                                           "a job's tokens committed per verification forward", ["drafter"],
                                           buckets=ACCEPTANCE_BUCKETS, registry=registry)
        self.cancellations = Counter("dflash_cancellations", "jobs stopped before their end, by phase (queued, "
                                     "prefill, decode) and reason (abandoned, stop, shutdown)", ["phase", "reason"],
                                     registry=registry)
        for kind in TOKEN_KINDS:  # at 0 from the start, so rates work from the first scrape
            self.tokens.labels(kind)
        for outcome in JOB_OUTCOMES:
            self.jobs.labels(outcome)
        self.model_load = Gauge("dflash_model_load_seconds", "time the model took to load at start-up",
                                registry=registry)
        self.model_load.set(load_seconds)
        Info("dflash_build", "version, model, dtype, weights format and CPU kind", registry=registry).info(dict(build))
        self._caches = _CacheCollector(registry)

    def watch(self, *, queued: Callable[[], int], running: Callable[[], int], in_flight: Callable[[], int],
              cache_stats: Callable[[], CacheStats]) -> None:
        self.jobs_queued.set_function(queued)
        self.jobs_running.set_function(running)
        self.in_flight.set_function(in_flight)
        self._caches.read = cache_stats

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape's body and content type (Prometheus text, or OpenMetrics when asked for)."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type

    # ---- feeds -----------------------------------------------------------------------------

    def request_done(self, done: RequestDone) -> None:
        dialect = done.fields.get("dialect") or "none"
        status = str(done.status) if done.status is not None else "none"
        self.requests.labels(self.endpoint(done.path), dialect, status).inc()
        ttft_ms = done.fields.get("ttft_ms")
        if ttft_ms is not None:
            self.ttft.labels(dialect).observe(ttft_ms / 1000)
        if "dialect" in done.fields:
            self.recent.appendleft(_recent_entry(done))

    def job_ended(self, record: JobRecord) -> None:
        self.jobs.labels(record.outcome).inc()
        if record.outcome == "cancelled":
            self.cancellations.labels(record.phase, record.cancel_reason or "abandoned").inc()
        if record.phase != "queued":
            self.queue_wait.observe(record.queue_s)
        stats = record.stats
        if stats is None:
            return
        self.prefill.observe(stats.prefill_ms / 1000)
        if stats.generated_tokens:
            self.decode.observe(stats.decode_ms / 1000)
        for kind, count in zip(TOKEN_KINDS, (stats.prompt_tokens, stats.cached_tokens, stats.prefilled_tokens,
                                             stats.generated_tokens)):
            self.tokens.labels(kind).inc(count)
        for drafter, counts in stats.drafters.items():
            self.draft_tokens.labels(drafter).inc(counts.draft_tokens)
            self.accepted_tokens.labels(drafter).inc(counts.accepted_tokens)
            self.verification_steps.labels(drafter).inc(counts.verification_steps)
            if counts.verification_steps:
                self.acceptance_length.labels(drafter).observe(counts.acceptance_length)

    def endpoint(self, path: str | None) -> str:
        if path in self._endpoints:
            return path
        if path is not None and path.startswith("/v1/responses/"):
            return "/v1/responses/{id}"
        return OTHER_ENDPOINT


class _CacheCollector(Collector):
    """The engine's caches as of the last job's end: entries, bytes and hits per tier, and the
    live KV state."""

    def __init__(self, registry: CollectorRegistry):
        self.read: Callable[[], CacheStats] = CacheStats
        registry.register(self)

    def collect(self) -> Iterator:
        stats = self.read()
        entries = GaugeMetricFamily("dflash_cache_entries", "snapshots a prefix cache tier holds", labels=["tier"])
        nbytes = GaugeMetricFamily("dflash_cache_bytes", "bytes a prefix cache tier holds", labels=["tier"])
        hits = CounterMetricFamily("dflash_cache_hits", "prompts whose prefix a tier's snapshot supplied",
                                   labels=["tier"])
        for tier, counts in stats.tiers.items():
            entries.add_metric([tier], counts.entries)
            nbytes.add_metric([tier], counts.bytes)
            hits.add_metric([tier], counts.hits)
        yield from (entries, nbytes, hits)
        yield GaugeMetricFamily("dflash_kv_tokens", "tokens whose keys/values the live KV state holds",
                                value=stats.kv_tokens)
        yield GaugeMetricFamily("dflash_kv_capacity_tokens", "tokens the live KV state can hold (max_ctx)",
                                value=stats.kv_capacity)

    def describe(self) -> Iterator:
        return iter(())  # collected at scrape time only


def _recent_entry(done: RequestDone) -> dict[str, Any]:
    """One row of the status page's table of the last requests."""
    fields = done.fields
    completion, decode_ms = fields.get("completion_tokens"), fields.get("decode_ms")
    return {
        "id": done.id,
        "at": round(time.time(), 3),
        "path": done.path,
        "dialect": fields.get("dialect"),
        "status": done.status,
        "duration_ms": round(done.duration_s * 1000, 1),
        "prompt_tokens": fields.get("prompt_tokens"),
        "cached_tokens": fields.get("cached_tokens"),
        "completion_tokens": completion,
        "ttft_ms": fields.get("ttft_ms"),
        "decode_tokens_per_s": round(completion / decode_ms * 1000, 2) if completion and decode_ms else None,
        "acceptance_length": fields.get("acceptance_length"),
        "finish_reason": fields.get("finish_reason"),
        "client_disconnected": done.client_disconnected,
    }
