"""One API host's capacity: 10,000 streams, submissions per second, abuse (issue 13).

``python -m bench.capacity`` starts the farm of ``bench.load`` on loopback, but
with the API at its *default* gunicorn settings (``api/gunicorn_conf.py``: the
gevent worker, ``api_workers`` processes), and measures:

streams
    ``--streams`` websockets on ``/v1/jobs/<id>/ws`` (``--fanout`` per job),
    then as many SSE streams. Workers stop consuming while every stream opens
    and receives ``queued``, so all are open at once; then the API's resident
    memory and CPU are read and ``/healthz`` is timed; then consuming resumes
    and every stream must receive seq 0, 1, ... to ``done`` without a gap.
submit
    ``POST /v1/jobs`` from ``--clients`` closed-loop clients for ``--submit-s``
    seconds (accepted/s, held to 500; p50 and p99, shown: by Little's law they
    are clients / rate), then the same clients offering ``--rate`` a second
    between them for ``--open-s`` seconds, each POST timed from its scheduled
    send (p50 held to 10 ms); workers idle (not consuming).
abuse
    ``--abusers`` anonymous ``/v1/ws`` sockets from one address: how many were
    admitted, how many closed with 4029, ``/healthz`` while they are held, and
    an authenticated stream's time to first token against one measured
    before the abuse.

The client is asyncio on raw sockets (a few KiB a stream), one process; it
raises its own open-files limit. Prints a table with [pass]/[FAIL] and exits 1
on a failed check. Services as in ``bench.load``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import requests

from bench.farm import Child, farm_settings, raise_open_files_limit
from bench.load import MODELS, LoadFarm, cpu_seconds, load_models_dir, proc_stats, services
from config import load_settings

HOST = "127.0.0.1"
CHAT = [{"role": "user", "content": "Count to ten."}]
OPEN_AT_ONCE = 200
CONNECT_TIMEOUT_S = 60.0


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.failed = False

    def row(self, name: str, value: str, ok: bool | None = None) -> None:
        mark = "" if ok is None else ("[pass]" if ok else "[FAIL]")
        self.failed = self.failed or ok is False
        self.rows.append((name, value, mark))
        print(f"  {name:<52} {value:>28} {mark}", flush=True)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- raw clients ---------------------------------------------------------------


async def ws_open(
    port: int, path: str, token: str | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(HOST, port)
    key = base64.b64encode(os.urandom(16)).decode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(
        (
            f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n{auth}\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    return reader, writer


async def ws_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame from the server: (opcode, payload); raises on a malformed header."""
    b0, b1 = await reader.readexactly(2)
    if b0 & 0x70:
        raise RuntimeError(f"reserved bits set in a frame header ({b0:#x})")
    length = b1 & 0x7F
    if b1 & 0x80:
        raise RuntimeError("a masked frame from the server")
    if length == 126:
        length = int.from_bytes(await reader.readexactly(2), "big")
    elif length == 127:
        length = int.from_bytes(await reader.readexactly(8), "big")
    return b0 & 0x0F, await reader.readexactly(length)


def mask_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


