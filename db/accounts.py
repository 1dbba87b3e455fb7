"""Users and API tokens. A token is shown once; only its SHA-256 is stored.

Tokens are 256 random bits, so a fast hash is the right one: there is nothing
to brute-force, and lookups by hash compare no secret byte by byte.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from db.schema import ApiToken, Role, User, utcnow
from db.session import Database

TOKEN_PREFIX = "sy_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for."""

    user_id: int
    user_name: str
    role: str
    token_id: int

    @property
    def sees_all_jobs(self) -> bool:
        return self.role in (Role.admin.value, Role.operator.value)


@dataclass(frozen=True)
class IssuedToken:
    """A freshly created token: ``secret`` is shown once and never stored."""

    token_id: int
    secret: str
    user_name: str


class Accounts:
    """User and token records through one :class:`Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def has_users(self) -> bool:
        with self.db.session() as s:
            return s.execute(select(User.id).limit(1)).first() is not None

    def add_user(self, name: str, role: Role = Role.user) -> int:
        with self.db.session() as s:
            user = User(name=name, role=role.value, created_at=utcnow())
            s.add(user)
            s.flush()
            return user.id

    def user_id(self, name: str) -> int | None:
        with self.db.session() as s:
            return s.execute(select(User.id).where(User.name == name)).scalar_one_or_none()

    def issue_token(
        self, user_name: str, *, name: str = "", expires_at: datetime | None = None
    ) -> IssuedToken:
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self.db.session() as s:
            user = s.execute(select(User).where(User.name == user_name)).scalar_one()
            token = ApiToken(
                user_id=user.id,
                name=name,
                token_hash=hash_token(secret),
                prefix=secret[:10],
                created_at=utcnow(),
                expires_at=expires_at,
            )
            s.add(token)
            s.flush()
            return IssuedToken(token_id=token.id, secret=secret, user_name=user.name)

    def revoke(self, token_id: int) -> bool:
        with self.db.session() as s:
            result = s.execute(
                update(ApiToken)
                .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def authenticate(self, secret: str) -> Principal | None:
        """The principal of a valid, unrevoked, unexpired token; else None."""
        digest = hash_token(secret)
        now = utcnow()
        with self.db.session() as s:
            row = s.execute(
                select(ApiToken, User)
                .join(User, User.id == ApiToken.user_id)
                .where(ApiToken.token_hash == digest)
            ).first()
            if row is None:
                return None
            token, user = row
            if not hmac.compare_digest(token.token_hash, digest):
                return None
            if token.revoked_at is not None or (
                token.expires_at is not None and token.expires_at <= now
            ):
                return None
            token.last_used_at = now
            return Principal(
                user_id=user.id, user_name=user.name, role=user.role, token_id=token.id
            )
