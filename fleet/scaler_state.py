"""The scaler's shared state in Redis and the policy of a model, as both sides read them.

:class:`ScalerState` holds the desired counts (``<prefix>:scaling:desired``),
the scaler's memory, the wake-up list and the leader lock's key; the API wakes
the scaler with :func:`wake_if_idle` when it enqueues for a model at zero, the
admin routes and ``switchyard status`` read the desired counts, and the
scaler (``workers/scaler.py``) writes them. :func:`policy_for` merges a
model's definition with its database overrides and windows.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from config import Settings
from config.catalog import SCALING_TUNABLES
from db.schema import ScalingOverride, ScalingWindow
from fleet.policy import Memory, Overrides, Policy, effective_policy
from fleet.schedule import Window

log = logging.getLogger(__name__)

# The wake-up list never grows past this many entries (one is enough to wake).
WAKE_LIST_MAX = 100


class ScalerState:
    """The scaler's keys in Redis: desired counts, memory, wake-ups, the leader lock."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.desired_key = settings.key("scaling", "desired")
        self.memory_key = settings.key("scaling", "memory")
        self.wake_key = settings.key("scaler", "wake")
        self.lock_key = self.lock_key_of(settings)

    @staticmethod
    def lock_key_of(settings: Settings) -> str:
        """The scaler leader's lock: it exists while a scaler leads."""
        return settings.key("scaler", "leader")

    def desired(self) -> dict[str, dict[str, Any]]:
        """Per model: ``desired``, ``reason``, ``detail``, ``at``, ``scaler``."""
        raw = self.redis.hgetall(self.desired_key)
        return {_text(k): json.loads(v) for k, v in raw.items()}

    def desired_of(self, model: str) -> int | None:
        raw = self.redis.hget(self.desired_key, model)
        return int(json.loads(raw)["desired"]) if raw else None

    def publish(self, model: str, body: dict[str, Any]) -> None:
        self.redis.hset(self.desired_key, model, json.dumps(body))

    def memories(self) -> dict[str, Memory]:
        raw = self.redis.hgetall(self.memory_key)
        found = {}
        for k, v in raw.items():
            try:
                found[_text(k)] = Memory.from_json(v)
            except (ValueError, KeyError, TypeError):
                log.warning("dropping unreadable scaler memory of %s", _text(k))
        return found

    def remember(self, memories: dict[str, Memory]) -> None:
        if memories:
            self.redis.hset(self.memory_key, mapping={m: v.to_json() for m, v in memories.items()})

    def wake(self, model: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.lpush(self.wake_key, model)
        pipe.ltrim(self.wake_key, 0, WAKE_LIST_MAX - 1)
        pipe.execute()

    def wait_wake(self, timeout: float) -> list[str]:
        """Models woken during ``timeout`` seconds (empty when none); drains the list."""
        got = self.redis.blpop([self.wake_key], timeout=max(timeout, 0.01))
        if got is None:
            return []
        woken = [_text(got[1])]
        while True:
            more = self.redis.lpop(self.wake_key)
            if more is None:
                return woken
            woken.append(_text(more))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def wake_if_idle(client: redis.Redis, settings: Settings, model: str) -> bool:
    """Called by the API after enqueueing for ``model``: wake the scaler if it is at zero.

    Returns True when a wake-up was sent. Never raises: a lost wake-up only
    delays the start until the scaler's next tick.
    """
    try:
        state = ScalerState(client, settings)
        desired = state.desired_of(model)
        if desired is None or desired == 0:
            state.wake(model)
            return True
    except (redis.RedisError, ValueError, KeyError) as exc:
        log.warning("could not wake the scaler for %s: %s", model, exc)
    return False


_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class LeaderLock:
    """A Redis lock with a TTL: ``hold()`` acquires it or renews it if already ours."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float, holder: str) -> None:
        self.redis = client
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.holder = holder

    def hold(self) -> bool:
        if self.redis.eval(_RENEW, 1, self.key, self.holder, self.ttl_ms):
            return True
        return bool(self.redis.set(self.key, self.holder, nx=True, px=self.ttl_ms))

    def release(self) -> None:
        self.redis.eval(_RELEASE, 1, self.key, self.holder)

    def leader(self) -> str | None:
        raw = self.redis.get(self.key)
        return _text(raw) if raw is not None else None


def policy_for(
    scaling: Any, override: ScalingOverride | None, windows: list[ScalingWindow]
) -> Policy:
    """A model's effective policy from its definition's scaling and its database rows."""
    overrides = None
    if override is not None:
        overrides = Overrides(
            **{name: getattr(override, name) for name in SCALING_TUNABLES},
            manual_replicas=override.manual_replicas,
            manual_until=override.manual_until,
        )
    extra = [
        Window(
            cron=w.cron,
            timezone=w.timezone,
            min_replicas=w.min_replicas,
            max_replicas=w.max_replicas,
            source="schedule",
            id=w.id,
        )
        for w in windows
    ]
    return effective_policy(scaling, overrides, extra)
