"""``radixkv router`` over replicas fed by their KV events, and ``radixkv serve
--replicas N`` which starts both: real processes, the official openai client.

After a mixed workload with evictions (and demotions to a host tier) the router's index
of each replica equals the replica's cache at idle, page for page, on both media; a
conversation's turns follow the replica that holds it; routing decisions on constructed
states; a replica killed mid-run: its requests are retried elsewhere, none lost."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from radixkv.cache.events import BlockIndex, BlockRemoved, BlockStored, KVEventBatch, block_hashes
from radixkv.server.process import launch, stop
from radixkv.errors import FieldError
from radixkv.server.router import Choice, Replica, TextTree, choose_approx, choose_by_cost
from radixkv.server.serve import replica_threads, shared_threads

PAGE = 16


# -- routing decisions on constructed states -------------------------------------------------------------------


def replica_holding(*prompts, host=(), inflight=0, queued=0.0) -> Replica:
    r = Replica("http://r")
    for p, medium in [(p, "GPU") for p in prompts] + [(p, "CPU") for p in host]:
        r.index.apply(KVEventBatch(0.0, [BlockStored(block_hashes(p, None, PAGE), None, list(p), PAGE, None, medium)]))
    r.inflight, r.queued_tokens = inflight, queued
    return r


def test_cost_picks_the_replica_holding_the_prefix():
    doc = list(range(1, 161))  # 10 pages
    prompt = doc + [7] * 20
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(), replica_holding(doc[:80]), replica_holding(doc)]
    c = choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0)
    assert c == Choice(2, 20.0, 160)
    # the same replica, loaded with more queued prefill than the saving: the next best
    reps[2].queued_tokens = 500.0
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0).replica == 1
    # a host-tier copy costs host_page_cost of computing a page
    reps = [replica_holding(), replica_holding(doc[:32], host=[doc])]
    c = choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.25, 1.0, 0.0)
    assert c.replica == 1 and c.cached == 160 and c.prefill == 20 + 0.25 * 128
    # a salted request never matches unsalted pages: a cold prompt goes where least was routed
    from radixkv.server.router import remember

    salted = block_hashes(prompt, "tenant", PAGE)
    reps = [replica_holding(doc, inflight=1), replica_holding(doc[:16], inflight=1)]
    remember(reps[0].history, block_hashes(doc, None, PAGE), 100)
    assert choose_by_cost(reps, [0, 1], salted, len(prompt), PAGE, 0.2, 1.0, 0.0) == Choice(1, 180.0, 0)
    # under cache_threshold of the prompt cached counts as cold too; imbalance goes to the least loaded
    reps = [replica_holding(doc[:16]), replica_holding()]
    remember(reps[0].history, block_hashes(doc[:16], None, PAGE), 100)
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, cache_threshold=0.3).replica == 1
    reps = [replica_holding(doc, inflight=100), replica_holding(inflight=10)]
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, 0.3, 64, 1.5).replica == 1
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, 0.3, 100, 1.5).replica == 0


def test_a_cold_prompt_goes_back_to_its_home():
    """A prefix every replica lost goes back to the replica it was routed to before (one home,
    not a copy per replica); without one, to the replica with the fewest routed pages."""
    from collections import OrderedDict

    from radixkv.server.router import remember

    prompt = list(range(1, 200))
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(), replica_holding(list(range(500, 900))), replica_holding(list(range(900, 1000)))]
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, 0.3).replica == 0
    reps[1].history = OrderedDict()
    remember(reps[1].history, hashes, 100)
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, 0.3).replica == 1
    remember(reps[1].history, list(range(1000, 1100)), 100)  # pushed out of the bounded history
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 1.0, 0.0, 0.3).replica == 0


def test_a_cold_prompt_goes_where_the_least_is_running():
    """Three replicas, four conversations: the first one's three turns are done (its replica
    has the most routed pages and nothing in flight), two more run on the other replicas.
    The fourth goes beside the finished one, not beside a running one; among replicas
    running as much, to the fewest routed pages."""
    from radixkv.server.router import remember

    prompt = list(range(1, 600))
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(list(range(1000, 1960))), replica_holding(list(range(2000, 2480)), inflight=1),
            replica_holding(list(range(3000, 3400)), inflight=1)]  # fmt: skip
    for r, base, n in zip(reps, (1000, 2000, 3000), (960, 480, 400)):
        remember(r.history, block_hashes(list(range(base, base + n)), None, PAGE), 1000)
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3).replica == 0
    reps[0].inflight = 1
    assert choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3).replica == 2


def test_equal_runs_go_to_the_fewest_routed_pages():
    """Two replicas hold the same prefix (a long shared system prompt): the cost is equal, so
    the one running less, then the one with fewer routed pages, takes the prompt."""
    from radixkv.server.router import remember

    system = list(range(1, 321))
    prompt = system + list(range(5000, 5100))
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(system), replica_holding(system)]
    remember(reps[0].history, block_hashes(system + list(range(7000, 7800)), None, PAGE), 1000)
    remember(reps[1].history, block_hashes(system, None, PAGE), 1000)
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3) == Choice(1, 100.0, 320)
    reps[1].inflight = 2
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3).replica == 0


def test_events_mode_follows_a_run_past_its_own_threshold():
    """The router's events mode follows an exact run over ``events_cache_threshold`` (0.1)
    of the prompt, not SGLang's 0.3 for its approximate text tree: a replica holding 20%
    of the prompt takes it though another runs less; at 0.3 the prompt is cold."""
    from radixkv.server.router import Router, RouterConfig

    prompt = list(range(1, 801))  # 50 pages; replica 1 holds the first 10
    for threshold, want in ((None, 1), (0.3, 0)):
        extra = {} if threshold is None else {"events_cache_threshold": threshold}
        router = Router(RouterConfig(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2"), **extra))
        router.replicas[0] = replica_holding()
        router.replicas[1] = replica_holding(prompt[:160], inflight=2)
        for r in router.replicas:
            r.up, r.events = True, {"endpoint": "tcp://127.0.0.1:1"}
        assert router.mode == "events"
        assert router.route("/generate", {"input_ids": prompt}, None, set()).replica == want


def test_a_pin_is_routed_by_its_prompt_and_a_hint_claims_nothing():
    """/pin goes where its prompt's pages are, like a generation request, and counts them
    as computed there (pending, routed); a hint computes nothing, so it claims neither."""
    from radixkv.server.router import Router, RouterConfig

    prompt = list(range(1, 321))  # 20 pages; replica 1 holds the first 12
    router = Router(RouterConfig(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2")))
    router.replicas[0] = replica_holding()
    router.replicas[1] = replica_holding(prompt[:192], inflight=1)
    for r in router.replicas:
        r.up, r.events = True, {"endpoint": "tcp://127.0.0.1:1"}
    hint = router.route("/pin", {"input_ids": prompt, "hint": True}, None, set())
    assert hint.replica == 1 and hint.cached == 192
    assert not router.replicas[1].pending and not router.replicas[1].history
    pin = router.route("/pin", {"input_ids": prompt}, None, set())
    assert pin.replica == 1 and len(router.replicas[1].pending) == 20 and len(router.replicas[1].history) == 20


def test_a_home_outranks_a_partial_copy_elsewhere():
    """A conversation routed to replica 0 that lost most of it under pressure goes back there,
    not to replica 1, which holds a shorter part of it now (a shared system prompt and the
    first turn): one home per prefix. The expected figures are what replica 0's cache holds."""
    from radixkv.server.router import remember

    prompt = list(range(1, 200))
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(prompt[:16]), replica_holding(prompt[:96])]
    remember(reps[0].history, hashes, 100)
    remember(reps[1].history, hashes[:6], 100)
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3) == Choice(0, 183.0, 16)
    # without the history, the replica holding more wins
    reps[0].history.clear()
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3) == Choice(1, 103.0, 96)


