"""Users and API tokens. A token is shown once; only its SHA-256 is stored.

Tokens are 256 random bits, so a fast hash is the right one: there is nothing
to brute-force, and lookups by hash compare no secret byte by byte.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from db.lookups import RowCache
from db.schema import ApiToken, Role, User, utcnow
from db.session import Database

TOKEN_PREFIX = "sy_"
# Valid tokens an API process keeps in its lookup cache at most.
MAX_CACHED_TOKENS = 10_000


class AccountError(ValueError):
    """A user or token operation that cannot be done as asked."""


class UnknownUser(AccountError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no user {name!r}")
        self.name = name


class DuplicateUser(AccountError):
    def __init__(self, name: str) -> None:
        super().__init__(f"user {name!r} exists")
        self.name = name


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for, with the user's own limits (None: the role's)."""

    user_id: int
    user_name: str
    role: str
    token_id: int
    max_concurrent_jobs: int | None = None
    requests_per_minute: int | None = None
    expires_at: datetime | None = None

    @property
    def sees_all_jobs(self) -> bool:
        return self.role in (Role.admin.value, Role.operator.value)

    @property
    def is_admin(self) -> bool:
        return self.role == Role.admin.value


@dataclass(frozen=True)
class IssuedToken:
    """A freshly created token: ``secret`` is shown once and never stored."""

    token_id: int
    secret: str
    user_name: str
    name: str = ""
    expires_at: datetime | None = None


@dataclass(frozen=True)
class UserInfo:
    id: int
    name: str
    role: str
    created_at: datetime
    max_concurrent_jobs: int | None
    requests_per_minute: int | None


