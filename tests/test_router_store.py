"""``radixkv serve --replicas 2`` over one LMDB store written through: the router learns
from each replica's ``/stats`` which store it writes to, counts what either wrote there
for both, and a prefix both replicas lost from memory is routed as a store read, which
the replica serves from the store; a flush through the router reaches both replicas and
the store. Real processes, the official openai client."""

from __future__ import annotations

import sys
import time

import httpx
import openai

from radixkv.server.process import launch, stop

PROMPT = "".join(f"Question {i}: what is {i} times {i}? Answer: {i * i}.\n" for i in range(16)) + "Question: 5 times 3?"


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_prefix_both_replicas_lost_is_routed_as_a_store_read(tmp_path):
    cmd = [sys.executable, "-m", "radixkv", "serve", "--replicas", "2", "--attention-backend", "torch",
           "--kv-cache-tokens", "512", "--kv-store", f"lmdb:{tmp_path / 'kv'}", "--kv-store-bytes", str(64 << 20),
           "--kv-store-write", "through"]  # fmt: skip
    proc, url = launch(cmd, "/health", "radixkv serve --replicas 2 (shared store)", timeout=600,
                       log_path=tmp_path / "serve.log")  # fmt: skip
    try:
        http = httpx.Client(base_url=url, timeout=300)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        state = http.get("/router/state").json()
        stores = [r.get("store") for r in state["replicas"]]
        assert all(stores) and stores[0]["spec"] == stores[1]["spec"] and stores[0]["write"] == "through"
        page_bytes = httpx.get(state["replicas"][0]["url"] + "/stats").json()["tiers"]["store"]["page_bytes"]
        assert stores[0]["limit"] == (64 << 20) // page_bytes  # the store's bytes over a page's bytes

        def ask() -> int:
            out = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=4, temperature=0)
            details = out.usage.prompt_tokens_details
            return details.cached_tokens if details else 0

        assert ask() == 0
        pages = wait_for(lambda: http.get("/router/state").json()["replicas"][0]["store"]["pages"])
        assert pages >= 10  # ~190 tokens of whole pages, written through by the replica that computed them
        for r in state["replicas"]:  # both lose it from memory; the store keeps it
            assert httpx.post(r["url"] + "/flush_cache", params={"tiers": "memory"}, timeout=60).status_code == 200
        wait_for(lambda: all(r["index"]["device"] == 0 for r in http.get("/router/state").json()["replicas"]))
        before = sum(r["expected_hit_tokens"] for r in http.get("/router/state").json()["replicas"])
        cached = ask()
        after = http.get("/router/state").json()
        expected = sum(r["expected_hit_tokens"] for r in after["replicas"]) - before
        assert expected >= pages * 16 - 16  # the router counted the store's pages (nothing was in memory)
        assert cached >= expected - 16  # and the replica read them from the store
        text = http.get("/metrics").text
        assert f'radixkv_router_store_blocks{{store="{stores[0]["spec"]}",kv_format=' in text
        # a flush through the router reaches both replicas and empties what the router knew
        out = http.post("/flush_cache", params={"tiers": "all"})
        assert out.status_code == 200, out.text
        assert [(a["url"], a["status"]) for a in out.json()["replicas"]] == [(r["url"], 200) for r in state["replicas"]]
        after = http.get("/router/state").json()["replicas"]
        assert [(r["store"]["pages"], r["routed_pages"]) for r in after] == [(0, 0), (0, 0)]
        wait_for(lambda: all(r["index"]["device"] == 0 for r in http.get("/router/state").json()["replicas"]))
        assert ask() == 0  # nothing left anywhere, and the router expected nothing
        assert sum(r["expected_hit_tokens"] for r in http.get("/router/state").json()["replicas"]) == expected + before
        bad = http.post("/flush_cache", params={"tiers": "disk"})
        assert bad.status_code == 400 and all(a["body"]["error"]["param"] == "tiers" for a in bad.json()["replicas"])
        http.close()
    finally:
        assert stop(proc, timeout=60) == 0
