"""A drain that hands a job over in the middle of a multi-byte character, through the real API.

The case is staged where it can be made exact: two job runners in this
process (worker ids of their own, each with a live heartbeat) take the place
of two worker processes, on one engine whose model is scripted to answer
Korean and emoji text. The engine is held just before the step that
generates a token inside a character; the first runner is told to drain then,
so the engine stops with part of a character generated and not yet sent. The
second runner continues the job. The client is the official ``openai`` SDK,
streaming from the session's API, which relays the job's Redis stream as for
any worker. Only the Celery delivery is replaced: the runners are called
with the job's id, as the generate task calls them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import redis
import torch

from config import Settings, load_catalog
from db.jobs import JobStore
from db.schema import utcnow
from db.session import Database
from fleet.registry import Heartbeat, WorkerReport
from jobs.events import EventLog, JobEvent, StreamTaken
from models.engine import Engine, GenerationRequest, RequestHandle
from models.llama import StepInput
from models.loader import load_model
from tests import farm
from workers.runner import JobRunner

MODEL = "tiny-handover"  # see conftest: no worker process ever serves it
CHAT = [{"role": "user", "content": "Say hello in Korean, with emoji."}]
ANSWER = "안녕하세요 👋🏽 여우 🦊 세계!"


class Gate:
    """A scripted forward: the request answers ``script``; the step that computes
    token ``hold_at`` waits until :meth:`release`."""

    def __init__(
        self, forward: Callable[..., torch.Tensor], prompt_len: int, script: list[int], hold_at: int
    ) -> None:
        self._forward = forward
        self._prompt_len = prompt_len
        self._script = script
        self._hold_at = hold_at
        self.reached = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def __call__(self, step: StepInput, cache: Any) -> torch.Tensor:
        logits = self._forward(step, cache)
        if not step.logit_rows:
            return logits
        index = int(step.positions[step.logit_rows[0]]) - self._prompt_len + 1
        if index == self._hold_at and not self._released.is_set():
            self.reached.set()
            assert self._released.wait(60), "the gate was never released"
        logits[0, :] = -1e4
        logits[0, self._script[min(index, len(self._script) - 1)]] = 1e4
        return logits


class WatchedEngine:
    """The engine, with a flag set when a runner cancels a request (its drain did)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.cancelled = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        handle = self._engine.submit(request)
        cancel = handle.cancel

        def watched_cancel() -> None:
            cancel()
            self.cancelled.set()

        handle.cancel = watched_cancel  # type: ignore[method-assign]
        return handle


