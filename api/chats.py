"""The chat resource: conversations kept server-side per user.

Routes (every one needs a token; another user's chat is a 404, never a 403):

- ``GET /v1/chats``                         the caller's chats, most recent first
- ``POST /v1/chats``                        create (title, model, system_prompt, params)
- ``GET /v1/chats/<id>``                    one chat with its messages
- ``PATCH /v1/chats/<id>``                  rename, change model / system prompt / params
- ``DELETE /v1/chats/<id>``                 delete the chat and its messages (jobs stay)
- ``POST /v1/chats/<id>/messages``          append a turn: ``{"role": "user", "content"}``
  or ``{"role": "assistant", "job_id"}`` for the job that answers
- ``GET /v1/chats/<id>/messages/<mid>``     one turn with its job's state and queue position

The chat store records; it does not generate. Clients submit the job (``POST
/v1/jobs`` or a ``generate`` frame on ``/v1/ws``) and link its id here, so every
front door streams the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import require_principal
from api.disclosure import public_error
from api.errors import NotFound, ValidationFailed
from api.openapi import spec
from api.schemas import GenerationParams, json_body, parse
from api.services import services
from db.chats import ChatStore, ChatTurn
from db.schema import Chat

bp = Blueprint("chats", __name__)

MAX_TITLE_CHARS = 200
MAX_SYSTEM_PROMPT_CHARS = 100_000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatFields(_Body):
    """What a client may set on a chat; on PATCH only the fields sent change."""

    title: str | None = Field(default=None, max_length=MAX_TITLE_CHARS)
    model: str | None = Field(default=None, min_length=1, max_length=64)
    system_prompt: str | None = Field(default=None, max_length=MAX_SYSTEM_PROMPT_CHARS)
    params: GenerationParams | None = None


class MessageBody(_Body):
    role: Literal["user", "assistant"]
    content: str | None = Field(default=None, max_length=1_000_000)
    job_id: str | None = Field(default=None, min_length=1, max_length=36)

    @model_validator(mode="after")
    def _shape(self) -> MessageBody:
        if self.role == "user" and (self.content is None or self.job_id is not None):
            raise ValueError("a user message has 'content' and no 'job_id'")
        if self.role == "assistant" and self.job_id is None:
            raise ValueError("an assistant message names the 'job_id' that answers")
        return self


def _store() -> ChatStore:
    return ChatStore(services().db)


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def chat_view(chat: Chat) -> dict[str, Any]:
    """The public JSON shape of a chat, without its messages."""
    return {
        "id": chat.id,
        "title": chat.title,
        "model": chat.model,
        "system_prompt": chat.system_prompt,
        "params": chat.params,
        "created_at": _iso(chat.created_at),
        "updated_at": _iso(chat.updated_at),
    }


def turn_view(turn: ChatTurn) -> dict[str, Any]:
    """The public JSON shape of a chat message."""
    view: dict[str, Any] = {
        "id": turn.id,
        "role": turn.role,
        "content": turn.content,
        "job_id": turn.job_id,
        "created_at": _iso(turn.created_at),
    }
    if turn.job_id is not None:
        view["job"] = {
            "status": turn.job_status,
            "finish_reason": turn.finish_reason,
            "error": public_error(turn.error),  # chats are users' own: no operator view
            "queue_position": turn.queue_position,
        }
    return view


def _own_chat(chat_id: str, user_id: int) -> Chat:
    chat = _store().get(chat_id, user_id)
    if chat is None:
        raise NotFound(f"no chat {chat_id!r}")
    return chat


def _changes(fields: ChatFields) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for name in fields.model_fields_set:
        value = getattr(fields, name)
        if name == "params":
            value = value.given() if value is not None else {}
        elif name in ("title", "system_prompt") and value is None:
            value = ""
        changes[name] = value
    model = changes.get("model")
    if model is not None:
        # The job path's check: the YAML with run-time overrides.
        services().job_service.served_model(model)
    return changes


@bp.get("/v1/chats")
@spec("The caller's chats, most recent first", tags=("chats",), auth="required")
def list_chats() -> Response:
    principal = require_principal()
    return jsonify({"data": [chat_view(c) for c in _store().for_user(principal.user_id)]})


@bp.post("/v1/chats")
@spec("Create a chat", tags=("chats",), body=ChatFields, auth="required", success=201)
def create_chat() -> tuple[Response, int]:
    principal = require_principal()
    raw = json_body()
    changes = _changes(parse(ChatFields, raw))
    chat = _store().create(principal.user_id, **changes)
    response = jsonify({**chat_view(chat), "messages": []})
    response.headers["Location"] = f"/v1/chats/{chat.id}"
    return response, 201


@bp.get("/v1/chats/<chat_id>")
@spec("A chat with its messages", tags=("chats",), auth="required")
def get_chat(chat_id: str) -> Response:
    principal = require_principal()
    chat = _own_chat(chat_id, principal.user_id)
    turns = _store().messages(chat.id)
    return jsonify({**chat_view(chat), "messages": [turn_view(t) for t in turns]})


@bp.patch("/v1/chats/<chat_id>")
@spec(
    "Rename a chat or change its model, system prompt or params",
    tags=("chats",),
    body=ChatFields,
    auth="required",
)
def update_chat(chat_id: str) -> Response:
    principal = require_principal()
    _own_chat(chat_id, principal.user_id)
    changes = _changes(parse(ChatFields, json_body()))
    chat = _store().update(chat_id, principal.user_id, changes)
    if chat is None:  # deleted meanwhile
        raise NotFound(f"no chat {chat_id!r}")
    return jsonify(chat_view(chat))


@bp.delete("/v1/chats/<chat_id>")
@spec("Delete a chat and its messages", tags=("chats",), auth="required", success=204)
def delete_chat(chat_id: str) -> tuple[str, int]:
    principal = require_principal()
    if not _store().delete(chat_id, principal.user_id):
        raise NotFound(f"no chat {chat_id!r}")
    return "", 204


@bp.post("/v1/chats/<chat_id>/messages")
@spec(
    "Append a turn: a user message, or the job that answers",
    tags=("chats",),
    body=MessageBody,
    auth="required",
    success=201,
)
def add_message(chat_id: str) -> tuple[Response, int]:
    principal = require_principal()
    chat = _own_chat(chat_id, principal.user_id)
    body = parse(MessageBody, json_body())
    if body.job_id is not None:
        job = services().jobs.get(body.job_id)
        # Only the caller's own jobs: a chat must not expose another user's output.
        if job is None or job.user_id != principal.user_id:
            raise ValidationFailed(f"job_id: no job {body.job_id!r} of yours", field="job_id")
    turn = _store().add_message(
        chat, role=body.role, content=body.content or "", job_id=body.job_id
    )
    return jsonify(turn_view(turn)), 201


@bp.get("/v1/chats/<chat_id>/messages/<int:message_id>")
@spec("One turn with its job's state and queue position", tags=("chats",), auth="required")
def get_message(chat_id: str, message_id: int) -> Response:
    principal = require_principal()
    chat = _own_chat(chat_id, principal.user_id)
    turn = _store().message(chat.id, message_id)
    if turn is None:
        raise NotFound(f"no message {message_id} in chat {chat_id!r}")
    return jsonify(turn_view(turn))
