"""Text Generation Inference compatible routes: ``/generate``, ``/generate_stream``, ``/info``.

``POST /`` is TGI's compatibility route too (``"stream": true`` streams), which
is what ``huggingface_hub.InferenceClient(model=<url>)`` posts to. Each request
is an ordinary job. The model is the ``X-Model`` header, else the ``model``
query parameter or body field, else the first enabled model of the catalog.

``POST /`` answers a one-element list, as TGI does (what the ``text-generation``
client reads); ``/generate`` answers the object.

Streams are TGI's SSE events: a ``token`` per event, and a last event with
``generated_text`` and ``details`` (``finish_reason``: length, eos_token or
stop_sequence). Workers coalesce tokens into events, so a ``token`` may hold
several tokens' text: its ``id`` is the token id when it holds one token, -1
when it holds several. ``details`` of a non-streamed answer list the generated
``tokens`` (ids as generated, each one's text decoded alone) and, with
``decoder_input_details``, the ``prefill`` (the prompt's ids). Log-probabilities
are not computed by the engine: every ``logprob`` is null, never a made-up
number. A job whose worker is lost continues on the next one, so a stream
carries each token once; when it cannot continue (a ``restart`` event after
text was sent) the stream ends with a generation error rather than repeat text.
A client that goes away, or stops reading for ``ws_send_timeout_s``, has its
job cancelled. Errors are TGI's ``{"error", "error_type"}`` bodies (validation,
overloaded, generation), the same whether streamed or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api import envelopes
from api.auth import optional_principal
from api.errors import NotFound, ValidationFailed
from api.openapi import Header, spec
from api.schemas import (
    GenerationParams,
    JobRequest,
    SamplingFields,
    check_stop_strings,
    json_body,
    parse,
)
from api.services import services
from api.streams import sse_response
from api.submission import (
    IDEMPOTENCY_HEADER,
    JobFailed,
    final_event,
    follow_job,
    idempotency_key_header,
    restart_error,
    submit_job,
)
from config.sampling import MAX_STOP_STRINGS
from db.overrides import ModelOverrides, apply
from db.schema import Job
from jobs.events import StreamedOutput, usage_of

bp = Blueprint("tgi", __name__)
envelopes.register(bp, envelopes.tgi_body)

MODEL_HEADER = Header("X-Model", "The model to use (default: the first enabled model).")


class TGIParameters(SamplingFields):
    """TGI's ``parameters``; the ones a transformers engine cannot honour only at their
    neutral value (null, false, 1)."""

    max_new_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    stop: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    do_sample: bool | None = None
    details: bool | None = None
    return_full_text: bool | None = None
    truncate: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Any value truncates to the model's limit."
    )
    decoder_input_details: bool | None = None
    watermark: bool | None = Field(default=None, description="Only false is supported.")
    best_of: int | None = Field(default=None, description="Only 1 is supported.")
    typical_p: float | None = Field(default=None, description="Not supported.")
    frequency_penalty: float | None = Field(default=None, description="Only 0 is supported.")
    top_n_tokens: int | None = Field(default=None, description="Not supported.")
    adapter_id: str | None = Field(default=None, max_length=0, description="Not supported.")
    grammar: None = Field(default=None, description="Not supported.")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: list[str] | None) -> list[str] | None:
        check_stop_strings(value or [])
        return value

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("watermarking is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("typical_p", "top_n_tokens")
    @classmethod
    def _unsupported(cls, value: float | None) -> float | None:
        if value is not None and value != 0 and value != 1:
            raise ValueError("not supported")
        return value

    @field_validator("frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 0):
            raise ValueError("only 0 is supported")
        return value

    def generation_params(self) -> GenerationParams:
        # TGI samples only when asked to (do_sample or a sampling knob); else greedy.
        sampling = bool(self.do_sample) or any(
            v is not None for v in (self.temperature, self.top_p, self.top_k)
        )
        temperature = self.temperature if sampling else 0.0
        if sampling and temperature is None:
            temperature = 1.0
        return GenerationParams(
            max_new_tokens=self.max_new_tokens,
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop or None,
            seed=self.seed,
            truncate=self.truncate is not None,
        )


class GenerateRequest(BaseModel):
    """Body of ``/generate``, ``/generate_stream`` and ``/``."""

    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1, max_length=1_000_000)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False
    model: str | None = Field(
        default=None, min_length=1, max_length=64, description="Switchyard: the model."
    )


def _default_model() -> str:
    svc = services()
    overrides = ModelOverrides(svc.db).all()
    for definition in svc.catalog:
        if apply(definition, overrides.get(definition.name)).enabled:
            return definition.name
    raise NotFound("no model is served here", field="model")


def _model_name(body_model: str | None = None) -> str:
    chosen = request.headers.get("X-Model") or request.args.get("model") or body_model
    return chosen or _default_model()


def _submit(body: GenerateRequest) -> Job:
    req = JobRequest(
        model=_model_name(body.model),
        prompt=body.inputs,
        params=body.parameters.generation_params(),
    )
    try:
        submitted = submit_job(req, optional_principal(), idempotency_key=idempotency_key_header())
    except ValidationFailed as exc:
        if exc.field == "params.max_new_tokens":
            name = "parameters.max_new_tokens"
            raise ValidationFailed(
                exc.message.replace("params.max_new_tokens", name), field=name
            ) from None
        raise
    return submitted.job


def _details(body: GenerateRequest, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "finish_reason": fields.get("finish_reason"),
        "generated_tokens": usage_of(fields)["completion_tokens"],
        "seed": body.parameters.seed,
    }


def _token_details(job: Job, body: GenerateRequest) -> dict[str, Any]:
    """``prefill`` and ``tokens`` of a finished job: ids from its stream, texts decoded alone.

    Empty when the stream's history is gone; texts empty when the API has no
    tokenizer for the model (see ``api/tokenizer.py``).
    """
    from api.tokenizer import TokenizerMissing, tokenizers

    history = services().events.history(job.id)
    output = StreamedOutput.of(history)
    ids = list(output.ids) if output.whole else []
    try:
        tokenizer: Any = tokenizers().get(services().job_service.served_model(job.model))
    except TokenizerMissing:
        tokenizer = None

    def text(token_id: int) -> str:
        if tokenizer is None:
            return ""
        return str(tokenizer.tokenizer.decode([token_id], skip_special_tokens=False))

    prefill: list[dict[str, Any]] = []
    if body.parameters.decoder_input_details and tokenizer is not None:
        prompt_ids = tokenizer.encode_prompt(body.inputs)
        prefill = [{"id": i, "text": text(i), "logprob": None} for i in prompt_ids]
    tokens = [{"id": i, "text": text(i), "logprob": None, "special": False} for i in ids]
    return {"prefill": prefill, "tokens": tokens}


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(job: Job, body: GenerateRequest) -> Iterator[str]:
    keepalive = services().settings.stream_keepalive_s
    index = 0
    ended = False
    prefix = body.inputs if body.parameters.return_full_text else ""
    sent = False
    try:
        for event in follow_job(job, idle_s=keepalive):
            if event is None:
                yield ": keep-alive\n\n"
                continue
            if event.type == "restart" and sent:
                # Text cannot be taken back: end here rather than send it twice.
                yield _data(envelopes.tgi_body(JobFailed(restart_error(event.fields))))
                break
            if event.type == "token" and event.text:
                index += 1
                sent = True
                ids = event.fields.get("ids")
                token_id = ids[0] if isinstance(ids, list) and len(ids) == 1 else -1
                yield _data(
                    {
                        "index": index,
                        "token": {
                            "id": token_id,
                            "text": event.text,
                            "logprob": None,
                            "special": False,
                        },
                        "generated_text": None,
                        "details": None,
                        "top_tokens": None,
                    }
                )
            elif event.type == "done":
                index += 1
                ended = True
                yield _data(
                    {
                        "index": index,
                        "token": {"id": -1, "text": "", "logprob": None, "special": True},
                        "generated_text": prefix + event.text,
                        "details": _details(body, event.fields),
                        "top_tokens": None,
                    }
                )
            elif event.type == "error":
                ended = True
                error = str(event.fields.get("error") or "error")
                # The same body as the non-streaming answer to this failure.
                yield _data(envelopes.tgi_body(JobFailed(error)))
    finally:
        if not ended:  # the client went away or stopped reading: free the job's batch slot
            services().job_service.cancel(job.id)


def _stream_response(job: Job, body: GenerateRequest) -> Response:
    timeout_s = services().settings.ws_send_timeout_s
    return sse_response(_stream(job, body), timeout_s, headers={"X-Job-Id": job.id})


def _generate(body: GenerateRequest, *, as_list: bool = False) -> Response:
    job = _submit(body)
    done = final_event(job, idle_s=services().settings.stream_keepalive_s)
    prefix = body.inputs if body.parameters.return_full_text else ""
    payload: dict[str, Any] = {"generated_text": prefix + done.text}
    if body.parameters.details:
        payload["details"] = {**_details(body, done.fields), **_token_details(job, body)}
    response = jsonify([payload] if as_list else payload)
    response.headers["X-Job-Id"] = job.id
    return response


@bp.post("/generate")
@spec(
    "TGI generate",
    tags=("tgi",),
    body=GenerateRequest,
    headers=(MODEL_HEADER, IDEMPOTENCY_HEADER),
)
def generate() -> Response:
    body = parse(GenerateRequest, json_body())
    return _generate(body)


@bp.post("/generate_stream")
@spec(
    "TGI generate, streamed as server-sent events",
    tags=("tgi",),
    body=GenerateRequest,
    headers=(MODEL_HEADER, IDEMPOTENCY_HEADER),
    stream=True,
)
def generate_stream() -> Response:
    body = parse(GenerateRequest, json_body())
    return _stream_response(_submit(body), body)


@bp.post("/")
@spec(
    'TGI compatibility route: generate, or stream with "stream": true',
    tags=("tgi",),
    body=GenerateRequest,
    headers=(MODEL_HEADER, IDEMPOTENCY_HEADER),
)
def compat_generate() -> Response:
    body = parse(GenerateRequest, json_body())
    if body.stream:
        return _stream_response(_submit(body), body)
    return _generate(body, as_list=True)


@bp.get("/info")
@spec("TGI model info", tags=("tgi",), headers=(MODEL_HEADER,))
def info() -> Response:
    job_service = services().job_service
    definition = job_service.served_model(_model_name())
    job_service.authorize_model(definition, optional_principal())
    limits = definition.limits
    return jsonify(
        {
            "model_id": definition.name,
            "model_sha": None,
            "model_dtype": definition.dtype,
            "model_device_type": definition.device,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": limits.max_batch_size,
            "max_best_of": 1,
            "max_stop_sequences": MAX_STOP_STRINGS,
            "max_input_tokens": limits.max_input_tokens,
            "max_input_length": limits.max_input_tokens,
            "max_total_tokens": limits.max_input_tokens + limits.max_new_tokens,
            "max_client_batch_size": 1,
            "validation_workers": 1,
            "router": "switchyard",
            "version": "switchyard",
            "sha": None,
            "docker_label": None,
        }
    )
