"""HTTP runtime benchmark: /health latency during a long prefill, and what the HTTP
layer costs against the same engine called in-process.

Everything runs on the CPU: SmolLM2-135M-Instruct in float32, the torch attention
backend, page size 16, a KV pool of ``kv_cache_tokens`` tokens, default scheduling
(512-token prefill chunks, 2048-token step budget). The server is ``radixkv serve`` as
a subprocess on 127.0.0.1 (a free port; its log goes to a temporary file, printed if it
fails), stopped with SIGTERM at the end (it must exit 0). The clients run in this
process and share the machine's cores with whichever system is measured: their costs
(httpx, JSON, SSE parsing) are part of what a real client pays.

1. /health during a long prefill. One non-streaming ``/v1/completions`` request with the
   prompt ``"word " * prefill_words`` (3,001 tokens for 3,000 words) and ``max_tokens``
   1 runs in a thread; meanwhile this thread sends ``GET /health`` every ``poll_ms``
   (20 ms from the start of one poll to the start of the next, or at once when a poll
   took longer) over one keep-alive connection, until the completion returns. Latency
   is per poll, from sending to the full response (perf_counter); count, p50, p99 and
   max are reported, and the completion's client-side duration as the prefill's. The
   same polling for ``idle_seconds`` with nothing running is the baseline. Target: max
   < 100 ms during the prefill. The server has one untimed warm-up request first.
2. HTTP vs in-process. ``clients`` concurrent clients each send ``requests_per_client``
   chat requests one after another (client c's k-th user message is distinct from all
   others; the chat template adds its default system message), greedy, ``max_tokens``
   16, ``ignore_eos`` (every answer is exactly 16 tokens: a request that gets another
   count is an error). Four runs, each from an emptied prefix cache after an untimed
   warm-up round (every client sends one request, with other messages):
   - in-process: an ``Engine`` with the server's settings in this process, the clients
     being asyncio tasks on one loop; a request is ``render_chat`` of its message, then
     ``generate_async`` (non-streaming) or ``stream`` (streaming) on that text. This
     engine runs (and is closed) before the server starts, so the two never share the
     cores.
   - HTTP: ``POST /v1/chat/completions`` with one ``httpx.AsyncClient`` (a connection
     per client); streaming requests read the SSE events (with
     ``stream_options.include_usage`` for the token count), non-streaming ones the JSON
     body.
   Per run: wall time from the first request to the last answer, requests/s, output
   tok/s (completion tokens over the wall time), end-to-end latency p50/p90 per request
   and, for streams, TTFT p50/p90: from sending the request (or opening the stream) to
   the first event (chunk) with non-empty text; the server's role-only first event does
   not count. HTTP / in-process is the ratio of output tok/s, per mode. The answers of
   all four runs are compared text for text.
3. After the HTTP runs: ``GET /debug/integrity`` must answer 200 and ``GET /stats`` must
   show nothing running or waiting.

    .venv/bin/python benchmarks/bench_server.py [--quick] [--json benchmarks/out/bench_server.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402
from radixkv.server.process import ServerProcess  # noqa: E402

TARGETS = {"health_max_ms_during_prefill": 100}
ENGINE = {"attention_backend": "torch", "kv_cache_tokens": 8192, "page_size": 16}
START_TIMEOUT_S = 180


@dataclass(frozen=True)
class Settings:
    prefill_words: int = 3000
    poll_ms: float = 20.0
    idle_seconds: float = 3.0
    clients: int = 32
    requests_per_client: int = 4
    max_tokens: int = 16


FULL = Settings()
QUICK = Settings(idle_seconds=1.0, clients=8, requests_per_client=2)


@dataclass
class Result:
    """One request as its client saw it."""

    text: str = ""
    tokens: int = 0
    latency: float = 0.0
    ttft: float | None = None  # streams only
    error: str | None = None


# -- the server process ----------------------------------------------------------------


def start_server(log_path: Path) -> tuple[ServerProcess, float]:
    """``radixkv serve`` with the ENGINE settings; returns it and the seconds until
    /health answered 200. Raises RuntimeError (with the log) if it does not come up."""
    t0 = time.perf_counter()
    server = ServerProcess("--attention-backend", ENGINE["attention_backend"], "--kv-cache-tokens",
                           str(ENGINE["kv_cache_tokens"]), "--page-size", str(ENGINE["page_size"]),
                           log_path=log_path, timeout=START_TIMEOUT_S)  # fmt: skip
    return server, time.perf_counter() - t0


def warm_up(url: str, model: str) -> None:
    """One short chat completion, so the server's first request is not a measured one."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"the warm-up request got HTTP {r.status_code}: {r.text}")


# -- 1. /health during a long prefill ----------------------------------------------------


