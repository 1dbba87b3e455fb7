"""The farm ``switchyard run`` started, recorded for the commands typed beside it.

``switchyard run`` writes ``farm.json`` in the state folder (mode 0600: it
holds the database and Redis passwords) with the settings variables its
processes got, its process id and the API's address, and removes it when it
stops. A ``switchyard`` command run with neither ``DATABASE_URL`` nor
``REDIS_URL`` set takes those variables from the record while that launcher
runs, so ``switchyard scale`` in a second terminal steers the farm of the
first one rather than the empty defaults. A variable set in the command's
own environment wins over the record; a record whose launcher is gone (it
was killed) is ignored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from config.settings import PREFIX, Settings, load_settings, variable_name

RECORD_NAME = "farm.json"
# Variables that name a farm: with one of them set, a command steers that
# farm whatever was recorded.
FARM_VARIABLES = ("DATABASE_URL", "REDIS_URL")


@dataclass(frozen=True)
class FarmRecord:
    """What ``switchyard run`` recorded about the farm it started."""

    path: Path
    pid: int
    api_url: str
    started_at: str
    environment: dict[str, str] = field(default_factory=dict)

    def running(self) -> bool:
        """Whether the launcher that wrote the record still runs."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: the launcher's pid, reused
            return False
        return True


@dataclass(frozen=True)
class FarmChoice:
    """The settings a command runs with, and the record they came from (if any)."""

    settings: Settings
    record: FarmRecord | None = None
    ignored: FarmRecord | None = None
    """A record not used because its launcher no longer runs."""


def record_path(state_dir: Path) -> Path:
    return state_dir / RECORD_NAME


def farm_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that are Switchyard settings (the farm's identity)."""
    known = {variable_name(name) for name in Settings.model_fields}
    return {k: v for k, v in environ.items() if k in known or k.startswith(PREFIX)}


def record_farm(
    state_dir: Path, environ: Mapping[str, str], *, api_url: str, pid: int | None = None
) -> Path:
    """Write the record of a farm started with ``environ`` (replacing any), mode 0600."""
    path = record_path(state_dir)
    body = {
        "pid": os.getpid() if pid is None else pid,
        "api_url": api_url,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": farm_environment(environ),
    }
    temporary = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=2)
    os.replace(temporary, path)
    return path


def read_farm(state_dir: Path) -> FarmRecord | None:
    """The record in ``state_dir``; None when there is none or it cannot be read."""
    path = record_path(state_dir)
    try:
        body = json.loads(path.read_text())
        environment = body["environment"]
        return FarmRecord(
            path=path,
            pid=int(body["pid"]),
            api_url=str(body.get("api_url", "")),
            started_at=str(body.get("started_at", "")),
            environment={str(k): str(v) for k, v in environment.items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def forget_farm(state_dir: Path, pid: int | None = None) -> None:
    """Remove the record if launcher ``pid`` (default: this process) wrote it."""
    record = read_farm(state_dir)
    if record is not None and record.pid == (os.getpid() if pid is None else pid):
        record.path.unlink(missing_ok=True)


def choose_farm(environ: Mapping[str, str] | None = None) -> FarmChoice:
    """The settings of the farm a command steers: its environment's, or the recorded farm's.

    Raises :class:`~config.settings.SettingsError` like :func:`load_settings`.
    """
    env = dict(os.environ if environ is None else environ)
    own = load_settings(env)
    if any(name in env for name in FARM_VARIABLES):
        return FarmChoice(own)
    record = read_farm(own.state_dir)
    if record is None:
        return FarmChoice(own)
    if not record.running():
        return FarmChoice(own, ignored=record)
    return FarmChoice(load_settings({**record.environment, **env}), record=record)


def masked_url(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def describe_farm(settings: Settings) -> str:
    """The farm ``settings`` point at, in one line, without passwords."""
    return (
        f"{masked_url(settings.database_url)} "
        f"(redis {masked_url(settings.redis_url)}, prefix {settings.redis_prefix})"
    )
