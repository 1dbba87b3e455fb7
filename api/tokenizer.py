"""``POST /tokenize``: token ids and count of a prompt or a chat, without torch.

The API never imports torch, and transformers' ``AutoTokenizer`` does. So this
reads the tokenizer files the model loader caches (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) with the ``tokenizers``
package (the same Rust tokenizer transformers wraps) and renders the chat
template with jinja2 in the sandbox transformers uses, the same way the engine
does: a prompt is encoded with the tokenizer's special tokens, a rendered chat
without (the template writes them).

Where the files are (see ``models/loader.py``): a GGUF model's under
``<state_dir>/models/<name>/model`` or ``.../tokenizer`` (written on a worker's
first load), a local model's in its folder, a hub model's in the local hub
cache, a random model's from its ``tokenizer_from`` model. Where the API does
not share the workers' disk (compose, Kubernetes) it uses the files a worker
published to Redis when it loaded the model (``fleet/tokenizers.py``). Until
either exists the route answers 503 saying so.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.auth import optional_principal
from api.errors import Unavailable, ValidationFailed
from api.limits import count_lookup
from api.openapi import spec
from api.schemas import Message, json_body, parse
from api.services import services
from config import Catalog, ModelDefinition, Settings
from config.catalog import GGUFSource, HubSource, LocalSource, RandomSource
from fleet.tokenizers import fetch_tokenizer_files, read_tokenizer_files

bp = Blueprint("tokenizer", __name__)

EXTENSION = "switchyard.tokenizers"
# The file the loader writes last into a cache folder; without it the folder is partial.
CACHE_MARKER = "switchyard-cache.json"


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``: a prompt or a chat of one model."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=64)
    prompt: str | None = Field(default=None, min_length=1, max_length=1_000_000)
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self


class TokenizerMissing(Unavailable):
    def __init__(self, model: str) -> None:
        super().__init__(
            f"the tokenizer of {model!r} is not cached yet; it is written when a worker first "
            f"loads the model (switchyard worker --model {model}), retry then"
        )


def tokenizer_folder(definition: ModelDefinition, catalog: Catalog, state_dir: Path) -> Path | None:
    """The folder holding ``definition``'s tokenizer files, or None if there is none yet."""
    source = definition.source
    if isinstance(source, RandomSource):
        donor = catalog.get(source.tokenizer_from)
        return tokenizer_folder(donor, catalog, state_dir) if donor is not None else None
    if isinstance(source, LocalSource):
        folder = Path(source.path).expanduser()
        return folder if (folder / "tokenizer.json").is_file() else None
    if isinstance(source, HubSource):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source.id, "tokenizer.json", revision=source.revision)
        return Path(found).parent if isinstance(found, str) else None
    assert isinstance(source, GGUFSource)
    for name in ("model", "tokenizer"):
        folder = state_dir / "models" / definition.name / name
        if (folder / CACHE_MARKER).is_file() and (folder / "tokenizer.json").is_file():
            return folder
    return None


def _special(config: dict[str, Any], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_environment() -> Any:
    """jinja2's immutable sandbox set up as transformers sets it up for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass
class TextTokenizer:
    """One model's tokenizer and chat template, as the engine uses them."""

    tokenizer: Any
    template: Any
    specials: dict[str, str | None]

    @classmethod
    def load(cls, folder: Path) -> TextTokenizer:
        return cls.from_files(read_tokenizer_files(folder))

    @classmethod
    def from_files(cls, files: dict[str, str]) -> TextTokenizer:
        """From the tokenizer files' texts, by name (``tokenizer.json`` required)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        config: dict[str, Any] = json.loads(files.get("tokenizer_config.json", "{}"))
        source = files.get("chat_template.jinja") or config.get("chat_template")
        template = _template_environment().from_string(source) if source else None
        specials = {
            name: _special(config, name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        return cls(tokenizer=tokenizer, template=template, specials=specials)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.template is None:
            raise ValidationFailed("messages: this model has no chat template", field="messages")
        import jinja2

        try:
            text = self.template.render(
                messages=messages, add_generation_prompt=True, **self.specials
            )
        except jinja2.TemplateError as exc:  # e.g. a template that wants alternating roles
            raise ValidationFailed(f"messages: {exc}", field="messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


class Tokenizers:
    """The process's loaded tokenizers, by model name (loaded on first use)."""

    def __init__(self, settings: Settings, catalog: Catalog, client: redis.Redis) -> None:
        self.settings = settings
        self.catalog = catalog
        self.redis = client
        self._lock = threading.Lock()
        self._loaded: dict[str, TextTokenizer] = {}

    def get(self, definition: ModelDefinition) -> TextTokenizer:
        with self._lock:
            found = self._loaded.get(definition.name)
        if found is not None:
            return found
        folder = tokenizer_folder(definition, self.catalog, self.settings.state_dir)
        if folder is not None:
            loaded = TextTokenizer.load(folder)
        else:
            # No shared model cache (compose, Kubernetes): what a worker published.
            files = fetch_tokenizer_files(self.redis, self.settings, definition.name)
            if not files:
                raise TokenizerMissing(definition.name)
            loaded = TextTokenizer.from_files(files)
        with self._lock:
            return self._loaded.setdefault(definition.name, loaded)


def tokenizers() -> Tokenizers:
    found = current_app.extensions.get(EXTENSION)
    if found is None:
        svc = services()
        found = current_app.extensions.setdefault(
            EXTENSION, Tokenizers(svc.settings, svc.catalog, svc.redis)
        )
    assert isinstance(found, Tokenizers)
    return found


@bp.post("/tokenize")
@spec(
    "Token ids and count of a prompt or chat, as the model's worker would encode it",
    tags=("models",),
    body=TokenizeRequest,
    description="503 until the model's tokenizer files are cached (a worker's first load).",
)
def tokenize() -> Response:
    principal = optional_principal()
    count_lookup(principal)
    req = parse(TokenizeRequest, json_body())
    job_service = services().job_service
    definition = job_service.served_model(req.model)
    job_service.authorize_model(definition, principal)
    tokenizer = tokenizers().get(definition)
    if req.messages is not None:
        ids = tokenizer.encode_chat([m.model_dump() for m in req.messages])
    else:
        ids = tokenizer.encode_prompt(req.prompt or "")
    limit = definition.limits.max_input_tokens
    return jsonify(
        {
            "model": definition.name,
            "tokens": ids,
            "count": len(ids),
            "max_input_tokens": limit,
            "fits": len(ids) <= limit,
        }
    )
