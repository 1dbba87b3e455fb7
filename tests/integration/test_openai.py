"""The OpenAI-compatible routes, driven by the official ``openai`` package."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
import requests

from config import Settings
from tests import farm

CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def token(migrated: Settings) -> str:
    # A user of its own: the limits of the shared test users stay untouched.
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


@pytest.fixture()
def client(api_url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key=token, max_retries=0, timeout=120)


def job_of(api_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(
        f"{api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_status(api_url: str, token: str, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = job_of(api_url, token, job_id)
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not final")


def test_chat_non_streaming_matches_the_job_and_tokenizer(
    client: openai.OpenAI, api_url: str, token: str, tiny_worker: farm.Process
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", messages=CHAT, max_tokens=12, temperature=0, seed=3
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == "tiny-random"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    job = job_of(api_url, token, raw.headers["X-Job-Id"])
    assert job["status"] == "succeeded" and job["output_text"] == choice.message.content
    # /tokenize counts the chat exactly as the worker did.
    r = requests.post(
        f"{api_url}/tokenize",
        json={"model": "tiny-random", "messages": CHAT},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["count"] == completion.usage.prompt_tokens == len(r.json()["tokens"])


def test_chat_streaming_with_usage_equals_non_streaming(
    client: openai.OpenAI, tiny_worker: farm.Process
) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny-random",
        "messages": CHAT,
        "max_completion_tokens": 16,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_streaming_and_not(client: openai.OpenAI, tiny_worker: farm.Process) -> None:
    whole = client.completions.create(
        model="tiny-random", prompt="Once upon a time", max_tokens=10, temperature=0, stop=["zzz"]
    )
    assert whole.object == "text_completion" and whole.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny-random",
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text


def test_errors_use_openai_envelope(client: openai.OpenAI, api_url: str, token: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model="tiny-random", messages=CHAT, n=2)
    assert err.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert nf.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.UnprocessableEntityError) as too_many:
        client.completions.create(model="tiny-random", prompt="x", max_tokens=100_000)
    assert too_many.value.body["param"] == "max_tokens"  # type: ignore[index]
    anonymous = openai.OpenAI(base_url=f"{api_url}/v1", api_key="sy_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model="tiny-random", messages=CHAT)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    for raw, status in ((b"\xff\xfe", 400), (b"{", 400), (b"[]", 422)):
        r = requests.post(f"{api_url}/v1/chat/completions", data=raw, headers=headers, timeout=30)
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    r = requests.post(
        f"{api_url}/v1/completions",
        json={"model": "tiny-random", "prompt": "x" * 2_000_000},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_client_going_away_cancels_a_streaming_job(
    api_url: str, token: str, tiny_worker: farm.Process
) -> None:
    body = {
        "model": "tiny-random",
        "messages": CHAT,
        "max_tokens": 1024,
        "temperature": 1.0,
        "stream": True,
    }
    with requests.post(
        f"{api_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        stream=True,
        timeout=60,
    ) as r:
        assert r.status_code == 200
        job_id = r.headers["X-Job-Id"]
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["role"]
    # The connection is closed before the 1024 tokens: the job must not run on.
    job = wait_status(api_url, token, job_id)
    assert job["status"] == "cancelled"
    assert (job["usage"]["completion_tokens"] or 0) < 1024


def test_client_going_away_cancels_a_queued_job(api_url: str, token: str) -> None:
    # tiny-late has no worker here: the job waits, only keep-alives are written.
    body = {"model": "tiny-late", "prompt": "hello", "max_tokens": 4, "stream": True}
    with requests.post(
        f"{api_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        stream=True,
        timeout=60,
    ) as r:
        assert r.status_code == 200
        job_id = r.headers["X-Job-Id"]
        assert job_of(api_url, token, job_id)["status"] == "queued"
    job = wait_status(api_url, token, job_id)
    assert job["status"] == "cancelled" and job["attempts"] == 0


def test_a_non_streaming_client_going_away_cancels_its_job(
    api_url: str, migrated: Settings
) -> None:
    """OpenAI's and TGI's one-answer routes: a client that gives up has its job cancelled."""
    token = farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)
    headers = {"Authorization": f"Bearer {token}"}
    # tiny-late has no worker here: each job waits in the queue until its client leaves.
    impatient = openai.OpenAI(base_url=f"{api_url}/v1", api_key=token, max_retries=0, timeout=2)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="tiny-late", messages=CHAT, max_tokens=4)
    tgi = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    with pytest.raises(requests.Timeout):
        requests.post(
            f"{api_url}/generate",
            json=tgi,
            headers={**headers, "X-Model": "tiny-late"},
            timeout=2,
        )
    deadline = time.monotonic() + 30
    while True:
        jobs = requests.get(f"{api_url}/v1/jobs", headers=headers, timeout=30).json()["data"]
        if len(jobs) == 2 and all(j["status"] == "cancelled" for j in jobs):
            break
        assert time.monotonic() < deadline, jobs
        time.sleep(0.2)
    assert all(j["attempts"] == 0 for j in jobs)
