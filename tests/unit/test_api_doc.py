"""The documentation cannot drift from the code.

``docs/api.md`` has one ``### `METHOD /path``` heading per operation of the
app's own ``/openapi.json``, no more, no less; ``/openapi.json`` lists every
route of the URL map; ``docs/operations.md`` names every setting's variable.
Builds the app with unreachable services: nothing here connects.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from flask import Flask

from api import create_app
from config import load_settings
from config.settings import PROJECT_ROOT, Settings, variable_name

API_DOC = PROJECT_ROOT / "docs" / "api.md"
OPERATIONS_DOC = PROJECT_ROOT / "docs" / "operations.md"
HEADING = re.compile(r"^### `(?P<method>[A-Z]+) (?P<path>/\S*)`$")
HTTP_METHODS = {"get", "post", "put", "patch", "delete"}

Operation = tuple[str, str]


@pytest.fixture(scope="module")
def app() -> Flask:
    settings = load_settings(
        {},
        database_url="sqlite:///:memory:",
        redis_url="redis://127.0.0.1:1/0",
        reaper_in_api=False,
    )
    return create_app(settings)


@pytest.fixture(scope="module")
def document(app: Flask) -> dict[str, Any]:
    response = app.test_client().get("/openapi.json")
    assert response.status_code == 200
    body = response.get_json()
    assert isinstance(body, dict)
    return body


def openapi_operations(document: dict[str, Any]) -> set[Operation]:
    return {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def documented_operations() -> set[Operation]:
    """Every route heading of docs/api.md; a malformed one fails the test."""
    found: set[Operation] = set()
    for number, line in enumerate(API_DOC.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("### `"):
            continue
        match = HEADING.match(line)
        assert match, f"docs/api.md:{number}: not a '### `METHOD /path`' heading: {line!r}"
        operation = (match["method"], match["path"])
        assert operation not in found, f"docs/api.md:{number}: {operation} documented twice"
        found.add(operation)
    return found


def flask_to_openapi(rule: str) -> str:
    """``/a/<int:b>`` as ``/a/{b}``."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def test_every_route_is_documented_and_every_documented_route_exists(
    document: dict[str, Any],
) -> None:
    in_code = openapi_operations(document)
    in_doc = documented_operations()
    assert in_code, "the OpenAPI document lists no operation"
    undocumented = sorted(in_code - in_doc)
    stale = sorted(in_doc - in_code)
    assert not undocumented, f"routes missing from docs/api.md: {undocumented}"
    assert not stale, f"docs/api.md documents routes the app does not have: {stale}"


def test_openapi_lists_every_route_of_the_url_map(app: Flask, document: dict[str, Any]) -> None:
    listed = openapi_operations(document)
    missing = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":  # Flask's default /static route
            continue
        path = flask_to_openapi(rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            if (method, path) not in listed:
                missing.append((method, path))
    assert not missing, f"routes absent from /openapi.json: {missing}"


def test_operations_doc_names_every_setting() -> None:
    text = OPERATIONS_DOC.read_text(encoding="utf-8")
    missing = [
        variable_name(name)
        for name in Settings.model_fields
        if f"`{variable_name(name)}`" not in text
    ]
    assert not missing, f"settings missing from docs/operations.md: {missing}"


def _curl_commands(text: str) -> list[str]:
    """Every ``curl`` command of ``text``'s shell examples, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]


def test_documented_curl_bodies_say_they_are_json() -> None:
    """The API refuses a body without ``Content-Type: application/json`` (415), and
    ``curl -d`` sends ``application/x-www-form-urlencoded``: an example must name the type."""
    checked = 0
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        for command in _curl_commands(path.read_text()):
            if not re.search(r"\s(-d|--data\S*)\s", command):
                continue
            checked += 1
            assert "--json " in command or re.search(
                r"-H ['\"]Content-Type: application/json['\"]", command
            ), f"{path.name}: {command[:120]}"
    assert checked >= 10  # the examples are still there to be checked
