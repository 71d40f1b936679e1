"""Operating `radixkv serve`: checks before the model loads, the start-up summary, the
stats line, the access log, error logging, config file and environment precedence, and
what /metrics shows (no salts, model_name, vLLM's names, aborted requests).

One real server process serves most tests; it takes its settings from all three layers
(a config file, RADIXKV_* variables, flags) so that their precedence is checked on it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv.engine.config import EngineConfig
from radixkv.server.app import ServerConfig
from radixkv.server.metrics import MAX_NAMESPACE_LABELS
from radixkv.server.ops import layered
from radixkv.server.process import ServerProcess

KEY = "ops-secret-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SALT = "tenant-salt-never-shown"
NAME = "ops-model"  # served_model_name, from the config file
POOL_TOKENS = 1024  # less than SmolLM2's 8192-token context: start-up warns


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    config = d / "serve.toml"
    config.write_text(f'served_model_name = "{NAME}"\nmax_fanout = 5\nmax_body_bytes = 1000\n'
                      f'stats-interval = 0.5\nattention_backend = "torch"\nkv_cache_tokens = {POOL_TOKENS}\n')  # fmt: skip
    env = {"RADIXKV_MAX_FANOUT": "6", "RADIXKV_MAX_BODY_BYTES": "2000", "RADIXKV_API_KEY": KEY}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    started = time.monotonic()
    try:
        server = ServerProcess("--config", str(config), "--log-level", "info", "--max-body-bytes", "300000",
                               "--threads", "2", "--access-log", str(d / "access.jsonl"), log_path=d / "server.log")  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    server.startup_seconds = time.monotonic() - started
    server.log_path, server.access_path = d / "server.log", d / "access.jsonl"
    with server:
        yield server
    assert server.exit_code == 0


@pytest.fixture(scope="module")
def http(ops_server):
    with httpx.Client(base_url=ops_server.url, headers=AUTH, timeout=120) as client:
        yield client


def log_text(server) -> str:
    return Path(server.log_path).read_text()


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def metrics(http) -> dict:
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def generate(http, text="Tell me about caches. ", salt=None, max_new_tokens=4, **extra):
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if salt is not None:
        body["cache_salt"] = salt
    return http.post("/generate", json=body, **extra)


# -- start-up ---------------------------------------------------------------------------------


def serve_error(*flags: str, env: dict | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "radixkv", "serve", *flags], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})  # fmt: skip
    return proc.returncode, proc.stderr.strip(), time.monotonic() - started


def test_startup_errors_arrive_before_the_model_loads(ops_server, tmp_path):
    """One line on stderr, exit 2, and no later than a server takes to load and answer."""
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("port = 1\nbogus_setting = 2\n")
    cases = [
        (["--model", str(tmp_path / "missing.gguf")], "neither a registered name"),
        (["--memory-bytes", "100"], "does not hold one KV page"),
        (["--config", str(bad_toml)], "unknown setting bogus_setting"),
        (["--config", str(tmp_path / "nope.toml")], "cannot be read"),
        (["--policy", "mru"], "--policy must be one of"),
        (["--port", "70000"], "--port must be in"),
        (["--threads", "0"], "threads must be in [1, 1024], got 0"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    for flags, message in cases:
        code, err, seconds = serve_error(*flags)
        assert code == 2, (flags, err)
        assert err.startswith("radixkv serve: error: ") and message in err and "\n" not in err, (flags, err)
        # Native weights load in about a second, so a whole start is mostly imports, as an error is:
        # an error path that loaded weights (expanded fp32: seconds more) would still be caught.
        assert seconds < ops_server.startup_seconds + 1.0, (flags, seconds, ops_server.startup_seconds)
    code, err, _ = serve_error(env={"RADIXKV_LOG_LEVEL": "loud"})
    assert code == 2 and "RADIXKV_LOG_LEVEL" in err


def test_startup_summary_and_pool_warning(ops_server):
    log = log_text(ops_server)
    port = ops_server.url.rsplit(":", 1)[1]
    for line in (f"model: {NAME} (", "weights: native (Q8_0 x 1, float32 x 61, Q4_1 x 120), 96.6 MB",
                 "; activations float32 (rounded to 16-bit codes per block of 32); KV dtype: fp32; device: cpu, 2 threads",
                 f"KV pool: {POOL_TOKENS // 16} pages x 16 tokens = {POOL_TOKENS} tokens", "page size: 16",
                 "attention backend: torch", f"listening on http://127.0.0.1:{port}"):  # fmt: skip
        assert line in log, line
    assert re.search(r"loaded in \d+\.\d\d s", log)
    assert re.search(rf"WARNING .*the KV pool holds {POOL_TOKENS} tokens, less than one full context", log)
    # the summary comes after the warning (checked before the load)
    assert log.index("less than one full context") < log.index("loaded in")


# -- config file, environment, flags ------------------------------------------------------------


def test_precedence_flags_over_env_over_file(ops_server, http):
    # served_model_name: the file alone
    assert http.get("/v1/models").json()["data"][0]["id"] == NAME
    # threads: the flag over $OMP_NUM_THREADS (1 in the tests, conftest)
    assert http.get("/stats").json()["threads"] == 2
    # api_key: the environment
    assert httpx.get(ops_server.url + "/v1/models").status_code == 401
    # max_fanout: file 5 < env 6 (env wins)
    body = {"model": NAME, "prompt": ["a"] * 7, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "limit per call is 6" in r.json()["error"]["message"]
    # max_body_bytes: file 1000 < env 2000 < flag 300000 (the flag wins)
    r = generate(http, text="hello " * 400, max_new_tokens=1)  # 2400+ bytes, ~400 tokens
    assert r.status_code == 200, r.text


def test_layered_settings_in_process(tmp_path):
    classes = (EngineConfig, ServerConfig)
    f = tmp_path / "c.toml"
    f.write_text('port = 1\nmax-running = 2\npage_size = 32\nallowed_origins = ["http://x.y"]\ndebug = true\n')
    env = {"RADIXKV_PORT": "3", "RADIXKV_MAX_RUNNING": "4", "RADIXKV_DEBUG": "false", "RADIXKV_KV_STORE_SECRET": "s",
           "RADIXKV_UNRELATED": "x"}  # fmt: skip
    values, source = layered(classes, {"port": 5}, str(f), env)
    assert (values["port"], values["max_running"], values["page_size"], values["debug"]) == (5, 4, 32, False)
    assert values["allowed_origins"] == ("http://x.y",) and values["policy"] == "lru"
    assert source == {"port": "flag", "max_running": "env", "page_size": "file", "allowed_origins": "file",
                      "debug": "env"}  # fmt: skip
    values, _ = layered(classes, {}, None, {"RADIXKV_CONFIG": str(f)})  # the file named by the environment
    assert values["port"] == 1
    f.write_text("port = 1\nnot_a_field = 2\nalso-not = 3\n")
    with pytest.raises(ValueError, match="unknown settings also-not, not_a_field"):
        layered(classes, {}, str(f), {})
    f.write_text('port = "eighty"\n')
    with pytest.raises(ValueError, match="port must be an int"):
        layered(classes, {}, str(f), {})
    f.write_text("port = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        layered(classes, {}, str(f), {})
    y = tmp_path / "c.yaml"
    y.write_text("port: 7\n")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="install PyYAML"):
            layered(classes, {}, str(y), {})
    else:
        assert layered(classes, {}, str(y), {})[0]["port"] == 7


# -- logs -----------------------------------------------------------------------------------------


def access_lines(server) -> list[dict]:
    """The access log's complete lines (a line being written has no newline yet)."""
    text = Path(server.access_path).read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_access_log_lines(ops_server, http):
    r = generate(http, salt=SALT, headers={**AUTH, "X-Request-Id": "req-42"})
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    bad = http.post("/generate", json={"text": "a", "sampling_params": {"temperature": -1}})
    assert bad.status_code == 400
    assert httpx.get(ops_server.url + "/stats").status_code == 401  # no key
    # an earlier test's authorised GET /stats is logged too: wait for this one's 401
    lines = wait_for(lambda: (ls := access_lines(ops_server)) and any(x["path"] == "/stats" and x["status"] == 401
                                                                       for x in ls) and ls, what="access log lines")  # fmt: skip
    (ok,) = [x for x in lines if x["request_id"] == "req-42"]
    assert ok["method"] == "POST" and ok["path"] == "/generate" and ok["status"] == 200
    assert (ok["prompt_tokens"], ok["completion_tokens"], ok["cached_tokens"]) == (
        meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])  # fmt: skip
    assert 0 < ok["latency_s"] < 120 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", ok["time"])
    (err,) = [x for x in lines if x["status"] == 400 and "temperature" in x.get("error", "")]
    assert err["path"] == "/generate" and err["param"] == "sampling_params.temperature"
    assert err["prompt_tokens"] is None and err["request_id"] is None
    assert any(x["status"] == 401 and x["path"] == "/stats" for x in lines)
    text = Path(ops_server.access_path).read_text()
    assert SALT not in text and KEY not in text
    # 4xx are logged with their reason
    log = wait_for(lambda: (t := log_text(ops_server)) and "GET /stats -> 401" in t and t, what="error log lines")
    assert re.search(r"INFO radixkv.server: POST /generate -> 400: .*temperature.* \(param sampling_params.temperature\)",
                     log)  # fmt: skip
    assert "GET /stats -> 401: invalid or missing API key" in log
    assert SALT not in log and KEY not in log


