"""Turning a :class:`~config.catalog.ModelDefinition` into a model in memory.

Every source is read from local files only (no network): a GGUF file in an
installed package or at a path, a local checkpoint folder, a hub id already in
the local cache, or random weights of a small Llama built from a seed.

A GGUF file is dequantized on its first load (tens of seconds on a CPU); a
plain safetensors copy plus its tokenizer is then written under
``cache_dir/<model name>/model`` and later starts load that copy in well under
a second. Caches are written to a temporary folder and renamed into place, so
two workers starting at once never see a half-written copy. Nothing is loaded
at import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from config.catalog import (
    Catalog,
    GGUFSource,
    HubSource,
    LocalSource,
    ModelDefinition,
    RandomSource,
)
from models.errors import ModelLoadError
from models.llama import LlamaRuntime, supports

log = logging.getLogger(__name__)

MARKER = "switchyard-cache.json"
"""File written last into a cache folder; a folder without it is not a cache."""

CACHE_FORMAT = 1
"""Bumped when the layout of a cache folder changes; older copies are rebuilt."""


@dataclass
class LoadedModel:
    """A model ready for the engine: in eval mode, on ``device``, in ``dtype``.

    ``runtime`` holds the weights the engine runs (repacked, maybe 4-bit:
    ``quantization``); ``model`` keeps the configuration and generation
    settings (its weights are released unless the load kept them).
    """

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    runtime: LlamaRuntime
    quantization: str | None
    step_delay_s: float = 0.0  # a paced test model (RandomSource.step_delay_ms)


def resolve_device(spec: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere (CPU half math is slow)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]


def resolve_quantization(spec: str, device: torch.device) -> str | None:
    """``auto`` is int4 on a CPU (PyTorch's int4 CPU kernels; bench/README.md) and none on CUDA."""
    if spec == "auto":
        return "int4" if device.type == "cpu" else None
    return None if spec == "none" else spec


def load_model(
    definition: ModelDefinition, catalog: Catalog, cache_dir: Path, *, keep_weights: bool = False
) -> LoadedModel:
    """Load ``definition`` into memory; raise :class:`ModelLoadError` if it cannot be.

    ``catalog`` resolves a random model's ``tokenizer_from``; ``cache_dir`` holds
    converted copies (created if missing). The call is slow (it loads weights)
    and is meant to run once per worker process. Once the engine's runtime
    holds its own (repacked) weights, the transformers model's are released
    (moved to the meta device) unless ``keep_weights``: benchmarks that also
    run transformers itself, or rebuild the runtime in other formats, keep them.

    The work runs on a thread of its own that ends with it. OpenMP keeps a
    team of worker threads per calling thread, and a caller's idle team
    halves the speed of the engine's own team on a 2-core machine (measured:
    a decoding step of SmolLM2-135M took 22 ms instead of 12 ms after a load
    on the caller's thread).
    """
    result: list[LoadedModel] = []
    error: list[BaseException] = []
    threads = torch.get_num_threads()

    def work() -> None:
        torch.set_num_threads(threads)
        try:
            result.append(_load_model(definition, catalog, cache_dir, keep_weights))
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=work, name=f"load-{definition.name}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _load_model(
    definition: ModelDefinition, catalog: Catalog, cache_dir: Path, keep_weights: bool
) -> LoadedModel:
    device = resolve_device(definition.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(definition.name, f"device {definition.device!r} asked but no CUDA")
    dtype = resolve_dtype(definition.dtype, device)
    source = definition.source
    try:
        if isinstance(source, RandomSource):
            model, tokenizer = _load_random(definition.name, source, catalog, cache_dir, dtype)
        else:
            model, tokenizer = _load_pretrained(definition.name, source, cache_dir, dtype)
    except ModelLoadError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as exc:
        raise ModelLoadError(definition.name, f"{type(exc).__name__}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    reason = supports(model)
    if reason is not None:
        raise ModelLoadError(definition.name, f"the engine cannot run this model: {reason}")
    quantization = resolve_quantization(definition.quantization, device)
    try:
        with torch.inference_mode():
            runtime = LlamaRuntime(model, quantization=quantization)
    except ValueError as exc:
        raise ModelLoadError(definition.name, f"quantization: {exc}") from exc
    if not keep_weights:
        model.to_empty(device="meta")  # the runtime keeps what it uses; the rest is freed
    pace = source.step_delay_ms / 1000 if isinstance(source, RandomSource) else 0.0
    return LoadedModel(
        definition.name, model, tokenizer, device, dtype, runtime, quantization, pace
    )


# -- sources -----------------------------------------------------------------


def _load_pretrained(
    name: str,
    source: GGUFSource | LocalSource | HubSource,
    cache_dir: Path,
    dtype: torch.dtype,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if isinstance(source, GGUFSource):
        folder, file = _gguf_location(name, source)
        cached = _valid_cache(cache_dir / name / "model", _gguf_fingerprint(folder / file))
        if cached is not None:
            return _from_folder(cached, dtype)
        log.info("dequantizing %s (first load; a safetensors copy will be cached)", folder / file)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=file, dtype=torch.float32
        )
        _write_cache(
            cache_dir / name / "model",
            _gguf_fingerprint(folder / file),
            model=model,
            tokenizer=tokenizer,
        )
        if dtype != torch.float32:
            model.to(dtype)  # type: ignore[arg-type]
        return model, tokenizer
    if isinstance(source, LocalSource):
        path = Path(source.path).expanduser()
        if not path.is_dir():
            raise ModelLoadError(name, f"source.path {str(path)!r} is not a folder")
        return _from_folder(path, dtype)
    kwargs: dict[str, Any] = {"local_files_only": True, "revision": source.revision}
    tokenizer = AutoTokenizer.from_pretrained(source.id, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.id, dtype=dtype, **kwargs)
    return model, tokenizer


def _load_random(
    name: str,
    source: RandomSource,
    catalog: Catalog,
    cache_dir: Path,
    dtype: torch.dtype,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    donor = catalog.get(source.tokenizer_from)
    if donor is None:
        raise ModelLoadError(
            name, f"source.tokenizer_from: no model named {source.tokenizer_from!r}"
        )
    tokenizer = load_tokenizer(donor, cache_dir)
    if source.hidden_size % source.num_attention_heads:
        raise ModelLoadError(name, "hidden_size is not a multiple of num_attention_heads")
    if source.num_attention_heads % source.num_key_value_heads:
        raise ModelLoadError(name, "num_attention_heads is not a multiple of num_key_value_heads")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    # A private RNG: building a test model must not reseed the caller's torch.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(source.seed)
        model = LlamaForCausalLM(config)
    model.to(dtype)  # type: ignore[arg-type]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model, tokenizer


def load_tokenizer(definition: ModelDefinition, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``definition`` alone, cached like its model (fast on reuse)."""
    source = definition.source
    if isinstance(source, RandomSource):
        raise ModelLoadError(definition.name, "a random model has no tokenizer of its own")
    if isinstance(source, LocalSource):
        return AutoTokenizer.from_pretrained(str(Path(source.path).expanduser()))
    if isinstance(source, HubSource):
        return AutoTokenizer.from_pretrained(
            source.id, local_files_only=True, revision=source.revision
        )
    folder, file = _gguf_location(definition.name, source)
    fingerprint = _gguf_fingerprint(folder / file)
    for candidate in (
        cache_dir / definition.name / "model",
        cache_dir / definition.name / "tokenizer",
    ):
        cached = _valid_cache(candidate, fingerprint)
        if cached is not None:
            return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=file)
    _write_cache(cache_dir / definition.name / "tokenizer", fingerprint, tokenizer=tokenizer)
    return tokenizer


# -- GGUF location and cache ------------------------------------------------------


def _gguf_location(name: str, source: GGUFSource) -> tuple[Path, str]:
    if source.package is not None:
        # find_spec, not import: a package may ship the file but import things we lack.
        spec = importlib.util.find_spec(source.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(name, f"source.package {source.package!r} is not installed")
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:
        folder = Path(str(source.path)).expanduser()
    if not (folder / source.file).is_file():
        raise ModelLoadError(name, f"source.file {source.file!r} not found in {folder}")
    return folder, source.file


def _gguf_fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {
        "format": CACHE_FORMAT,
        "source": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _valid_cache(folder: Path, fingerprint: dict[str, Any]) -> Path | None:
    try:
        recorded = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return folder if recorded == fingerprint else None


def _write_cache(
    folder: Path,
    fingerprint: dict[str, Any],
    *,
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel | None = None,
) -> None:
    """Write a cache folder atomically: build it aside, then rename it into place.

    A failure to write (read-only disk, full disk) is logged, not raised: the
    model in memory is fine, only the next start will be slow again.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex}"
    try:
        if model is not None:
            # transformers refuses to save a GGUF-quantized model; the weights
            # in memory are already plain dequantized tensors, so drop the marks.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(fingerprint), encoding="utf-8")
        if folder.exists():
            # A stale copy (older source or format): move it aside, then drop it.
            stale = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex}"
            with contextlib.suppress(OSError):
                os.rename(folder, stale)
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process renamed its copy in first; theirs is as good as ours.
            log.info("cache %s was written by another process", folder)
    except OSError as exc:
        log.warning("could not write the model cache %s: %s", folder, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_folder(
    folder: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model, tokenizer
