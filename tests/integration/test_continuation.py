"""Continuation through real clients: kill -9 the serving worker mid-stream, on every API.

Each case runs one greedy request twice through the same client: once
undisturbed (the reference), once with its worker killed after its first
tokens. The reaper (every 0.5 s, heartbeat TTL 3 s; see conftest) re-queues
the job, the other worker continues it from the token ids its stream holds,
and the client must read exactly the reference text: one copy of each token,
the job's stream gapless, two attempts, a ``resumed`` event and no
``restart``. Workers serve ``tiny-recovery`` (a tiny random model that may
generate long answers); prompt plus output always fit its context, so
continuation is possible unless a test takes the stream's history away.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import requests
import websocket
from huggingface_hub import InferenceClient, constants
from text_generation import Client as TGIClient

from config import Settings
from db.jobs import JobStore
from db.session import Database
from jobs.events import EventLog
from tests import farm

MODEL = "tiny-recovery"
MAX_NEW = 400  # several seconds here
CHAT = [{"role": "user", "content": "Tell me a very long story about a fox."}]
PROMPT = "Once upon a time, a fox"


class Pool:
    """``tiny-recovery`` workers; keeps two alive so a killed job continues at once."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.procs: dict[str, farm.Process] = {}

    def ensure(self, n: int) -> None:
        alive = sum(p.alive() for p in self.procs.values())
        starting = [farm.start_worker(self.settings, MODEL, self.log_dir) for _ in range(n - alive)]
        for proc in starting:
            self.procs[farm.wait_ready(self.settings, MODEL, proc)] = proc

    def kill(self, worker_id: str) -> None:
        proc = self.procs[worker_id].proc
        proc.kill()
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.alive():
                proc.stop()


@pytest.fixture(scope="module")
def pool(migrated: Settings, log_dir: Path) -> Iterator[Pool]:
    workers = Pool(migrated, log_dir)
    try:
        yield workers
    finally:
        workers.stop_all()


class Killer:
    """Kills the worker of the next running ``MODEL`` job once it has streamed a few tokens."""

    def __init__(self, settings: Settings, pool: Pool) -> None:
        self.settings = settings
        self.pool = pool
        self.jobs = JobStore(Database(settings.database_url))
        self.events = EventLog(redis.Redis.from_url(settings.redis_url), settings)
        self.job_id: str | None = None
        self.victim: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Killer:
        self._thread.start()
        return self

    def _target(self) -> tuple[str, str] | None:
        for job in self.jobs.running():
            if job.model != MODEL or job.worker not in self.pool.procs:
                continue
            tokens = [e for e in self.events.history(job.id) if e.type == "token"]
            if len(tokens) >= 3:
                return job.id, job.worker
        return None

    def _run(self) -> None:
        self.job_id, self.victim = farm.wait_for("a job mid-stream", self._target, 120, 0.02)
        self.pool.kill(self.victim)

    def join(self) -> str:
        self._thread.join(timeout=130)
        assert self.job_id is not None, "no job was killed"
        return self.job_id


def check_continued(
    settings: Settings, job_id: str, victim: str | None, max_new: int | None = MAX_NEW
) -> None:
    """The job's stream is gapless with one ``resumed`` after its second start.

    ``max_new``: the completion tokens the job must have counted (None: not checked,
    for a sampled job that may draw its end of sequence early).
    """
    events = EventLog(redis.Redis.from_url(settings.redis_url), settings)
    history = events.history(job_id)
    assert [e.seq for e in history] == list(range(len(history)))
    types = [e.type for e in history]
    assert "restart" not in types, types
    assert types.count("started") == 2 and types.count("resumed") == 1, types
    resumed = history[types.index("resumed")]
    assert types[types.index("resumed") - 1] == "started"
    assert resumed.fields["attempt"] == 2 and resumed.fields["previous_worker"] == victim
    assert resumed.fields["tokens"] >= 3
    job = JobStore(Database(settings.database_url)).get(job_id)
    assert job is not None and job.status == "succeeded" and job.attempts == 2
    if max_new is not None:
        assert job.completion_tokens == max_new


