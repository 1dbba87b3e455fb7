"""``switchyard user list|set`` and ``switchyard token list|revoke``, against the database.

``user add`` and ``token create`` live in :mod:`cli.main`; these complete
them. They need no API: they open the database named by ``DATABASE_URL``.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import Any

from cli.steering import announce, command_settings
from config import Settings


def _accounts(settings: Settings) -> Any:
    from db.accounts import Accounts
    from db.session import Database

    return Accounts(Database(settings.database_url))


def _limit(value: str) -> int | None:
    """``none`` (back to the role's default) or a number ≥ 0 (0: no limit)."""
    if value.lower() == "none":
        return None
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError("a limit is 0 or more (0: no limit), or 'none'")
    return number


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def _cmd_user_list(_: argparse.Namespace) -> int:
    print(f"{'NAME':24} {'ROLE':9} {'MAX JOBS':>8} {'REQ/MIN':>8}  CREATED")
    for u in _accounts(command_settings()).list_users():
        jobs = "role" if u.max_concurrent_jobs is None else str(u.max_concurrent_jobs)
        rpm = "role" if u.requests_per_minute is None else str(u.requests_per_minute)
        print(f"{u.name:24} {u.role:9} {jobs:>8} {rpm:>8}  {_when(u.created_at)}")
    return 0


def _cmd_user_set(args: argparse.Namespace) -> int:
    from db.accounts import UnknownUser
    from db.schema import Role

    changes: dict[str, Any] = {}
    if args.max_concurrent_jobs is not None:
        changes["max_concurrent_jobs"] = _limit(args.max_concurrent_jobs)
    if args.requests_per_minute is not None:
        changes["requests_per_minute"] = _limit(args.requests_per_minute)
    settings = command_settings()
    try:
        user = _accounts(settings).update_user(
            args.name, role=Role(args.role) if args.role else None, **changes
        )
    except UnknownUser as exc:
        raise SystemExit(f"switchyard: {exc}") from None
    print(
        f"{user.name}: role {user.role}, max concurrent jobs "
        f"{user.max_concurrent_jobs if user.max_concurrent_jobs is not None else 'role default'}"
        f", requests per minute "
        f"{user.requests_per_minute if user.requests_per_minute is not None else 'role default'}"
    )
    announce(settings)
    return 0


def _cmd_token_list(args: argparse.Namespace) -> int:
    from db.schema import utcnow

    now = utcnow()
    print(
        f"{'ID':>5} {'USER':20} {'NAME':16} {'PREFIX':11} {'STATE':8} "
        f"{'EXPIRES':19} {'LAST USED':19}"
    )
    for t in _accounts(command_settings()).list_tokens(args.user):
        state = "revoked" if t.revoked_at else ("active" if t.active(now) else "expired")
        print(
            f"{t.id:>5} {t.user_name:20} {t.name or '-':16} {t.prefix:11} {state:8} "
            f"{_when(t.expires_at):19} {_when(t.last_used_at):19}"
        )
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    settings = command_settings()
    accounts = _accounts(settings)
    if accounts.token_owner(args.id) is None:
        raise SystemExit(f"switchyard: no token {args.id}")
    if accounts.revoke(args.id):
        print(f"revoked token {args.id}")
    else:
        print(f"token {args.id} was already revoked")
    announce(settings)
    return 0


def register(users: Any, tokens: Any) -> None:
    """Add the list/set/revoke subcommands to the ``user`` and ``token`` parsers."""
    p = users.add_parser("list", help="list users with their roles and limits")
    p.set_defaults(func=_cmd_user_list)

    p = users.add_parser("set", help="change a user's role or limits")
    p.add_argument("name")
    p.add_argument("--role", choices=["admin", "operator", "user"])
    p.add_argument(
        "--max-concurrent-jobs",
        metavar="N|none",
        help="queued+running jobs at once (0: no limit, none: the role's default)",
    )
    p.add_argument(
        "--requests-per-minute",
        metavar="N|none",
        help="generation requests per minute (0: no limit, none: the role's default)",
    )
    p.set_defaults(func=_cmd_user_set)

    p = tokens.add_parser("list", help="list tokens (never their secrets)")
    p.add_argument("--user", help="only this user's tokens")
    p.set_defaults(func=_cmd_token_list)

    p = tokens.add_parser("revoke", help="revoke a token by id")
    p.add_argument("id", type=int)
    p.set_defaults(func=_cmd_token_revoke)
