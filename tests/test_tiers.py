"""Cache tiers below the pool (radixkv.cache.tiers): eviction demotes pages to a host
tier or a store, an admission promotes the run that follows its tree match; pages come
back bit-exact, and only under the identity that computed them.

Pool-level tests drive KVPool + RadixCache + KVCacheManager + KVTiers with synthetic
K/V (fast); engine tests run the embedded model and compare greedy tokens with a run
without tiers. Stores are real: LMDB files, a redis-server process."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from radixkv.cache import KVCacheManager, KVPool, PoolConfig, RadixCache, SeqKV
from radixkv.cache.store import PageStore, open_store
from radixkv.cache.tiers import HostTier, KVTiers, layout

from test_store import redis_server, start_redis  # noqa: F401 (a fixture)

PAGE = 4


class Node:
    """One process's KV memory with tiers: pool, tree, manager."""

    def __init__(self, tiers_args: dict, kv_dtype="fp32", page_size=PAGE, pages=16, weights="w", store=None,
                 host_bytes=None):  # fmt: skip
        self.pool = KVPool(PoolConfig(2, 2, 8, page_size, kv_dtype=kv_dtype, num_pages=pages))
        self.tree = RadixCache(self.pool, page_size)
        page_store = PageStore(store, layout(self.pool)) if store is not None else None
        host = HostTier(host_bytes) if host_bytes else None
        self.tiers = KVTiers(self.pool, weights, "tok", host, page_store, **tiers_args)
        self.kv = KVCacheManager(self.pool, self.tree, page_size, self.tiers)

    def prefill(self, tokens, namespace=None) -> SeqKV:
        """Admit ``tokens``, write K/V for what the cache did not have (a function of
        the token and its position), release. Returns the sequence (its cached_tokens)."""
        seq = SeqKV(namespace)
        self.kv.admit(seq, tokens)
        assert self.kv.reserve(seq, len(tokens) - seq.computed)
        slots = self.pool.slots(seq.pages, seq.computed, len(tokens))
        for layer in range(2):
            self.pool.store_kv(layer, *kv_of(tokens[seq.computed :], seq.computed, layer), slots)
        self.kv.computed(seq, len(tokens))
        cached = seq.cached_tokens
        self.kv.release(seq, tokens)
        self.kv.check([])
        seq.cached_tokens = cached
        return seq

    def read(self, tokens, namespace=None):
        """The stored K/V of ``tokens``' cached whole pages (layer 1), via a match."""
        m = self.tree.match_prefix(tokens, namespace, record_stats=False)
        return self.pool.read_kv(1, self.pool.slots(m.pages, 0, len(m.pages) * self.pool.page_size))


def kv_of(tokens, start, layer):
    g = torch.Generator().manual_seed(1000 * layer + start + int(sum(tokens)))
    n = len(tokens)
    return torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)


DOC = list(range(100, 142))  # 10 whole pages of 4 and two more tokens (computed, the last to sample)
OTHER = list(range(500, 542))


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_host_tier_demotes_and_promotes_bit_exact(kv_dtype):
    node = Node({}, kv_dtype, host_bytes=1 << 20)
    assert node.prefill(DOC).cached_tokens == 0
    before = node.read(DOC)
    node.prefill(OTHER)  # the pool (16 pages) cannot hold both: DOC's tail is demoted to the host tier
    assert node.tiers.stats.demoted_pages > 0
    again = node.prefill(DOC)
    assert again.cached_tokens == 40  # every whole page of DOC[:-1]: the tree's head, the host's tail
    assert node.tiers.stats.host_hit_tokens > 0
    after = node.read(DOC)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_the_host_tier_keeps_its_bound_and_overflows_into_the_store(tmp_path):
    page_bytes = Node({}).pool.page_bytes
    node = Node({}, host_bytes=3 * page_bytes, store=open_store(f"lmdb:{tmp_path / 'kv'}"))
    node.prefill(DOC)
    node.prefill(OTHER)
    assert node.tiers.host.bytes <= 3 * page_bytes and node.tiers.store.stats.writes > 0  # write-back
    assert node.prefill(DOC).cached_tokens == 40  # host pages, then the store's
    assert node.tiers.stats.store_hit_tokens > 0


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
def test_store_serves_a_restart_and_a_second_process_write_through(tmp_path, request, kind):
    spec = f"lmdb:{tmp_path / 'kv'}" if kind == "lmdb" else request.getfixturevalue("redis_server").url
    if kind == "redis":
        open_store(spec).clear()
    first = Node({"write": "through"}, store=open_store(spec))
    first.prefill(DOC)
    expected = first.read(DOC)
    restarted = Node({"write": "through"}, store=open_store(spec))  # a fresh pool and tree on the same file
    assert restarted.prefill(DOC).cached_tokens == 40
    got = restarted.read(DOC)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_tiers import Node, DOC
        from radixkv.cache.store import open_store
        print(Node({{"write": "through"}}, store=open_store({spec!r})).prefill(DOC).cached_tokens)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "40"


