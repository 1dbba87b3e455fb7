"""The operator commands of scaling: ``scaler``, ``scale``, ``schedule``, ``status``.

switchyard scaler [--executor local|kubernetes]      run the scaling loop (one leads)
switchyard scale MODEL N [--for 2h]                  pin MODEL at N replicas (for a while)
switchyard scale MODEL --auto                        back to the automatic policy
switchyard scale MODEL --min 1 --max 4 [--target 8]  change the policy (``--reset`` restores)
switchyard schedule add MODEL --cron '* 9-18 * * 1-5' --tz Europe/Paris --min 4
switchyard schedule list MODEL
switchyard schedule remove MODEL ID
switchyard status [--json]                           desired vs ready, queues, workers, decisions

The commands talk to the database and Redis directly (no API token needed:
whoever can run them on a host with the farm's settings is an operator); each
change is audited as ``cli:<user>``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import signal
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from cli.steering import announce
from cli.steering import command_settings as _settings
from config import Settings, load_catalog
from config.catalog import SCALING_TUNABLES
from config.farm_record import describe_farm
from config.logs import configure_logging


def _controls(settings: Settings) -> Any:
    import redis

    from db.session import Database
    from fleet.controls import ScalingControls

    return ScalingControls(
        settings,
        load_catalog(settings.models_dir),
        Database(settings.database_url),
        redis.Redis.from_url(settings.redis_url),
    )


def _actor(args: argparse.Namespace) -> str:
    return f"cli:{args.actor or getpass.getuser()}"


def _fail(exc: Exception) -> int:
    print(f"switchyard: {exc}", file=sys.stderr)
    return 2


def reaper_hook(settings: Settings, db: Any, client: Any) -> Callable[[], Any]:
    """The reaper's sweep (``fleet/reaper.py``), which the scaler leader runs each tick.

    Sweeps are safe from several processes at once, so this adds to the API's
    own reaper thread rather than replacing it.
    """
    from db.jobs import JobStore
    from fleet.reaper import Reaper
    from jobs.events import EventLog

    reaper = Reaper(settings, JobStore(db), EventLog(client, settings), client)
    return reaper.sweep


def _cmd_scaler(args: argparse.Namespace) -> int:
    import redis

    from db.session import Database
    from workers.executors import build_executor
    from workers.executors.base import ExecutorError
    from workers.scaler import Scaler

    settings = _settings()
    configure_logging(settings)
    client = redis.Redis.from_url(settings.redis_url)
    db = Database(settings.database_url)
    try:
        executor = build_executor(
            args.executor or settings.scaler_executor, settings, client=client
        )
    except ExecutorError as exc:
        raise SystemExit(f"switchyard scaler: {exc}") from None
    scaler = Scaler(
        settings,
        load_catalog(settings.models_dir),
        db,
        client,
        executor,
        reaper=reaper_hook(settings, db, client),
        alive_file=settings.scaler_alive_file,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scaler.run(stop)
    db.dispose()
    return 0


def _policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for flag, name in (
        ("min", "min_replicas"),
        ("max", "max_replicas"),
        ("target", "target_jobs_per_replica"),
        ("upscale_delay", "upscale_delay_s"),
        ("downscale_delay", "downscale_delay_s"),
        ("zero_delay", "scale_to_zero_delay_s"),
    ):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = value
    for name in args.reset or []:
        changes[name] = None
    return changes


def _cmd_scale(args: argparse.Namespace) -> int:
    from fleet.controls import UnknownModel
    from fleet.policy import PolicyError
    from fleet.schedule import ScheduleError, parse_duration

    settings = _settings()
    controls = _controls(settings)
    actor = _actor(args)
    changes = _policy_changes(args)
    try:
        if args.auto and args.replicas is not None:
            raise PolicyError("replicas", "give a replica count or --auto, not both")
        if changes:
            controls.update_policy(args.model, changes, actor)
        if args.auto:
            controls.auto(args.model, actor)
            print(f"{args.model}: automatic scaling")
        elif args.replicas is not None:
            until = datetime.now(UTC) + parse_duration(args.duration) if args.duration else None
            controls.scale(args.model, args.replicas, until=until, actor=actor)
            note = f" until {until.isoformat(timespec='seconds')}" if until else ""
            print(f"{args.model}: {args.replicas} replicas{note}")
        elif not changes:
            raise PolicyError("replicas", "give a replica count, --auto or a policy option")
        if changes:
            effective = controls.view(args.model)["effective"]
            print(f"{args.model}: " + " ".join(f"{k}={v}" for k, v in effective.items()))
    except (UnknownModel, PolicyError, ScheduleError) as exc:
        return _fail(exc)
    announce(settings)
    return 0


def _window_line(w: dict[str, Any]) -> str:
    ident = str(w["id"]) if w["id"] is not None else "-"
    low = "" if w["min_replicas"] is None else str(w["min_replicas"])
    high = "" if w["max_replicas"] is None else str(w["max_replicas"])
    return (
        f"{ident:>4}  {w['source']:<10}  {w['cron']:<20}  {w['timezone']:<16}  {low:>3}  {high:>3}"
    )


def _cmd_schedule(args: argparse.Namespace) -> int:
    from fleet.controls import UnknownModel
    from fleet.schedule import ScheduleError

    settings = _settings()
    controls = _controls(settings)
    try:
        if args.action == "add":
            w = controls.add_window(
                args.model,
                cron=args.cron,
                timezone=args.tz,
                min_replicas=args.min,
                max_replicas=args.max,
                actor=_actor(args),
            )
            print(f"added window {w['id']} to {args.model}")
            announce(settings)
        elif args.action == "remove":
            if not controls.remove_window(args.model, args.id, _actor(args)):
                print(f"switchyard: {args.model} has no window {args.id}", file=sys.stderr)
                return 1
            print(f"removed window {args.id} from {args.model}")
            announce(settings)
        else:
            print(f"{'id':>4}  {'source':<10}  {'cron':<20}  {'timezone':<16}  min  max")
            for w in controls.windows(args.model):
                print(_window_line(w))
    except (UnknownModel, ScheduleError) as exc:
        return _fail(exc)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    settings = _settings()
    status = _controls(settings).status(decisions=args.decisions)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"farm: {describe_farm(settings)}")
    print(f"scaler leader: {status['leader'] or 'none'}")
    print(
        f"{'model':<20} {'desired':>7} {'ready':>5} {'start':>5} {'drain':>5} "
        f"{'queued':>6} {'running':>7}  reason"
    )
    for m in status["models"]:
        desired = "-" if m["desired"] is None else str(m["desired"])
        why = f"{m['reason']}: {m['detail']}" if m["reason"] else "(no scaler has run)"
        print(
            f"{m['model']:<20} {desired:>7} {m['replicas_ready']:>5} {m['replicas_starting']:>5} "
            f"{m['replicas_draining']:>5} {m['queued']:>6} {m['running']:>7}  {why}"
        )
    if status["workers"]:
        print("\nworkers:")
        for w in status["workers"]:
            print(
                f"  {w['id']:<48} {w['state']:<9} {w['busy_slots']}/{w['total_slots']} slots "
                f"{w['device']}"
            )
    if status.get("decisions"):
        print("\nlast scaling decisions:")
        for d in status["decisions"]:
            before = "?" if d["previous"] is None else d["previous"]
            print(
                f"  {d['at'][:19]}  {d['model']:<20} {before} -> {d['desired']}  "
                f"{d['reason']}: {d['detail']}"
            )
    return 0


def register(sub: Any) -> None:
    """Add the scaling subcommands to the ``switchyard`` parser's subparsers."""
    p = sub.add_parser("scaler", help="run the scaling loop (several may run; one leads)")
    p.add_argument(
        "--executor",
        choices=["local", "kubernetes", "none"],
        help="what applies replica counts (default: SWITCHYARD_SCALER_EXECUTOR)",
    )
    p.set_defaults(func=_cmd_scaler)

    p = sub.add_parser("scale", help="set a model's replicas by hand, or its scaling policy")
    p.add_argument("model")
    p.add_argument("replicas", nargs="?", type=int, help="pin the model at this many replicas")
    p.add_argument("--for", dest="duration", help="only for this long (90s, 15m, 2h, 1h30m)")
    p.add_argument("--auto", action="store_true", help="back to the automatic policy")
    p.add_argument("--min", type=int, help="min_replicas")
    p.add_argument("--max", type=int, help="max_replicas")
    p.add_argument("--target", type=float, help="target queued+running jobs per replica")
    p.add_argument("--upscale-delay", type=float, help="seconds")
    p.add_argument("--downscale-delay", type=float, help="seconds")
    p.add_argument("--zero-delay", type=float, help="seconds idle before scaling to zero")
    p.add_argument(
        "--reset",
        action="append",
        choices=SCALING_TUNABLES,
        help="restore a tunable to the model definition's value (repeatable)",
    )
    p.add_argument("--as", dest="actor", help="name recorded in the audit (default: your user)")
    p.set_defaults(func=_cmd_scale)

    schedule = sub.add_parser("schedule", help="time-of-day scaling windows").add_subparsers(
        dest="action", required=True
    )
    p = schedule.add_parser("add", help="add a window: while --cron matches, clamp replicas")
    p.add_argument("model")
    p.add_argument("--cron", required=True, help="five-field cron, e.g. '* 9-18 * * 1-5'")
    p.add_argument("--tz", default="UTC", help="timezone of the cron (default UTC)")
    p.add_argument("--min", type=int, help="at least this many replicas in the window")
    p.add_argument("--max", type=int, help="at most this many replicas in the window")
    p.add_argument("--as", dest="actor", help="name recorded in the audit (default: your user)")
    p.set_defaults(func=_cmd_schedule)
    p = schedule.add_parser("list", help="list a model's windows (definition and run-time)")
    p.add_argument("model")
    p.set_defaults(func=_cmd_schedule)
    p = schedule.add_parser("remove", help="remove a run-time window by id")
    p.add_argument("model")
    p.add_argument("id", type=int)
    p.add_argument("--as", dest="actor", help="name recorded in the audit (default: your user)")
    p.set_defaults(func=_cmd_schedule)

    p = sub.add_parser("status", help="models: desired vs ready replicas, queues, workers")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--decisions", type=int, default=10, help="how many recent scaling decisions to show"
    )
    p.set_defaults(func=_cmd_status)