def run_killed(
    settings: Settings, pool: Pool, call: Callable[[], str]
) -> tuple[str, str, str | None]:
    """``call()`` with its job's worker killed mid-stream: (text, job id, victim)."""
    pool.ensure(2)
    killer = Killer(settings, pool).start()
    text = call()
    job_id = killer.join()
    return text, job_id, killer.victim


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def openai_chat_stream(api_url: str, token: str) -> str:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=token, max_retries=0, timeout=180)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def openai_completion(api_url: str, token: str) -> str:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=token, max_retries=0, timeout=180)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    return out.choices[0].text


def tgi_client(api_url: str, token: str) -> TGIClient:
    return TGIClient(api_url, headers={**auth(token), "X-Model": MODEL}, timeout=180)


def tgi_generate_stream(api_url: str, token: str) -> str:
    responses = list(tgi_client(api_url, token).generate_stream(PROMPT, max_new_tokens=MAX_NEW))
    text = "".join(r.token.text for r in responses if not r.token.special)
    assert responses[-1].generated_text == text
    return text


def tgi_generate(api_url: str, token: str) -> str:
    """``POST /`` through the official client (it reads a one-element list)."""
    out = tgi_client(api_url, token).generate(PROMPT, max_new_tokens=MAX_NEW)
    assert out.details is not None and out.details.generated_tokens == MAX_NEW
    assert len(out.details.tokens) == MAX_NEW  # the ids, carried ones included
    return out.generated_text


def hf_stream(api_url: str, token: str) -> str:
    client = InferenceClient(model=api_url, token=token, headers={"X-Model": MODEL}, timeout=180)
    return "".join(client.text_generation(PROMPT, max_new_tokens=MAX_NEW, stream=True))


def native_sse(api_url: str, token: str) -> str:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "params": {"max_new_tokens": MAX_NEW, "temperature": 0},
    }
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    events = farm.sse_events(api_url, r.json()["id"], token, timeout=180)
    assert [e["seq"] for e in events] == list(range(len(events)))
    text = "".join(e["text"] for e in events if e["type"] == "token")
    assert events[-1]["type"] == "done" and events[-1]["text"] == text
    return text


def multiplexed(api_url: str, token: str) -> str:
    url = api_url.replace("http", "ws", 1) + "/v1/ws"
    ws = websocket.create_connection(url, header=[f"Authorization: Bearer {token}"], timeout=180)
    try:
        ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "id": "r1",
                    "model": MODEL,
                    "messages": CHAT,
                    "params": {"max_new_tokens": MAX_NEW, "temperature": 0},
                }
            )
        )
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv()))
    finally:
        ws.close()
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert frames[-1]["type"] == "done" and frames[-1]["text"] == text
    return text


CLIENTS = {
    "openai-chat-stream": openai_chat_stream,
    "openai-completion": openai_completion,
    "tgi-generate-stream": tgi_generate_stream,
    "tgi-generate": tgi_generate,
    "hf-stream": hf_stream,
    "native-sse": native_sse,
    "multiplexed-ws": multiplexed,
}


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_killed_worker_is_invisible_to_the_client(
    name: str,
    api_url: str,
    user_token: str,
    migrated: Settings,
    pool: Pool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # HF_HUB_OFFLINE=1 blocks huggingface_hub from any URL, ours too.
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    call = CLIENTS[name]
    pool.ensure(2)
    reference = call(api_url, user_token)
    assert reference
    text, job_id, victim = run_killed(migrated, pool, lambda: call(api_url, user_token))
    assert text == reference
    check_continued(migrated, job_id, victim)


# Sampled, not greedy: each draw is seeded, so an uninterrupted run is reproducible.
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


def openai_chat_stream_seeded(api_url: str, token: str) -> str:
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=token, max_retries=0, timeout=180)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=MAX_NEW,
        stream=True,
        **SEEDED,  # type: ignore[arg-type]
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def native_sse_seeded(api_url: str, token: str) -> str:
    body = {"model": MODEL, "messages": CHAT, "params": {"max_new_tokens": MAX_NEW, **SEEDED}}
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=auth(token), timeout=30)
    assert r.status_code == 202, r.text
    events = farm.sse_events(api_url, r.json()["id"], token, timeout=180)
    assert [e["seq"] for e in events] == list(range(len(events)))
    text = "".join(e["text"] for e in events if e["type"] == "token")
    assert events[-1]["type"] == "done" and events[-1]["text"] == text
    return text