def test_a_shared_store_counts_for_every_replica_writing_to_it():
    """Two replicas write to one store; a third has none. A prompt whose pages one of them
    wrote (and both lost from memory) is a store read on either of the two, at
    store_page_cost a page: warm on both, so the one running less takes it; the replica
    still holding a page in memory pays less for it; the third would compute it all."""
    from radixkv.server.router import SharedStore

    doc = list(range(1, 161))  # 10 pages
    prompt = doc + [7] * 20
    hashes = block_hashes(prompt, None, PAGE)
    store = SharedStore("lmdb:/kv", limit=100)
    reps = [replica_holding(inflight=2), replica_holding(inflight=1), replica_holding()]
    reps[0].store = reps[1].store = store
    store.add(hashes[:10])
    assert store.run(hashes, 0) == 10 and store.run(hashes, 4) == 6
    c = choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3, store_page_cost=0.1)
    assert c == Choice(1, 20 + 0.1 * 160, 160)
    reps[0].index = replica_holding(doc[:64]).index  # 4 pages in replica 0's memory, 6 from the store
    c = choose_by_cost(reps, [0, 1, 2], hashes, len(prompt), PAGE, 0.2, 0.0, 0.0, 0.3, store_page_cost=0.1)
    assert c.replica == 0 and c.cached == 160 and c.prefill == pytest.approx(20 + 0.1 * 96)
    store.add(list(range(10**6, 10**6 + 100)))  # written since: the oldest pages count as gone
    assert store.run(hashes, 0) == 0 and len(store) == 100