@pytest.mark.parametrize("case", ["another model", "another KV format", "another cache salt", "another page size"])
def test_pages_of_another_identity_are_never_found(tmp_path, case):
    """Regression guards: one store, two writers that differ in one thing; the second
    finds nothing of the first's and computes everything itself."""
    spec = f"lmdb:{tmp_path / 'kv'}"
    Node({"write": "through"}, store=open_store(spec)).prefill(DOC)
    args = {"another model": dict(weights="w2"), "another KV format": dict(kv_dtype="int8"),
            "another cache salt": {}, "another page size": dict(page_size=2, pages=32)}[case]  # fmt: skip
    other = Node({"write": "through"}, store=open_store(spec), **args)
    namespace = "tenant-b" if case == "another cache salt" else None
    assert other.prefill(DOC, namespace).cached_tokens == 0
    assert other.tiers.stats.store_hit_tokens == 0 and other.tiers.store.stats.corrupt == 0
    assert Node({"write": "through"}, store=open_store(spec)).prefill(DOC).cached_tokens == 40  # the same identity does


def test_a_corrupted_store_entry_is_a_miss_deleted_and_recomputed(tmp_path):
    spec = f"lmdb:{tmp_path / 'kv'}"
    Node({"write": "through"}, store=open_store(spec)).prefill(DOC)
    raw = open_store(spec)
    keys = Node({}).tiers.keys(DOC, None)
    blob = bytearray(raw.get([keys[3]])[0])
    blob[-7] ^= 0xFF  # a flipped payload byte in page 3
    raw.put([(keys[3], bytes(blob))])
    node = Node({"write": "through"}, store=open_store(spec))
    assert node.prefill(DOC).cached_tokens == 12  # pages 0-2 from the store; 3 on computed again
    assert node.tiers.store.stats.corrupt == 1
    fresh = Node({"write": "through"}, store=open_store(spec))
    assert fresh.prefill(DOC).cached_tokens == 40  # the recomputed page 3 was stored again, whole


def test_flush_empties_each_tier_when_asked(tmp_path):
    node = Node({"write": "through"}, host_bytes=1 << 20, store=open_store(f"lmdb:{tmp_path / 'kv'}"))
    node.prefill(DOC)
    node.prefill(OTHER)
    stored = node.tiers.store.usage()["entries"]
    assert len(node.tiers.host) and stored == 20  # write-through: every page of both
    node.kv.flush("host")
    assert len(node.tiers.host) == 0 and node.pool.num_free() < node.pool.num_pages
    node.kv.flush("device")  # without demoting: the host tier stays empty
    assert node.pool.num_free() == node.pool.num_pages and len(node.tiers.host) == 0
    assert node.tiers.store.usage()["entries"] == stored and node.prefill(DOC).cached_tokens == 40  # from the store
    node.kv.flush("all")
    assert node.tiers.store.usage()["entries"] == 0 and node.pool.num_free() == node.pool.num_pages
    with pytest.raises(ValueError, match="tiers must be one of memory, device, host, store, all"):
        node.kv.flush("disk")
    node.kv.check([])


# -- the engine, with the real model -----------------------------------------------------------

SP = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
DOC_A = "The quick brown fox jumps over the lazy dog near the river bank. " * 24
DOC_B = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod. " * 12


def _run(prompts, **cfg):
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling import SamplingParams

    with Engine(kv_cache_tokens=640, **cfg) as engine:
        outs = [engine.generate(p, SamplingParams(**SP)) for p in prompts]
        engine.check_integrity()
        return ([o.token_ids for o in outs], [o.cached_tokens for o in outs], engine.stats(),
                [o.prompt_tokens for o in outs])  # fmt: skip


def used(served: int, prompt_tokens: int) -> int:
    """The cached tokens of a request whose prefix a tier served (``served`` tokens,
    whole pages): all of them, but where they end one token before the prompt does the
    last page's last row is computed again with that token (a lone token would be a decode
    row: ``KVCacheManager._copy_last_page``)."""
    return served - 1 if served == prompt_tokens - 1 else served


@pytest.fixture(scope="module")
def baseline():
    return _run([DOC_A, DOC_B, DOC_A])