def poll_health(client: httpx.Client, period: float, until) -> list[float]:
    """GET /health every ``period`` seconds while ``until()`` is False; latencies in s.
    A non-200 answer is an error: the server must stay healthy throughout."""
    latencies = []
    while not until():
        t0 = time.perf_counter()
        r = client.get("/health")
        latencies.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"/health answered {r.status_code}: {r.text}")
        time.sleep(max(0.0, t0 + period - time.perf_counter()))
    return latencies


def long_completion(url: str, model: str, words: int, box: dict) -> None:
    """The long-prompt completion (run in a thread): its duration and usage go in ``box``,
    or the error."""
    body = {"model": model, "prompt": "word " * words, "max_tokens": 1}
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        box["seconds"] = time.perf_counter() - t0
        if r.status_code != 200:
            box["error"] = f"HTTP {r.status_code}: {r.text}"
        else:
            box["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]
    except httpx.HTTPError as e:
        box["error"] = repr(e)


def bench_health(url: str, model: str, s: Settings) -> dict:
    """Latency summaries of /health idle and during the long prefill, and the prefill."""
    period = s.poll_ms / 1000
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/health")  # open the keep-alive connection
        end = time.perf_counter() + s.idle_seconds
        idle = poll_health(client, period, lambda: time.perf_counter() >= end)
        box: dict = {}
        worker = threading.Thread(target=long_completion, args=(url, model, s.prefill_words, box))
        worker.start()
        busy = poll_health(client, period, lambda: not worker.is_alive())
        worker.join()
    if "error" in box:
        raise RuntimeError(f"the long-prompt completion failed: {box['error']}")
    return {"idle": summary_ms(idle), "prefill": summary_ms(busy),
            "prefill_seconds": box["seconds"], "prompt_tokens": box["prompt_tokens"]}  # fmt: skip


def summary_ms(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1000
    return {"polls": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max())}  # fmt: skip


# -- 2. the same chat load in-process and over HTTP ------------------------------------------


def user_messages(s: Settings, round_name: str, per_client: int | None = None) -> list[list[str]]:
    """Per client, its ``per_client`` (default ``requests_per_client``) distinct short user messages."""
    return [[f"{round_name} question {k + 1} from user {c}: what is {c + 2} times {k + 3}? Answer in one sentence."
             for k in range(per_client or s.requests_per_client)] for c in range(s.clients)]  # fmt: skip


async def run_load(request, messages: list[list[str]], stream: bool) -> tuple[float, list[list[Result]]]:
    """Every client sends its messages one after another, all clients at once; returns
    the wall time and the results, per client in order. ``request(message, stream)`` is
    one request of the system under test."""

    async def client(texts):
        return [await request(text, stream) for text in texts]

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client(texts) for texts in messages))
    return time.perf_counter() - t0, results


def engine_requester(engine: Engine, s: Settings):
    """``request(message, stream)`` through the in-process engine."""
    params = SamplingParams(temperature=0, max_new_tokens=s.max_tokens, ignore_eos=True)

    async def request(message: str, stream: bool) -> Result:
        res = Result()
        t0 = time.perf_counter()
        try:
            text = engine.render_chat([{"role": "user", "content": message}])
            if stream:
                async for chunk in engine.stream(text, params):
                    if res.ttft is None and chunk.text:
                        res.ttft = time.perf_counter() - t0
                    res.text += chunk.text
                    res.tokens += len(chunk.token_ids)
            else:
                out = await engine.generate_async(text, params)
                if out.error is not None:
                    res.error = out.error
                res.text, res.tokens = out.outputs[0].text, len(out.outputs[0].token_ids)
        except Exception as e:  # counted as this request's error, the run goes on
            res.error = repr(e)
        res.latency = time.perf_counter() - t0
        return check_count(res, s)

    return request


def http_requester(client: httpx.AsyncClient, model: str, s: Settings):
    """``request(message, stream)`` through ``POST /v1/chat/completions``."""

    async def request(message: str, stream: bool) -> Result:
        body = {"model": model, "messages": [{"role": "user", "content": message}], "temperature": 0,
                "max_tokens": s.max_tokens, "ignore_eos": True, "stream": stream}  # fmt: skip
        res = Result()
        t0 = time.perf_counter()
        try:
            if stream:
                body["stream_options"] = {"include_usage": True}
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}"
                    else:
                        await read_sse(r, res, t0)
            else:
                r = await client.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.text}"
                else:
                    data = r.json()
                    res.text, res.tokens = data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            res.error = repr(e)
        res.latency = time.perf_counter() - t0
        return check_count(res, s)

    return request


