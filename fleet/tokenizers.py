"""A model's tokenizer files, shared through Redis so the API can tokenize without the model.

A worker publishes the files its engine's tokenizer saves (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) once its model is loaded;
the API's ``POST /tokenize`` reads them from its own disk when it shares the
workers' model cache (``switchyard run``) and from Redis when it does not
(compose, Kubernetes). The hash is overwritten by each worker start, so it
follows the model a worker actually serves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, cast

import redis

from config import Settings

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_key(settings: Settings, model: str) -> str:
    return settings.key("tokenizer", model)


def saved_tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """The text files ``tokenizer.save_pretrained`` writes, by name (those that exist)."""
    with tempfile.TemporaryDirectory(prefix="sy-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return read_tokenizer_files(Path(tmp))


def read_tokenizer_files(folder: Path) -> dict[str, str]:
    """The tokenizer files found in ``folder``, by name."""
    return {
        name: (folder / name).read_text(encoding="utf-8")
        for name in TOKENIZER_FILES
        if (folder / name).is_file()
    }


def publish_tokenizer_files(
    client: redis.Redis, settings: Settings, model: str, files: dict[str, str]
) -> None:
    """Replace ``model``'s published tokenizer files with ``files``."""
    if "tokenizer.json" not in files:
        raise ValueError("a tokenizer needs tokenizer.json")
    key = tokenizer_key(settings, model)
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=cast(Any, files))  # redis-py types the mapping invariantly
    pipe.execute()


def fetch_tokenizer_files(client: redis.Redis, settings: Settings, model: str) -> dict[str, str]:
    """``model``'s published tokenizer files (empty when no worker published them)."""
    raw = cast(dict[bytes, bytes], client.hgetall(tokenizer_key(settings, model)))
    files = {k.decode(): v.decode("utf-8") for k, v in raw.items()}
    return files if "tokenizer.json" in files else {}
