"""Engine fixtures: the tiny random model, loaded once per session, and engines on it."""

from __future__ import annotations

import os

# Never reach the model hub from unit tests; set before transformers is imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from config import Catalog, load_catalog, load_settings

if TYPE_CHECKING:
    from models.engine import Engine
    from models.loader import LoadedModel


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    """The real model catalog of the repository.

    ``SY_TEST_MODELS_DIR`` names another catalog folder: ``python -m bench.cuda``
    uses it to run these tests with ``tiny-random`` on a GPU.
    """
    other = os.environ.get("SY_TEST_MODELS_DIR")
    return load_catalog(Path(other) if other else load_settings({}).models_dir)


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """The state folder's model cache (shared with workers, so reruns are fast)."""
    return load_settings({}).state_dir / "models"


@pytest.fixture(scope="session")
def tiny(catalog: Catalog, model_cache_dir: Path) -> Iterator[LoadedModel]:
    """``tiny-random`` (random 2-layer Llama with SmolLM2's tokenizer), loaded once.

    torch runs on one thread meanwhile: the model's operations are too small to
    gain from more, and spinning OpenMP threads make a busy CI machine crawl.
    """
    import torch

    from models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model(catalog["tiny-random"], catalog, model_cache_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def make_engine(tiny: LoadedModel) -> Iterator[Callable[..., Engine]]:
    """Build started engines on the tiny model; every one is stopped after the test."""
    from models.engine import Engine

    engines: list[Engine] = []

    def make(
        max_batch_size: int = 8,
        max_input_tokens: int = 512,
        start: bool = True,
        prefix_caching: bool = True,
        nice: int = 0,
    ) -> Engine:
        engine = Engine(
            tiny,
            max_batch_size=max_batch_size,
            max_input_tokens=max_input_tokens,
            prefix_caching=prefix_caching,
            nice=nice,
        )
        if start:
            engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop(timeout=10)


def pytest_report_header() -> str:
    """Where the engine tests run (``SY_TEST_MODELS_DIR`` can move them to a GPU)."""
    other = os.environ.get("SY_TEST_MODELS_DIR")
    folder = Path(other) if other else load_settings({}).models_dir
    tiny = load_catalog(folder)["tiny-random"]
    return f"engine tests: tiny-random on device {tiny.device!r}, dtype {tiny.dtype!r} ({folder})"
