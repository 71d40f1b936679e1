"""Pins, TTLs, cache_control and session_id through a real `radixkv serve` process: the
native /pin, /unpin and /generate fields with httpx, the OpenAI routes with the official
openai client; /stats lists every entry. Each test leaves the server idle, consistent
(/debug/integrity) and without entries."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixkv.server.process import ServerProcess

MODEL = "smollm2-135m-instruct"
PAGE = 16
POOL_TOKENS = 1024  # 64 pages; max-pinned-share 0.25: 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(
        "--attention-backend", "torch", "--kv-cache-tokens", str(POOL_TOKENS), "--max-pinned-share", "0.25",
        "--session-ttl", "60", "--debug", log_path=tmp_path_factory.mktemp("server") / "server.log",
    ) as server:  # fmt: skip
        yield server.url
    assert server.exit_code == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(autouse=True)
def clean_after_each_test(http):
    yield
    for entry in entries(http):
        http.post("/unpin", json={"id": entry["id"]})
    assert entries(http) == []
    assert http.get("/debug/integrity").status_code == 200


def entries(http) -> list[dict]:
    return http.get("/stats").json()["pins"]["entries"]


def tokens(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"text": text}).json()["tokens"]


def words(n: int, seed: int = 0) -> str:
    vocab = ["radix", "tree", "page", "cache", "token", "prefix", "engine", "pool", "leaf", "node", "lock", "hint"]
    return " ".join(vocab[(i * 5 + seed) % len(vocab)] for i in range(n))


def test_pin_lists_and_unpins_and_refuses_past_the_cap(http):
    ids = tokens(http, words(120))[:100]
    r = http.post("/pin", json={"input_ids": ids})
    assert r.status_code == 200, r.text
    pin = r.json()
    assert (pin["kind"], pin["tokens"], pin["pages"], pin["expires_in"]) == ("pin", 96, 6, None)
    stats = http.get("/stats").json()["pins"]
    assert (stats["pinned_pages"], stats["max_pinned_pages"]) == (6, 16)
    assert stats["entries"] == [{"id": pin["id"], "kind": "pin", "tokens": 96, "pages": 6, "expires_in": None}]
    r = http.post("/pin", json={"text": words(300, seed=7)})  # 11 more pages: 17 > 16
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "text" and "the cap is 16 pages (max_pinned_share 0.25)" in error["message"]
    assert http.get("/stats").json()["pins"]["pinned_pages"] == 6
    r = http.post("/pin", json={"input_ids": ids, "ttl": 30})  # the same prefix: one entry, refreshed
    assert r.json()["id"] == pin["id"] and r.json()["expires_in"] is None  # a pin without ttl outlives any
    assert http.post("/unpin", json={"id": pin["id"]}).json() == {"unpinned": 1}
    r = http.post("/unpin", json={"id": pin["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "id"
    for body, param in (({"input_ids": ids, "ttl": -1}, "ttl"), ({"input_ids": [1, 2]}, "input_ids"),
                        ({"input_ids": ids, "uses": 2}, "uses"), ({"input_ids": ids, "pin": True}, "pin"),
                        ({}, "text")):  # fmt: skip
        r = http.post("/pin", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert http.post("/unpin", json={}).json()["error"]["param"] == "id"


def test_generate_pins_hints_and_keeps_its_session(http):
    ids = tokens(http, words(80, seed=1))[:70]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    r = http.post("/generate", json={**body, "pin": {"ttl": 30, "tokens": 40}})
    assert r.status_code == 200, r.text
    pin = r.json()["meta_info"]["pin"]
    assert (pin["kind"], pin["tokens"], pin["pages"]) == ("ttl", 32, 2) and 29 < pin["expires_in"] <= 30
    r = http.post("/generate", json={**body, "hint": {"uses": 2}, "session_id": "agent-1"})
    got = {e["kind"]: e for e in entries(http)}
    assert got["hint"]["uses"] == 2 and got["hint"]["tokens"] == 64 and got["hint"]["session"] == "agent-1"
    assert got["session"]["tokens"] == 64 and got["session"]["session"] == "agent-1"  # 70 + 2 computed: 4 pages
    assert http.post("/unpin", json={"session_id": "agent-1"}).json() == {"unpinned": 2}
    for extra, param in (({"pin": {"ttl": 0}}, "pin.ttl"), ({"pin": {"tokens": 0}}, "pin.tokens"),
                         ({"hint": {"uses": 0}}, "hint.uses"), ({"session_id": ""}, "session_id")):  # fmt: skip
        r = http.post("/generate", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = http.post("/generate", json={"input_ids": tokens(http, words(400, seed=3))[:300], "pin": True,
                                     "sampling_params": {"max_new_tokens": 1}})  # 18 pages > 16
    assert r.status_code == 400 and r.json()["error"]["param"] == "pin"
    assert "max_pinned_share" in r.json()["error"]["message"]


def test_chat_cache_control_keeps_the_prompt_through_its_message(http, client):
    system = "You answer in one word. " + words(60, seed=2)
    messages = [{"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"role": "user", "content": "Name a tree."}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"session_id": "chat-1"})  # fmt: skip
    full = http.post("/render_chat", json={"messages": [{"role": m["role"], "content": m["content"]}
                                                        for m in messages]}).json()["tokens"]  # fmt: skip
    head = http.post("/render_chat", json={"messages": [{"role": "system", "content": system}],
                                           "add_generation_prompt": False}).json()["tokens"]  # fmt: skip
    assert full[: len(head)] == head  # the system message's end is a position in the whole prompt
    got = {e["kind"]: e for e in entries(http)}
    assert got["ttl"]["tokens"] == len(head) // PAGE * PAGE and 3590 < got["ttl"]["expires_in"] <= 3600
    assert got["session"]["session"] == "chat-1"
    # the next turn finds all of it cached and replaces the session's entry
    follow = [*messages, {"role": "assistant", "content": r.choices[0].message.content},
              {"role": "user", "content": "Another?"}]  # fmt: skip
    r2 = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=2, temperature=0,
                                        extra_body={"session_id": "chat-1"})  # fmt: skip
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(head) // PAGE * PAGE
    sessions = [e for e in entries(http) if e["kind"] == "session"]
    assert len(sessions) == 1 and sessions[0]["id"] != got["session"]["id"]
    # a text part carries it as well; and the completions route takes it for the whole prompt
    parts = [{"role": "system", "content": [{"type": "text", "text": system,
                                             "cache_control": {"type": "ephemeral"}}]},
             {"role": "user", "content": "Name a leaf."}]  # fmt: skip
    client.chat.completions.create(model=MODEL, messages=parts, max_tokens=1)
    c = client.completions.create(model=MODEL, prompt=words(50, seed=4), max_tokens=1,
                                  extra_body={"cache_control": {"type": "ephemeral", "ttl": 120}})  # fmt: skip
    ttls = sorted(e["tokens"] for e in entries(http) if e["kind"] == "ttl")
    assert ttls == sorted({len(head) // PAGE * PAGE, c.usage.prompt_tokens // PAGE * PAGE})


def test_bad_cache_control_and_session_id_are_400s_naming_the_field(client):
    def refused(param, **kw):
        with pytest.raises(openai.BadRequestError) as e:
            kw.setdefault("messages", [{"role": "user", "content": "hi"}])
            client.chat.completions.create(model=MODEL, max_tokens=1, **kw)
        assert e.value.body["param"] == param, e.value.body

    refused("messages[0].cache_control.ttl",
            messages=[{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}])
    refused("messages[0].cache_control.type", messages=[{"role": "user", "content": "hi",
                                                         "cache_control": {"type": "persistent"}}])  # fmt: skip
    refused("messages[0].content[0].cache_control.ttl", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": -5}}]}])  # fmt: skip
    refused("cache_control.ttl", extra_body={"cache_control": {"type": "ephemeral", "ttl": "soon"}})
    refused("session_id", extra_body={"session_id": "x" * 300})
    many = [{"role": "user", "content": f"m{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]
    refused("cache_control", messages=many)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_control": {"type": "ephemeral", "ttl": 0}})  # fmt: skip
    assert e.value.body["param"] == "cache_control.ttl"
