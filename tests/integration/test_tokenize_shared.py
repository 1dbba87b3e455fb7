"""POST /tokenize on an API that does not share the workers' disk (compose, Kubernetes)."""

from __future__ import annotations

from pathlib import Path

import redis
import requests

from config import Settings
from fleet.tokenizers import tokenizer_key
from tests import farm

CHAT = [{"role": "user", "content": "Count these tokens, please: 1, 2, 3."}]


def _tokenize(base: str, token: str) -> requests.Response:
    return requests.post(
        f"{base}/tokenize",
        json={"model": "tiny-random", "messages": CHAT},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def test_an_api_without_the_model_cache_uses_what_the_worker_published(
    migrated: Settings,
    api_url: str,
    user_token: str,
    tiny_worker: farm.Process,
    tmp_path: Path,
) -> None:
    # The API that shares the worker's state folder reads the files from disk.
    local = _tokenize(api_url, user_token)
    assert local.status_code == 200, local.text

    # An API with an empty state folder of its own: only Redis has the files.
    elsewhere = migrated.model_copy(update={"state_dir": tmp_path / "api-state"})
    with farm.serve_app_in_thread(elsewhere) as other:
        shared = _tokenize(other, user_token)
        assert shared.status_code == 200, shared.text
        assert shared.json()["tokens"] == local.json()["tokens"]

    # Without the worker's published files either, it says why (and stays up).
    client = redis.Redis.from_url(migrated.redis_url)
    key = tokenizer_key(migrated, "tiny-random")
    saved = client.dump(key)
    assert saved is not None
    client.delete(key)
    try:
        with farm.serve_app_in_thread(elsewhere) as other:
            missing = _tokenize(other, user_token)
            assert missing.status_code == 503
            assert "not cached yet" in missing.json()["error"]
            assert requests.get(f"{other}/healthz", timeout=10).status_code == 200
    finally:
        client.restore(key, 0, saved, replace=True)
