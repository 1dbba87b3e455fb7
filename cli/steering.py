"""Which farm a ``switchyard`` command steers, and saying so.

Every command takes its settings from :func:`command_settings`: the
environment's, or, with neither ``DATABASE_URL`` nor ``REDIS_URL`` set, those
of the farm a running ``switchyard run`` recorded (:mod:`config.farm_record`).
A command that changes something then calls :func:`announce`, which names
that farm on stderr (passwords masked; stdout stays what scripts read) and
warns when no scaler leads it: a farm that is not running, or not the one
meant, is seen at once instead of a change that silently goes nowhere.
"""

from __future__ import annotations

import sys

import redis

from config import Settings, SettingsError
from config.farm_record import choose_farm, describe_farm
from fleet.scaler_state import LeaderLock, ScalerState

# How long the check for a scaler may wait on Redis, in seconds.
LEADER_CHECK_TIMEOUT_S = 3.0


def command_settings() -> Settings:
    """The settings of the farm this command steers; a bad setting exits with its name."""
    try:
        choice = choose_farm()
    except SettingsError as exc:
        raise SystemExit(f"switchyard: bad setting {exc}") from None
    if choice.ignored is not None:
        print(
            f"switchyard: {choice.ignored.path} records a farm whose `switchyard run` "
            f"(pid {choice.ignored.pid}) is no longer running; using this environment's settings",
            file=sys.stderr,
        )
    return choice.settings


def scaler_leader(settings: Settings) -> str | None:
    """The scaler that leads the farm of ``settings``; None if none does.

    Raises :class:`redis.RedisError` when the farm's Redis does not answer.
    """
    client = redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=LEADER_CHECK_TIMEOUT_S,
        socket_connect_timeout=LEADER_CHECK_TIMEOUT_S,
    )
    try:
        return LeaderLock(client, ScalerState(client, settings).lock_key, 1, "").leader()
    finally:
        client.close()


def announce(settings: Settings) -> None:
    """Name on stderr the farm a change went to; warn if no scaler leads it."""
    print(f"switchyard: farm {describe_farm(settings)}", file=sys.stderr)
    try:
        leader = scaler_leader(settings)
    except redis.RedisError as exc:
        print(
            f"switchyard: warning: the farm's Redis does not answer ({type(exc).__name__}); "
            "cannot tell whether a scaler leads it",
            file=sys.stderr,
        )
        return
    if leader is None:
        print(
            "switchyard: warning: no scaler leads this farm: is it running, and the one you "
            "meant? Replica changes wait until `switchyard run` or `switchyard scaler` runs "
            "for it (or set DATABASE_URL and REDIS_URL to steer another farm).",
            file=sys.stderr,
        )
