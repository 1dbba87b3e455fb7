"""The images' health probes: ``python -m cli.healthcheck [--url URL] [--worker]``.

A container runtime runs a probe every few seconds under a short timeout
(Docker's ``HEALTHCHECK --timeout``, a Kubernetes exec probe's
``timeoutSeconds``, one second unless set), on a host that may be busy
generating. ``python -m cli healthcheck`` imports the whole command line first
(SQLAlchemy, the scaler's state: 3.1 s measured in the API image on a loaded
2-core host, so Docker marked a healthy API ``unhealthy``); this module imports
only what its probe needs: the standard library for the API's, Redis and the
worker registry for a worker's.

- the API's: ``GET /healthz`` answers 200. The URL defaults to this
  container's own API, ``SWITCHYARD_API_HOST`` / ``SWITCHYARD_API_PORT`` as
  the API reads them (a wildcard address probed on loopback).
- a worker's (``--worker``): a worker of this host is ``ready`` or
  ``starting`` in the registry (its heartbeat), read from Redis.
- a scaler's (``--scaler``): its loop turned within ``--max-age`` seconds
  (default 60): the file it touches at every turn
  (:attr:`config.Settings.scaler_alive_file`, :mod:`workers.scaler`) is that
  recent. Redis is not asked, so a Redis outage does not restart scalers.

Exit status 0 when healthy, 1 (with the reason on stderr) when not.
``switchyard healthcheck`` runs the same probes with the steered farm's
settings (:mod:`cli.steering`).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config import Settings

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
API_TIMEOUT_S = 3.0
SCALER_MAX_AGE_S = 60.0
"""How long a scaler's loop may go without turning (a tick can take seconds) and be healthy."""


def default_url(environ: Mapping[str, str] = os.environ) -> str:
    """This host's API, where ``SWITCHYARD_API_HOST`` / ``_PORT`` put it."""
    host = environ.get("SWITCHYARD_API_HOST", "").strip()
    port = environ.get("SWITCHYARD_API_PORT", "").strip() or "8000"
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address in a URL
    return f"http://{host}:{port}"


def probe_api(url: str, timeout_s: float = API_TIMEOUT_S) -> int:
    """0 when ``url``'s ``/healthz`` answers 200, else 1."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout_s) as response:
            if response.status == 200:
                return 0
            print(f"unhealthy: /healthz answered {response.status}", file=sys.stderr)
            return 1
    except OSError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1


def _load_settings() -> Settings | None:
    from config import SettingsError, load_settings

    try:
        return load_settings()
    except SettingsError as exc:
        print(f"unhealthy: bad setting {exc}", file=sys.stderr)
        return None


def probe_scaler(settings: Settings | None = None, max_age_s: float = SCALER_MAX_AGE_S) -> int:
    """0 when the scaler's loop of this state folder turned within ``max_age_s``, else 1."""
    import time

    settings = settings or _load_settings()
    if settings is None:
        return 1
    path = settings.scaler_alive_file
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        print(f"unhealthy: no scaler has run with this state folder ({path})", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if age <= max_age_s:
        return 0
    print(f"unhealthy: the scaler's loop last turned {age:.0f} s ago", file=sys.stderr)
    return 1


def probe_worker(settings: Settings | None = None) -> int:
    """0 when a worker of this host is ready or starting, else 1."""
    import socket

    import redis

    from fleet.registry import list_workers

    settings = settings or _load_settings()
    if settings is None:
        return 1
    host = socket.gethostname()
    try:
        workers = list_workers(redis.Redis.from_url(settings.redis_url), settings)
    except redis.RedisError as exc:
        print(f"unhealthy: Redis unreachable ({type(exc).__name__})", file=sys.stderr)
        return 1
    mine = [w for w in workers if w.host == host and not w.lost]
    if any(w.state in ("ready", "starting") for w in mine):
        return 0
    print(f"unhealthy: no live worker on {host}", file=sys.stderr)
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The probe's options (here and in ``switchyard healthcheck``)."""
    parser.add_argument(
        "--url",
        default=None,
        help="API base URL to probe (default: this host's API, from SWITCHYARD_API_HOST "
        "and SWITCHYARD_API_PORT; http://127.0.0.1:8000 when unset)",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--worker", action="store_true", help="probe this host's worker instead")
    target.add_argument(
        "--scaler",
        action="store_true",
        help="probe the scaler of this state folder instead: its loop turned within --max-age",
    )
    parser.add_argument(
        "--max-age",
        type=float,
        default=SCALER_MAX_AGE_S,
        metavar="SECONDS",
        help=f"with --scaler: how long ago its loop may last have turned (default "
        f"{SCALER_MAX_AGE_S:.0f})",
    )


def run(args: argparse.Namespace, settings: Settings | None = None) -> int:
    """The probe ``args`` ask for; ``settings`` (the worker's and the scaler's) or the
    environment's."""
    if args.worker:
        return probe_worker(settings)
    if args.scaler:
        return probe_scaler(settings, args.max_age)
    return probe_api(args.url or default_url())


def build_parser() -> argparse.ArgumentParser:
    """``python -m cli.healthcheck``'s parser."""
    parser = argparse.ArgumentParser(
        prog="python -m cli.healthcheck",
        description="exit 0 if the API (or this host's worker, or the scaler) is healthy",
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