def test_stats_line(ops_server, http):
    assert generate(http, text="Stats line, please. " * 3, max_new_tokens=8).status_code == 200

    def busy_line():
        lines = re.findall(r"stats: prompt [\d.]+ tok/s, generation ([\d.]+) tok/s.*", log_text(ops_server))
        return [m for m in lines if float(m) > 0]

    wait_for(busy_line, 10, "a stats line with generation throughput")
    line = re.findall(r"stats: .*", log_text(ops_server))[-1]
    assert re.search(r"running \d+, waiting \d+, prefix-cache hit rate (-|[\d.]+%) \(overall [\d.]+%\), "
                     r"KV pool [\d.]+% used \(\d+/64 pages\)", line), line  # fmt: skip


# -- metrics ----------------------------------------------------------------------------------------


def test_salts_never_in_metrics_and_other_bucket(http):
    salts = [f"{SALT}-{i}" for i in range(MAX_NAMESPACE_LABELS + 4)]
    for salt in salts:
        assert generate(http, text="Hi. ", salt=salt, max_new_tokens=1).status_code == 200
    assert generate(http, text="Hi. ", max_new_tokens=1).status_code == 200
    text = http.get("/metrics").text
    assert SALT not in text
    labels = {dict(labels).get("namespace") for name, labels in metrics(http) if name.endswith("prefix_cache_queries_total")}
    labels.discard(None)
    assert "other" in labels and "default" in labels
    hashed = labels - {"other", "default"}
    assert len(hashed) <= MAX_NAMESPACE_LABELS and all(re.fullmatch("ns-[0-9a-f]{12}", x) for x in hashed)


