"""Benchmark of the bare generation engine, in process (no queue, no API).

``python -m bench.engine`` loads SmolLM2-135M and, for greedy decoding of 64
new tokens from fixed prompts, prints the single-stream tokens/s and, for 1, 4,
8 and 16 concurrent clients, the aggregate tokens/s, the time to first token
(p50) and the ratio to single-stream, all measured in the same run.
``--document N`` puts the first N words of ``bench/quality.txt`` (repeated as
needed) before every prompt: the same levels at a long context, where
attention over the KV cache weighs as much as the weights.

:func:`run_engine_bench` returns the rows so a farm benchmark can reuse it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
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


def with_document(prompts: Sequence[str], words: int) -> list[str]:
    """``prompts``, each after the first ``words`` words of ``bench/quality.txt``
    (the text repeated as often as needed) and a blank line."""
    if words <= 0:
        return list(prompts)
    text = (Path(__file__).with_name("quality.txt")).read_text(encoding="utf-8").split()
    document = " ".join((text * (words // len(text) + 1))[:words])
    return [f"{document}\n\n{prompt}" for prompt in prompts]


def run_engine_bench(
    loaded: Any,
    *,
    concurrencies: Sequence[int] = (1, 4, 8, 16),
    max_new_tokens: int = 64,
    requests_per_client: int = 2,
    max_batch_size: int | None = None,
    prompts: Sequence[str] = PROMPTS,
    progress: Callable[[dict[str, float]], None] | None = None,
    nice: int = 0,
) -> list[dict[str, float]]:
    """Measure one engine at several concurrency levels; return one row per level.

    ``loaded`` is a :class:`models.loader.LoadedModel`. First every prompt runs
    alone, one after another: that is the single-stream baseline (row with
    ``concurrency`` 0) and the reference text of each prompt. Then each level
    runs ``concurrency`` client threads, each sending ``requests_per_client``
    requests one after another (so requests join and leave a running batch).
    Row keys: ``concurrency``, ``requests``, ``tokens``, ``seconds``,
    ``tokens_per_s`` (aggregate), ``ttft_p50_s``, ``ratio`` (to single-stream)
    and ``identical`` (share of requests whose text equals the prompt's text
    alone). ``progress`` is called with each row as soon as it is measured.
    ``nice`` is the engine's (:class:`models.engine.Engine`).
    """
    from models.engine import Engine, GenerationRequest, SamplingParams, freeze_heap

    engine = Engine(
        loaded,
        max_batch_size=max_batch_size or max(concurrencies),
        max_input_tokens=2048,
        nice=nice,
    )
    engine.start()
    encoded = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    try:
        engine.generate(GenerationRequest("warm-up", encoded[0], params))
        freeze_heap()  # as the worker does once loaded
        reference: dict[int, str] = {}
        single = _run_level(engine, encoded, params, 1, len(encoded), reference, None)
        single["concurrency"] = 0
        single["ratio"] = 1.0
        rows = [single]
        if progress:
            progress(single)
        for c in concurrencies:
            row = _run_level(engine, encoded, params, c, requests_per_client, None, reference)
            row["ratio"] = row["tokens_per_s"] / single["tokens_per_s"]
            rows.append(row)
            if progress:
                progress(row)
    finally:
        engine.stop()
    return rows


def _run_level(
    engine: Any,
    encoded: Sequence[list[int]],
    params: Any,
    concurrency: int,
    requests_per_client: int,
    record: dict[int, str] | None,
    reference: dict[int, str] | None,
) -> dict[str, float]:
    """``concurrency`` closed-loop clients, each sending ``requests_per_client`` requests."""
    from models.engine import FinishEvent, GenerationRequest

    ttfts: list[float] = []
    counts: list[int] = []
    same: list[bool] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(requests_per_client):
            which = (k * requests_per_client + j) % len(encoded)
            start = time.perf_counter()
            handle = engine.submit(GenerationRequest(f"c{k}-{j}", encoded[which], params))
            first: float | None = None
            for event in handle:
                if first is None:
                    first = time.perf_counter() - start
                if isinstance(event, FinishEvent):
                    with lock:
                        counts.append(event.completion_tokens)
                        ttfts.append(first)
                        if record is not None:
                            record[which] = event.text
                        if reference is not None:
                            same.append(reference.get(which) == event.text)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests": concurrency * requests_per_client,
        "tokens": sum(counts),
        "seconds": seconds,
        "tokens_per_s": sum(counts) / seconds,
        "ttft_p50_s": statistics.median(ttfts),
        "identical": sum(same) / len(same) if same else 1.0,
    }


def run_alternatives(
    loaded: Any,
    fresh_copy: Any,
    *,
    batch: int = 8,
    max_new_tokens: int = 64,
    prompts: Sequence[str] = PROMPTS,
) -> list[dict[str, Any]]:
    """Other ways to batch the same model, measured for comparison with the engine.

    ``transformers generate``: one static, left-padded batch of ``batch``
    prompts (every request starts and ends together; none can join).
    ``ContinuousBatchingManager``: transformers' own continuous batching, with
    ``batch`` streamed requests. ``fresh_copy`` is a second load of the model,
    because the manager switches the model's attention implementation.
    Rows: ``name``, ``tokens``, ``seconds``, ``tokens_per_s``.
    """
    import torch
    from transformers import GenerationConfig

    tokenizer = loaded.tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompts[i % len(prompts)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(batch)
    ]
    rows: list[dict[str, Any]] = []

    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    inputs = {k: v.to(loaded.device) for k, v in inputs.items()}
    with torch.inference_mode():
        started = time.perf_counter()
        out = loaded.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        seconds = time.perf_counter() - started
    new = out[:, inputs["input_ids"].shape[1] :]
    tokens = int((new != tokenizer.pad_token_id).sum())
    rows.append(_alt_row(f"transformers generate, static batch {batch}", tokens, seconds))

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    manager = fresh_copy.model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        started = time.perf_counter()
        for i, prompt in enumerate(ids):
            manager.add_request(prompt, request_id=f"cb{i}", max_new_tokens=max_new_tokens)
        tokens = 0
        for i in range(len(ids)):
            result = manager.get_result(request_id=f"cb{i}", timeout=600)
            tokens += len(result.generated_tokens) if result is not None else 0
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    rows.append(_alt_row(f"ContinuousBatchingManager, {batch} requests", tokens, seconds))
    return rows


def _alt_row(name: str, tokens: int, seconds: float) -> dict[str, Any]:
    return {"name": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def format_table(rows: Sequence[dict[str, float]], title: str) -> str:
    """A small text table of :func:`run_engine_bench` rows."""
    lines = [
        title,
        f"{'clients':>7} {'requests':>8} {'tokens':>6} {'seconds':>7} {'tok/s':>7} "
        f"{'TTFT p50':>9} {'x single':>8} {'same text':>9}",
    ]
    for r in rows:
        clients = str(int(r["concurrency"])) if r["concurrency"] else "single"
        lines.append(
            f"{clients:>7} {int(r['requests']):>8} {int(r['tokens']):>6} "
            f"{r['seconds']:>7.2f} {r['tokens_per_s']:>7.1f} {r['ttft_p50_s'] * 1000:>7.0f}ms "
            f"{r['ratio']:>7.2f}x {r['identical'] * 100:>8.0f}%"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help="how many of the fixed prompts to use"
    )
    parser.add_argument(
        "--document",
        type=int,
        default=0,
        metavar="WORDS",
        help="put this many words of bench/quality.txt before every prompt (a long context)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--quantization",
        choices=["int4", "int4-a8", "none"],
        help="the model's weight format instead of its definition's (models/*.yaml)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also measure transformers' static-batch generate and ContinuousBatchingManager",
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workers.openmp import spin_briefly

    spin_briefly()  # as a worker does (before torch loads)
    import torch

    from config import load_catalog, load_settings
    from models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = load_settings()
    catalog = load_catalog(settings.models_dir)
    started = time.perf_counter()
    cache = Path(settings.state_dir) / "models"
    definition = catalog[args.model]
    if args.quantization:
        definition = definition.model_copy(update={"quantization": args.quantization})
    loaded = load_model(definition, catalog, cache, keep_weights=args.compare)
    print(
        f"loaded {args.model} in {time.perf_counter() - started:.1f}s ({loaded.device}, "
        f"{loaded.dtype}, {loaded.quantization or 'dense'}, "
        f"torch threads {torch.get_num_threads()})"
    )
    prompts = with_document(PROMPTS[: args.prompts], args.document)
    title = f"engine: {args.model}, greedy, {args.max_new_tokens} new tokens"
    if args.document:
        lengths = [len(loaded.tokenizer(p)["input_ids"]) for p in prompts]
        title += f", prompts of {min(lengths)}-{max(lengths)} tokens"
    print(format_table([], title))
    rows = run_engine_bench(
        loaded,
        concurrencies=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        requests_per_client=args.requests_per_client,
        prompts=prompts,
        progress=lambda row: print(format_table([row], "").splitlines()[-1], flush=True),
        nice=settings.engine_nice,  # as a worker's engine
    )
    if args.compare:
        single = rows[0]["tokens_per_s"]
        copy = load_model(definition, catalog, cache, keep_weights=True)
        alternatives = run_alternatives(
            loaded, copy, max_new_tokens=args.max_new_tokens, prompts=prompts
        )
        for alt in alternatives:
            print(
                f"{alt['name']:<45} {alt['tokens']:>5} tokens {alt['seconds']:>7.2f}s "
                f"{alt['tokens_per_s']:>7.1f} tok/s {alt['tokens_per_s'] / single:>6.2f}x single"
            )


if __name__ == "__main__":
    main()