async def read_sse(r: httpx.Response, res: Result, t0: float) -> None:
    """Fill ``res`` from a chat completion's SSE events: the text, TTFT at the first
    non-empty delta, the token count from the usage event; an error event or a missing
    ``[DONE]`` is the request's error."""
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            res.error = event["error"].get("message", data)
            return
        for choice in event["choices"]:
            content = choice["delta"].get("content") or ""
            if content and res.ttft is None:
                res.ttft = time.perf_counter() - t0
            res.text += content
        if event.get("usage"):
            res.tokens = event["usage"]["completion_tokens"]
    if not done:
        res.error = "the stream ended without [DONE]"


def check_count(res: Result, s: Settings) -> Result:
    """With ignore_eos every answer has exactly ``max_tokens`` tokens; anything else is an error."""
    if res.error is None and res.tokens != s.max_tokens:
        res.error = f"{res.tokens} completion tokens, not {s.max_tokens}"
    return res


def load_row(system: str, stream: bool, wall: float, results: list[list[Result]]) -> dict:
    """One table row's figures from a run."""
    flat = [r for client in results for r in client]
    ok = [r for r in flat if r.error is None]
    latency = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {
        "system": system,
        "mode": "streaming" if stream else "non-streaming",
        "requests": len(flat),
        "wall_s": wall,
        "req_s": len(ok) / wall,
        "out_tok_s": sum(r.tokens for r in ok) / wall,
        "latency_p50_s": quantile(latency, 50),
        "latency_p90_s": quantile(latency, 90),
        "ttft_p50_s": quantile(ttft, 50) if stream else None,
        "ttft_p90_s": quantile(ttft, 90) if stream else None,
        "errors": len(flat) - len(ok),
        "error_samples": sorted({r.error for r in flat if r.error is not None})[:3],
    }


def quantile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def bench_in_process(s: Settings) -> tuple[list[dict], dict]:
    """Streaming and non-streaming runs through an in-process Engine; returns the rows
    and the answers per mode."""
    rows, answers = [], {}
    with Engine(**ENGINE) as engine:
        request = engine_requester(engine, s)
        for stream in (True, False):
            asyncio.run(run_load(request, user_messages(s, "Warm-up", 1), stream))
            if not engine.flush_cache():
                raise RuntimeError("the engine was not idle after the warm-up round")
            wall, results = asyncio.run(run_load(request, user_messages(s, "Measured"), stream))
            rows.append(load_row("in-process", stream, wall, results))
            answers[rows[-1]["mode"]] = texts(results)
    return rows, answers


def bench_http(url: str, model: str, s: Settings) -> tuple[list[dict], dict]:
    """The same two runs through the server; returns the rows and the answers per mode."""

    async def one_run(stream: bool, messages: list[list[str]]):
        limits = httpx.Limits(max_connections=s.clients, max_keepalive_connections=s.clients)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            return await run_load(http_requester(client, model, s), messages, stream)

    rows, answers = [], {}
    for stream in (True, False):
        asyncio.run(one_run(stream, user_messages(s, "Warm-up", 1)))
        flush(url)
        wall, results = asyncio.run(one_run(stream, user_messages(s, "Measured")))
        rows.append(load_row("HTTP", stream, wall, results))
        answers[rows[-1]["mode"]] = texts(results)
    return rows, answers


def flush(url: str) -> None:
    r = httpx.post(url + "/flush_cache", timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text}")


def texts(results: list[list[Result]]) -> list[list[str | None]]:
    return [[r.text if r.error is None else None for r in client] for client in results]


# -- 3. the server's state afterwards ---------------------------------------------------------


def check_after(url: str) -> dict:
    """/debug/integrity's status and /stats' running and waiting counts, read once."""
    with httpx.Client(base_url=url, timeout=60) as client:
        integrity = client.get("/debug/integrity")
        stats = client.get("/stats").json()
    return {"integrity_status": integrity.status_code, "integrity_body": integrity.text,
            "running": stats["running"], "waiting": stats["waiting"], "preemptions": stats["preemptions"]}  # fmt: skip


# -- report ------------------------------------------------------------------------------


