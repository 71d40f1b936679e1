"""Prometheus metrics of one server, in its own registry.

Request-level series (tokens, per-namespace cache hits, latencies) are updated when a
request ends; engine gauges and counters (KV usage, queue lengths, preemptions,
evictions) are read from ``Engine.snapshot()`` at scrape time.

A cache salt is a tenant's secret: it never appears in a label. A namespace is labelled
``ns-`` and 12 hex digits of an HMAC-SHA256 of its salt under a key drawn at start-up
(stable while the process lives, not across restarts, not invertible), requests without
a salt ``default``; only the first ``MAX_NAMESPACE_LABELS`` namespaces get a label of
their own, later ones count under ``other``.
"""

from __future__ import annotations

import hmac
import secrets

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixkv.engine.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DEFAULT_NAMESPACE = "default"
OTHER_NAMESPACES = "other"
MAX_NAMESPACE_LABELS = 32


class _EngineCollector:
    """Engine state at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.snapshot()
        pool, cache = s["pool"], s["cache"]
        yield _gauge("radixkv_kv_usage_ratio", "Fraction of KV pages referenced (tree or requests)",
                     1 - pool["free"] / pool["pages"])  # fmt: skip
        yield _gauge("radixkv_kv_pages", "KV pages in the pool", pool["pages"])
        yield _gauge("radixkv_num_requests_running", "Requests in the running batch", s["running"])
        yield _gauge("radixkv_num_requests_waiting", "Requests waiting for admission", s["waiting"])
        yield _counter("radixkv_preemptions", "Running requests preempted for memory", s["preemptions"])
        yield _counter("radixkv_engine_steps", "Engine forward steps", s["steps"])
        if cache is not None:
            yield _gauge("radixkv_prefix_cache_pages", "Pages held by the prefix cache", cache["cached_pages"])
            yield _counter("radixkv_prefix_cache_evicted_pages", "Pages evicted from the prefix cache",
                           cache["evicted_pages"])  # fmt: skip
            yield _counter("radixkv_prefix_cache_inserted_pages", "Pages inserted into the prefix cache",
                           cache["inserted_pages"])  # fmt: skip
        tiers = s.get("tiers")
        if tiers is not None:
            hits = CounterMetricFamily("radixkv_prefix_cache_tier_hit_tokens", "Prompt tokens served by each cache tier",
                                       labels=["tier"])  # fmt: skip
            hits.add_metric(["device"], cache["hit_tokens"] if cache else 0)
            hits.add_metric(["host"], tiers["host_hit_tokens"])
            hits.add_metric(["store"], tiers["store_hit_tokens"])
            yield hits
            yield _counter("radixkv_kv_demoted_pages", "Pages the device pool evicted into a lower tier",
                           tiers["demoted_pages"])  # fmt: skip
            yield _counter("radixkv_kv_promoted_pages", "Pages brought back from a lower tier", tiers["promoted_pages"])
            if "host" in tiers:
                yield _gauge("radixkv_kv_host_pages", "Pages in the host tier", tiers["host"]["pages"])
                yield _gauge("radixkv_kv_host_bytes", "Bytes in the host tier", tiers["host"]["bytes"])
            store = tiers.get("store")
            if store is not None:
                yield _gauge("radixkv_kv_store_up", "1 while the KV store answers, 0 while it is skipped", int(store["available"]))
                yield _counter("radixkv_kv_store_read_bytes", "Bytes read from the KV store", store["read_bytes"])
                yield _counter("radixkv_kv_store_write_bytes", "Bytes written to the KV store", store["write_bytes"])
                yield _counter("radixkv_kv_store_read_seconds", "Time spent reading (and verifying) store entries",
                               store["read_s"])  # fmt: skip
                yield _counter("radixkv_kv_store_write_seconds", "Time spent writing store entries", store["write_s"])
                yield _counter("radixkv_kv_store_corrupt", "Store entries refused by verification (deleted, never used)",
                               store["corrupt"])  # fmt: skip
                yield _counter("radixkv_kv_store_unavailable", "Store operations that found it unreachable",
                               store["unavailable"])  # fmt: skip


def _gauge(name, doc, value):
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name, doc, value):
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        self.requests = Counter("radixkv_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)  # fmt: skip
        self.errors = Counter("radixkv_request_errors", "Requests answered with an HTTP error",
                              ["endpoint", "status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("radixkv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("radixkv_generation_tokens", "Generated tokens", registry=r)
        self.cache_queries = Counter("radixkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     ["namespace"], registry=r)  # fmt: skip
        self.cache_hits = Counter("radixkv_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  ["namespace"], registry=r)  # fmt: skip
        self.ttft = Histogram("radixkv_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("radixkv_inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("radixkv_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self._key = secrets.token_bytes(32)
        self._labels: set[str] = set()

    def namespace_label(self, namespace: str | None) -> str:
        """The label of a namespace (see the module docstring); never the salt itself."""
        if namespace is None:
            return DEFAULT_NAMESPACE
        label = "ns-" + hmac.new(self._key, namespace.encode(), "sha256").hexdigest()[:12]
        if label not in self._labels:
            if len(self._labels) >= MAX_NAMESPACE_LABELS:
                return OTHER_NAMESPACES
            self._labels.add(label)
        return label

    def finished(self, endpoint: str, out: RequestOutput, namespace: str | None) -> None:
        ns = self.namespace_label(namespace)
        for o in out.outputs:
            self.requests.labels(endpoint, o.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.cache_queries.labels(ns).inc(out.prompt_tokens)
        self.cache_hits.labels(ns).inc(out.cached_tokens)
        m = out.metrics
        if m is not None:
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.inter_token_latencies:
                self.itl.observe(gap)
            self.e2e.observe(m.finish_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