@pytest.fixture(scope="module")
def engine(migrated: Settings) -> Iterator[Engine]:
    catalog = load_catalog(migrated.models_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(catalog[MODEL], catalog, migrated.state_dir / "models")
    engine = Engine(loaded, max_batch_size=4, max_input_tokens=512)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop(timeout=10)
        torch.set_num_threads(threads)


def inside_a_character(engine: Engine, ids: list[int]) -> bool:
    return str(engine.tokenizer.decode(ids)).endswith("\ufffd")


def test_a_drain_inside_a_multibyte_character_hands_over_whole_characters(
    api_url: str,
    user_token: str,
    migrated: Settings,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = list(engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"])
    # Hold the step that generates a token inside a character that earlier tokens
    # began (the emoji's skin-tone modifier), with whole characters, multi-byte
    # ones among them, sent before it.
    hold_at = next(
        k
        for k in range(len(script) // 2, len(script))
        if inside_a_character(engine, script[:k]) and inside_a_character(engine, script[: k + 1])
    )
    prompt_len = len(engine.encode_chat(CHAT))
    gate = Gate(engine.runtime.forward, prompt_len, script, hold_at)
    monkeypatch.setattr(engine.runtime, "forward", gate)

    client = redis.Redis.from_url(migrated.redis_url)
    catalog = load_catalog(migrated.models_dir)
    jobs = JobStore(Database(migrated.database_url))
    events = EventLog(client, migrated)
    writes: list[list[str]] = []  # the event types of each append, in order
    append_fenced = events.append_fenced

    def recorded(job_id: str, batch: list[JobEvent], owner: str) -> bool:
        cancel = append_fenced(job_id, batch, owner)
        writes.append([e.type for e in batch])
        return cancel

    monkeypatch.setattr(events, "append_fenced", recorded)
    watched = WatchedEngine(engine)
    runners, beats = [], []
    for name in ("handover-a", "handover-b"):
        runner = JobRunner(
            settings=migrated,
            definition=catalog[MODEL],
            engine=watched,  # type: ignore[arg-type]
            jobs=jobs,
            events=events,
            worker_id=f"{name}-{time.time_ns()}",
        )
        beat = Heartbeat(client, migrated, WorkerReport(runner.worker_id, MODEL, state="ready"))
        beat.start()
        runners.append(runner)
        beats.append(beat)
    first, second = runners

    box: list[str] = []

    def stream() -> None:
        sdk = openai.OpenAI(
            base_url=f"{api_url}/v1", api_key=user_token, max_retries=0, timeout=120
        )
        chunks = sdk.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=len(script),
            temperature=0,
            stream=True,
        )
        box.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        job_id = farm.wait_for(
            "the job to be queued",
            lambda: next((i for i, m in jobs.queued_before(utcnow()) if m == MODEL), None),
            30,
        )
        running = threading.Thread(target=first.run, args=(job_id,), daemon=True)
        running.start()
        assert gate.reached.wait(60), "the engine never reached the held step"
        first.drain(0)  # as SIGTERM does with the default grace of 0 s
        assert watched.cancelled.wait(10), "the drain did not cancel the request"
        gate.release()  # the engine generates the held token, then drops the request
        running.join(30)
        assert not running.is_alive()

        handed = events.history(job_id)
        row = jobs.get(job_id)
        assert row is not None and row.status == "queued" and row.attempts == 0
        sent = [e for e in handed if e.type == "token"]
        carried = [i for e in sent for i in e.fields["ids"]]
        # The engine was inside a character when it stopped (it had generated the
        # held token); what the stream holds ends before that character.
        assert inside_a_character(engine, script[: hold_at + 1])
        assert carried == script[: len(carried)] and len(carried) < hold_at
        first_text = "".join(e.text for e in sent)
        assert first_text and "\ufffd" not in first_text
        assert first_text == engine.tokenizer.decode(carried)
        assert not first_text.isascii()

        second.run(job_id)
        reader.join(60)
        assert box, "the OpenAI stream did not end"
    finally:
        gate.release()
        for beat in beats:
            beat.stop()

    text = box[0]
    assert text == ANSWER and "\ufffd" not in text
    history = events.history(job_id)
    assert [e.seq for e in history] == list(range(len(history)))
    types = [e.type for e in history]
    assert types.count("started") == 2 and "restart" not in types
    resumed = history[types.index("resumed")]
    assert types[types.index("resumed") - 1] == "started"
    assert resumed.fields["tokens"] == len(carried)
    assert resumed.fields["previous_worker"] == first.worker_id
    # The first run said `started` at once; the second said it with `resumed`, in
    # one write, so no death of its worker can leave the one without the other.
    starts = [w for w in writes if "started" in w]
    assert starts == [["started"], ["started", "resumed"]], writes
    # Each token once: the ids of every token event are the script, no byte twice.
    assert [i for e in history if e.type == "token" for i in e.fields["ids"]] == script
    assert history[-1].type == "done" and history[-1].fields["text"] == ANSWER
    job = jobs.get(job_id)
    assert job is not None and job.status == "succeeded" and job.attempts == 1
    assert job.output_text == ANSWER and job.completion_tokens == len(script)


def test_a_fenced_write_reads_the_jobs_cancel_request_and_refuses_another_owner(
    migrated: Settings,
) -> None:
    """The runner learns of a cancel from its writes (it polls only between them)."""
    events = EventLog(redis.Redis.from_url(migrated.redis_url), migrated)
    job_id = str(uuid.uuid4())

    def token(seq: int) -> list[JobEvent]:
        return [JobEvent(seq=seq, type="token", fields={"text": "x", "ids": [1]})]

    assert events.take(job_id, "attempt-1") == []  # an empty stream: no history
    assert events.append_fenced(job_id, token(1), "attempt-1") is False
    events.request_cancel(job_id)
    assert events.append_fenced(job_id, token(2), "attempt-1") is True
    # Taking the stream returns its history, read in the same transaction.
    assert events.take(job_id, "attempt-2") == token(1) + token(2)
    with pytest.raises(StreamTaken):
        events.append_fenced(job_id, token(3), "attempt-1")
    assert [e.seq for e in events.history(job_id)] == [1, 2]