def report_health(s: Settings, health: dict) -> bool:
    """Print the /health table; return whether the target was met."""
    print(f"\n1. GET /health latency, polled every {s.poll_ms:.0f} ms over one keep-alive connection")
    print(f"{'while':<28}{'polls':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for name, key in ((f"idle ({s.idle_seconds:.0f} s)", "idle"), (f"{health['prompt_tokens']}-token prefill", "prefill")):
        h = health[key]
        print(f"{name:<28}{h['polls']:>7}{h['p50_ms']:>9.1f}{h['p99_ms']:>9.1f}{h['max_ms']:>9.1f}")
    met = health["prefill"]["max_ms"] < TARGETS["health_max_ms_during_prefill"]
    print(f"prefill: {health['prompt_tokens']} prompt tokens, max_tokens 1, {health['prefill_seconds']:.2f} s "
          f"(client-side); target max < {TARGETS['health_max_ms_during_prefill']} ms during it: "
          f"{'met' if met else 'not met'}")  # fmt: skip
    return met


def report_load(s: Settings, rows: list[dict], answers: dict) -> tuple[dict, bool]:
    """Print the load table; return the HTTP / in-process tok/s ratio per mode and
    whether all runs' answers were identical."""
    print(f"\n2. {s.clients} clients x {s.requests_per_client} sequential chat requests "
          f"({s.clients * s.requests_per_client} per run), greedy, {s.max_tokens} tokens each (ignore_eos)")  # fmt: skip
    print(f"{'system':<12}{'mode':<15}{'wall s':>8}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'p90 s':>7}{'latency p50':>13}{'p90 s':>7}{'errors':>8}")  # fmt: skip
    for r in rows:
        ttft = "-".rjust(10) + "-".rjust(7) if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:>10.3f}{r['ttft_p90_s']:>7.3f}"
        lat = "-".rjust(13) + "-".rjust(7) if r["latency_p50_s"] is None else (
            f"{r['latency_p50_s']:>13.3f}{r['latency_p90_s']:>7.3f}")  # fmt: skip
        print(f"{r['system']:<12}{r['mode']:<15}{r['wall_s']:>8.2f}{r['req_s']:>8.2f}{r['out_tok_s']:>11.1f}"
              f"{ttft}{lat}{r['errors']:>8}")  # fmt: skip
        for message in r["error_samples"]:
            print(f"    error: {message}")
    by = {(r["system"], r["mode"]): r for r in rows}
    ratio = {mode: by["HTTP", mode]["out_tok_s"] / by["in-process", mode]["out_tok_s"]
             for mode in ("streaming", "non-streaming")}  # fmt: skip
    print("HTTP / in-process output tok/s: " + ", ".join(f"{mode} {v:.2f}x" for mode, v in ratio.items()))
    runs = list(answers.values())
    same = all(run == runs[0] for run in runs) and all(t is not None for t in sum(runs[0], []))
    print(f"greedy answers identical in all {len(runs)} runs: {'yes' if same else 'no'}")
    if not same:
        diff = sum(a != b for run in runs[1:] for ca, cb in zip(runs[0], run) for a, b in zip(ca, cb))
        print(f"    {diff} answers differ from the first run's (or failed)")
    return ratio, same


def report_after(after: dict, exit_code: int | None) -> bool:
    """Print the after-run checks; return whether they all passed."""
    idle = after["running"] == 0 and after["waiting"] == 0
    ok = after["integrity_status"] == 200 and idle and exit_code == 0
    print("\n3. After the HTTP runs")
    print(f"GET /debug/integrity: {after['integrity_status']} {after['integrity_body']}")
    print(f"GET /stats: running {after['running']}, waiting {after['waiting']}, preemptions {after['preemptions']}")
    print(f"exit code after SIGTERM: {exit_code}")
    print(f"checks: {'passed' if ok else 'FAILED'}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer clients and requests, a shorter idle baseline")
    ap.add_argument("--json", default="benchmarks/out/bench_server.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    s = QUICK if args.quick else FULL

    rows, answers = bench_in_process(s)  # first, and closed before the server starts
    log_path = Path(tempfile.mkstemp(prefix="bench_server-", suffix=".log")[1])
    server, start_s = start_server(log_path)
    url, exit_code = server.url, None
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm_up(url, model)
        health = bench_health(url, model, s)
        flush(url)
        http_rows, http_answers = bench_http(url, model, s)
        after = check_after(url)
        exit_code = server.stop()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    if exit_code != 0:
        print(f"server log ({log_path}):\n{log_path.read_text()}")
    else:
        log_path.unlink()
    rows += http_rows
    answers.update({f"HTTP {mode}": a for mode, a in http_answers.items()})

    print(f"SmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), torch attention backend, page size 16, "
          f"KV pool {ENGINE['kv_cache_tokens']} tokens; server up in {start_s:.1f} s")  # fmt: skip
    met = report_health(s, health)
    ratio, same = report_load(s, rows, answers)
    checks = report_after(after, exit_code)

    write_result(
        args.json,
        {
            "health": {**health, "target_met": met},
            "load": rows,
            "http_over_in_process_tok_s": ratio,
            "answers_identical": same,
            "after": {**after, "exit_code": exit_code, "passed": checks},
        },
        torch=torch.__version__, threads=torch.get_num_threads(), engine=ENGINE, settings=asdict(s), targets=TARGETS,
        server_start_seconds=start_s,
    )  # fmt: skip


if __name__ == "__main__":
    main()
