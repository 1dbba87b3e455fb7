"""The batching engine on the tiny random model: batching, sampling, text, failures."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from models.detokenize import IncrementalDetokenizer, StopStringFilter
from models.engine import (
    Engine,
    EngineClosed,
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    PromptTooLong,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)
from models.loader import LoadedModel

MakeEngine = Callable[..., Engine]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)


def drain(handle: RequestHandle, timeout: float = 30) -> tuple[list[TokenEvent], FinishEvent]:
    """Every event of ``handle``; fails the test if it takes longer than ``timeout``."""
    tokens: list[TokenEvent] = []
    deadline = time.monotonic() + timeout
    while True:
        event = handle.next_event(timeout=max(0.0, deadline - time.monotonic()))
        assert event is not None, "the engine did not finish the request in time"
        if isinstance(event, FinishEvent):
            return tokens, event
        tokens.append(event)


def ids_of(tokens: list[TokenEvent]) -> list[int]:
    return [t for event in tokens for t in event.token_ids]


def prompts(engine: Engine, n: int) -> list[list[int]]:
    """``n`` chat prompts of different lengths."""
    return [
        engine.encode_chat([{"role": "user", "content": "Tell me a story " + "about cats " * i}])
        for i in range(n)
    ]


def record_batch_sizes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    original = engine._decode_step

    def step() -> None:
        sizes.append(len(engine._batch))
        original()

    monkeypatch.setattr(engine, "_decode_step", step)
    return sizes


# -- batching ---------------------------------------------------------------------


def test_greedy_output_is_the_same_alone_and_joining_a_running_batch(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 6)
    lengths = [40, 12, 30, 8, 25, 16]
    alone = []
    for i, p in enumerate(ps):
        tokens, finish = drain(
            engine.submit(GenerationRequest(f"alone{i}", p, GREEDY_N(lengths[i])))
        )
        assert finish.finish_reason == "length"
        alone.append((ids_of(tokens), finish.text))

    sizes = record_batch_sizes(engine, monkeypatch)
    handles: list[RequestHandle] = []
    firsts: list[TokenEvent] = []
    for i, p in enumerate(ps):
        handles.append(engine.submit(GenerationRequest(f"mixed{i}", p, GREEDY_N(lengths[i]))))
        if i < 3:
            # Wait until this one is decoding, so the next one joins mid-flight.
            first = handles[-1].next_event(timeout=30)
            assert isinstance(first, TokenEvent)
            firsts.append(first)
    results = []
    for i, h in enumerate(handles):
        tokens, finish = drain(h)
        if i < 3:
            tokens = [firsts[i], *tokens]
        results.append((ids_of(tokens), finish.text))
        assert finish.finish_reason == "length"
        assert finish.completion_tokens == lengths[i]
    assert results == alone
    assert max(sizes) == 4, "requests were not batched together"
    assert engine.busy_slots == 0


def GREEDY_N(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def test_max_batch_size_is_respected_and_waiting_requests_are_served_in_order(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_batch_size=3)
    sizes = record_batch_sizes(engine, monkeypatch)
    admitted: list[str] = []
    original = engine._prefill

    def prefill(seq: Any) -> Any:
        admitted.append(seq.request.request_id)
        return original(seq)

    monkeypatch.setattr(engine, "_prefill", prefill)
    ps = prompts(engine, 7)
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(10))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert all(f.finish_reason == "length" for f in finishes)
    assert max(sizes) == 3
    assert admitted == [f"r{i}" for i in range(7)]


def test_concurrent_submits_from_many_threads(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 4)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY)).text for p in ps]
    results: dict[int, str] = {}

    def client(i: int) -> None:
        results[i] = engine.generate(GenerationRequest(f"t{i}", ps[i % 4], GREEDY)).text

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(12)] == [expected[i % 4] for i in range(12)]
    assert engine.tokens_per_second() > 0


# -- sampling -----------------------------------------------------------------------


def test_a_seed_gives_the_same_text_alone_and_batched(make_engine: MakeEngine) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    first = engine.generate(GenerationRequest("a", p, params))
    again = engine.generate(GenerationRequest("b", p, params))
    assert first.text == again.text
    others = [
        engine.submit(GenerationRequest(f"n{i}", p, SamplingParams(max_new_tokens=20, seed=i)))
        for i in range(3)
    ]
    batched = engine.generate(GenerationRequest("c", p, params))
    assert batched.text == first.text
    assert {drain(h)[1].text for h in others} != {first.text}
    other_seed = engine.generate(
        GenerationRequest("d", p, SamplingParams(max_new_tokens=20, top_p=0.9, top_k=50, seed=99))
    )
    assert other_seed.text != first.text


def test_repetition_penalty_and_filters_produce_valid_output(make_engine: MakeEngine) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    for params in (
        SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=1, seed=3),
        SamplingParams(max_new_tokens=12, temperature=2.0, top_p=0.5, seed=3),
    ):
        finish = engine.generate(GenerationRequest("p", p, params))
        assert finish.finish_reason == "length"
        assert finish.completion_tokens == 12
    # top_k=1 is greedy whatever the temperature.
    greedy = engine.generate(GenerationRequest("g", p, GREEDY_N(12)))
    top1 = engine.generate(
        GenerationRequest("k", p, SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1))
    )
    assert top1.text == greedy.text


# -- stop strings, eos and text --------------------------------------------------------


def test_stop_string_split_across_tokens_is_never_emitted(
    make_engine: MakeEngine, tiny: LoadedModel
) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    tokens, full = drain(engine.submit(GenerationRequest("full", p, GREEDY_N(40))))
    pieces = [tiny.tokenizer.decode([t]) for t in ids_of(tokens)]
    assert "".join(pieces) == full.text
    # A stop string made of the end of one token and the start of the next.
    stop = None
    offset = 0
    for a, b in itertools.pairwise(pieces[4:]):
        offset = full.text.index(a + b, offset)
        candidate = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and full.text.find(candidate) == offset + len(a) - 2:
            stop = candidate
            break
    assert stop is not None, "no usable token boundary in the greedy output"
    expected = full.text[: full.text.index(stop)]

    params = SamplingParams(max_new_tokens=40, temperature=0, stop=("never-there", stop))
    tokens, finish = drain(engine.submit(GenerationRequest("stop", p, params)))
    assert finish.finish_reason == "stop_sequence"
    assert finish.text == expected
    assert "".join(e.text for e in tokens) == expected
    assert all(stop not in e.text for e in tokens)


def test_stop_string_that_never_matches_releases_held_text_at_the_end(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    full = engine.generate(GenerationRequest("full", p, GREEDY_N(20)))
    # The output's last character plus something that never follows: held back to the end.
    stop = full.text[-1] + "\x00never"
    tokens, finish = drain(
        engine.submit(
            GenerationRequest(
                "s", p, SamplingParams(max_new_tokens=20, temperature=0, stop=(stop,))
            )
        )
    )
    assert finish.finish_reason == "length"
    assert finish.text == full.text == "".join(e.text for e in tokens)


class ScriptedModel:
    """Wraps a model so that one request (batch row 0) produces ``script``, token by token."""

    def __init__(self, model: Any, prompt_len: int, script: list[int]) -> None:
        self._model = model
        self._prompt_len = prompt_len
        self._script = script
        self.config = model.config
        self.generation_config = model.generation_config
        self.forward = model.forward

    def get_input_embeddings(self) -> Any:
        return self._model.get_input_embeddings()

    def __call__(self, *, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        out = self._model(input_ids=input_ids, **kwargs)
        positions = kwargs.get("position_ids")
        if positions is None:
            index = input_ids.shape[1] - self._prompt_len
        else:
            index = int(positions[0, -1]) - self._prompt_len + 1
        token = self._script[min(index, len(self._script) - 1)]
        out.logits[0, -1, :] = -1e4
        out.logits[0, -1, token] = 1e4
        return out


def scripted_engine(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, prompt: list[int], script: list[int]
) -> Engine:
    engine = make_engine()
    monkeypatch.setattr(engine, "model", ScriptedModel(engine.model, len(prompt), script))
    return engine


@pytest.mark.parametrize(
    "text",
    ["안녕하세요, 세계! 반갑습니다.", "Emoji: 👋🏽 🇫🇷 🧑‍🚀 done", "naïve café — 東京 ✓"],
)
def test_multibyte_text_round_trips_without_broken_characters(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel, text: str
) -> None:
    script = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = prompts(make_engine(start=False), 1)[0]
    engine = scripted_engine(make_engine, monkeypatch, prompt, script)
    tokens, finish = drain(engine.submit(GenerationRequest("mb", prompt, GREEDY_N(len(script)))))
    assert finish.finish_reason == "length"
    assert finish.text == text == "".join(e.text for e in tokens)
    assert ids_of(tokens) == script
    assert all("\ufffd" not in e.text for e in tokens)
    # Some tokens carry only part of a character: they are sent with the token completing it.
    assert len(tokens) < len(script) or text.isascii()


def test_emoji_stop_string_and_eos(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> None:
    tok = tiny.tokenizer
    script = tok("Hi 👋🏽 there 🇫🇷 end", add_special_tokens=False)["input_ids"]
    prompt = prompts(make_engine(start=False), 1)[0]
    engine = scripted_engine(make_engine, monkeypatch, prompt, script)
    tokens, finish = drain(
        engine.submit(
            GenerationRequest(
                "s", prompt, SamplingParams(max_new_tokens=60, temperature=0, stop=("🇫🇷",))
            )
        )
    )
    assert (finish.finish_reason, finish.text) == ("stop_sequence", "Hi 👋🏽 there ")
    assert "".join(e.text for e in tokens) == finish.text

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos_script = [*tok("Bonjour", add_special_tokens=False)["input_ids"], im_end]
    engine = scripted_engine(make_engine, monkeypatch, prompt, eos_script)
    tokens, finish = drain(engine.submit(GenerationRequest("e", prompt, GREEDY_N(60))))
    assert (finish.finish_reason, finish.text) == ("eos_token", "Bonjour")
    assert finish.completion_tokens == len(eos_script)
    assert finish.prompt_tokens == len(prompt)


def test_random_output_round_trips(make_engine: MakeEngine, tiny: LoadedModel) -> None:
    """Free sampling emits byte-pieces of characters; text must match a full decode."""
    engine = make_engine()
    p = prompts(engine, 1)[0]
    for seed in range(4):
        params = SamplingParams(max_new_tokens=48, temperature=3.0, seed=seed)
        tokens, finish = drain(engine.submit(GenerationRequest(f"r{seed}", p, params)))
        assert "".join(e.text for e in tokens) == finish.text
        assert all(e.text for e in tokens)


def test_incremental_detokenizer_and_stop_filter_units(tiny: LoadedModel) -> None:
    text = "Grüße 👋🏽 from 서울 and   spaces\n\nnew lines"
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tiny.tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == text == detok.full_text()
    assert all("\ufffd" not in piece for piece in pieces)

    f = StopStringFilter(("STOP", "xy"))
    assert f.feed("abc ST") == ("abc ", False)
    assert f.feed("O") == ("", False)
    assert f.feed("P and more") == ("", True)
    f = StopStringFilter(("STOP",))
    assert f.feed("abc ST") == ("abc ", False)
    assert f.feed("ill") == ("STill", False)
    assert f.flush() == ""


# -- cancellation and stop ----------------------------------------------------------------


def test_cancel_ends_the_request_and_frees_its_slot(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=1)
    p = prompts(engine, 1)[0]
    running = engine.submit(GenerationRequest("long", p, GREEDY_N(3000)))
    queued = engine.submit(GenerationRequest("next", p, GREEDY_N(5)))
    first = running.next_event(timeout=30)
    assert isinstance(first, TokenEvent)
    assert engine.busy_slots == 1
    running.cancel()
    tokens, finish = drain(running)
    assert finish.finish_reason == "cancelled"
    assert finish.text == first.text + "".join(e.text for e in tokens)
    assert finish.completion_tokens < 3000
    # The freed slot serves the waiting request.
    assert drain(queued)[1].finish_reason == "length"
    assert engine.busy_slots == 0
    running.cancel()  # cancelling a finished request does nothing
    assert running.next_event(timeout=0) == finish


def test_cancel_a_waiting_request_ends_it_at_once(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=1)
    p = prompts(engine, 1)[0]
    running = engine.submit(GenerationRequest("long", p, GREEDY_N(3000)))
    assert running.next_event(timeout=30) is not None
    waiting = engine.submit(GenerationRequest("w", p, GREEDY_N(5)))
    waiting.cancel()
    assert drain(waiting, timeout=1)[1] == FinishEvent("cancelled", "", len(p), 0)
    running.cancel()
    assert drain(running)[1].finish_reason == "cancelled"


def test_stop_cancels_pending_requests_and_refuses_new_ones(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=1)
    p = prompts(engine, 1)[0]
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(3000))) for i in range(3)]
    assert handles[0].next_event(timeout=30) is not None
    engine.stop()
    assert [drain(h)[1].finish_reason for h in handles] == ["cancelled"] * 3
    with pytest.raises(EngineClosed):
        engine.submit(GenerationRequest("late", p, GREEDY))


# -- failure isolation -----------------------------------------------------------------------


def test_a_failing_request_does_not_fail_its_neighbours(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    ps = prompts(engine, 3)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY)).text for p in ps]
    original = engine._advance

    def advance(seq: Any, token: int) -> None:
        if seq.request.request_id == "bad" and len(seq.generated) >= 3:
            raise RuntimeError("sampling exploded")
        original(seq, token)

    monkeypatch.setattr(engine, "_advance", advance)
    handles = [
        engine.submit(GenerationRequest(rid, p, GREEDY))
        for rid, p in zip(["good0", "bad", "good2"], ps, strict=True)
    ]
    finishes = [drain(h)[1] for h in handles]
    assert finishes[1].finish_reason == "error"
    assert finishes[1].error is not None and "sampling exploded" in finishes[1].error
    assert [finishes[0].text, finishes[2].text] == [expected[0], expected[2]]


def test_a_failing_forward_step_fails_its_requests_and_the_engine_serves_on(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    ps = prompts(engine, 2)
    real = engine.model
    failures = {"left": 1}

    class Boom:
        config = real.config
        generation_config = real.generation_config

        def __call__(self, **kwargs: Any) -> Any:
            shape = tuple(kwargs["input_ids"].shape)
            if shape == (2, 1) and failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("device fell over")
            return real(**kwargs)

    monkeypatch.setattr(engine, "model", Boom())
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(30))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert all(f.finish_reason == "error" for f in finishes), finishes
    assert all(f.error and "device fell over" in f.error for f in finishes)
    assert engine.busy_slots == 0
    after = engine.generate(GenerationRequest("after", ps[0], GREEDY))
    assert after.finish_reason == "length"
    assert after.completion_tokens == GREEDY.max_new_tokens


def test_a_failing_prefill_fails_only_that_request(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    original = engine._prefill

    def prefill(seq: Any) -> Any:
        if seq.request.request_id == "bad":
            raise ValueError("bad prompt")
        return original(seq)

    monkeypatch.setattr(engine, "_prefill", prefill)
    good = engine.submit(GenerationRequest("good", p, GREEDY))
    bad = engine.submit(GenerationRequest("bad", p, GREEDY))
    assert drain(bad)[1].finish_reason == "error"
    assert drain(good)[1].finish_reason == "length"


# -- validation and prompts --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(stop=tuple(str(i) for i in range(9))), "stop"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(seed=-1), "seed"),
    ],
)
def test_bad_params_are_refused(
    make_engine: MakeEngine, params: SamplingParams, field: str
) -> None:
    engine = make_engine(start=False)
    with pytest.raises(InvalidRequest) as caught:
        engine.submit(GenerationRequest("r", [1, 2, 3], params))
    assert caught.value.field == field


def test_bad_prompts_are_refused(make_engine: MakeEngine) -> None:
    engine = make_engine(max_input_tokens=16, start=False)
    with pytest.raises(InvalidRequest) as caught:
        engine.submit(GenerationRequest("r", [], GREEDY))
    assert caught.value.field == "prompt"
    with pytest.raises(InvalidRequest):
        engine.submit(GenerationRequest("r", [10**9], GREEDY))
    with pytest.raises(PromptTooLong) as too_long:
        engine.submit(GenerationRequest("r", [5] * 17, GREEDY))
    assert (too_long.value.n_tokens, too_long.value.limit) == (17, 16)
    with pytest.raises(PromptTooLong):
        engine.encode_prompt("word " * 40)
    assert len(engine.encode_prompt("word " * 40, truncate=True)) == 16
    with pytest.raises(InvalidRequest):
        engine.encode_prompt("")


def test_long_chat_is_refused_or_truncated_keeping_the_system_message(
    make_engine: MakeEngine, tiny: LoadedModel
) -> None:
    engine = make_engine(max_input_tokens=80, start=False)
    system = {"role": "system", "content": "You are Zorblax the helpful."}
    turns = []
    for i in range(6):
        turns.append({"role": "user", "content": f"question {i}: " + "blah " * 8})
        turns.append({"role": "assistant", "content": f"answer {i}: " + "meh " * 8})
    turns.append({"role": "user", "content": "the final question?"})
    messages = [system, *turns]
    with pytest.raises(PromptTooLong) as caught:
        engine.encode_chat(messages)
    assert caught.value.limit == 80 and caught.value.n_tokens > 80
    ids = engine.encode_chat(messages, truncate=True)
    assert len(ids) <= 80
    text = tiny.tokenizer.decode(ids)
    assert "Zorblax" in text and "the final question?" in text
    assert "question 0" not in text
    assert text.endswith("<|im_start|>assistant\n")

    # One message alone too long: its beginning is cut, system and framing stay.
    huge = [system, {"role": "user", "content": "start " + "filler " * 200 + "the end"}]
    ids = engine.encode_chat(huge, truncate=True)
    assert len(ids) == 80
    text = tiny.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Zorblax")
    assert "the end<|im_end|>\n<|im_start|>assistant\n" in text
    assert "start filler" not in text


def test_out_of_memory_halves_the_batch_and_requeued_requests_resume(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 4)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY_N(20))).text for p in ps]
    real = engine.model
    sizes: list[int] = []

    class TightMemory:
        config = real.config
        generation_config = real.generation_config

        def __call__(self, **kwargs: Any) -> Any:
            rows, width = kwargs["input_ids"].shape
            if width == 1:
                sizes.append(rows)
                if rows == 4 and sizes.count(4) == 3:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(**kwargs)

    monkeypatch.setattr(engine, "model", TightMemory())
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(20))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert [f.finish_reason for f in finishes] == ["length"] * 4
    assert [f.text for f in finishes] == expected
    assert 2 in sizes[sizes.index(4) :], "the batch was not halved after the error"
    assert max(sizes[sizes.index(4) + 3 :]) <= 2


class FailingCat:
    """``models.batch``'s torch, whose ``cat`` raises ``error`` on chosen calls (1-based)."""

    def __init__(self, error: BaseException, calls: set[int]) -> None:
        self.error = error
        self.calls = calls
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def cat(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.count += 1
        if self.count in self.calls:
            raise self.error
        return torch.cat(*args, **kwargs)


def test_a_merge_that_runs_out_of_memory_half_way_leaves_the_batch_as_it_was(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import DynamicCache

    import models.batch
    from models.batch import Batch

    engine = make_engine()
    batch: Batch[str] = Batch()
    for name, p in zip(("a", "b"), prompts(engine, 2), strict=True):
        ids = torch.tensor([p])
        cache = DynamicCache(config=engine.model.config)
        with torch.inference_mode():
            engine.model(input_ids=ids, use_cache=True, **{engine._cache_kwarg: cache})
        batch.add(name, cache, len(p))
    before = [
        (k.clone(), v.clone()) for k, v in ((layer.keys, layer.values) for layer in batch.layers())
    ]
    mask = batch.mask.clone() if batch.mask is not None else None
    p = prompts(engine, 6)[5]  # longer than both: the merge pads the batch on the left
    third = DynamicCache(config=engine.model.config)
    with torch.inference_mode():
        engine.model(input_ids=torch.tensor([p]), use_cache=True, **{engine._cache_kwarg: third})
    # Layer 0's keys and values merge, layer 1's values fail.
    failing = FailingCat(torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)"), {4})
    monkeypatch.setattr(models.batch, "torch", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        batch.add("c", third, len(p))
    assert failing.count == 4
    assert batch.seqs == ["a", "b"]
    assert batch.mask is not None and mask is not None and torch.equal(batch.mask, mask)
    for layer, (k, v) in zip(batch.layers(), before, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    monkeypatch.setattr(models.batch, "torch", torch)
    batch.add("c", third, len(p))  # and the same merge succeeds once memory is back
    assert batch.seqs == ["a", "b", "c"] and batch.mask is not None
    assert batch.mask.shape == (3, len(p)) and batch.layers()[1].keys.shape[0] == 3


def test_out_of_memory_while_merging_a_request_puts_it_back_and_every_request_finishes(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on an H200 (bench/cuda.py): a real OOM in the merge used to lose the request."""
    import models.batch

    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 4)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY_N(20))).text for p in ps]
    # Each merge into a running batch makes 5 calls (keys and values of 2 layers,
    # then the mask): r1's merge is calls 1-5, r2's 6-10, r3's 11-15. Call 12
    # (r3's first values) fails half-way; r3 waits for a slot, then resumes.
    failing = FailingCat(torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)"), {12})
    monkeypatch.setattr(models.batch, "torch", failing)
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(20))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert failing.count >= 12, "the injected error was never reached"
    assert [f.finish_reason for f in finishes] == ["length"] * 4, [f.error for f in finishes]
    assert [f.text for f in finishes] == expected
    assert [f.completion_tokens for f in finishes] == [20] * 4


def test_a_merge_that_fails_otherwise_fails_only_that_request(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import models.batch

    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 3)
    failing = FailingCat(RuntimeError("merge exploded"), {1})
    first = engine.submit(GenerationRequest("r0", ps[0], GREEDY_N(40)))
    assert isinstance(first.next_event(timeout=30), TokenEvent)  # r0 runs alone, nothing merged
    monkeypatch.setattr(models.batch, "torch", failing)
    rest = [
        engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(10))) for i, p in enumerate(ps[1:], 1)
    ]
    finishes = [drain(h)[1] for h in (first, *rest)]
    assert [f.finish_reason for f in finishes] == ["length", "error", "length"]
    assert finishes[1].error == "RuntimeError: merge exploded"
    assert engine.busy_slots == 0
