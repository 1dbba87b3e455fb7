"""Real clients against gunicorn (two worker processes) and a tiny-random worker:
the ``openai`` package, ``huggingface_hub.InferenceClient``, and per-user limits
counted across gunicorn's processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from huggingface_hub import InferenceClient, constants

from config import Settings
from tests import farm


@pytest.fixture(scope="module")
def gunicorn_url(migrated: Settings, log_dir: Path) -> Iterator[str]:
    with farm.serve_gunicorn(migrated, log_dir) as url:
        yield url


@pytest.fixture(scope="module")
def token(migrated: Settings) -> str:
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


def test_openai_client_chat_and_completions(
    gunicorn_url: str, token: str, tiny_worker: farm.Process
) -> None:
    client = openai.OpenAI(base_url=f"{gunicorn_url}/v1", api_key=token, max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model="tiny-random",
        messages=messages,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
    )
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny-random",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == whole.choices[0].message.content and streamed
    text = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=6, temperature=0)
    chunks = client.completions.create(
        model="tiny-random", prompt="Hi", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text


def test_huggingface_client_generate_and_stream(
    gunicorn_url: str, token: str, tiny_worker: farm.Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    client = InferenceClient(model=gunicorn_url, token=token, headers={"X-Model": "tiny-random"})
    text = client.text_generation("Once", max_new_tokens=6)
    events = list(client.text_generation("Once", max_new_tokens=6, stream=True, details=True))
    assert events[-1].generated_text == text and text
    assert events[-1].details is not None and events[-1].details.generated_tokens == 6


def test_requests_per_minute_hold_across_gunicorn_processes(
    gunicorn_url: str, migrated: Settings
) -> None:
    limited = farm.make_token(migrated, requests_per_minute=4, max_concurrent_jobs=0)
    headers = {"Authorization": f"Bearer {limited}"}
    body = {"model": "tiny-late", "prompt": "hi", "params": {"max_new_tokens": 2}}
    # A fresh connection per request, so gunicorn spreads them over its workers.
    codes = [
        requests.post(
            f"{gunicorn_url}/v1/jobs", json=body, headers={**headers, "Connection": "close"}
        ).status_code
        for _ in range(8)
    ]
    assert codes == [202] * 4 + [429] * 4
    for job in requests.get(f"{gunicorn_url}/v1/jobs", headers=headers).json()["data"]:
        requests.delete(f"{gunicorn_url}/v1/jobs/{job['id']}", headers=headers)
