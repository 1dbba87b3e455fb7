"""``switchyard``: the command line of the farm.

switchyard run                     everything on this machine (make run)
switchyard worker --model NAME     one worker process for one model
switchyard migrate                 apply database migrations
switchyard user add NAME [--role]  add a user
switchyard token create --user N   issue an API token (shown once)
switchyard user list | set NAME     users, roles, per-user limits (cli/accounts.py)
switchyard token list | revoke ID  tokens (prefix, expiry, last use; never the secret)
switchyard models validate         check every model definition
switchyard models list | workers | reaper   operations (see cli/operations.py)
switchyard scaler | scale | schedule | status   scaling (see cli/scaling.py)
switchyard chat [--model M]        terminal chat with a running farm (client/)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from cli.steering import announce
from cli.steering import command_settings as _settings
from config import CatalogError, load_catalog
from config.logs import configure_logging


def _cmd_worker(args: argparse.Namespace) -> int:
    from workers.bootstrap import run_worker

    settings = _settings()
    configure_logging(settings)
    return run_worker(settings, args.model or settings.default_model)


def _cmd_migrate(_: argparse.Namespace) -> int:
    from db.migrate import upgrade

    settings = _settings()
    upgrade(settings.database_url)
    print("database is up to date")
    announce(settings)
    return 0


def _cmd_user_add(args: argparse.Namespace) -> int:
    from db.accounts import Accounts
    from db.schema import Role
    from db.session import Database

    settings = _settings()
    accounts = Accounts(Database(settings.database_url))
    if accounts.user_id(args.name) is not None:
        raise SystemExit(f"switchyard: user {args.name!r} exists")
    accounts.add_user(args.name, Role(args.role))
    print(f"added {args.role} {args.name}")
    announce(settings)
    return 0


def _cmd_token_create(args: argparse.Namespace) -> int:
    from db.accounts import Accounts
    from db.session import Database

    settings = _settings()
    accounts = Accounts(Database(settings.database_url))
    if accounts.user_id(args.user) is None:
        raise SystemExit(f"switchyard: no user {args.user!r}")
    days = settings.token_ttl_days if args.days is None else args.days
    expires = datetime.now(UTC) + timedelta(days=days) if days else None
    issued = accounts.issue_token(args.user, name=args.name, expires_at=expires)
    print(issued.secret)
    # On stderr: the secret alone stays on stdout for scripts that capture it.
    when = f"expires {expires:%Y-%m-%d %H:%M} UTC" if expires else "never expires"
    print(f"token {issued.token_id} for {args.user} {when}", file=sys.stderr)
    announce(settings)
    return 0


def _cmd_models_validate(_: argparse.Namespace) -> int:
    settings = _settings()
    try:
        catalog = load_catalog(settings.models_dir)
    except CatalogError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    for d in catalog:
        print(f"ok  {d.name}  ({d.source.kind}, {d.backend})")
    return 0


def _cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when healthy: the API answers /healthz, a worker on this host is ready,
    or the scaler's loop turns."""
    from cli.healthcheck import run

    return run(args, _settings() if args.worker or args.scaler else None)


def _cmd_chat(args: argparse.Namespace) -> int:
    from client.chat import run

    return run(args)


def _cmd_run(args: argparse.Namespace) -> int:
    from workers.launcher import run_local

    return run_local(models=args.model or None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM worker farm")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "run", help="run API, Redis (embedded if needed) and workers on this machine"
    )
    p.add_argument("--model", action="append", help="model to start a worker for (repeatable)")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("worker", help="serve one model from its queue")
    p.add_argument("--model", help="model name (default: SWITCHYARD_DEFAULT_MODEL)")
    p.set_defaults(func=_cmd_worker)

    p = sub.add_parser(
        "healthcheck", help="exit 0 if the API (or this host's worker, or the scaler) is healthy"
    )
    from cli.healthcheck import add_arguments as add_healthcheck_arguments

    add_healthcheck_arguments(p)
    p.set_defaults(func=_cmd_healthcheck)

    from cli.scaling import register as register_scaling

    register_scaling(sub)

    p = sub.add_parser("migrate", help="apply database migrations")
    p.set_defaults(func=_cmd_migrate)

    users = sub.add_parser("user", help="manage users").add_subparsers(dest="action", required=True)
    p = users.add_parser("add", help="add a user")
    p.add_argument("name")
    p.add_argument("--role", choices=["admin", "operator", "user"], default="user")
    p.set_defaults(func=_cmd_user_add)

    tokens = sub.add_parser("token", help="manage API tokens").add_subparsers(
        dest="action", required=True
    )
    p = tokens.add_parser("create", help="issue a token for a user (printed once)")
    p.add_argument("--user", required=True)
    p.add_argument("--name", default="")
    p.add_argument(
        "--days",
        type=float,
        default=None,
        help="expire after N days (0: never; default SWITCHYARD_TOKEN_TTL_DAYS, 90)",
    )
    p.set_defaults(func=_cmd_token_create)

    from cli.accounts import register as register_accounts

    register_accounts(users, tokens)

    models = sub.add_parser("models", help="model definitions").add_subparsers(
        dest="action", required=True
    )
    p = models.add_parser("validate", help="validate every model definition")
    p.set_defaults(func=_cmd_models_validate)

    from cli.operations import register as register_operations

    register_operations(sub, models)

    from client.chat import add_arguments as add_chat_arguments

    p = sub.add_parser("chat", help="chat with a model of a running farm, in the terminal")
    add_chat_arguments(p)
    p.set_defaults(func=_cmd_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
