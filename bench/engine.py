"""Benchmark of the bare generation engine, in process (no queue, no API).

``python -m bench.engine`` loads SmolLM2-135M and, for greedy decoding of 64
new tokens from fixed prompts, prints the single-stream tokens/s and, for 1, 4,
8 and 16 concurrent clients, the aggregate tokens/s, the time to first token
(p50) and the ratio to single-stream, all measured in the same run.

:func:`run_engine_bench` returns the rows so a farm benchmark can reuse it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle gear system works.",
    "Describe a walk through a busy market in a large city.",
    "Write a letter to a friend about your summer holiday by the sea.",
    "Explain why the sky is blue to a ten year old, step by step.",
    "Tell me about the history of bread making.",
    "Write a detailed recipe for a vegetable soup.",
    "Describe how a train journey across the mountains feels.",
)


def run_engine_bench(
    loaded: Any,
    *,
    concurrencies: Sequence[int] = (1, 4, 8, 16),
    max_new_tokens: int = 64,
    requests_per_client: int = 2,
    max_batch_size: int | None = None,
    prompts: Sequence[str] = PROMPTS,
) -> list[dict[str, float]]:
    """Measure one engine at several concurrency levels; return one row per level.

    ``loaded`` is a :class:`models.loader.LoadedModel`. Each level runs
    ``concurrency`` client threads, each sending ``requests_per_client``
    requests one after another (so requests join and leave a running batch).
    Row keys: ``concurrency``, ``requests``, ``tokens``, ``seconds``,
    ``tokens_per_s`` (aggregate), ``ttft_p50_s``, ``ratio`` (to the first
    row, normally concurrency 1).
    """
    from models.engine import Engine, FinishEvent, GenerationRequest, SamplingParams

    engine = Engine(
        loaded,
        max_batch_size=max_batch_size or max(concurrencies),
        max_input_tokens=2048,
    )
    engine.start()
    encoded = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    try:
        engine.generate(GenerationRequest("warm-up", encoded[0], params))
        rows: list[dict[str, float]] = []
        for concurrency in concurrencies:
            ttfts: list[float] = []
            tokens = 0
            lock = threading.Lock()

            def client(k: int) -> None:
                nonlocal tokens
                for j in range(requests_per_client):
                    ids = encoded[(k * requests_per_client + j) % len(encoded)]
                    start = time.perf_counter()
                    handle = engine.submit(GenerationRequest(f"c{k}-{j}", ids, params))
                    first: float | None = None
                    for event in handle:
                        if first is None:
                            first = time.perf_counter() - start
                        if isinstance(event, FinishEvent):
                            with lock:
                                tokens += event.completion_tokens
                                ttfts.append(first)

            threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "concurrency": concurrency,
                    "requests": concurrency * requests_per_client,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "ttft_p50_s": statistics.median(ttfts),
                }
            )
    finally:
        engine.stop()
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base
    return rows


def format_table(rows: Sequence[dict[str, float]], title: str) -> str:
    """A small text table of :func:`run_engine_bench` rows."""
    lines = [
        title,
        f"{'clients':>7} {'requests':>8} {'tokens':>6} {'seconds':>7} {'tok/s':>7} {'TTFT p50':>9} {'x single':>8}",
    ]
    for r in rows:
        lines.append(
            f"{int(r['concurrency']):>7} {int(r['requests']):>8} {int(r['tokens']):>6} "
            f"{r['seconds']:>7.2f} {r['tokens_per_s']:>7.1f} {r['ttft_p50_s'] * 1000:>7.0f}ms "
            f"{r['ratio']:>7.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from config import load_catalog, load_settings
    from models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = load_settings()
    catalog = load_catalog(settings.models_dir)
    started = time.perf_counter()
    loaded = load_model(catalog[args.model], catalog, Path(settings.state_dir) / "models")
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f}s "
          f"({loaded.device}, {loaded.dtype}, torch threads {torch.get_num_threads()})")
    rows = run_engine_bench(
        loaded,
        concurrencies=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        requests_per_client=args.requests_per_client,
    )
    print(format_table(rows, f"engine: {args.model}, greedy, {args.max_new_tokens} new tokens"))


if __name__ == "__main__":
    main()
