"""Prometheus metrics of one server, in its own registry.

Request-level series (tokens, per-namespace cache hits, latencies) are updated when a
request ends; engine gauges and counters (KV usage, queue lengths, preemptions,
evictions) are read from ``Engine.snapshot()`` at scrape time.

A cache salt is a tenant's secret: it never appears in a label. A namespace is labelled
``ns-`` and 12 hex digits of an HMAC-SHA256 of its salt under a key drawn at start-up
(stable while the process lives, not across restarts, not invertible), requests without
a salt ``default``; only the first ``MAX_NAMESPACE_LABELS`` namespaces get a label of
their own, later ones count under ``other``.

Request and prefix-cache series carry a ``model_name`` label (the served model name).
vLLM's names and label sets (``vllm:prefix_cache_queries_total``, ``vllm:num_requests_running``,
``vllm:request_success_total{finished_reason}``, ... with ``model_name`` and ``engine``)
are exported beside radixkv's own, so dashboards built for vLLM work unchanged.
"""

from __future__ import annotations

import secrets

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixkv.cache.capture import opaque_namespace
from radixkv.engine.request import RequestOutput
from radixkv.server.ops import add_output

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DEFAULT_NAMESPACE = "default"
OTHER_NAMESPACES = "other"
MAX_NAMESPACE_LABELS = 32
VLLM_ENGINE = "0"  # vLLM labels each engine core by index; radixkv has one


class _EngineCollector:
    """Engine state at scrape time."""

    def __init__(self, engine, model_name: str = ""):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.snapshot()
        pool, cache = s["pool"], s["cache"]
        # vLLM's names and labels (model_name, engine), so its dashboards work unchanged
        labels = {"model_name": self.model_name, "engine": VLLM_ENGINE}
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches (radixkv: running "
                     "batch)", s["running"], labels)  # fmt: skip
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed", s["waiting"], labels)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     1 - pool["free"] / pool["pages"], labels)  # fmt: skip
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine", s["preemptions"],
                       labels)  # fmt: skip
        yield _gauge("radixkv_kv_usage_ratio", "Fraction of KV pages referenced (tree or requests)",
                     1 - pool["free"] / pool["pages"])  # fmt: skip
        yield _gauge("radixkv_kv_pages", "KV pages in the pool", pool["pages"])
        yield _gauge("radixkv_num_requests_running", "Requests in the running batch", s["running"])
        yield _gauge("radixkv_num_requests_waiting", "Requests waiting for admission", s["waiting"])
        yield _counter("radixkv_preemptions", "Running requests preempted for memory", s["preemptions"])
        yield _counter("radixkv_engine_steps", "Engine forward steps", s["steps"])
        pins = s.get("pins")
        if pins is not None:
            yield _gauge("radixkv_pinned_pages", "KV pages under pins and TTLs (capped by max_pinned_share)",
                         pins["pinned_pages"])  # fmt: skip
            yield _gauge("radixkv_hinted_pages", "KV pages protected by hints and session entries (advisory)",
                         pins["hinted_pages"])  # fmt: skip
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


def _gauge(name, doc, value, labels: dict | None = None):
    g = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    g.add_metric(list((labels or {}).values()), value)
    return g


def _counter(name, doc, value, labels: dict | None = None):
    c = CounterMetricFamily(name, doc, labels=list(labels or ()))
    c.add_metric(list((labels or {}).values()), value)
    return c