SEEDED_CLIENTS = {
    "openai-chat-stream": openai_chat_stream_seeded,
    "native-sse": native_sse_seeded,
}


@pytest.mark.parametrize("name", list(SEEDED_CLIENTS))
def test_a_killed_worker_is_invisible_to_a_seeded_sampled_stream(
    name: str, api_url: str, user_token: str, migrated: Settings, pool: Pool
) -> None:
    """A sampled job (temperature > 0, a seed) killed mid-stream continues with the
    draws the uninterrupted run made: the engine replays the carried tokens one a
    step, so the request's random stream is where it was when the worker died."""
    call = SEEDED_CLIENTS[name]
    pool.ensure(2)
    reference = call(api_url, user_token)
    assert reference and reference == call(api_url, user_token)  # the seed decides
    # It is sampled: the greedy answer to the same question is another text.
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=user_token, max_retries=0)
    greedy = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    assert not reference.startswith(greedy.choices[0].message.content or "")
    text, job_id, victim = run_killed(migrated, pool, lambda: call(api_url, user_token))
    assert text == reference
    check_continued(migrated, job_id, victim, max_new=None)


def test_an_answer_that_cannot_continue_ends_the_openai_stream_with_an_error(
    api_url: str, user_token: str, migrated: Settings, pool: Pool
) -> None:
    """The stream's history lost its beginning (as when Redis trims or loses it): the
    next attempt cannot know what was sent, so ``restart``, and the OpenAI stream
    ends with an error instead of sending the answer a second time."""
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key=user_token, max_retries=0, timeout=180)
    pool.ensure(2)
    killer = Killer(migrated, pool)
    kill = killer._run

    def kill_and_trim() -> None:
        kill()
        assert killer.job_id is not None
        channel = killer.events.channel(killer.job_id)
        (first_id, _fields), *_ = killer.events.redis.xrange(channel, count=1)
        killer.events.redis.xdel(channel, first_id)  # the `queued` event, seq 0

    killer._thread = threading.Thread(target=kill_and_trim, daemon=True)
    killer.start()
    text = ""
    with pytest.raises(openai.APIError, match="could not be continued"):
        for c in client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
        ):
            if c.choices:
                text += c.choices[0].delta.content or ""
    job_id = killer.join()
    history = killer.events.history(job_id)
    types = [e.type for e in history]
    assert "restart" in types and "resumed" not in types
    restart = history[types.index("restart")]
    assert restart.fields["reason"] == "the stream's history is incomplete"
    # What the client got is the first attempt's text, never a second copy.
    first = "".join(e.text for e in history[: types.index("restart")] if e.type == "token")
    assert text and first.startswith(text)


def test_a_later_attempt_fences_off_an_earlier_one_still_writing(migrated: Settings) -> None:
    """A worker taken for lost but still running cannot write after the next attempt
    read the stream: its write lands before (and is carried over) or is refused."""
    from jobs.events import JobEvent, StreamTaken

    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    job_id = f"fence-{time.time_ns()}"
    first = JobEvent(0, "token", {"text": "a", "ids": [1]})
    events.take(job_id, "attempt-1")
    events.append_fenced(job_id, [first], "attempt-1")
    events.take(job_id, "attempt-2")
    with pytest.raises(StreamTaken):
        events.append_fenced(job_id, [JobEvent(1, "token", {"text": "b", "ids": [2]})], "attempt-1")
    second = JobEvent(1, "started", {"attempt": 2, "worker": "w2"})
    events.append_fenced(job_id, [second], "attempt-2")
    assert events.history(job_id) == [first, second]