def test_the_store_learns_written_pages_from_the_right_events():
    """Write-through: pages stored (any tier). Write-back: pages leaving the last memory
    tier; with a host tier a page the device demotes is on the host, not in the store."""
    from radixkv.server.router import written_to_store

    doc = list(range(1, 65))
    h = block_hashes(doc, None, PAGE)
    demote = [BlockRemoved(h[2:], "GPU"), BlockStored(h[2:], h[1], doc[32:], PAGE, None, "CPU")]
    push_out = [BlockRemoved(h[3:], "CPU")]
    stored = [BlockStored(h, None, doc, PAGE, None, "GPU")]
    assert written_to_store(stored + demote, "through", "CPU") == h + h[2:]
    assert written_to_store(stored + demote + push_out, "back", "CPU") == h[3:]
    assert written_to_store(stored + [BlockRemoved(h[1:], "GPU")], "back", "GPU") == h[1:]


def test_pending_pages_count_until_their_events_come():
    prompt = list(range(1, 100))
    hashes = block_hashes(prompt, None, PAGE)
    reps = [replica_holding(), replica_holding()]
    reps[1].pending = {h: 10.0 for h in hashes}
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 1.0, 5.0).replica == 1
    assert choose_by_cost(reps, [0, 1], hashes, len(prompt), PAGE, 0.2, 1.0, 11.0).replica == 0  # expired


def test_index_follows_removals_and_clears():
    idx = BlockIndex()
    doc = list(range(1, 65))
    h = block_hashes(doc, None, PAGE)
    idx.apply(KVEventBatch(0.0, [BlockStored(h, None, doc, PAGE, None, "GPU")]))
    assert idx.match(h) == (4, 0)
    idx.apply(KVEventBatch(0.0, [BlockRemoved(h[2:], "GPU"), BlockStored(h[2:], h[1], doc[32:], PAGE, None, "CPU")]))
    assert idx.match(h) == (2, 2)
    from radixkv.cache.events import AllBlocksCleared

    idx.apply(KVEventBatch(0.0, [AllBlocksCleared()]))
    assert idx.match(h) == (0, 0) and len(idx) == 0


def test_approx_mode_follows_sglang_rules():
    reps = [Replica(f"http://r{i}", text=TextTree(1 << 20)) for i in range(3)]
    text = "system: you are a helpful assistant. " * 8
    reps[1].text.insert(text)
    assert choose_approx(reps, [0, 1, 2], text + "user: hi", 0.3, 64, 1.5) == 1  # best match over the threshold
    reps[0].text.insert("x" * 64)
    reps[2].text.insert("y" * 32)
    assert choose_approx(reps, [0, 1, 2], "a new prompt entirely " * 4, 0.3, 64, 1.5) == 2  # else the smallest tree
    reps[1].inflight, reps[0].inflight, reps[2].inflight = 100, 10, 20
    assert choose_approx(reps, [0, 1, 2], text, 0.3, 64, 1.5) == 0  # imbalanced: the least loaded
    tree = TextTree(64)
    tree.insert("a" * 200)
    assert tree.chars <= 64