def test_model_name_label_and_vllm_aliases(http):
    before = metrics(http)
    r = generate(http, text="Tell me about vLLM dashboards. " * 3, max_new_tokens=5)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    after = metrics(http)
    v = (("engine", "0"), ("model_name", NAME))

    def moved(name, labels):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("vllm:prompt_tokens_total", v) == meta["prompt_tokens"]
    assert moved("vllm:generation_tokens_total", v) == 5
    assert moved("vllm:prefix_cache_queries_total", v) == meta["prompt_tokens"]
    assert moved("vllm:prefix_cache_hits_total", v) == meta["cached_tokens"]
    assert moved("vllm:request_success_total", tuple(sorted((*v, ("finished_reason", "length"))))) == 1
    assert moved("vllm:time_to_first_token_seconds_count", v) == 1
    assert moved("vllm:e2e_request_latency_seconds_count", v) == 1
    assert moved("vllm:inter_token_latency_seconds_count", v) == 4
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, v) in after, gauge
    assert 0 < after[("vllm:kv_cache_usage_perc", v)] <= 1
    m = (("model_name", NAME),)
    assert moved("radixkv_prompt_tokens_total", m) == meta["prompt_tokens"]
    assert moved("radixkv_requests_total", (("endpoint", "/generate"), ("finish_reason", "length"), *m)) == 1
    assert moved("radixkv_prefix_cache_queries_total", (*m, ("namespace", "default"))) == meta["prompt_tokens"]
    assert moved("radixkv_time_to_first_token_seconds_count", m) == 1


def test_aborted_requests_counted(ops_server, http):
    name = ("radixkv_requests_aborted_total", (("endpoint", "/generate"),))
    before = metrics(http).get(name, 0)
    body = {"text": "Count to a thousand:", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}}  # fmt: skip
    with httpx.Client(base_url=ops_server.url, headers=AUTH, timeout=120) as client:
        with client.stream("POST", "/generate", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk: the server aborts the request
    wait_for(lambda: metrics(http).get(name, 0) == before + 1, 30, "the aborted counter")
    wait_for(lambda: http.get("/stats").json()["running"] == 0, 30, "the request to end")
    wait_for(lambda: any(x["path"] == "/generate" and x.get("error") == "client disconnected"
                         for x in access_lines(ops_server)), 30, "the aborted request's access line")  # fmt: skip