class Metrics:
    def __init__(self, engine, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        r.register(_EngineCollector(engine, model_name))
        m = ["model_name"]
        self.requests = Counter("radixkv_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason", *m], registry=r)  # fmt: skip
        self.errors = Counter("radixkv_request_errors", "Requests answered with an HTTP error",
                              ["endpoint", "status"], registry=r)  # fmt: skip
        self.aborted = Counter("radixkv_requests_aborted", "Requests whose client went away before the answer "
                               "(their engine requests aborted) or that the server aborted (shutdown)",
                               ["endpoint"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("radixkv_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("radixkv_generation_tokens", "Generated tokens", m, registry=r)
        self.cache_queries = Counter("radixkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     ["namespace", *m], registry=r)  # fmt: skip
        self.cache_hits = Counter("radixkv_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  ["namespace", *m], registry=r)  # fmt: skip
        self.ttft = Histogram("radixkv_time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("radixkv_inter_token_latency_seconds", "Time between consecutive tokens", m,
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("radixkv_e2e_request_latency_seconds", "Arrival to finish", m,
                             buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        # vLLM's names and label sets (model_name, engine) for the same series: existing
        # dashboards work unchanged (https://docs.vllm.ai/en/latest/design/metrics.html)
        v = ["model_name", "engine"]
        self.v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed", v, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Number of generation tokens processed", v, registry=r)
        self.v_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                 "tokens", v, registry=r)  # fmt: skip
        self.v_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens", v,
                              registry=r)  # fmt: skip
        self.v_success = Counter("vllm:request_success", "Count of successfully processed requests",
                                 [*v, "finished_reason"], registry=r)  # fmt: skip
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds", v,
                                buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds", v,
                               buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds", v,
                               buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        # the series of fixed labels, bound once (``labels()`` per token was most of the
        # cost of ``finished`` on the event loop): each radixkv series with its vLLM alias
        v = (model_name, VLLM_ENGINE)
        self._prompt = (self.prompt_tokens.labels(model_name), self.v_prompt.labels(*v))
        self._generation = (self.generation_tokens.labels(model_name), self.v_generation.labels(*v))
        self._ttft = (self.ttft.labels(model_name), self.v_ttft.labels(*v))
        self._itl = (self.itl.labels(model_name), self.v_itl.labels(*v))
        self._e2e = (self.e2e.labels(model_name), self.v_e2e.labels(*v))
        self._v_queries, self._v_hits = self.v_queries.labels(*v), self.v_hits.labels(*v)
        self.prompt_tokens_seen = 0  # for the stats line (ops.StatsLine)
        self._key = secrets.token_bytes(32)
        self._labels: set[str] = set()

    @property
    def namespace_key(self) -> bytes:
        """The HMAC key of the labels; a recorded trace hashes salts under it too, so its
        namespace ids equal these labels."""
        return self._key

    def namespace_label(self, namespace: str | None) -> str:
        """The label of a namespace (see the module docstring); never the salt itself."""
        if namespace is None:
            return DEFAULT_NAMESPACE
        label = opaque_namespace(self._key, namespace)  # the hash traces use (radixkv.cache.capture)
        if label not in self._labels:
            if len(self._labels) >= MAX_NAMESPACE_LABELS:
                return OTHER_NAMESPACES
            self._labels.add(label)
        return label

    def finished(self, endpoint: str, out: RequestOutput, namespace: str | None) -> None:
        ns, model = self.namespace_label(namespace), self.model_name
        aborted = False
        for o in out.outputs:
            reason = o.finish_reason or "unknown"
            self.requests.labels(endpoint, reason, model).inc()
            self.v_success.labels(model, VLLM_ENGINE, reason).inc()
            aborted = aborted or reason == "abort"
        if aborted:
            self.aborted.labels(endpoint).inc()
        for c in self._prompt:
            c.inc(out.prompt_tokens)
        for c in self._generation:
            c.inc(out.completion_tokens)
        self.cache_queries.labels(ns, model).inc(out.prompt_tokens)
        self.cache_hits.labels(ns, model).inc(out.cached_tokens)
        self._v_queries.inc(out.prompt_tokens)
        self._v_hits.inc(out.cached_tokens)
        self.prompt_tokens_seen += out.prompt_tokens
        add_output(out)  # the access log's token counts of the request being answered
        m = out.metrics
        if m is None:
            return
        for ttft, itl, e2e in zip(self._ttft, self._itl, self._e2e):
            if m.ttft is not None:
                ttft.observe(m.ttft)
            for gap in m.inter_token_latencies:
                itl.observe(gap)
            e2e.observe(m.finish_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
