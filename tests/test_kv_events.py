"""KV events (radixkv.cache.events): the cache's changes as vLLM/SGLang-schema events.

A subscriber's index rebuilt from the events (encoded and decoded as on the wire) holds
exactly the tree's pages on GPU and the host tier's on CPU, after random workloads with
evictions, demotions, promotions and flushes; the ZMQ publisher numbers its batches and
replays them; endpoints that would publish off this machine are refused."""

import random

import msgspec
import numpy as np
import pytest

from radixkv.cache import KVCacheManager, KVPool, PoolConfig, RadixCache, SeqKV
from radixkv.cache.events import (
    MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockIndex, BlockStored, KVEventRecorder, ZmqEventPublisher,
    block_hashes, check_endpoint, decode, encode, hash_of, KVEventBatch, tree_blocks,
)  # fmt: skip
from radixkv.cache.tiers import HostTier, KVTiers

PAGE = 4


class Replica:
    """One process's KV memory with a host tier and an event recorder."""

    def __init__(self, pages=24, host_pages=12):
        self.pool = KVPool(PoolConfig(2, 2, 8, PAGE, kv_dtype="fp32", num_pages=pages))
        self.tree = RadixCache(self.pool, PAGE)
        host = HostTier(host_pages * self.pool.config.bytes_per_page) if host_pages else None
        self.tiers = KVTiers(self.pool, "w", "tok", host) if host is not None else None
        self.events = KVEventRecorder(PAGE)
        self.kv = KVCacheManager(self.pool, self.tree, PAGE, self.tiers, events=self.events)
        self.index = BlockIndex()

    def prefill(self, tokens, namespace=None) -> SeqKV:
        seq = SeqKV(namespace)
        self.kv.admit(seq, tokens)
        assert self.kv.reserve(seq, len(tokens) - seq.computed)
        slots = self.pool.slots(seq.pages, seq.computed, len(tokens))
        k = np.arange(len(tokens) - seq.computed, dtype=np.float32)[:, None, None] * np.ones((1, 2, 8), np.float32)
        import torch

        for layer in range(2):
            t = torch.from_numpy(k)
            self.pool.store_kv(layer, t, t, slots)
        self.kv.computed(seq, len(tokens))
        self.kv.release(seq, tokens)
        return seq

    def sync(self) -> None:
        """Ship the queued events as a batch over the wire format into the index."""
        self.index.apply(decode(encode(KVEventBatch(0.0, self.events.take()))))

    def check(self) -> None:
        self.kv.check([])  # also: the recorder's device pages are the tree's
        self.sync()
        assert self.index.device == tree_blocks(self.tree)
        assert self.index.lower.get(MEDIUM_HOST, set()) == set(map(hash_of, self.events.host.values()))
        if self.tiers is not None:
            assert len(self.events.host) == len(self.tiers.host)


def test_hashes_chain_pages_under_the_salt():
    toks = list(range(1, 13))
    h = block_hashes(toks, None, PAGE)
    assert len(h) == 3 and len(set(h)) == 3 and all(0 <= x < 2**63 for x in h)
    assert block_hashes(toks[:8], None, PAGE) == h[:2]  # a prefix's hashes are a prefix
    assert block_hashes(toks + [99], None, PAGE) == h  # the partial page is not a block
    assert block_hashes(toks, "tenant", PAGE)[0] != h[0]  # salts never share
    assert block_hashes([9, 2, 3, 4] + toks[4:], None, PAGE)[1] != h[1]  # a page's hash depends on all before


