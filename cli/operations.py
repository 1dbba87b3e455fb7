"""Operator commands of ``switchyard``: ``workers``, ``models list`` and ``reaper``.

switchyard workers [--json]        every registered worker, lost ones included
switchyard models list [--json]    each model: desired/ready replicas, queue depth
switchyard reaper [--once]         re-queue lost workers' jobs, re-send lost messages
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import asdict
from typing import Any

from cli.steering import announce
from cli.steering import command_settings as _settings
from config import CatalogError, load_catalog
from config.logs import configure_logging


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _cmd_workers(args: argparse.Namespace) -> int:
    import redis

    from fleet.capacity import worker_status
    from fleet.registry import list_workers

    settings = _settings()
    reports = list_workers(redis.Redis.from_url(settings.redis_url), settings)
    if args.json:
        print(json.dumps([asdict(w) for w in reports], indent=2))
        return 0
    if not reports:
        print("no workers registered")
        return 0
    rows = [["ID", "MODEL", "STATUS", "DEVICE", "SLOTS", "TOK/S", "BEAT", "ERROR"]]
    for w in reports:
        rows.append(
            [
                w.id,
                w.model,
                worker_status(w),
                str(w.device),
                f"{w.busy_slots}/{w.total_slots}",
                f"{float(w.tokens_per_s):.1f}",
                f"{float(w.heartbeat_age_s):.0f}s ago",
                str(w.error or ""),
            ]
        )
    print(_table(rows))
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    import redis

    from db.jobs import JobStore
    from db.session import Database
    from fleet.capacity import fleet

    settings = _settings()
    try:
        catalog = load_catalog(settings.models_dir)
    except CatalogError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    db = Database(settings.database_url)
    try:
        lines = fleet(catalog, JobStore(db), redis.Redis.from_url(settings.redis_url), settings)
    finally:
        db.dispose()
    if args.json:
        print(json.dumps([asdict(c) for c in lines], indent=2))
        return 0
    rows = [["MODEL", "DESIRED", "READY", "STARTING", "QUEUED", "RUNNING", "ACCESS"]]
    for c in lines:
        d = catalog[c.model]
        access = ("public" if d.public else "token") + ("" if d.enabled else ", disabled")
        desired = f"{c.desired}" + (" (min)" if c.desired_from == "definition" else "")
        rows.append(
            [
                c.model,
                desired,
                str(c.ready),
                str(c.starting),
                str(c.queued),
                str(c.running),
                access,
            ]
        )
    print(_table(rows))
    return 0


def _cmd_reaper(args: argparse.Namespace) -> int:
    import redis

    from db.jobs import JobStore
    from db.session import Database
    from fleet.reaper import Reaper, ReaperLoop
    from jobs.events import EventLog

    settings = _settings()
    configure_logging(settings)
    client = redis.Redis.from_url(settings.redis_url)
    db = Database(settings.database_url)

    def make() -> Reaper:
        return Reaper(settings, JobStore(db), EventLog(client, settings), client)

    try:
        if args.once:
            reaper = make()
            reaper.sweep()
            for r in reaper.last_sweep:
                print(f"{r.action:9} {r.job_id}  {r.model}  {r.reason}")
            announce(settings)
            return 0
        loop = ReaperLoop(settings, make)

        def on_signal(_signum: int, _frame: Any) -> None:
            loop.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(f"switchyard reaper: sweeping every {settings.reaper_interval_s:g} s", flush=True)
        loop.run()
        return 0
    finally:
        db.dispose()


def register(sub: Any, models: Any) -> None:
    """Add the commands to ``switchyard``'s subparsers and its ``models`` group."""
    p = sub.add_parser("workers", help="list the farm's workers (lost ones included)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_workers)

    p = sub.add_parser("reaper", help="recover jobs of lost workers and lost messages")
    p.add_argument("--once", action="store_true", help="sweep once and print what was done")
    p.set_defaults(func=_cmd_reaper)

    p = models.add_parser("list", help="each model with desired/ready replicas and queue depth")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_models_list)
