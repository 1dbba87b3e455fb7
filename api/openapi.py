"""The OpenAPI 3.1 document of every route, built from the routes themselves.

A view declares its documentation with :func:`spec`: the pydantic model of its
body (the same class the view validates with), of its query string, the
headers it reads, who may call it. ``GET /openapi.json`` walks the app's URL
map, so a route without a declaration is still listed (methods and path
parameters), and no schema is written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from flask import Blueprint, Flask, Response, current_app, jsonify
from pydantic import BaseModel

bp = Blueprint("openapi", __name__)

Auth = Literal["none", "optional", "required", "operator", "admin"]
F = TypeVar("F", bound=Callable[..., Any])
REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": (
        "Switchyard's error body. OpenAI routes answer OpenAI's envelope "
        '{"error": {"message", "type", "param", "code"}} instead.'
    ),
    "properties": {
        "error": {"type": "string"},
        "error_type": {"type": "string"},
        "field": {"type": "string"},
    },
    "required": ["error", "error_type"],
}


@dataclass(frozen=True)
class Header:
    name: str
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True)
class RouteDoc:
    summary: str
    tags: tuple[str, ...]
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    headers: tuple[Header, ...] = ()
    auth: Auth = "optional"
    success: int = 200
    stream: bool = False
    websocket: bool = False
    description: str = ""


def spec(
    summary: str,
    *,
    tags: tuple[str, ...],
    body: type[BaseModel] | None = None,
    query: type[BaseModel] | None = None,
    headers: tuple[Header, ...] = (),
    auth: Auth = "optional",
    success: int = 200,
    stream: bool = False,
    websocket: bool = False,
    description: str = "",
) -> Callable[[F], F]:
    """Attach the OpenAPI description of a view (put it below the route decorator)."""
    doc = RouteDoc(
        summary=summary,
        tags=tags,
        body=body,
        query=query,
        headers=headers,
        auth=auth,
        success=success,
        stream=stream,
        websocket=websocket,
        description=description,
    )

    def mark(view: F) -> F:
        view.__openapi__ = doc  # type: ignore[attr-defined]
        return view

    return mark


class _Components:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}

    def ref(self, model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template=REF)
        for name, sub in schema.pop("$defs", {}).items():
            self.schemas.setdefault(name, sub)
        self.schemas.setdefault(model.__name__, schema)
        return {"$ref": REF.format(model=model.__name__)}

    def inline(self, model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template=REF)
        for name, sub in schema.pop("$defs", {}).items():
            self.schemas.setdefault(name, sub)
        return schema


def _path(rule: str) -> tuple[str, list[dict[str, Any]]]:
    """Flask's ``/a/<int:b>`` as OpenAPI's ``/a/{b}`` plus its path parameters."""
    params = []
    out = []
    for part in rule.split("/"):
        if part.startswith("<") and part.endswith(">"):
            converter, _, name = part[1:-1].rpartition(":")
            schema: dict[str, Any] = (
                {"type": "integer"} if converter == "int" else {"type": "string"}
            )
            params.append({"name": name, "in": "path", "required": True, "schema": schema})
            out.append("{" + name + "}")
        else:
            out.append(part)
    return "/".join(out), params


def _security(auth: Auth) -> list[dict[str, list[str]]]:
    if auth == "none":
        return []
    if auth == "optional":
        return [{"bearer": []}, {}]
    return [{"bearer": []}]


def _error_responses(auth: Auth) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    responses: dict[str, Any] = {
        "400": {"description": "malformed body (not JSON, not UTF-8)", **error},
        "413": {"description": "body above max_body_bytes", **error},
        "422": {"description": "a field is invalid; 'field' names it", **error},
    }
    if auth != "none":
        responses["401"] = {"description": "missing, invalid, expired or revoked token", **error}
    if auth in ("operator", "admin"):
        responses["403"] = {"description": f"the token's user is not {auth}", **error}
    return responses


def _operation(
    doc: RouteDoc | None, endpoint: str, method: str, comps: _Components
) -> dict[str, Any]:
    if doc is None:
        return {
            "operationId": f"{endpoint}_{method}".replace(".", "_"),
            "summary": endpoint,
            "responses": {"default": {"description": "see the route's documentation"}},
        }
    op: dict[str, Any] = {
        "operationId": f"{endpoint}_{method}".replace(".", "_"),
        "summary": doc.summary,
        "tags": list(doc.tags),
        "security": _security(doc.auth),
    }
    if doc.description:
        op["description"] = doc.description
    parameters: list[dict[str, Any]] = []
    if doc.query is not None:
        schema = comps.inline(doc.query)
        required = set(schema.get("required", []))
        for name, prop in schema.get("properties", {}).items():
            parameters.append(
                {"name": name, "in": "query", "required": name in required, "schema": prop}
            )
    for header in doc.headers:
        parameters.append(
            {
                "name": header.name,
                "in": "header",
                "required": False,
                "description": header.description,
                "schema": header.schema,
            }
        )
    if parameters:
        op["parameters"] = parameters
    if doc.body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": comps.ref(doc.body)}},
        }
    if doc.websocket:
        success: dict[str, Any] = {"description": "switching protocols to a websocket"}
        op["responses"] = {"101": success, **_error_responses(doc.auth)}
        return op
    media = "text/event-stream" if doc.stream else "application/json"
    success = {"description": "success", "content": {media: {}}}
    responses: dict[str, Any] = {str(doc.success): success, **_error_responses(doc.auth)}
    if doc.body is not None:
        responses["429"] = {"description": "a queue or a caller's limit is full; see Retry-After"}
    op["responses"] = responses
    return op


def build_document(app: Flask) -> dict[str, Any]:
    """The OpenAPI document of ``app``'s routes."""
    comps = _Components()
    paths: dict[str, dict[str, Any]] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        if rule.endpoint == "static":
            continue
        view = app.view_functions[rule.endpoint]
        doc: RouteDoc | None = getattr(view, "__openapi__", None)
        path, path_params = _path(rule.rule)
        methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
        for method in methods:
            op = _operation(doc, rule.endpoint, method.lower(), comps)
            if path_params:
                op["parameters"] = path_params + op.get("parameters", [])
            paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Switchyard",
            "version": "1",
            "description": (
                "A farm of LLM inference workers: native jobs, OpenAI- and TGI-compatible "
                "routes, a multiplexed websocket, admin routes."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": comps.schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


@bp.get("/openapi.json")
@spec("This document", tags=("meta",), auth="none")
def openapi_document() -> Response:
    document = current_app.extensions.get("switchyard.openapi")
    if document is None:
        document = build_document(current_app)
        current_app.extensions["switchyard.openapi"] = document
    return jsonify(document)
