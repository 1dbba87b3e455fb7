"""What the API answers before it touches any service: JSON errors, no torch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient

from api import create_app
from api.errors import refusal_error
from config import load_settings
from config.settings import PROJECT_ROOT
from jobs.errors import (
    InvalidRequest,
    JobRefused,
    OverLimit,
    QueueDown,
    TokenRequired,
    UnknownModel,
    Unservable,
)


@pytest.fixture()
def client() -> Iterator[FlaskClient]:
    # Unreachable services: these requests must be answered without them.
    # No reaper thread: one per test, each failing to reach Redis, only adds noise.
    settings = load_settings(
        {},
        database_url="sqlite:///:memory:",
        redis_url="redis://127.0.0.1:1/0",
        reaper_in_api=False,
    )
    app = create_app(settings)
    try:
        yield app.test_client()
    finally:
        app.extensions["switchyard"].close()


def test_healthz_needs_no_dependency(client: FlaskClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.get_json() == {"status": "ok"}


def test_readyz_names_what_is_down(client: FlaskClient) -> None:
    r = client.get("/readyz")
    assert r.status_code == 503
    assert r.get_json()["checks"]["redis"].startswith("unavailable")


@pytest.mark.parametrize(
    ("data", "status", "field"),
    [
        (b"{", 400, None),
        (b"\xff", 400, None),
        (b"[1, 2]", 422, "(body)"),
        (
            b'{"model": "tiny-random", "prompt": "x", "params": {"temperature": -1}}',
            422,
            "params.temperature",
        ),
        (b'{"model": "tiny-random", "prompt": "x", "params": {"top_p": 0}}', 422, "params.top_p"),
        (
            b'{"model": "tiny-random", "prompt": "x", "params": {"temperature": NaN}}',
            422,
            "params.temperature",
        ),
        (b'{"model": "tiny-random", "prompt": "x", "params": {"stop": [""]}}', 422, "params.stop"),
        (b'{"model": "tiny-random", "prompt": "", "params": {}}', 422, "prompt"),
    ],
)
def test_bad_bodies_are_json_errors(
    client: FlaskClient, data: bytes, status: int, field: str | None
) -> None:
    r = client.post("/v1/jobs", data=data, content_type="application/json")
    assert r.status_code == status
    body = r.get_json()
    assert body["error"] and body["error_type"]
    assert body.get("field") == field


def test_deeply_nested_json_is_rejected_not_crashed(client: FlaskClient) -> None:
    r = client.post(
        "/v1/jobs", data=b"[" * 100_000 + b"]" * 100_000, content_type="application/json"
    )
    assert r.status_code in (400, 422)
    assert r.get_json()["error"]


def test_unknown_route_and_method_are_json(client: FlaskClient) -> None:
    assert client.get("/nope").get_json()["error_type"] == "not_found"
    r = client.patch("/v1/jobs")
    assert r.status_code == 405 and r.get_json()["error"]


def test_api_never_imports_torch() -> None:
    code = "import sys, api; api.create_app(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PROJECT_ROOT)


@pytest.mark.parametrize(
    ("refused", "status", "body", "headers"),
    [
        (UnknownModel("no m", field="model"), 404, ("not_found", "model"), set()),
        (TokenRequired("token"), 401, ("unauthorized", None), {"WWW-Authenticate"}),
        (InvalidRequest("over", field="params.x"), 422, ("validation_error", "params.x"), set()),
        (OverLimit("full", 1.2), 429, ("rate_limited", None), {"Retry-After"}),
        (Unservable("none can come"), 503, ("unavailable", None), set()),
        (QueueDown("down"), 503, ("unavailable", None), set()),
    ],
)
def test_each_refusal_of_the_job_service_has_its_answer(
    refused: JobRefused, status: int, body: tuple[str, str | None], headers: set[str]
) -> None:
    error = refusal_error(refused)
    assert (error.status, error.error_type, error.field) == (status, *body)
    assert error.message == refused.message and set(error.headers) == headers
    if isinstance(refused, OverLimit):
        assert error.headers["Retry-After"] == "2"  # whole seconds, rounded up
