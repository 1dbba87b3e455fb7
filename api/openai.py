"""OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each request is an ordinary job (:func:`api.submission.submit_job`): a row, a Celery
message, a Redis stream. A streaming answer relays the job's events as
``chat.completion.chunk`` / ``text_completion`` chunks, ends with
``data: [DONE]``, and adds a usage chunk when ``stream_options.include_usage``.
A job whose worker is lost continues on the next one from the tokens already
sent, so the stream carries one copy of each token (``resumed`` events are not
relayed); when it cannot continue (a ``restart`` event after text was sent),
the stream ends with an error chunk rather than send the answer again.
If the client goes away mid-stream its job is cancelled (noticed on the next
write: a token, or a keep-alive comment every ``stream_keepalive_s``), and so
is the job of a client that stops reading: a write it does not take within
``ws_send_timeout_s`` closes the connection.
Errors use OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

Parameters: model, messages / prompt, max_tokens (max_completion_tokens wins),
temperature, top_p, stop, seed, n (1 only), stream, stream_options, user, and
the extras top_k and repetition_penalty. Parameters OpenAI has but a
transformers engine cannot honour (logprobs, penalties, logit_bias, tools) are
accepted only at their neutral value; anything else is a 422 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api import envelopes
from api.auth import optional_principal
from api.errors import ValidationFailed
from api.openapi import spec
from api.schemas import (
    GenerationParams,
    JobRequest,
    Message,
    SamplingFields,
    check_stop_strings,
    json_body,
    parse,
)
from api.services import services
from api.streams import sse_response
from api.submission import (
    IDEMPOTENCY_HEADER,
    final_event,
    follow_job,
    idempotency_key_header,
    restart_error,
    submit_job,
)
from config.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, OPENAI_MAX_TEMPERATURE
from db.schema import Job
from jobs.events import usage_of
from jobs.service import Submitted

bp = Blueprint("openai", __name__)
envelopes.register(bp, envelopes.openai_body)

FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
MAX_TEXT = 1_000_000


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


class ChatMessage(BaseModel):
    """One message; ``developer`` is read as ``system``, text parts are joined."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: (
        Annotated[str, Field(max_length=MAX_TEXT)]
        | Annotated[list[TextPart], Field(min_length=1, max_length=100)]
    )
    name: str | None = Field(default=None, max_length=64)

    def as_message(self) -> Message:
        text = (
            self.content
            if isinstance(self.content, str)
            else "\n".join(p.text for p in self.content)
        )
        role = "system" if self.role == "developer" else self.role
        return Message(role=role, content=text)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class _Common(SamplingFields):
    model: str = Field(min_length=1, max_length=64)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=OPENAI_MAX_TEMPERATURE)
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_STRINGS),
        ]
        | None
    ) = None
    n: int | None = Field(default=1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = Field(default=None, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(default=None, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(
        default=None, max_length=0, description="Only empty is supported."
    )
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, value: float | None) -> float | None:
        if value not in (None, 0):
            raise ValueError("only 0 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        check_stop_strings(items)
        return value

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_new_tokens: int | None) -> GenerationParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return GenerationParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=stop or None,
            seed=self.seed,
        )


class ChatCompletionRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool | None = Field(default=None, description="Only false is supported.")
    response_format: ResponseFormat | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("log probabilities are not supported")
        return value

    def max_new_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def job_request(self) -> JobRequest:
        return JobRequest(
            model=self.model,
            messages=[m.as_message() for m in self.messages],
            params=self._params(self.max_completion_tokens or self.max_tokens),
        )


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``: one prompt (a string or a list of one string)."""

    prompt: (
        Annotated[str, Field(max_length=MAX_TEXT)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_TEXT)]], Field(min_length=1, max_length=1)
        ]
    )
    echo: bool | None = Field(default=None, description="Only false is supported.")
    logprobs: int | None = Field(default=None, description="Only null is supported.")
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    suffix: str | None = Field(default=None, max_length=0, description="Not supported.")

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: give one prompt (a string or a list of one string)")
        if not self.prompt_text():
            raise ValueError("prompt: must not be empty")
        if self.echo:
            raise ValueError("echo: not supported")
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def max_new_tokens_field(self) -> str:
        return "max_tokens"

    def job_request(self) -> JobRequest:
        return JobRequest(
            model=self.model, prompt=self.prompt_text(), params=self._params(self.max_tokens)
        )


def _submit(body: ChatCompletionRequest | CompletionRequest) -> Submitted:
    principal = optional_principal()
    try:
        return submit_job(body.job_request(), principal, idempotency_key=idempotency_key_header())
    except ValidationFailed as exc:
        if exc.field == "params.max_new_tokens":  # name the field the client sent
            name = body.max_new_tokens_field()
            raise ValidationFailed(
                exc.message.replace("params.max_new_tokens", name), field=name
            ) from None
        raise


def _finish_reason(fields: dict[str, Any]) -> str:
    reason = str(fields.get("finish_reason") or "stop")
    return FINISH_REASONS.get(reason, reason)


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class _Answer:
    """The envelope of one answer's bodies: the whole answer or its streamed chunks."""

    completion_id: str
    object: str
    job: Job
    include_usage: bool = False
    choice: Callable[[str | None, str | None], dict[str, Any]] | None = None
    """A streamed chunk's choice from its text and finish reason."""

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": self.object,
            "created": int(self.job.created_at.timestamp()),
            "model": self.job.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        """An SSE chunk; it carries ``usage`` (null but on the last) when the client asked."""
        return _data(self.body(choices, **({"usage": usage} if self.include_usage else {})))

    def __call__(
        self, text: str | None, finish: str | None, usage: dict[str, int] | None = None
    ) -> str:
        """A chunk of ``text`` (and ``finish``), or with ``usage`` the usage-only last chunk."""
        assert self.choice is not None
        return self.chunk([] if usage is not None else [self.choice(text, finish)], usage)


def _chat_choice(text: str | None, finish: str | None) -> dict[str, Any]:
    delta = {"content": text} if text else {}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text_choice(text: str | None, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def _error_chunk(message: str) -> str:
    return _data(
        {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "generation_error",
            }
        }
    )


def _stream(
    job: Job,
    body: ChatCompletionRequest | CompletionRequest,
    chunk: _Answer,
    first: str | None,
) -> Iterator[str]:
    """The SSE body of a streaming answer; cancels the job if the client leaves early."""
    keepalive = services().settings.stream_keepalive_s
    include_usage = body.include_usage()
    ended = False
    sent = False
    try:
        if first is not None:
            yield first
        for event in follow_job(job, idle_s=keepalive):
            if event is None:
                yield ": keep-alive\n\n"
            elif event.type == "token" and event.text:
                sent = True
                yield chunk(event.text, None)
            elif event.type == "restart" and sent:
                # Text cannot be taken back: end here rather than send it twice.
                yield _error_chunk(restart_error(event.fields))
                break
            elif event.type == "done":
                yield chunk("", _finish_reason(event.fields))
                if include_usage:
                    yield chunk(None, None, usage=usage_of(event.fields))
                ended = True
            elif event.type == "error":
                yield _error_chunk(str(event.fields.get("error") or "error"))
                ended = True
        yield "data: [DONE]\n\n"
    finally:
        # The client went away, stopped reading (a write timed out) or the server is
        # stopping: free the job's slot.
        if not ended:
            services().job_service.cancel(job.id)


def _sse(stream: Iterator[str], job: Job) -> Response:
    timeout_s = services().settings.ws_send_timeout_s
    return sse_response(stream, timeout_s, headers={"X-Job-Id": job.id})


@bp.post("/v1/chat/completions")
@spec(
    "OpenAI chat completion (streaming with stream=true)",
    tags=("openai",),
    body=ChatCompletionRequest,
    headers=(IDEMPOTENCY_HEADER,),
)
def chat_completions() -> Response:
    body = parse(ChatCompletionRequest, json_body())
    job = _submit(body).job
    completion_id = f"chatcmpl-{job.id}"

    if body.stream:
        chunk = _Answer(
            completion_id, "chat.completion.chunk", job, body.include_usage(), _chat_choice
        )
        role = {"role": "assistant", "content": ""}
        first = chunk.chunk([{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}])
        return _sse(_stream(job, body, chunk, first), job)

    done = final_event(job, idle_s=services().settings.stream_keepalive_s)
    response = jsonify(
        _Answer(completion_id, "chat.completion", job).body(
            [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done.text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": _finish_reason(done.fields),
                }
            ],
            usage=usage_of(done.fields),
        )
    )
    response.headers["X-Job-Id"] = job.id
    return response


@bp.post("/v1/completions")
@spec(
    "OpenAI text completion (streaming with stream=true)",
    tags=("openai",),
    body=CompletionRequest,
    headers=(IDEMPOTENCY_HEADER,),
)
def completions() -> Response:
    body = parse(CompletionRequest, json_body())
    job = _submit(body).job
    answer = _Answer(f"cmpl-{job.id}", "text_completion", job, body.include_usage(), _text_choice)

    if body.stream:
        return _sse(_stream(job, body, answer, None), job)

    done = final_event(job, idle_s=services().settings.stream_keepalive_s)
    response = jsonify(
        answer.body(
            [_text_choice(done.text, _finish_reason(done.fields))], usage=usage_of(done.fields)
        )
    )
    response.headers["X-Job-Id"] = job.id
    return response
