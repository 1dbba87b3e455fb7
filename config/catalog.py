"""Model definitions: one YAML file per model under ``config/models/``.

A definition is validated when the catalog is loaded; a bad file raises
:class:`CatalogError` naming the file and the field, and the whole catalog is
refused (a farm that silently drops a model is worse than one that won't start).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from config.sampling import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MAX_TOP_K

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"


class CatalogError(ValueError):
    """A model definition file is unreadable or invalid."""

    def __init__(self, path: Path, field: str, message: str) -> None:
        super().__init__(f"{path}: {field}: {message}")
        self.path = path
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GGUFSource(_Strict):
    """A GGUF file, found in an installed Python package or at a path."""

    kind: Literal["gguf"]
    file: str
    package: str | None = None
    path: str | None = None

    @model_validator(mode="after")
    def _one_location(self) -> GGUFSource:
        if (self.package is None) == (self.path is None):
            raise ValueError("give exactly one of 'package' or 'path'")
        return self


class LocalSource(_Strict):
    """A folder holding a transformers checkpoint (config, weights, tokenizer)."""

    kind: Literal["local"]
    path: str


class HubSource(_Strict):
    """A hub id; only ever read from the local cache (no network at run time)."""

    kind: Literal["hub"]
    id: str
    revision: str | None = None


class RandomSource(_Strict):
    """Random weights of a small Llama-shaped model, built locally (tests).

    The tokenizer is borrowed from another model of the catalog so the chat
    template and vocabulary are real.
    """

    kind: Literal["random"]
    tokenizer_from: str
    seed: int = 0
    hidden_size: int = Field(default=64, ge=8)
    intermediate_size: int = Field(default=128, ge=8)
    num_hidden_layers: int = Field(default=2, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    step_delay_ms: float = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Time each engine step takes at least: a test model with a set pace, "
        "so fault tests catch jobs mid-flight however fast the engine is.",
    )


Source = Annotated[GGUFSource | LocalSource | HubSource | RandomSource, Field(discriminator="kind")]


class Limits(_Strict):
    """What one request and one worker may take."""

    max_input_tokens: int = Field(default=2048, ge=1)
    max_new_tokens: int = Field(default=512, ge=1)
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_step_tokens: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="Tokens one engine step runs: decoding rows plus prompt chunks.",
    )
    slots: int | None = Field(
        default=None, ge=1, le=1024, description="Celery task slots; default max_batch_size."
    )
    max_queue_length: int | None = Field(
        default=None,
        ge=0,
        description="Jobs that may wait in the queue (429 beyond); default the setting's.",
    )

    @property
    def task_slots(self) -> int:
        return self.slots if self.slots is not None else self.max_batch_size


class SamplingDefaults(_Strict):
    """Sampling used when a request does not say."""

    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.7, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    repetition_penalty: float = Field(default=1.0, gt=0, le=MAX_REPETITION_PENALTY)


class RunCommand(_Strict):
    """Run ``args`` (no shell) before the model loads; a non-zero exit or ``timeout_s`` fails it."""

    action: Literal["run_command"]
    args: list[str] = Field(min_length=1)
    timeout_s: float = Field(default=60, gt=0)


class WriteFile(_Strict):
    """Write ``body`` to ``path`` (relative paths: under the state folder) before loading."""

    action: Literal["write_file"]
    path: str
    body: str
    mode: str = Field(default="0644", pattern=r"^0[0-7]{3}$")


PreStartAction = Annotated[RunCommand | WriteFile, Field(discriminator="action")]


class HealthCheck(_Strict):
    """How a ready worker checks its own engine: a one-token generation every ``interval_s``.

    After ``max_retries`` failures in a row (an error, or no answer within
    ``timeout_s``) the worker reports ``failed`` and exits non-zero, so its
    executor restarts it.
    """

    interval_s: float = Field(default=10, gt=0)
    max_retries: int = Field(default=3, ge=1)
    initial_delay_s: float = Field(default=0, ge=0)
    timeout_s: float = Field(default=30, gt=0)


class ScheduleWindow(_Strict):
    """A time-of-day window: while ``cron`` matches, replicas are clamped.

    The window is active during every minute the five-field cron expression
    matches in ``timezone`` (``* 9-18 * * 1-5``: weekdays 09:00-18:59).
    """

    cron: str
    timezone: str = "UTC"
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=0)

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        from croniter import croniter

        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a five-field cron expression")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {value!r}") from None
        return value

    @model_validator(mode="after")
    def _bounds(self) -> ScheduleWindow:
        if self.min_replicas is None and self.max_replicas is None:
            raise ValueError("a window sets min_replicas, max_replicas or both")
        if (
            self.min_replicas is not None
            and self.max_replicas is not None
            and self.min_replicas > self.max_replicas
        ):
            raise ValueError("min_replicas is above max_replicas")
        return self


SCALING_TUNABLES = (
    "min_replicas",
    "max_replicas",
    "target_jobs_per_replica",
    "upscale_delay_s",
    "downscale_delay_s",
    "scale_to_zero_delay_s",
)
"""The scaling fields an operator may change at run time (``switchyard scale``, the API)."""


class Scaling(_Strict):
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=1, ge=0)
    target_jobs_per_replica: float = Field(default=8, gt=0)
    upscale_delay_s: float = Field(default=0, ge=0)
    downscale_delay_s: float = Field(default=300, ge=0)
    scale_to_zero_delay_s: float = Field(default=900, ge=0)
    windows: list[ScheduleWindow] = Field(default_factory=list)

    @model_validator(mode="after")
    def _ordered(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        return self


class ModelDefinition(_Strict):
    """One served model: where it comes from, how it runs, who may use it."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    source: Source
    backend: Literal["transformers"] = "transformers"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int4", "int4-a8"] = Field(
        default="auto",
        description="Linear-layer weights: int4 (4-bit weights in groups of 32, 16-bit "
        "activations: the float32 rendition's answers), int4-a8 (the same weights with "
        "8-bit activations: faster steps of several rows, answers that drift; CPU "
        "only), none (dense in dtype), auto (int4 on a CPU, none on a GPU).",
    )
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    limits: Limits = Field(default_factory=Limits)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    public: bool = False
    enabled: bool = True
    pre_start_actions: list[PreStartAction] = Field(default_factory=list)
    health_check: HealthCheck = Field(default_factory=HealthCheck)
    scaling: Scaling = Field(default_factory=Scaling)

    @model_validator(mode="after")
    def _int4_a8_on_a_cpu(self) -> ModelDefinition:
        if self.quantization == "int4-a8" and self.device.startswith("cuda"):
            raise ValueError("quantization int4-a8 runs on a CPU only (device: auto or cpu)")
        return self

    @model_validator(mode="after")
    def _sampling_within_limits(self) -> ModelDefinition:
        if self.sampling.max_new_tokens > self.limits.max_new_tokens:
            raise ValueError("sampling.max_new_tokens is above limits.max_new_tokens")
        return self


