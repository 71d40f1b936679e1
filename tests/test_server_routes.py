"""The routes and options clients call beside generation: GET /v1/models/{model}
(openai's ``models.retrieve``), vLLM's /tokenize and /detokenize bodies, CORS
(``--allowed-origins``), /openapi.json, and ``radixkv --version``; each against a real
`radixkv serve` process, through the official openai client where it has a call for it.

The module's server serves a model name with a ``/`` in it, behind an API key, for two
allowed origins; two more servers (one test each) check ``*`` with restricted methods
and headers, and that without ``--allowed-origins`` nothing changes.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import httpx
import msgspec
import openai
import pytest

from radixkv.server import protocol as P
from radixkv.server.app import ServerConfig
from radixkv.server.process import ServerProcess
from test_server import integrity_after_each_test, wait_idle  # noqa: F401  (integrity_after_each_test: autouse)

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # served under this name: an id with a "/"
KEY = "routes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
OTHER_ORIGIN = "http://localhost:5173"
POOL = ("--attention-backend", "torch", "--kv-cache-tokens", "2048")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi<|im_end|> there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(*POOL, "--api-key", KEY, "--served-model-name", NAME,
                       "--allowed-origins", ORIGIN, OTHER_ORIGIN + "/",
                       log_path=tmp_path_factory.mktemp("routes") / "server.log") as s:  # fmt: skip
        yield s.url
    assert s.exit_code == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def cors_headers(r: httpx.Response) -> dict:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-")}


# -- GET /v1/models/{model} ------------------------------------------------------------------------


def test_models_retrieve_through_the_openai_client(client, http, server):
    listed = client.models.list().data
    card = client.models.retrieve(NAME)  # the client percent-encodes the "/"
    assert (card.id, card.object, card.owned_by, card.created) == (NAME, "model", "radixkv", listed[0].created)
    assert [m.id for m in listed] == [NAME]
    assert http.get(f"/v1/models/{NAME}").json() == card.model_dump(exclude_unset=True)  # a raw "/" in the path
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    error = e.value.body if "code" in e.value.body else e.value.body["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "gpt-4o" in error["message"]
    assert http.get("/v1/models/smollm2-135m-instruct").status_code == 404  # the engine's name is not an alias here
    assert http.post(f"/v1/models/{NAME}", json={}).status_code == 405
    assert http.get("/v1/models/").status_code == 404  # no id: no such route
    assert httpx.get(f"{server}/v1/models/{NAME}").status_code == 401  # the key, as on every route but /health
    # the served name is the one requests must send
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert r.model == NAME and r.usage.completion_tokens >= 1


# -- /tokenize and /detokenize -------------------------------------------------------------------------


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_takes_radixkv_and_vllm_bodies(http, server):
    text = "The cache keeps <|im_end|> every prefix."
    max_context = http.get("/model_info").json()["max_context"]
    old = tokenize(http, text=text)  # radixkv's body: what RuntimeEndpoint sends
    assert old["count"] == len(old["tokens"]) > 5 and old["max_model_len"] == max_context
    assert old["token_strs"] is None
    # vLLM's prompt body: add_special_tokens defaults to True there (this tokenizer adds nothing)
    special = tokenize(http, text=text, add_special_tokens=True)["tokens"]
    assert tokenize(http, model=NAME, prompt=text)["tokens"] == special
    assert tokenize(http, prompt=text, add_special_tokens=False)["tokens"] == old["tokens"]
    split = tokenize(http, prompt=text, split_special_tokens=True)["tokens"]
    assert len(split) > len(old["tokens"])  # <|im_end|> as plain text
    strs = tokenize(http, prompt=" cache cache", return_token_strs=True)
    assert strs["token_strs"] == ["Ġcache", "Ġcache"] and strs["tokens"][0] == strs["tokens"][1]
    # vLLM's chat body: the prompt ids a chat request would use, as /render_chat gives them
    for add in (True, False):
        rendered = http.post("/render_chat", json={"messages": CHAT, "add_generation_prompt": add}).json()
        chat = tokenize(http, model=NAME, messages=CHAT, add_generation_prompt=add)
        assert chat["tokens"] == rendered["tokens"] and chat["count"] == len(rendered["tokens"])
    default = tokenize(http, messages=CHAT)["tokens"]
    assert tokenize(http, messages=CHAT, add_special_tokens=True)["tokens"] == default  # nothing to add here
    opted = tokenize(http, messages=CHAT, special_tokens_in_content=True)["tokens"]
    assert len(opted) < len(default)  # the marker in the content became one special token
    used = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=1, temperature=0)  # fmt: skip
    assert used.usage.prompt_tokens == len(default)
    # the frontend's HTTP backend still gets what it reads
    from radixkv.frontend import RuntimeEndpoint

    endpoint = RuntimeEndpoint(server, api_key=KEY)
    try:
        assert endpoint.tokenize(text) == old["tokens"]
        assert endpoint.tokenize(text, split_special_tokens=True) == split
    finally:
        endpoint.close()


def test_detokenize_is_vllms_and_inverts_tokenize(http):
    text = "Radix trees share prefixes: <|im_start|>user\nnaïve café ✓"
    ids = tokenize(http, text=text)["tokens"]
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert http.post("/detokenize", json={"model": NAME, "tokens": ids}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    vocab = http.get("/model_info").json()["vocab_size"]
    assert http.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200


BAD = [  # (id, path, body, status, param)
    ("detok id too large", "/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("detok id at vocab", "/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("detok id negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detok wrong type", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("detok missing", "/detokenize", {}, 400, None),
    ("detok unknown field", "/detokenize", {"tokens": [1], "skip_special": True}, 400, "skip_special"),
    ("detok other model", "/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
    ("tok nothing", "/tokenize", {"model": NAME}, 400, "text"),
    ("tok text and prompt", "/tokenize", {"text": "a", "prompt": "a"}, 400, "prompt"),
    ("tok prompt and messages", "/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
    ("tok unknown field", "/tokenize", {"prompt": "a", "continue_final_messag": True}, 400, "continue_final_messag"),
    ("tok other model", "/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ("tok empty messages", "/tokenize", {"messages": []}, 400, "messages"),
    ("tok bad role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("tok split with messages", "/tokenize", {"messages": CHAT, "split_special_tokens": True}, 400,
     "split_special_tokens"),
]


@pytest.mark.parametrize("path, body, status, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tokenizer_bodies_get_a_clear_4xx(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param


def test_fuzzed_tokenizer_bodies_get_a_json_4xx_or_a_200(http):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fields = {"/tokenize": ["text", "prompt", "messages", "model", "add_special_tokens", "split_special_tokens",
                            "add_generation_prompt", "tools", "special_tokens_in_content", "return_token_strs"],
              "/detokenize": ["tokens", "model"]}  # fmt: skip
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=12), st.just(NAME))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text"]), inner, max_size=3), max_leaves=10)  # fmt: skip

    @st.composite
    def bodies(draw):
        path = draw(st.sampled_from(sorted(fields)))
        names = draw(st.lists(st.sampled_from(fields[path] + ["unknown"]), max_size=4, unique=True))
        return path, {name: draw(values) for name in names}

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies())
    def check(case):
        path, body = case
        r = http.post(path, json=body)
        assert r.status_code in (200, 400, 404), (path, body, r.text[:300])
        assert ("error" in r.json()) == (r.status_code != 200)

    check()


# -- CORS ------------------------------------------------------------------------------------------------


def preflight(url: str, path: str, origin: str, method: str = "POST", headers: str | None = None) -> httpx.Response:
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return httpx.options(url + path, headers=h)  # no key: browsers send none on a preflight


def test_cors_preflight_for_allowed_origins_only(server):
    for origin in (ORIGIN, OTHER_ORIGIN):  # the second was given with a trailing "/"
        r = preflight(server, "/v1/chat/completions", origin, headers="authorization, content-type, x-stainless-os")
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == origin and "origin" in r.headers["vary"].lower()
        assert {"GET", "POST", "OPTIONS"} == {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
        asked = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert asked == {"authorization", "content-type", "x-stainless-os"}  # "*": what was asked, echoed
        assert int(r.headers["access-control-max-age"]) > 0
    assert preflight(server, f"/v1/models/{NAME}", ORIGIN, "GET").status_code == 204
    for origin in ("http://evil.example", "http://app.example:8080", "https://app.example"):
        r = preflight(server, "/v1/chat/completions", origin)
        assert r.status_code == 403 and cors_headers(r) == {}, r.headers
        assert r.json()["error"]["type"] == "cors_error"
    r = preflight(server, "/v1/chat/completions", ORIGIN, "DELETE")
    assert r.status_code == 403 and cors_headers(r) == {}
    # an OPTIONS that is not a preflight (no Access-Control-Request-Method) is routed as before
    assert httpx.options(server + "/v1/models", headers={"Origin": ORIGIN}).status_code == 405


def test_cors_headers_on_responses_to_allowed_origins(server, http, client):
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "origin" in r.headers["vary"].lower()
    for origin in ("http://evil.example", None):
        r = http.get("/v1/models", headers={"Origin": origin} if origin else {})
        assert r.status_code == 200 and cors_headers(r) == {}
    # errors too (the page can read why), and /health without the key
    r = httpx.get(server + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server + "/health", headers={"Origin": OTHER_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == OTHER_ORIGIN
    # a stream, through the openai client as a browser app would call it
    raw = client.chat.completions.with_raw_response.create(model=NAME, messages=CHAT, max_tokens=3, stream=True,
                                                           extra_headers={"Origin": ORIGIN})  # fmt: skip
    assert raw.headers["access-control-allow-origin"] == ORIGIN
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert [c for c in raw.parse()][-1].choices[0].finish_reason in ("length", "stop")


def test_cors_any_origin_with_restricted_methods_and_headers(tmp_path):
    with ServerProcess(*POOL, "--allowed-origins", "*", "--allowed-methods", "post", "--allowed-headers",
                       "Content-Type", "X-Cache-Salt", log_path=tmp_path / "server.log") as s:  # fmt: skip
        r = preflight(s.url, "/v1/completions", "https://anything.example", headers="content-type,x-cache-salt")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        assert "vary" not in r.headers
        assert r.headers["access-control-allow-methods"] == "POST"
        allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
        assert {"content-type", "x-cache-salt", "accept"} <= allowed and "authorization" not in allowed
        for method, headers in (("GET", None), ("POST", "authorization")):
            r = preflight(s.url, "/v1/completions", "https://anything.example", method, headers)
            assert r.status_code == 403 and cors_headers(r) == {}, r.text
        r = httpx.post(s.url + "/v1/completions", headers={"Origin": "null"},
                       json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 1})  # fmt: skip
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        with httpx.Client(base_url=s.url) as c:
            wait_idle(c)
    assert s.exit_code == 0


def test_no_cors_headers_without_allowed_origins(tmp_path):
    with ServerProcess(*POOL, log_path=tmp_path / "server.log") as s:
        r = preflight(s.url, "/v1/chat/completions", ORIGIN)
        assert r.status_code == 405 and cors_headers(r) == {}  # as before: no route answers OPTIONS
        r = httpx.get(s.url + "/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and cors_headers(r) == {}
        doc = httpx.get(s.url + "/openapi.json").json()
        assert "security" not in doc and "securitySchemes" not in doc["components"]
    assert s.exit_code == 0


def test_cors_settings_are_checked():
    assert ServerConfig(allowed_origins=["HTTP://App.Example:8080/"]).allowed_origins == ("http://app.example:8080",)
    assert ServerConfig(allowed_methods=["get", "post"]).allowed_methods == ("GET", "POST")
    for bad in (["app.example"], ["http://app.example/path"], "http://app.example", [""]):
        with pytest.raises(ValueError, match="allowed_origins"):
            ServerConfig(allowed_origins=bad)
    with pytest.raises(ValueError, match="allowed_headers"):
        ServerConfig(allowed_headers=["x header"])
    run = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--allowed-origins", "app.example"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "allowed_origins" in run.stderr


# -- /openapi.json ----------------------------------------------------------------------------------


ROUTES = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/models/{model}"), ("POST", "/generate"), ("POST", "/flush_cache"), ("GET", "/metrics"),
          ("GET", "/health"), ("GET", "/stats"), ("GET", "/debug/integrity"), ("GET", "/model_info"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/render_chat"), ("GET", "/openapi.json")}  # fmt: skip


def test_openapi_lists_every_route_with_its_schemas(http, server):
    r = http.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "radixkv" and doc["info"]["version"]
    schemas = doc["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    # the document lists what the server dispatches (Server.routes); a route without an
    # entry in radixkv.server.openapi.ROUTES would be "(not described)"
    from radixkv.server.openapi import ROUTES as DESCRIBED

    routes = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert routes >= ROUTES
    for method, path in routes:
        op = doc["paths"][path][method.lower()]
        assert (method, path) in DESCRIBED and op["summary"] != "(not described)", (method, path)
        ok = op["responses"]["200"]["content"]
        assert ok and all("schema" in c for c in ok.values()), (method, path)
        assert resolve(op["responses"]["default"]["content"]["application/json"]["schema"])["required"] == ["error"]
        if DESCRIBED[method, path].request is not None:
            body = resolve(op["requestBody"]["content"]["application/json"]["schema"])
            assert body["type"] == "object" and body["properties"]
        if path != "/health":
            assert op.get("security") != []  # the key, as the server wants it
    assert doc["paths"]["/health"]["get"]["security"] == [] and doc["security"] == [{"bearerAuth": []}]
    # the chat request: every field of the Struct, the required ones required
    chat = resolve(doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"])
    fields = msgspec.structs.fields(P.ChatCompletionRequest)
    assert set(chat["properties"]) == {f.encode_name for f in fields}
    assert {"messages", "model", "max_tokens", "temperature", "stream", "tools"} <= set(chat["properties"])
    assert set(chat["required"]) == {f.encode_name for f in fields if f.required}
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert doc["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
    tok = resolve(doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"])
    assert {"text", "prompt", "messages", "add_generation_prompt"} <= set(tok["properties"])
    assert tok["additionalProperties"] is False
    # every $ref points at a schema the document has
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    assert refs and all(ref.rsplit("/", 1)[1] in schemas for ref in refs)
    # and every route it lists is served: none answers 404 or 405
    for path, ops in doc["paths"].items():
        url = path.replace("{model}", NAME)
        for method in ops:
            r = http.request(method.upper(), url, json={} if method == "post" else None)
            assert r.status_code not in (404, 405), (method, path, r.text)


# -- radixkv --version ---------------------------------------------------------------------------------


def test_version_flag(monkeypatch):
    import importlib.metadata

    import radixkv

    run = subprocess.run([sys.executable, "-m", "radixkv", "--version"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == importlib.metadata.version("radixkv") == radixkv.__version__

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)  # a source tree on sys.path, not installed
    assert radixkv.package_version() == radixkv.__version__


def test_new_config_fields_are_flags():
    from radixkv.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-origins", ORIGIN, "*", "--allowed-headers", "authorization"])
    config = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    assert config.allowed_origins == (ORIGIN, "*") and config.allowed_headers == ("authorization",)
    assert config.allowed_methods == ("*",)
