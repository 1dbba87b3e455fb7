"""The TGI-compatible routes, driven by ``huggingface_hub.InferenceClient``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
from huggingface_hub import InferenceClient, constants
from huggingface_hub.errors import ValidationError

from config import Settings
from tests import farm


@pytest.fixture(scope="module")
def token(migrated: Settings) -> str:
    return farm.make_token(migrated, max_concurrent_jobs=0, requests_per_minute=0)


@pytest.fixture()
def client(api_url: str, token: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[InferenceClient]:
    # HF_HUB_OFFLINE=1 (no model downloads) also blocks the client from any URL,
    # even ours on localhost; only this client, in this process, is let through.
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    yield InferenceClient(model=api_url, token=token, headers={"X-Model": "tiny-random"})


def test_generate_with_details_and_plain(
    client: InferenceClient, tiny_worker: farm.Process
) -> None:
    text = client.text_generation("The fox", max_new_tokens=8, seed=1)
    assert isinstance(text, str) and text
    out = client.text_generation("The fox", max_new_tokens=8, details=True, seed=1)
    assert out.generated_text == text  # greedy: TGI samples only when asked
    assert out.details is not None
    assert out.details.finish_reason in ("length", "eos_token", "stop_sequence")
    assert 0 < out.details.generated_tokens <= 8
    full = client.text_generation("The fox", max_new_tokens=8, return_full_text=True)
    assert full == "The fox" + text


def test_stream_ends_with_generated_text_and_details(
    client: InferenceClient, tiny_worker: farm.Process
) -> None:
    events = list(client.text_generation("The fox", max_new_tokens=8, stream=True, details=True))
    final = events[-1]
    assert final.generated_text == "".join(e.token.text for e in events)
    assert final.details is not None and final.details.finish_reason == "length"
    assert all(e.generated_text is None for e in events[:-1])
    plain = list(client.text_generation("The fox", max_new_tokens=8, stream=True))
    assert "".join(plain) == final.generated_text


def test_routes_and_model_choice(api_url: str, token: str, tiny_worker: farm.Process) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    body = {"inputs": "The fox", "parameters": {"max_new_tokens": 4, "details": True}}
    by_param = requests.post(
        f"{api_url}/generate?model=tiny-random", json=body, headers=auth, timeout=60
    )
    by_body = requests.post(
        f"{api_url}/generate", json={**body, "model": "tiny-random"}, headers=auth, timeout=60
    )
    assert by_param.status_code == by_body.status_code == 200, by_param.text
    assert by_param.json()["generated_text"] == by_body.json()["generated_text"]
    assert by_param.json()["details"]["finish_reason"] == "length"
    with requests.post(
        f"{api_url}/generate_stream",
        json=body,
        headers={**auth, "X-Model": "tiny-random"},
        stream=True,
        timeout=60,
    ) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        data = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith(b"data:")]
    assert data[-1]["generated_text"] == by_param.json()["generated_text"]
    assert data[-1]["details"]["generated_tokens"] == 4
    info = requests.get(f"{api_url}/info", headers={**auth, "X-Model": "tiny-random"}, timeout=30)
    assert info.json()["model_id"] == "tiny-random" and info.json()["max_input_tokens"] == 512
    # No model named: the first enabled model of the catalog.
    default = requests.get(f"{api_url}/info", headers=auth, timeout=30)
    assert default.status_code == 200 and default.json()["model_id"] == "smollm2-135m"


def test_errors_are_tgi_shaped(client: InferenceClient, api_url: str, token: str) -> None:
    with pytest.raises(ValidationError):
        client.text_generation("The fox", max_new_tokens=100_000)
    r = requests.post(
        f"{api_url}/generate",
        json={"inputs": "x", "parameters": {"best_of": 3}},
        headers={"Authorization": f"Bearer {token}", "X-Model": "tiny-random"},
        timeout=30,
    )
    assert r.status_code == 422
    assert r.json() == {
        "error": r.json()["error"],
        "error_type": "validation",
        "field": "parameters.best_of",
    }
    r = requests.post(f"{api_url}/generate", json={"inputs": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"
    r = requests.post(
        f"{api_url}/generate",
        json={"inputs": "x"},
        headers={"Authorization": f"Bearer {token}", "X-Model": "nope"},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]