class Catalog:
    """The models this farm knows, by name, in file order."""

    def __init__(self, definitions: list[ModelDefinition]) -> None:
        self._by_name = {d.name: d for d in definitions}

    def __iter__(self) -> Iterator[ModelDefinition]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> ModelDefinition | None:
        return self._by_name.get(name)

    def __getitem__(self, name: str) -> ModelDefinition:
        return self._by_name[name]

    @property
    def names(self) -> list[str]:
        return list(self._by_name)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(file)"


def load_definition(path: Path) -> ModelDefinition:
    """Read and validate one definition file."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CatalogError(path, "(file)", f"cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise CatalogError(path, "(file)", "expected a mapping of fields")
    try:
        definition = ModelDefinition.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CatalogError(path, _field_path(first["loc"]), first["msg"]) from None
    if definition.name != path.stem:
        raise CatalogError(path, "name", f"{definition.name!r} differs from the file name")
    return definition


def load_catalog(models_dir: Path) -> Catalog:
    """Load every ``*.yaml`` under ``models_dir``; any bad file refuses the lot."""
    if not models_dir.is_dir():
        raise CatalogError(models_dir, "(folder)", "no such folder")
    definitions = [load_definition(p) for p in sorted(models_dir.glob("*.yaml"))]
    catalog = Catalog(definitions)
    for d in catalog:
        if isinstance(d.source, RandomSource) and d.source.tokenizer_from not in catalog:
            raise CatalogError(
                models_dir / f"{d.name}.yaml",
                "source.tokenizer_from",
                f"no model named {d.source.tokenizer_from!r}",
            )
    return catalog
