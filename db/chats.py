"""Chats: conversations kept server-side, one owner each, turns linked to their jobs.

A user turn holds its text. An assistant turn names the job that produced it;
its text is the job's output, copied into the turn once the job is final (so
the conversation survives the job row being pruned). Every read and write
takes the owner's user id, and a chat of someone else reads as missing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select

from db.jobs import JobStore
from db.schema import Chat, ChatMessage, Job, JobStatus, utcnow
from db.session import Database

# Longest title derived from a chat's first message, in characters.
AUTO_TITLE_CHARS = 60
FINAL_STATUSES = frozenset(
    {JobStatus.succeeded.value, JobStatus.failed.value, JobStatus.cancelled.value}
)


@dataclass(frozen=True)
class ChatTurn:
    """One message of a chat, with the state of its job when it has one.

    ``queue_position`` counts the queued jobs of the same model ahead of this
    one (0: next to be taken), as the ``queued`` frames of ``/v1/ws`` do; it
    is set only while the job is queued.
    """

    id: int
    chat_id: str
    role: str
    content: str
    job_id: str | None
    job_status: str | None
    finish_reason: str | None
    error: str | None
    queue_position: int | None
    created_at: datetime


class ChatStore:
    """Chat and chat-message records through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.jobs = JobStore(db)

    def for_user(self, user_id: int) -> list[Chat]:
        """The user's chats, most recently active first."""
        with self.db.session() as s:
            rows = s.execute(
                select(Chat)
                .where(Chat.user_id == user_id)
                .order_by(Chat.updated_at.desc(), Chat.created_at.desc())
            )
            return list(rows.scalars())

    def create(
        self,
        user_id: int,
        *,
        title: str = "",
        model: str | None = None,
        system_prompt: str = "",
        params: dict[str, Any] | None = None,
    ) -> Chat:
        now = utcnow()
        chat = Chat(
            id=str(uuid.uuid4()),
            user_id=user_id,
            title=title,
            model=model,
            system_prompt=system_prompt,
            params=params or {},
            created_at=now,
            updated_at=now,
        )
        with self.db.session() as s:
            s.add(chat)
        return chat

    def get(self, chat_id: str, user_id: int) -> Chat | None:
        """The chat if it exists and belongs to ``user_id``; else None."""
        with self.db.session() as s:
            chat = s.get(Chat, chat_id)
            if chat is None or chat.user_id != user_id:
                return None
            return chat

    def update(self, chat_id: str, user_id: int, changes: dict[str, Any]) -> Chat | None:
        """Set the given fields (title, model, system_prompt, params); None if not the user's."""
        allowed = {"title", "model", "system_prompt", "params"}
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)}")
        with self.db.session() as s:
            chat = s.get(Chat, chat_id)
            if chat is None or chat.user_id != user_id:
                return None
            for name, value in changes.items():
                setattr(chat, name, value)
            chat.updated_at = utcnow()
            return chat

    def delete(self, chat_id: str, user_id: int) -> bool:
        """Remove the chat and its messages (its jobs stay); False if not the user's."""
        with self.db.session() as s:
            chat = s.get(Chat, chat_id)
            if chat is None or chat.user_id != user_id:
                return False
            # Delete the turns explicitly: SQLite enforces ON DELETE CASCADE only
            # when its foreign-key pragma is on, and the ORM need not rely on it.
            s.execute(delete(ChatMessage).where(ChatMessage.chat_id == chat_id))
            s.delete(chat)
            return True

    def add_message(
        self, chat: Chat, *, role: str, content: str = "", job_id: str | None = None
    ) -> ChatTurn:
        """Append a turn to ``chat`` (already checked to be the caller's).

        The first user turn of an untitled chat becomes its title.
        """
        now = utcnow()
        with self.db.session() as s:
            message = ChatMessage(
                chat_id=chat.id, role=role, content=content, job_id=job_id, created_at=now
            )
            s.add(message)
            record = s.get(Chat, chat.id)
            if record is not None:
                record.updated_at = now
                if not record.title and role == "user" and content.strip():
                    record.title = _title_from(content)
            s.flush()
            return self._turn(message, s.get(Job, job_id) if job_id else None)

    def messages(self, chat_id: str) -> list[ChatTurn]:
        """Every turn of a chat in order, settling finished jobs' text into their turns."""
        with self.db.session() as s:
            rows = s.execute(
                select(ChatMessage, Job)
                .outerjoin(Job, Job.id == ChatMessage.job_id)
                .where(ChatMessage.chat_id == chat_id)
                .order_by(ChatMessage.id)
            ).all()
            return [self._turn(message, job) for message, job in rows]

    def message(self, chat_id: str, message_id: int) -> ChatTurn | None:
        with self.db.session() as s:
            message = s.get(ChatMessage, message_id)
            if message is None or message.chat_id != chat_id:
                return None
            return self._turn(message, s.get(Job, message.job_id) if message.job_id else None)

    def _turn(self, message: ChatMessage, job: Job | None) -> ChatTurn:
        position = None
        if job is not None:
            if job.status in FINAL_STATUSES and not message.content and job.output_text:
                message.content = job.output_text
            if job.status == JobStatus.queued.value:
                position = self.jobs.queue_position(job)
        return ChatTurn(
            id=message.id,
            chat_id=message.chat_id,
            role=message.role,
            content=message.content if message.content or job is None else job.output_text or "",
            job_id=message.job_id,
            job_status=job.status if job is not None else None,
            finish_reason=job.finish_reason if job is not None else None,
            error=job.error if job is not None else None,
            queue_position=position,
            created_at=message.created_at,
        )


def _title_from(content: str) -> str:
    line = " ".join(content.split())
    if len(line) <= AUTO_TITLE_CHARS:
        return line
    return line[: AUTO_TITLE_CHARS - 1].rstrip() + "…"