class Stream:
    """One subscriber: its seqs, whether it opened, ended well, and why not."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.seqs: list[int] = []
        self.opened = asyncio.Event()
        self.done = False
        self.error: str | None = None
        self.first_token_at: float | None = None


async def follow_ws(port: int, token: str, stream: Stream) -> None:
    try:
        reader, writer = await asyncio.wait_for(
            ws_open(port, f"/v1/jobs/{stream.job_id}/ws", token), CONNECT_TIMEOUT_S
        )
    except Exception as exc:
        stream.error = f"open: {type(exc).__name__}: {exc}"
        stream.opened.set()
        return
    try:
        while True:
            opcode, payload = await ws_frame(reader)
            if opcode == 0x9:  # ping: answer
                writer.write(mask_frame(0xA, payload))
                continue
            if opcode == 0x8:
                code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
                if not stream.done:
                    stream.error = f"closed {code} {payload[2:].decode(errors='replace')}"
                return
            if opcode != 0x1:
                continue
            event = json.loads(payload)
            take(stream, event)
            if stream.done:
                writer.write(mask_frame(0x8, (1000).to_bytes(2, "big")))
                return
    except Exception as exc:
        if not stream.done:
            stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.opened.set()
        writer.close()


def take(stream: Stream, event: dict[str, Any]) -> None:
    seq = int(event["seq"])
    if seq != len(stream.seqs):
        stream.error = stream.error or f"seq {seq} after {len(stream.seqs)} events"
    stream.seqs.append(seq)
    if event["type"] == "queued":
        stream.opened.set()
    if event["type"] == "token" and stream.first_token_at is None:
        stream.first_token_at = time.perf_counter()
    if event["type"] in ("done", "error"):
        stream.done = event["type"] == "done"
        if not stream.done:
            stream.error = f"error event: {event.get('error')}"


async def follow_sse(port: int, token: str, stream: Stream) -> None:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(HOST, port), CONNECT_TIMEOUT_S
        )
        writer.write(
            (
                f"GET /v1/jobs/{stream.job_id}/events HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT_S)
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    except Exception as exc:
        stream.error = f"open: {type(exc).__name__}: {exc}"
        stream.opened.set()
        return
    try:
        while not stream.done:
            line = await reader.readline()
            if not line:
                stream.error = stream.error or "the server closed the stream before done"
                return
            if line.startswith(b"data: "):
                take(stream, json.loads(line[6:]))
    except Exception as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.opened.set()
        writer.close()


def healthz_times(base: str, n: int) -> list[float]:
    """``n`` timed ``GET /healthz``, from a process of their own.

    Timed from this process they would include its own wait for the GIL
    behind the event loop that serves ten thousand client sockets.
    """
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_healthz_times, base, n).result()


def _healthz_times(base: str, n: int) -> list[float]:
    times = []
    with requests.Session() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            s.get(f"{base}/healthz", timeout=30)
            times.append(time.perf_counter() - t0)
            time.sleep(0.01)
    return times


def post_job(session: requests.Session, farm: LoadFarm, model: str, tokens: int) -> str:
    r = session.post(
        f"{farm.base}/v1/jobs",
        json={"model": model, "messages": CHAT, "params": {"max_new_tokens": tokens}},
        headers={"Authorization": f"Bearer {farm.token}"},
        timeout=30,
    )
    if r.status_code != 202:
        raise RuntimeError(f"POST /v1/jobs: {r.status_code} {r.text[:200]}")
    return str(r.json()["id"])


# -- phases --------------------------------------------------------------------


def streams_phase(farm: LoadFarm, args: argparse.Namespace, kind: str, report: Report) -> None:
    n = args.streams
    jobs = max(1, n // args.fanout)
    farm.consuming(False)
    with requests.Session() as s:
        job_ids = [post_job(s, farm, MODELS[i % len(MODELS)], args.tokens) for i in range(jobs)]
    streams = [Stream(job_ids[i % jobs]) for i in range(n)]
    follow = follow_ws if kind == "ws" else follow_sse
    port = farm.settings.api_port
    api = psutil.Process(farm.api_pid)
    rss0 = proc_stats(farm.api_pid).rss

    async def run() -> tuple[float, float, float, list[float]]:
        gate = asyncio.Semaphore(OPEN_AT_ONCE)

        async def one(stream: Stream) -> None:
            async with gate:
                task = asyncio.create_task(follow(port, farm.token, stream))
                await stream.opened.wait()
            await task

        cpu0, t0 = cpu_seconds(api.pid), time.perf_counter()
        tasks = [asyncio.create_task(one(st)) for st in streams]
        while sum(st.opened.is_set() for st in streams) < n:
            await asyncio.sleep(0.5)
        opened_s = time.perf_counter() - t0
        cpu_open = cpu_seconds(api.pid) - cpu0
        rss = proc_stats(farm.api_pid).rss
        health = await asyncio.to_thread(healthz_times, farm.base, 200)
        await asyncio.to_thread(farm.consuming, True)
        t1 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*tasks), args.timeout_s)
        return opened_s, cpu_open, rss, [time.perf_counter() - t1, *health]

    opened_s, cpu_open, rss, rest = asyncio.run(run())
    drain_s, health = rest[0], rest[1:]
    held = sum(1 for st in streams if st.error is None or not st.error.startswith("open"))
    good = sum(1 for st in streams if st.done and st.error is None)
    label = "websocket" if kind == "ws" else "SSE"
    report.row(f"{label}: streams open at once ({jobs} jobs)", f"{held:,} / {n:,}", held == n)
    report.row(f"{label}: opened in", f"{opened_s:.1f} s")
    report.row(f"{label}: every token in order to done", f"{good:,} / {n:,}", good == n)
    report.row(f"{label}: streamed to done in", f"{drain_s:.1f} s")
    per = (rss - rss0) / max(held, 1)
    report.row(
        f"{label}: API RSS with all open (per stream)",
        f"{rss / 2**20:,.0f} MiB ({per / 1024:.1f} KiB)",
        rss <= 1.5 * 2**30,
    )
    report.row(f"{label}: API CPU to open them (per stream)", f"{cpu_open * 1e6 / n:,.0f} us")
    report.row(
        f"{label}: /healthz p50 / p99 with all open",
        f"{pct(health, 0.5) * 1e3:.1f} / {pct(health, 0.99) * 1e3:.1f} ms",
        pct(health, 0.99) <= 0.1,
    )
    errors = [st.error for st in streams if st.error]
    if errors:
        print(f"  e.g. {errors[0]!r} ({len(errors)} streams with an error)", flush=True)


class Poster:
    """One keep-alive HTTP/1.1 connection that POSTs a fixed JSON body (raw asyncio).

    A threaded ``requests`` client spends more CPU a request than the API does
    (and this machine's two cores are shared with it), so it measured itself.
    """

    def __init__(self, port: int, path: str, body: bytes, token: str) -> None:
        self.port = port
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> int:
        """Send the request once; the response's status code."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                close = True
        await self.reader.readexactly(length)
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def submit_phase(farm: LoadFarm, args: argparse.Namespace, report: Report) -> None:
    farm.consuming(False)
    api = psutil.Process(farm.api_pid)
    port = farm.settings.api_port
    bodies = [
        json.dumps({"model": model, "messages": CHAT, "params": {"max_new_tokens": 4}}).encode()
        for model in MODELS[:2]
    ]

    def poster(k: int) -> Poster:
        return Poster(port, "/v1/jobs", bodies[k % 2], farm.token)

    async def closed_loop() -> tuple[list[float], int, float, float]:
        latencies: list[float] = []
        refused = 0
        stop_at = time.perf_counter() + args.submit_s

        async def client(k: int) -> None:
            nonlocal refused
            conn = poster(k)
            try:
                while time.perf_counter() < stop_at:
                    t0 = time.perf_counter()
                    if await conn.post() == 202:
                        latencies.append(time.perf_counter() - t0)
                    else:
                        refused += 1
            finally:
                conn.close()

        cpu0, t0 = cpu_seconds(api.pid), time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(args.clients)))
        return latencies, refused, time.perf_counter() - t0, cpu_seconds(api.pid) - cpu0

    latencies, refused, wall, cpu = asyncio.run(closed_loop())
    rate = len(latencies) / wall
    report.row(
        f"submit: accepted/s at {args.clients} closed-loop clients", f"{rate:,.0f}", rate >= 500
    )
    # Little's law: closed-loop clients that never pause keep `clients` POSTs in
    # the API at once, so their p50 is clients / rate (32 / 500 per s = 64 ms);
    # shown, not held to the 10 ms target (that would take 3,200/s).
    report.row(
        f"submit: POST p50 / p99 at {args.clients} closed-loop clients",
        f"{pct(latencies, 0.5) * 1e3:.1f} / {pct(latencies, 0.99) * 1e3:.1f} ms",
    )
    report.row("submit: API CPU per accepted POST", f"{cpu * 1e3 / max(len(latencies), 1):.2f} ms")
    if refused:
        report.row("submit: refused (not 202)", f"{refused:,}")

    # The same clients, each on its own connection, now offering `rate` a second
    # between them: client k sends its j-th POST at start + (j * clients + k) / rate.
    # A POST's latency runs from that scheduled time, so one sent late because the
    # client's previous answer was slow counts its lateness (no coordinated omission).
    n = int(args.rate * args.open_s)

    async def paced() -> list[float]:
        lat: list[float] = []
        start = time.perf_counter()

        async def client(k: int) -> None:
            conn = poster(k)
            try:
                for i in range(k, n, args.clients):
                    due = start + i / args.rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if await conn.post() == 202:
                        lat.append(time.perf_counter() - due)
            finally:
                conn.close()

        await asyncio.gather(*(client(k) for k in range(args.clients)))
        return lat

    paced_lat = asyncio.run(paced())
    report.row(
        f"submit: {args.clients} clients offering {args.rate:.0f}/s, accepted",
        f"{len(paced_lat):,} / {n:,}",
        len(paced_lat) == n,
    )
    report.row(
        f"submit: {args.clients} clients offering {args.rate:.0f}/s, POST p50 / p99",
        f"{pct(paced_lat, 0.5) * 1e3:.1f} / {pct(paced_lat, 0.99) * 1e3:.1f} ms",
        pct(paced_lat, 0.5) <= 0.010,
    )
    farm.consuming(True)


