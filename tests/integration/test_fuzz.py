"""Hostile input: property-based requests generated from /openapi.json (schemathesis),
plus hand-picked nasty bodies. No answer may be a 5xx or a non-JSON error.

The app under test has its own catalog, where every model's queue holds zero
jobs: a valid submission is refused with a 429 before anything is enqueued, so
thousands of generated requests start no generation, while every validation
path is still walked.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from api import create_app
from config import Settings
from tests import farm

# Generated cases per operation and mode; ~45 operations × 2 modes. The long
# run (make faults) raises it with SY_FUZZ_EXAMPLES.
EXAMPLES = int(os.environ.get("SY_FUZZ_EXAMPLES", "25"))
SKIPPED = {
    # Websocket routes are not HTTP requests.
    "GET /v1/ws",
    "GET /v1/jobs/{job_id}/ws",
    # Revoking random token ids would revoke the fuzzing token itself.
    "DELETE /v1/admin/tokens/{token_id}",
}


@pytest.fixture(scope="module")
def fuzz_settings(migrated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    folder = tmp_path_factory.mktemp("fuzz-models")
    for path in migrated.models_dir.glob("*.yaml"):
        text = path.read_text()
        if "max_batch_size:" in text:
            text = text.replace("max_batch_size:", "max_queue_length: 0\n  max_batch_size:", 1)
        (folder / path.name).write_text(text)
    # A Redis prefix of its own, so no worker of the session (nor a failed one) is seen;
    # hence no reaper either: it would take the session's running jobs for orphans.
    return migrated.model_copy(
        update={
            "models_dir": folder,
            "redis_prefix": f"fz{uuid.uuid4().hex[:6]}",
            "reaper_in_api": False,
        }
    )


# Run-time settings the fuzzer's admin token may change; restored afterwards, since
# the database is the session's.
RESTORED_TABLES = ("model_overrides", "scaling_overrides", "scaling_windows")


@pytest.fixture(scope="module")
def fuzz_app(fuzz_settings: Settings) -> Iterator[Flask]:
    from sqlalchemy import inspect

    from db.schema import Base

    app = create_app(fuzz_settings)
    db = app.extensions["switchyard"].db
    present = set(inspect(db.engine).get_table_names())
    tables = [Base.metadata.tables[t] for t in RESTORED_TABLES if t in present]
    with db.engine.connect() as conn:
        saved = {t.name: [dict(r._mapping) for r in conn.execute(t.select())] for t in tables}
    try:
        yield app
    finally:
        with db.engine.begin() as conn:
            for t in tables:
                conn.execute(t.delete())
                if saved[t.name]:
                    conn.execute(t.insert(), saved[t.name])
        app.extensions["switchyard"].close()


def json_error_body(response: Any) -> None:
    if response.status_code >= 400:
        # schemathesis' responses: lower-case header names, a list of values each.
        content_type = (response.headers.get("content-type") or [""])[0]
        assert content_type.startswith("application/json"), (
            response.status_code,
            response.text[:200],
        )
        body = json.loads(response.text)
        assert isinstance(body, dict) and body.get("error"), body


def fuzz(strategy: Any, token: str, label: str) -> None:
    """Draw cases of one operation; each answer must be below 500, errors JSON."""

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(strategy)
        headers = dict(case.headers or {})
        headers.setdefault("Authorization", f"Bearer {token}")
        response = case.call(headers=headers)
        assert response.status_code < 500, (label, response.status_code, response.text[:300])
        json_error_body(response)

    # Negative mode of an operation with nothing to make invalid (no parameters).
    with contextlib.suppress(Unsatisfiable):
        run()


def test_generated_requests_never_get_5xx_or_non_json_errors(
    fuzz_app: Flask, fuzz_settings: Settings
) -> None:
    token = farm.make_token(fuzz_settings, "admin")
    schema = schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app)
    operations = [r.ok() for r in schema.get_all_operations()]
    checked = 0
    for operation in operations:
        if f"{operation.method.upper()} {operation.path}" in SKIPPED:
            continue
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz(operation.as_strategy(generation_mode=mode), token, operation.label)
            checked += 1
    assert checked >= 40


@pytest.fixture(scope="module")
def client(fuzz_app: Flask, fuzz_settings: Settings) -> Iterator[Any]:
    token = farm.make_token(fuzz_settings)
    client = fuzz_app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    yield client


NASTY: list[tuple[str, bytes, int, str | None]] = [
    ("/v1/chat/completions", b"\xff\xfe\xfd", 400, None),
    ("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000, 400, None),
    (
        "/generate",
        b'{"inputs": "x", "parameters": {"stop": [' + b'"a",' * 5000 + b'"a"]}}',
        422,
        "parameters.stop",
    ),
    (
        "/v1/completions",
        b'{"model": "tiny-random", "prompt": "x", "max_tokens": -5}',
        422,
        "max_tokens",
    ),
    (
        "/v1/completions",
        b'{"model": "tiny-random", "prompt": "x", "max_tokens": 1e400}',
        422,
        "max_tokens",
    ),
    (
        "/v1/completions",
        b'{"model": "tiny-random", "prompt": "x", "temperature": NaN}',
        422,
        "temperature",
    ),
    (
        "/v1/completions",
        b'{"model": "tiny-random", "prompt": "x", "seed": 99999999999999999999999}',
        422,
        "seed",
    ),
    ("/v1/chat/completions", b'{"model": "tiny-random", "messages": "hi"}', 422, "messages"),
    ("/v1/chat/completions", b'{"model": ["x"], "messages": []}', 422, "model"),
    (
        "/v1/jobs",
        b'{"model": "tiny-random", "prompt": "x", "params": {"top_k": -1}}',
        422,
        "params.top_k",
    ),
    ("/tokenize", b'{"model": "tiny-random", "prompt": 5}', 422, "prompt"),
    # NUL has no use in text and Postgres cannot store it: refused by name.
    ("/v1/jobs", b'{"model": "tiny-random", "prompt": "a\\u0000b"}', 422, "prompt"),
    (
        "/v1/jobs",
        b'{"model": "tiny-random", "messages": [{"role": "user", "content": "\\u0000"}]}',
        422,
        "messages.0.content",
    ),
    ("/v1/completions", b'{"model": "tiny-random", "prompt": "\\u0000"}', 422, "prompt"),
    ("/generate", b'{"inputs": "x\\u0000"}', 422, "inputs"),
    (
        "/v1/jobs",
        b'{"model": "tiny-random", "prompt": "x", "params": {"stop": ['
        + b'"ab",' * 10_000
        + b'"ab"]}}',
        422,
        "params.stop",
    ),
    (
        "/v1/jobs",
        b'{"model": "tiny-random", "prompt": "x", "params": {"max_new_tokens": 1000000000}}',
        422,
        "params.max_new_tokens",
    ),
    ("/v1/admin/users", b'{"name": "a b"}', 403, None),
]


@pytest.mark.parametrize(("path", "raw", "status", "field"), NASTY)
def test_nasty_bodies_are_4xx_naming_the_field(
    client: Any, path: str, raw: bytes, status: int, field: str | None
) -> None:
    r = client.post(path, data=raw, content_type="application/json")
    assert r.status_code == status, r.get_data(as_text=True)[:300]
    body = r.get_json()
    if path.startswith("/v1/chat") or path.startswith("/v1/completions"):
        assert body["error"]["param"] == field and body["error"]["message"]
    else:
        assert body["error"] and body.get("field") == field


def test_oversized_body_is_413_in_each_envelope(client: Any) -> None:
    big = json.dumps({"model": "tiny-random", "prompt": "x" * 2_000_000})
    for path in ("/v1/jobs", "/v1/completions", "/generate"):
        r = client.post(path, data=big, content_type="application/json")
        assert r.status_code == 413
        body = r.get_json()
        assert body["error"]