def test_metric_labels_are_escaped():
    """A replica URL (or store spec) with a quote or backslash stays one label value."""
    from radixkv.server.router import Router, RouterConfig

    text = Router(RouterConfig(replicas=('http://127.0.0.1:1/a"b\\c',))).metrics()
    assert 'radixkv_router_replica_up{replica="http://127.0.0.1:1/a\\"b\\\\c"} 0' in text


def test_replicas_share_the_cores_unless_told():
    assert [replica_threads(n, cpus=8) for n in (1, 2, 3, 8, 9)] == [8, 4, 2, 1, 1]
    assert replica_threads(3, cpus=2) == 1
    assert shared_threads(None, 3, {}, cpus=8) == ["--threads", "2"]
    # a --threads setting (passed on with the other flags) or $OMP_NUM_THREADS wins
    assert shared_threads(4, 3, {}, cpus=8) == []
    assert shared_threads(None, 3, {"OMP_NUM_THREADS": "4"}, cpus=8) == []
    with pytest.raises(FieldError, match=r"replicas must be >= 1, got 0"):
        replica_threads(0, cpus=8)


# -- real processes -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`radixkv serve --replicas 3` (small pools, a host tier: evictions and demotions)."""
    log = tmp_path_factory.mktemp("router") / "serve.log"
    cmd = [sys.executable, "-m", "radixkv", "serve", "--replicas", "3", "--attention-backend", "torch",
           "--kv-cache-tokens", "512", "--host-cache-bytes", str(24 * 720 * 1024),
           "--kv-events-format", "map"]  # vLLM's wire form (test_router_store runs the array form)  # fmt: skip
    proc, url = launch(cmd, "/health", "radixkv serve --replicas 3", timeout=600, log_path=log)
    try:
        http = httpx.Client(base_url=url, timeout=300)
        state = http.get("/router/state").json()
        yield proc, url, http, state
        http.close()
    finally:
        code = stop(proc, timeout=60)
    assert code == 0
    for r in state["replicas"]:  # the replicas stopped with it
        with pytest.raises(httpx.TransportError):
            httpx.get(r["url"] + "/health", timeout=2)


def wait_idle(urls: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                s = httpx.get(u + "/stats", timeout=10).json()
            except httpx.TransportError:
                break  # a replica that is down is idle
            if not s["running"] and not s["waiting"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)


FEW_SHOT = "".join(f"Question {i}: what is {i} plus {i}? Answer: {2 * i}.\n" for i in range(14))


def test_replicas_publish_events_and_the_router_uses_them(cluster):
    _, _, http, state = cluster
    assert state["mode"] == "events" and len(state["replicas"]) == 3
    assert all(r["up"] and r["events"] for r in state["replicas"])
    stats = [httpx.get(r["url"] + "/stats").json() for r in state["replicas"]]
    assert {s["kv_events"]["format"] for s in stats} == {"map"}
    # the tests' $OMP_NUM_THREADS (conftest) reached every replica: one thread each
    assert [s["threads"] for s in stats] == [1, 1, 1]


def test_router_index_equals_replicas_at_idle(cluster):
    _, url, http, state = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    urls = [r["url"] for r in state["replicas"]]

    def conversation(k: int) -> list[int]:
        messages, cached = [{"role": "system", "content": f"You are assistant number {k}. Be brief."}], []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Tell me fact {turn} about the number {k * 7 + turn}."})
            out = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                                 temperature=0)  # fmt: skip
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
        return cached

    def few_shot(i: int) -> int:
        out = client.completions.create(model="smollm2-135m-instruct", prompt=FEW_SHOT + f"Question: {i} plus 1?",
                                        max_tokens=4, temperature=0)  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0

    with cf.ThreadPoolExecutor(4) as pool:
        convs = [pool.submit(conversation, k) for k in range(12)]
        shots = [pool.submit(few_shot, i) for i in range(8)]
        cached = [f.result() for f in convs]
        shot_cached = [f.result() for f in shots]
    # a conversation's later turns come back to the replica holding its earlier turns (pools
    # this small evict some between turns; round robin would send 2 of 3 elsewhere)
    later = [c[t] > 0 for c in cached for t in (1, 2)]
    assert sum(later) >= 0.75 * len(later), cached
    assert sum(shot_cached) > 0
    wait_idle(urls)
    evicted = sum(httpx.get(u + "/stats").json()["cache"]["evicted_pages"] for u in urls)
    assert evicted > 0  # pools of 32 pages: the workload did not fit
    deadline = time.monotonic() + 20
    while True:
        routed = http.get("/router/state", params={"blocks": 1}).json()["replicas"]
        truth = [httpx.get(u + "/debug/kv_blocks").json() for u in urls]
        diverged = sum(len(set(r["blocks"].get(m, [])) ^ set(t[m])) for r, t in zip(routed, truth) for m in ("GPU", "CPU"))
        if diverged == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert diverged == 0
    assert any(t["CPU"] for t in truth)  # demotions to the host tier were followed too
    for u in urls:
        assert httpx.get(u + "/debug/integrity").status_code == 200