def test_stored_events_carry_tokens_parent_and_medium():
    r = Replica(host_pages=0)
    toks = list(range(100, 110))  # 2 whole pages + 2 tokens (the last is never cached)
    r.prefill(toks)
    events = r.events.take()
    assert isinstance(events[0], AllBlocksCleared)  # a fresh replica says so first
    (stored,) = events[1:]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == block_hashes(toks[:8], None, PAGE)
    assert stored.parent_block_hash is None and stored.token_ids == toks[:8]
    assert stored.block_size == PAGE and stored.medium == MEDIUM_DEVICE
    r.prefill(toks[:8] + [7, 7, 7, 7, 7])  # a branch after page 2
    (branch,) = r.events.take()
    r.index.apply(KVEventBatch(0.0, [*events, branch]))
    assert branch.parent_block_hash == stored.block_hashes[-1] and branch.token_ids == [7, 7, 7, 7]
    # the wire format is vLLM's: an array per struct, the tag first
    raw = msgspec.msgpack.decode(encode(KVEventBatch(1.5, [branch])))
    assert raw[0] == 1.5 and raw[1][0][0] == "BlockStored" and raw[1][0][1] == branch.block_hashes
    r.check()


@pytest.mark.parametrize("host_pages", [0, 10])
def test_index_equals_the_cache_after_random_work(host_pages):
    rng = random.Random(host_pages)
    r = Replica(pages=24, host_pages=host_pages)
    docs = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    for step in range(300):
        op = rng.random()
        if op < 0.03:
            r.kv.flush(rng.choice(["device", "host", "memory"]) if host_pages else "device")
        else:
            prompt = rng.choice(docs) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 14))]
            r.prefill(prompt, rng.choice([None, None, "salt"]))
        if step % 7 == 0:
            r.check()
    r.check()
    assert r.tree.evicted_pages > 50  # the pool was under pressure throughout
    if host_pages:
        assert r.tiers.stats.promoted_pages > 0 and r.index.lower[MEDIUM_HOST]


def test_match_reads_device_then_lower_tiers():
    r = Replica(pages=6, host_pages=10)
    a = list(range(1, 22))  # 5 whole pages
    r.prefill(a)
    r.prefill(list(range(200, 221)))  # pushes most of a down to the host tier
    r.check()
    hashes = block_hashes(a, None, PAGE)
    ov = r.index.match(hashes)
    assert ov.device + ov.lower == 5 and ov.lower > 0
    assert r.index.match(block_hashes([5] + a, None, PAGE)) == (0, 0)


def test_publisher_numbers_batches_and_replays(tmp_path):
    zmq = pytest.importorskip("zmq")
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(pub_ep, replay_ep, topic="t", buffer_steps=3)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(pub_ep)
    try:
        # a SUB socket misses what was sent before it joined: publish until one arrives
        got = None
        for _ in range(200):
            pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                got = sub.recv_multipart()
                break
        assert got is not None and got[0] == b"t" and len(got) == 3
        assert isinstance(decode(got[2]).events[0], AllBlocksCleared)
        for i in range(5):
            pub.publish([BlockStored([i], None, [1, 2, 3, 4], 4, None, MEDIUM_DEVICE)])
        last = None
        while last is None or decode(last[2]).events[0].block_hashes != [4]:
            assert sub.poll(5000)
            last = sub.recv_multipart()
        seq = int.from_bytes(last[1], "big", signed=True)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        dealer.send((seq - 10).to_bytes(8, "big", signed=True))  # older than the buffer keeps: what it has
        frames = []
        while True:
            assert dealer.poll(5000)
            f = dealer.recv_multipart()
            if int.from_bytes(f[0], "big", signed=True) == -1:
                break
            frames.append(f)
        assert [int.from_bytes(f[0], "big", signed=True) for f in frames] == [seq - 2, seq - 1, seq]
        assert [decode(f[1]).events[0].block_hashes for f in frames] == [[2], [3], [4]]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557", "tcp://127.0.0.1",
                                      "udp://127.0.0.1:5", "ipc://", 5557])  # fmt: skip
def test_endpoints_off_this_machine_are_refused(endpoint):
    with pytest.raises(ValueError, match="kv_events"):
        check_endpoint("kv_events", endpoint)


def test_loopback_endpoints_pass():
    for ep in ("tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:5557", "ipc:///tmp/x"):
        assert check_endpoint("kv_events", ep) == ep
