"""Request bodies, validated with pydantic; a bad field is a 422 naming it."""

from __future__ import annotations

import json
import math
from typing import Any, Literal, TypeVar

from flask import request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from api.errors import BadRequest, UnsupportedMediaType, ValidationFailed
from config.sampling import (
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
)


def check_finite(value: float | None) -> float | None:
    """A sampling number must be finite (JSON parsers accept NaN and Infinity)."""
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def check_stop_strings(items: list[str]) -> None:
    """Every front door takes the same stop strings: 1 to MAX_STOP_CHARS characters."""
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")


MAX_DEADLINE_S = 7 * 86400
T = TypeVar("T", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1_000_000)


class SamplingFields(_Body):
    """The sampling fields every front door takes, within config/sampling.py's bounds."""

    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)

    @field_validator("temperature", "top_p", "repetition_penalty")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return check_finite(value)


class GenerationParams(SamplingFields):
    """Sampling parameters; any left out take the model's defaults."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    stop: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    truncate: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: list[str] | None) -> list[str] | None:
        check_stop_strings(value or [])
        return value

    def given(self) -> dict[str, Any]:
        """Only the parameters the client set."""
        return self.model_dump(exclude_none=True, exclude_defaults=True)


class JobRequest(_Body):
    model: str = Field(min_length=1, max_length=64)
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=1000)
    prompt: str | None = Field(default=None, min_length=1, max_length=1_000_000)
    params: GenerationParams = Field(default_factory=GenerationParams)
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Seconds the job may wait in the queue before it expires unstarted.",
    )

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self


def is_json_type(mimetype: str) -> bool:
    """``application/json`` or a ``+json`` type of it (parameters already stripped)."""
    return mimetype == "application/json" or (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    )


def json_body() -> Any:
    """The request's JSON body; 400 when it is not JSON or not UTF-8.

    A body must say it is JSON (``Content-Type: application/json``), else 415:
    a web page can make its visitors' browsers send a ``text/plain`` or form
    body to any site without asking first, but not a JSON one.
    """
    raw = request.get_data(cache=True)
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    if not is_json_type(request.mimetype):
        given = request.mimetype or "none"
        raise UnsupportedMediaType(
            f"the request body must be sent with 'Content-Type: application/json' (got {given})"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    if "\\u0000" in text:  # JSON can only carry a NUL escaped
        reject_nul(data)
    return data


def reject_nul(data: Any, path: tuple[str | int, ...] = ()) -> None:
    """422 naming the first string (or key) of ``data`` that holds a NUL character.

    No text we store or feed a tokenizer has a use for U+0000, and Postgres
    cannot store it in a text column: refuse it up front, naming the field.
    """
    if isinstance(data, str):
        if "\x00" in data:
            field = field_name(path) if path else "(body)"
            raise ValidationFailed(f"{field}: must not contain NUL (U+0000)", field=field)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            reject_nul(item, (*path, i))
    elif isinstance(data, dict):
        for key, value in data.items():
            reject_nul(key, path)
            reject_nul(value, (*path, key))


def parse(schema: type[T], data: Any) -> T:
    """Validate ``data`` against ``schema``; 422 naming the first bad field."""
    if not isinstance(data, dict):
        raise ValidationFailed("the body must be a JSON object", field="(body)")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = field_name(first["loc"])
        raise ValidationFailed(f"{field}: {first['msg']}", field=field) from None


# Names pydantic puts in an error's location for the member of a union that
# failed (``stop.list[str]``): they are types, not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "is-instance"})


def field_name(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a dotted field name (``messages.0.role``)."""
    parts = [
        str(p)
        for p in loc
        if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or p.startswith("function-")))
    ]
    return ".".join(parts) or "(body)"