def test_metrics_per_replica(cluster):
    _, _, http, state = cluster
    text = http.get("/metrics").text
    for r in state["replicas"]:
        assert f'radixkv_router_replica_up{{replica="{r["url"]}"}} 1' in text
        assert f'radixkv_router_index_blocks{{replica="{r["url"]}",medium="GPU"}}' in text


def test_pins_and_flushes_through_the_router(cluster):
    """A pin goes where its prompt is routed, /unpin and /flush_cache reach every replica."""
    _, _, http, state = cluster
    urls = [r["url"] for r in state["replicas"]]
    prompt = "".join(f"Pinned fact {i}: {i} squared is {i * i}.\n" for i in range(8)) + "Which fact is pinned?"  # ~7 pages
    pin = http.post("/pin", json={"text": prompt})
    assert pin.status_code == 200, pin.text
    info = pin.json()
    assert info["pages"] > 0
    holders = [u for u in urls if any(e["id"] == info["id"] for e in httpx.get(u + "/stats").json()["pins"]["entries"])]
    assert len(holders) == 1
    out = http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert out.json()["meta_info"]["cached_tokens"] >= info["tokens"]  # routed to the replica that pinned it
    gone = http.post("/unpin", json={"id": info["id"]})
    assert gone.status_code == 200 and gone.json()["unpinned"] == 1
    assert sorted(a["status"] for a in gone.json()["replicas"]) == [200, 404, 404]  # ids never collide
    again = http.post("/unpin", json={"id": info["id"]})
    assert again.status_code == 404 and again.json()["unpinned"] == 0
    ended = http.post("/unpin", json={"session_id": "no-such-session"})
    assert ended.status_code == 200 and ended.json()["unpinned"] == 0
    wait_idle(urls)
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert [a["url"] for a in flushed.json()["replicas"]] == urls
    assert all(r["routed_pages"] == 0 for r in http.get("/router/state").json()["replicas"])
    assert all(not (t["GPU"] or t["CPU"]) for t in (httpx.get(u + "/debug/kv_blocks").json() for u in urls))
    deadline = time.monotonic() + 20
    while any(r["index"]["device"] for r in http.get("/router/state").json()["replicas"]):  # the events follow
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_killed_replica_loses_no_request(cluster):
    """Runs last: it kills one replica of the module's cluster."""
    proc, url, http, state = cluster
    urls = [r["url"] for r in state["replicas"]]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    cmdlines = {int(p): open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in children}
    prompts = [f"Write a long story about a cat named {name}." for name in "ABCDEFGHIJKL"]

    def ask(p: str) -> int:
        r = httpx.post(url + "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 48, "temperature": 0}},
                       timeout=300)  # fmt: skip
        return r.status_code

    with cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        deadline = time.monotonic() + 120
        victim = None
        while victim is None:  # a replica serving some of them
            assert time.monotonic() < deadline
            victim = next((u for u in urls if httpx.get(u + "/stats").json()["running"]), None)
            time.sleep(0.05)
        pid = next(p for p, cmd in cmdlines.items() if f"--port {victim.rsplit(':', 1)[1]} " in cmd + " ")
        os.kill(pid, signal.SIGKILL)
        codes = [f.result() for f in futures]
    assert codes == [200] * len(prompts)
    after = http.get("/router/state").json()
    assert after["retries"] >= 1 and after["lost"] == 0
    assert not after["replicas"][urls.index(victim)]["up"]
    assert http.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