def test_engine_with_a_host_tier_is_token_exact_and_hits_more(baseline):
    tokens, cached, stats, _ = _run([DOC_A, DOC_B, DOC_A], host_cache_bytes=256 << 20)
    assert tokens == baseline[0]
    assert cached[2] > baseline[1][2] and stats["tiers"]["host_hit_tokens"] > 0


def test_engine_shares_through_redis_and_survives_the_server_going(baseline):
    server = start_redis()
    try:
        tokens, cached, _, _ = _run([DOC_A], kv_store=server.url, kv_store_write="through")
        # another engine
        again, cached2, stats, prompts = _run([DOC_A, DOC_B], kv_store=server.url, kv_store_write="through")
        assert again[0] == tokens[0] == baseline[0][0]
        assert cached2[0] > 0 and used(stats["tiers"]["store_hit_tokens"], prompts[0]) == cached2[0]
        server.stop()
        after, _, stats, _ = _run([DOC_A, DOC_B, DOC_A], kv_store=server.url, host_cache_bytes=256 << 20)
        assert after == baseline[0] and stats["tiers"]["store"]["unavailable"] >= 1  # served from what it has
    finally:
        server.stop()


def test_server_killed_and_restarted_serves_the_document_from_lmdb(tmp_path):
    """`radixkv serve` with an LMDB store (write-through): killed with SIGKILL after one
    request, a new server process on the same file serves the same prompt from the
    store at once, token-identical; /metrics counts the store's tokens; /flush_cache
    with tiers=all empties the store."""
    import signal

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from radixkv.server.process import ServerProcess

    flags = ("--kv-cache-tokens", "1024", "--kv-store", f"lmdb:{tmp_path / 'kv'}", "--kv-store-write", "through")
    body = {"text": DOC_A, "sampling_params": SP}
    first = ServerProcess(*flags, log_path=tmp_path / "first.log")
    try:
        one = httpx.post(first.url + "/generate", json=body, timeout=120).json()
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
    with ServerProcess(*flags, log_path=tmp_path / "second.log") as second:
        two = httpx.post(second.url + "/generate", json=body, timeout=120).json()
        assert two["output_ids"] == one["output_ids"]
        assert one["meta_info"]["cached_tokens"] == 0 and two["meta_info"]["cached_tokens"] >= 320
        samples = {(s.name, tuple(s.labels.items())): s.value
                   for f in text_string_to_metric_families(httpx.get(second.url + "/metrics").text) for s in f.samples}  # fmt: skip
        served = int(samples[("radixkv_prefix_cache_tier_hit_tokens_total", (("tier", "store"),))])
        assert used(served, two["meta_info"]["prompt_tokens"]) == two["meta_info"]["cached_tokens"]
        assert samples[("radixkv_kv_store_corrupt_total", ())] == 0
        bad = httpx.post(second.url + "/flush_cache?tiers=disk")  # the tiers are memory, device, host, store, all
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tiers"
        assert httpx.post(second.url + "/flush_cache?tiers=all").json() == {"flushed": True}
        again = httpx.post(second.url + "/generate", json=body, timeout=120).json()
        assert again["meta_info"]["cached_tokens"] == 0  # nothing left anywhere


def test_sim_tiers_recover_the_unlimited_hit_rate(capsys):
    """`radixkv sim`: a device pool at 10% of the unique pages loses most hits; a host
    tier that holds them all brings the hit rate back to the unlimited one, as does a
    small host tier over a store that holds them all; the table says which tier served
    how much."""
    from radixkv.cache import sim, traces
    from radixkv.cli import main

    trace = traces.synthetic("multi_turn")
    unlimited = sim.replay(trace, None, 16)
    cap = round(0.1 * unlimited.cached_pages)
    alone = sim.replay(trace, cap, 16)
    tiered = sim.replay(trace, cap, 16, host_pages=unlimited.cached_pages)
    small = sim.replay(trace, cap, 16, host_pages=cap)
    assert alone.hit_rate < 0.5 * unlimited.hit_rate
    assert tiered.hit_tokens == unlimited.hit_tokens and tiered.host_hit_tokens > 0
    assert alone.hit_tokens < small.hit_tokens < tiered.hit_tokens
    assert tiered.cached_per_request == unlimited.cached_per_request
    stored = sim.replay(trace, cap, 16, host_pages=cap, store_pages=unlimited.cached_pages)  # host overflows to it
    assert stored.hit_tokens == unlimited.hit_tokens and stored.store_hit_tokens > 0 and stored.host_hit_tokens > 0
    assert main(["sim", "--workload", "multi_turn", "--capacity", "0.1", "--host-pages", str(cap), "--store-pages",
                 str(cap), "--no-belady", "--policy", "lru"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "from host" in out and "from store" in out
