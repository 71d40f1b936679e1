"""What SGLang's router (PyPI ``sglang-router``) needs of a worker, against a real
`radixkv serve` process: ``GET /server_info`` (the model's names, read when the router
adds a worker), and the request bodies the router forwards, which it re-encodes with
SGLang's own fields at their defaults (``BODIES``: what sglang-router 0.3.2 sent for
plain requests). Those fields are honoured at those values; another value is a 400
naming the field. The last test puts the router itself in front of the server when
``.peers/sglang-router-venv`` has it (``benchmarks/peers/sglang_router.py``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from radixkv import package_version
from radixkv.server.process import ServerProcess
from test_server import integrity_after_each_test, wait_idle  # noqa: F401  (integrity_after_each_test: autouse)

MODEL = "smollm2-135m-instruct"
NAME = "compat-model"  # the served name, unlike --model
POOL_TOKENS = 2048
MAX_RUNNING = 8
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]

# sglang-router 0.3.2's re-encoding of {"text", "sampling_params"}, of a chat request with
# max_tokens, and of a completions request: the fields it adds, each at its default
ROUTER_GENERATE = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}  # fmt: skip
ROUTER_CHAT = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "logprobs": False}  # fmt: skip
ROUTER_COMPLETIONS = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                      "return_hidden_states": False, "echo": False}  # fmt: skip
BODIES = {  # route -> (a plain body, the same as the router forwards it)
    "/generate": ({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
                  {"text": "The capital of France is", "sampling_params": {"temperature": 0.0, "max_new_tokens": 6},
                   "stream": False, **ROUTER_GENERATE}),
    "/v1/chat/completions": ({"model": NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0},
                             {"messages": CHAT, "model": NAME, "max_completion_tokens": 6, "stream": False,
                              "temperature": 0.0, **ROUTER_CHAT}),
    "/v1/completions": ({"model": NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0},
                        {"model": NAME, "prompt": "Once upon a time", "max_tokens": 6, "stream": False,
                         "temperature": 0.0, **ROUTER_COMPLETIONS}),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--attention-backend", "torch", "--kv-cache-tokens", str(POOL_TOKENS), "--served-model-name",
                       NAME, "--max-running", str(MAX_RUNNING),
                       log_path=tmp_path_factory.mktemp("sglang_compat") / "server.log") as s:  # fmt: skip
        yield s.url
    assert s.exit_code == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def output(route: str, body: dict) -> str:
    if route == "/generate":
        return body["text"]
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_server_info_names_the_model_and_the_limits(http):
    r = http.get("/server_info")
    assert r.status_code == 200
    info = r.json()
    assert info == {"model_path": MODEL, "served_model_name": NAME, "version": package_version(),
                    "context_length": http.get("/model_info").json()["max_context"],
                    "max_total_tokens": POOL_TOKENS, "max_running_requests": MAX_RUNNING, "page_size": 16}  # fmt: skip


def test_openapi_describes_server_info(http):
    doc = http.get("/openapi.json").json()
    op = doc["paths"]["/server_info"]["get"]
    ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ServerInfo") and op["summary"] != "(not described)"
    assert set(doc["components"]["schemas"]["ServerInfo"]["required"]) == {
        "model_path", "served_model_name", "version", "context_length", "max_total_tokens", "max_running_requests",
        "page_size"}  # fmt: skip


@pytest.mark.parametrize("route", sorted(BODIES))
def test_the_routers_bodies_answer_as_the_plain_ones(http, route):
    plain, forwarded = BODIES[route]
    a, b = http.post(route, json=plain), http.post(route, json=forwarded)
    assert a.status_code == b.status_code == 200, b.text
    assert output(route, a.json()) == output(route, b.json()) != ""  # greedy: the same tokens


def test_a_streamed_chat_as_the_router_forwards_it(http):
    _, body = BODIES["/v1/chat/completions"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    plain, _ = BODIES["/v1/chat/completions"]
    assert text == http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]


REFUSED = [  # (route, field, a value radixkv does not honour)
    ("/generate", "return_hidden_states", True), ("/generate", "return_text_in_logprobs", True),
    ("/generate", "background", True), ("/generate", "no_logs", True), ("/generate", "return_bytes", True),
    ("/generate", "return_entropy", True),
    ("/v1/chat/completions", "no_stop_trim", True), ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "return_hidden_states", True),
    ("/v1/completions", "no_stop_trim", True), ("/v1/completions", "return_hidden_states", True),
]  # fmt: skip


@pytest.mark.parametrize("route, field, value", REFUSED)
def test_sglang_fields_at_other_values_are_a_400_naming_them(http, route, field, value):
    _, body = BODIES[route]
    r = http.post(route, json={**body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_reasoning_switches_and_log_metrics_change_nothing(http):
    plain, body = BODIES["/v1/chat/completions"]
    r = http.post("/v1/chat/completions", json={**body, "separate_reasoning": False, "stream_reasoning": False})
    assert r.status_code == 200
    expected = http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    assert r.json()["choices"][0]["message"] == expected
    _, body = BODIES["/generate"]
    assert http.post("/generate", json={**body, "log_metrics": False}).status_code == 200


def test_generate_checks_a_model_when_given(http):
    _, body = BODIES["/generate"]
    assert http.post("/generate", json={**body, "model": NAME}).status_code == 200
    r = http.post("/generate", json={**body, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


def test_behind_sglang_router(http, server):
    """The router registers the server under its served name and forwards chat and
    /generate to it; the second turn of a chat finds the first one's pages cached."""
    from benchmarks.peers import sglang_router

    if not sglang_router.available():
        pytest.skip("sglang-router is not installed (benchmarks/peers/sglang_router.py: install())")
    wait_idle(http)
    assert http.post("/flush_cache").status_code == 200
    proc, url = sglang_router.start([server], "cache_aware")
    try:
        with httpx.Client(base_url=url, timeout=120) as router:
            assert [m["id"] for m in router.get("/v1/models").json()["data"]] == [NAME]
            messages = list(CHAT)
            cached = []
            for question in ("Name a color.", "Name another one."):
                messages.append({"role": "user", "content": question})
                r = router.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 8,
                                                               "temperature": 0})  # fmt: skip
                assert r.status_code == 200, r.text
                messages.append(r.json()["choices"][0]["message"])
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert cached[0] == 0 and cached[1] > 0
            plain, _ = BODIES["/generate"]
            r = router.post("/generate", json=plain)
            assert r.status_code == 200 and r.json()["text"] == http.post("/generate", json=plain).json()["text"]
    finally:
        assert sglang_router.stop(proc) == 0
