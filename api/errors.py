"""The API's exception hierarchy and the one place that turns errors into JSON.

Bodies are ``{"error": <message>, "error_type": <kind>}`` (plus ``field`` when
one input field is to blame); no route ever answers HTML or a stack trace.
The job service's refusals (:mod:`jobs.errors`, which know no HTTP) get their
status code here too (:func:`refusal_error`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from jobs.errors import (
    InvalidRequest,
    JobRefused,
    OverLimit,
    QueueDown,
    TokenRequired,
    UnknownModel,
    Unservable,
)

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error a client should see, with its HTTP status."""

    status = 500
    error_type = "internal_error"

    def __init__(
        self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.message, "error_type": self.error_type}
        if self.field is not None:
            body["field"] = self.field
        return body


class BadRequest(ApiError):
    status = 400
    error_type = "bad_request"


class Unauthorized(ApiError):
    status = 401
    error_type = "unauthorized"

    def __init__(self, message: str = "a valid API token is required") -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="switchyard"'})


class Forbidden(ApiError):
    status = 403
    error_type = "forbidden"


class NotFound(ApiError):
    status = 404
    error_type = "not_found"


class Conflict(ApiError):
    status = 409
    error_type = "conflict"


class UnsupportedMediaType(ApiError):
    status = 415
    error_type = "unsupported_media_type"


class ValidationFailed(ApiError):
    status = 422
    error_type = "validation_error"


class RateLimited(ApiError):
    """429: a limit is full; ``Retry-After`` says when to try again, in seconds."""

    status = 429
    error_type = "rate_limited"

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        super().__init__(message, headers={"Retry-After": str(self.retry_after_s)})


class Unavailable(ApiError):
    status = 503
    error_type = "unavailable"


def refusal_error(refused: JobRefused) -> ApiError:
    """The answer to a refusal of the job service (:mod:`jobs.errors`): the one place
    that gives each its status code."""
    if isinstance(refused, UnknownModel):
        return NotFound(refused.message, field=refused.field)
    if isinstance(refused, TokenRequired):
        return Unauthorized(refused.message)
    if isinstance(refused, InvalidRequest):
        return ValidationFailed(refused.message, field=refused.field)
    if isinstance(refused, OverLimit):
        return RateLimited(refused.message, refused.retry_after_s)
    if isinstance(refused, (Unservable, QueueDown)):
        return Unavailable(refused.message, field=refused.field)
    return ApiError(refused.message, field=refused.field)  # pragma: no cover - a new kind


def error_response(error: ApiError) -> Response:
    response = jsonify(error.body())
    response.status_code = error.status
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def register_error_handlers(app: Flask) -> None:
    """Map every error, ours or Werkzeug's or unexpected, to a JSON body."""

    @app.errorhandler(ApiError)
    def _api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(JobRefused)
    def _refused(error: JobRefused) -> Response:
        return error_response(refusal_error(error))

    @app.errorhandler(HTTPException)
    def _http_error(error: HTTPException) -> Response:
        kind = (error.name or "error").lower().replace(" ", "_")
        response = jsonify({"error": error.description or error.name, "error_type": kind})
        response.status_code = error.code or 500
        if error.code == 405 and error.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(error.valid_methods)  # type: ignore[attr-defined]
        return response

    @app.errorhandler(Exception)
    def _unexpected(error: Exception) -> Response:
        from redis import RedisError
        from sqlalchemy.exc import OperationalError

        if isinstance(error, (RedisError, OperationalError)):
            log.warning("dependency unavailable: %s", type(error).__name__)
            return error_response(Unavailable("a backing service is unavailable; retry shortly"))
        log.exception("unhandled error")
        return error_response(ApiError("internal error"))
