"""Error bodies of the compatible front doors: OpenAI's envelope and TGI's shape.

Each blueprint registers :func:`register` with its own body builder; every
error raised under it (ours, Werkzeug's, unexpected) is first normalised to an
:class:`ApiError` here, so status codes are decided in one way for all doors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, jsonify
from werkzeug.exceptions import HTTPException

from api.errors import ApiError, Unavailable, refusal_error
from jobs.errors import JobRefused

log = logging.getLogger(__name__)

BodyBuilder = Callable[[ApiError], dict[str, Any]]


def as_api_error(error: Exception) -> ApiError:
    """Any exception as the :class:`ApiError` a client should see."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, JobRefused):
        return refusal_error(error)
    if isinstance(error, HTTPException):
        kind = (error.name or "error").lower().replace(" ", "_")
        api_error = ApiError(error.description or error.name or "error")
        api_error.status = error.code or 500
        api_error.error_type = kind
        return api_error
    from redis import RedisError
    from sqlalchemy.exc import OperationalError

    if isinstance(error, (RedisError, OperationalError)):
        log.warning("dependency unavailable: %s", type(error).__name__)
        return Unavailable("a backing service is unavailable; retry shortly")
    log.exception("unhandled error", exc_info=error)
    return ApiError("internal error")


def register(bp: Blueprint, build: BodyBuilder) -> None:
    """Answer every error of ``bp``'s routes with ``build``'s body."""

    def handle(error: Exception) -> Response:
        api_error = as_api_error(error)
        response = jsonify(build(api_error))
        response.status_code = api_error.status
        for name, value in api_error.headers.items():
            response.headers[name] = value
        return response

    bp.register_error_handler(Exception, handle)


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def openai_body(error: ApiError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers."""
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPES.get(error.status, "server_error"),
            "param": error.field,
            "code": error.error_type,
        }
    }


_TGI_TYPES = {429: "overloaded", 503: "overloaded", 400: "validation", 413: "validation"}
# TGI's router names a failed generation "generation" (its InferError::GenerationError).
_TGI_KINDS = {"generation_error": "generation"}


def tgi_body(error: ApiError) -> dict[str, Any]:
    """``{"error", "error_type"}`` with TGI's kinds (validation, overloaded, generation)."""
    kind = _TGI_TYPES.get(error.status, _TGI_KINDS.get(error.error_type, error.error_type))
    if error.status == 422:
        kind = "validation"
    body: dict[str, Any] = {"error": error.message, "error_type": kind}
    if error.field is not None:
        body["field"] = error.field
    return body