def abuse_phase(farm: LoadFarm, args: argparse.Namespace, report: Report) -> None:
    port = farm.settings.api_port

    def ttft() -> float:
        farm.consuming(True)
        with requests.Session() as s:
            job = post_job(s, farm, MODELS[0], 8)
        stream = Stream(job)
        t0 = time.perf_counter()
        asyncio.run(follow_ws(port, farm.token, stream))
        return (stream.first_token_at or float("inf")) - t0

    base = statistics.median(ttft() for _ in range(5))

    async def abuse() -> tuple[int, int, list[float], float]:
        codes: list[int | None] = []
        holders: list[asyncio.StreamWriter] = []

        async def one() -> None:
            try:
                reader, writer = await ws_open(port, "/v1/ws", None)
            except Exception:
                codes.append(None)
                return
            holders.append(writer)
            try:
                while True:
                    opcode, payload = await asyncio.wait_for(ws_frame(reader), 3.0)
                    if opcode == 0x8:
                        codes.append(int.from_bytes(payload[:2], "big"))
                        return
            except TimeoutError:
                codes.append(0)  # admitted: still open
            except Exception:
                codes.append(None)

        gate = asyncio.Semaphore(OPEN_AT_ONCE)

        async def gated() -> None:
            async with gate:
                await one()

        await asyncio.gather(*(gated() for _ in range(args.abusers)))
        health = await asyncio.to_thread(healthz_times, farm.base, 100)
        during = statistics.median([await asyncio.to_thread(ttft) for _ in range(5)])
        for w in holders:
            w.close()
        return codes.count(0), codes.count(4029), health, during

    admitted, capped, health, during = asyncio.run(abuse())
    report.row(
        f"abuse: {args.abusers:,} anonymous sockets, one address: admitted / 4029",
        f"{admitted:,} / {capped:,}",
        admitted <= farm.settings.streams_per_address and admitted + capped == args.abusers,
    )
    report.row(
        "abuse: /healthz p99 while held",
        f"{pct(health, 0.99) * 1e3:.1f} ms",
        pct(health, 0.99) <= 0.1,
    )
    report.row(
        "abuse: user TTFT unloaded / during",
        f"{base * 1e3:.0f} / {during * 1e3:.0f} ms",
        during - base <= 0.05,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    p.add_argument("--phase", choices=("streams", "submit", "abuse", "all"), default="all")
    p.add_argument("--streams", type=int, default=10_000)
    p.add_argument("--fanout", type=int, default=50, help="subscribers per job")
    p.add_argument("--tokens", type=int, default=16, help="max_new_tokens of a streamed job")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--submit-s", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--open-s", type=float, default=5.0)
    p.add_argument("--abusers", type=int, default=5000)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--database-url")
    p.add_argument("--redis-url")
    p.add_argument("--redis-prefix")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (timeout, Ctrl-C's cousin) must still stop the farm's processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = load_settings()
    services(args, base)
    limit = raise_open_files_limit()
    if args.streams + 512 > limit:
        raise SystemExit(f"capacity: {args.streams} streams need more than {limit} open files")
    log_dir = base.state_dir / "bench" / time.strftime("capacity-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = Report()
    with ExitStack() as stack:
        models_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-cap-")))
        args.models_dir = str(load_models_dir(models_dir))
        args.api_port = None
        args.redis_prefix = args.redis_prefix or f"cap{uuid.uuid4().hex[:8]}"
        settings = farm_settings(args, base, stack)
        env = {
            **os.environ,
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": settings.redis_url,
            "SWITCHYARD_REDIS_PREFIX": settings.redis_prefix,
            "SWITCHYARD_STATE_DIR": str(settings.state_dir),
            "SWITCHYARD_MODELS_DIR": str(settings.models_dir),
            "SWITCHYARD_API_HOST": HOST,
            "SWITCHYARD_API_PORT": str(settings.api_port),
            "SWITCHYARD_TORCH_THREADS": str(args.threads),
            # Room in the queues for the submit phase's jobs (workers idle).
            "SWITCHYARD_MAX_QUEUE_LENGTH": "1000000",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        print(
            f"capacity: {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; API at its default gunicorn "
            f"settings ({settings.api_workers} x {settings.api_worker_class}); logs in {log_dir}",
            flush=True,
        )
        farm = LoadFarm(settings, env, 0, 1, log_dir)
        farm.start = lambda: _start(farm)  # type: ignore[method-assign]
        stack.callback(farm.stop)
        farm.start()
        if args.phase in ("streams", "all"):
            streams_phase(farm, args, "ws", report)
            streams_phase(farm, args, "sse", report)
        if args.phase in ("submit", "all"):
            submit_phase(farm, args, report)
        if args.phase in ("abuse", "all"):
            abuse_phase(farm, args, report)
        print(f"capacity: load average at the end {os.getloadavg()[0]:.2f}", flush=True)
    return 1 if report.failed else 0


def _start(farm: LoadFarm) -> None:
    """The API as ``make run`` serves it (api/gunicorn_conf.py, nothing overridden)."""
    from bench.farm import wait_http, wait_worker_ready
    from config.settings import PROJECT_ROOT

    farm.clear_leftovers()
    conf = str(PROJECT_ROOT / "api" / "gunicorn_conf.py")
    farm.api = Child(
        "api",
        [sys.executable, "-m", "gunicorn", "-c", conf, "api:create_app()"],
        farm.env,
        farm.log_dir,
    )
    for model in MODELS:
        argv = [sys.executable, "-m", "cli", "worker", "--model", model]
        farm.workers[model].append(Child(f"worker-{model}", argv, farm.env, farm.log_dir))
    wait_http(farm.base + "/healthz", farm.api, 120)
    for model, children in farm.workers.items():
        for child in children:
            wait_worker_ready(farm.settings, model, child)


if __name__ == "__main__":
    sys.exit(main())