@dataclass(frozen=True)
class TokenInfo:
    """A token as listed: never its secret nor its hash, only its first characters."""

    id: int
    user_name: str
    name: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None

    def active(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


_UNSET: object = object()


def _user_info(user: User) -> UserInfo:
    return UserInfo(
        id=user.id,
        name=user.name,
        role=user.role,
        created_at=user.created_at,
        max_concurrent_jobs=user.max_concurrent_jobs,
        requests_per_minute=user.requests_per_minute,
    )


class Accounts:
    """User and token records through one :class:`Database`."""

    def __init__(
        self, db: Database, *, touch_interval_s: float = 60.0, cache_s: float = 0.0
    ) -> None:
        self.db = db
        # A valid token's principal is kept this long, in seconds, so a burst of
        # requests with one token costs one query; a revocation, a role change or
        # an expiry takes effect within it. Invalid tokens are never kept.
        self.cache_s = cache_s
        # Valid tokens' principals, one lookup of a token at a time (db/lookups.py).
        self._cache = RowCache(MAX_CACHED_TOKENS)
        # A token's last-used time is written at most this often: one UPDATE
        # per request would turn every read of the API into a write.
        self.touch_interval = timedelta(seconds=touch_interval_s)

    def forget_tokens(self) -> None:
        """Empty the token cache: the next lookup of every token reads the database."""
        self._cache.clear()

    def has_users(self) -> bool:
        with self.db.session() as s:
            return s.execute(select(User.id).limit(1)).first() is not None

    def add_user(
        self,
        name: str,
        role: Role = Role.user,
        *,
        max_concurrent_jobs: int | None = None,
        requests_per_minute: int | None = None,
    ) -> int:
        """Create a user; raises :class:`DuplicateUser` if the name is taken."""
        try:
            with self.db.session() as s:
                user = User(
                    name=name,
                    role=Role(role).value,
                    created_at=utcnow(),
                    max_concurrent_jobs=max_concurrent_jobs,
                    requests_per_minute=requests_per_minute,
                )
                s.add(user)
                s.flush()
                return user.id
        except IntegrityError:
            raise DuplicateUser(name) from None

    def user_id(self, name: str) -> int | None:
        with self.db.session() as s:
            return s.execute(select(User.id).where(User.name == name)).scalar_one_or_none()

    def get_user(self, name: str) -> UserInfo | None:
        with self.db.session() as s:
            user = s.execute(select(User).where(User.name == name)).scalar_one_or_none()
            return _user_info(user) if user is not None else None

    def list_users(self) -> list[UserInfo]:
        with self.db.session() as s:
            return [_user_info(u) for u in s.execute(select(User).order_by(User.id)).scalars()]

    def update_user(
        self,
        name: str,
        *,
        role: Role | None = None,
        max_concurrent_jobs: int | object | None = _UNSET,
        requests_per_minute: int | object | None = _UNSET,
    ) -> UserInfo:
        """Change a user's role or limits (None: back to the role's default).

        Raises :class:`UnknownUser`.
        """
        self.forget_tokens()
        with self.db.session() as s:
            user = s.execute(select(User).where(User.name == name)).scalar_one_or_none()
            if user is None:
                raise UnknownUser(name)
            if role is not None:
                user.role = Role(role).value
            if max_concurrent_jobs is not _UNSET:
                user.max_concurrent_jobs = max_concurrent_jobs  # type: ignore[assignment]
            if requests_per_minute is not _UNSET:
                user.requests_per_minute = requests_per_minute  # type: ignore[assignment]
            s.flush()
            return _user_info(user)

    def issue_token(
        self, user_name: str, *, name: str = "", expires_at: datetime | None = None
    ) -> IssuedToken:
        """A new token for ``user_name``; raises :class:`UnknownUser`."""
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self.db.session() as s:
            user = s.execute(select(User).where(User.name == user_name)).scalar_one_or_none()
            if user is None:
                raise UnknownUser(user_name)
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
            return IssuedToken(
                token_id=token.id,
                secret=secret,
                user_name=user.name,
                name=name,
                expires_at=expires_at,
            )

    def list_tokens(self, user_name: str | None = None) -> list[TokenInfo]:
        """Every token (of one user when ``user_name`` is given), oldest first."""
        query = select(ApiToken, User.name).join(User, User.id == ApiToken.user_id)
        if user_name is not None:
            query = query.where(User.name == user_name)
        with self.db.session() as s:
            return [
                TokenInfo(
                    id=t.id,
                    user_name=u,
                    name=t.name,
                    prefix=t.prefix,
                    created_at=t.created_at,
                    expires_at=t.expires_at,
                    revoked_at=t.revoked_at,
                    last_used_at=t.last_used_at,
                )
                for t, u in s.execute(query.order_by(ApiToken.id))
            ]

    def token_owner(self, token_id: int) -> str | None:
        with self.db.session() as s:
            return s.execute(
                select(User.name)
                .join(ApiToken, ApiToken.user_id == User.id)
                .where(ApiToken.id == token_id)
            ).scalar_one_or_none()

    def revoke(self, token_id: int) -> bool:
        """Revoke a token; False if there is no such token or it was revoked already.

        This object's token cache forgets every token at once; other processes'
        caches within their ``cache_s``.
        """
        self.forget_tokens()
        with self.db.session() as s:
            result = s.execute(
                update(ApiToken)
                .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def authenticate(self, secret: str) -> Principal | None:
        """The principal of a valid, unrevoked, unexpired token; else None.

        Records the token's last use when the recorded one is older than the
        touch interval.
        """
        digest = hash_token(secret)
        now = utcnow()
        if self.cache_s <= 0:
            return self._authenticate(digest, now)
        known = self._cache.get(
            digest,
            self.cache_s,
            lambda: self._authenticate(digest, now),
            keep=lambda principal: principal is not None,  # invalid tokens are never kept
        )
        assert known is None or isinstance(known, Principal)
        if known is not None and known.expires_at is not None and known.expires_at <= now:
            return self._authenticate(digest, now)  # expired while cached: the row says why
        return known

    def _authenticate(self, digest: str, now: datetime) -> Principal | None:
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
            if token.last_used_at is None or now - token.last_used_at >= self.touch_interval:
                token.last_used_at = now
            return Principal(
                user_id=user.id,
                user_name=user.name,
                role=user.role,
                token_id=token.id,
                max_concurrent_jobs=user.max_concurrent_jobs,
                requests_per_minute=user.requests_per_minute,
                expires_at=token.expires_at,
            )
