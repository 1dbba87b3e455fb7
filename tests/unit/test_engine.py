"""The batching engine on the tiny random model: batching, sampling, text, failures."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
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
from models.llama import StepInput
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
    """The number of sequences in each forward pass (decoding rows plus prefill chunks)."""
    sizes: list[int] = []
    original = engine.runtime.forward

    def forward(step: StepInput, cache: Any) -> torch.Tensor:
        sizes.append(len(step.decode_slots) + len(step.chunks))
        return original(step, cache)

    monkeypatch.setattr(engine.runtime, "forward", forward)
    return sizes


def record_prefilled(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every prefill chunk each forward pass runs."""
    prefilled: list[int] = []
    original = engine.runtime.forward

    def forward(step: StepInput, cache: Any) -> torch.Tensor:
        prefilled.extend(c.length for c in step.chunks)
        return original(step, cache)

    monkeypatch.setattr(engine.runtime, "forward", forward)
    return prefilled


def fail_forward(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, when: Callable[[Any], bool], error: Exception
) -> list[Any]:
    """Make a forward pass raise ``error`` whenever ``when(plan)`` holds; return the plans run."""
    plans: list[Any] = []
    original_plan, original_forward = engine._plan, engine.runtime.forward

    def plan() -> Any:
        plans.append(original_plan())
        return plans[-1]

    def forward(step: StepInput, cache: Any) -> torch.Tensor:
        if when(plans[-1]):
            raise error
        return original_forward(step, cache)

    monkeypatch.setattr(engine, "_plan", plan)
    monkeypatch.setattr(engine.runtime, "forward", forward)
    return plans


def ids_in(plan: Any, part: str = "seqs") -> list[str]:
    return [seq.request.request_id for seq in getattr(plan, part)]


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
    original = engine._admit

    def admit() -> None:
        before = set(map(id, engine._running))
        original()
        admitted.extend(s.request.request_id for s in engine._running if id(s) not in before)

    monkeypatch.setattr(engine, "_admit", admit)
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


class ScriptedForward:
    """Wraps the runtime's forward so that one request (logit row 0) produces ``script``."""

    def __init__(self, forward: Callable[..., torch.Tensor], prompt_len: int, script: list[int]):
        self._forward = forward
        self._prompt_len = prompt_len
        self._script = script

    def __call__(self, step: StepInput, cache: Any) -> torch.Tensor:
        logits = self._forward(step, cache)
        position = int(step.positions[step.logit_rows[0]])
        index = position - self._prompt_len + 1
        token = self._script[min(index, len(self._script) - 1)]
        logits[0, :] = -1e4
        logits[0, token] = 1e4
        return logits


def scripted_engine(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, prompt: list[int], script: list[int]
) -> Engine:
    engine = make_engine()
    scripted = ScriptedForward(engine.runtime.forward, len(prompt), script)
    monkeypatch.setattr(engine.runtime, "forward", scripted)
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
    # A NUL (a random or confused model's byte token) is U+FFFD: Postgres stores no NUL.
    ids = tiny.tokenizer("a\x00b", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tiny.tokenizer)
    assert "".join(detok.push(t) for t in ids) == "a\ufffdb" == detok.full_text()

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


def test_next_events_gathers_tokens_until_the_finish_or_the_end_of_the_wait(
    make_engine: MakeEngine, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny, "step_delay_s", 0.01)  # a token every 10 ms or more
    engine = make_engine(max_batch_size=1)
    p = prompts(engine, 1)[0]
    handle = engine.submit(GenerationRequest("short", p, GREEDY_N(20)))
    first = handle.next_events(timeout=30)  # the wait ends at the first event
    assert len(first) >= 1 and all(isinstance(e, TokenEvent) for e in first)
    # With until_finished only the finish ends the wait: the tokens that came
    # meanwhile are returned with it, in order.
    rest = handle.next_events(timeout=30, until_finished=True)
    finish = rest[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
    tokens = [e for e in first + rest[:-1] if isinstance(e, TokenEvent)]
    assert len(tokens) == len(first) + len(rest) - 1
    assert "".join(e.text for e in tokens) == finish.text
    assert len(rest) > 2  # several tokens gathered: no return at the first of them
    assert handle.next_events(timeout=0) == [finish]  # and again, alone

    # Or the timeout ends it, with what came so far and no finish.
    long = engine.submit(GenerationRequest("long", p, GREEDY_N(3000)))
    assert long.next_events(timeout=30)
    started = time.monotonic()
    gathered = long.next_events(timeout=0.3, until_finished=True)
    assert time.monotonic() - started >= 0.25
    assert len(gathered) > 2 and all(isinstance(e, TokenEvent) for e in gathered)
    long.cancel()
    assert drain(long)[1].finish_reason == "cancelled"


def thread_nice(native_id: int) -> int:
    """A thread's nice value, from /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux")
def test_nice_lowers_the_step_loops_priority_and_only_its_own(make_engine: MakeEngine) -> None:
    mine = thread_nice(threading.get_native_id())
    engine = make_engine(nice=5)
    p = prompts(engine, 1)[0]
    assert drain(engine.submit(GenerationRequest("n", p, GREEDY_N(3))))[1].completion_tokens == 3
    assert engine._thread is not None and engine._thread.native_id is not None
    assert thread_nice(engine._thread.native_id) == min(19, mine + 5)
    assert thread_nice(threading.get_native_id()) == mine
    assert thread_nice(os.getpid()) == mine  # the process's main thread too


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
    failures = {"left": 1}

    def decoding_two(plan: Any) -> bool:
        if plan.decoding == 2 and not plan.prefilling and failures["left"]:
            failures["left"] -= 1
            return True
        return False

    fail_forward(engine, monkeypatch, decoding_two, RuntimeError("device fell over"))
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
    """A prompt whose prefill raises fails alone, whoever shared its step."""
    engine = make_engine()
    ps = prompts(engine, 3)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY)).text for p in ps]
    plans = fail_forward(
        engine,
        monkeypatch,
        lambda plan: "bad" in ids_in(plan, "prefilling"),
        ValueError("bad prompt"),
    )
    first = engine.submit(GenerationRequest("good0", ps[0], GREEDY))
    assert isinstance(first.next_event(timeout=30), TokenEvent)  # decoding when the others come
    bad = engine.submit(GenerationRequest("bad", ps[1], GREEDY))
    good = engine.submit(GenerationRequest("good2", ps[2], GREEDY))
    bad_finish = drain(bad)[1]
    assert bad_finish.finish_reason == "error" and bad_finish.error == "ValueError: bad prompt"
    assert drain(good)[1].text == expected[2]
    assert first.next_event(timeout=30) is not None
    rest = drain(first)[1]
    assert rest.finish_reason == "length" and rest.text == expected[0]
    assert any({"bad", "good2"} <= set(ids_in(p, "prefilling")) for p in plans), (
        "the two prompts never shared a step"
    )
    assert engine.busy_slots == 0


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
    sizes: list[int] = []

    def tight_memory(plan: Any) -> bool:
        if plan.prefilling:
            return False
        sizes.append(plan.decoding)
        return plan.decoding == 4 and sizes.count(4) == 3

    fail_forward(
        engine, monkeypatch, tight_memory, torch.cuda.OutOfMemoryError("CUDA out of memory")
    )
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(20))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert [f.finish_reason for f in finishes] == ["length"] * 4
    assert [f.text for f in finishes] == expected
    assert [f.completion_tokens for f in finishes] == [20] * 4
    after = sizes[sizes.index(4) + 3 :]
    assert 2 in after, "the batch was not halved after the error"
    assert max(after) <= 2


def test_out_of_memory_growing_the_cache_puts_requests_back_and_every_request_finishes(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on an H200 (bench/cuda.py): a real OOM while a request joined used to lose it."""
    engine = make_engine(max_batch_size=4)
    ps = prompts(engine, 4)
    expected = [engine.generate(GenerationRequest("x", p, GREEDY_N(20))).text for p in ps]
    engine._cache.release()
    original = engine._cache.ensure
    calls = {"n": 0}

    def ensure(length: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3 and len(engine._running) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        original(length)

    monkeypatch.setattr(engine._cache, "ensure", ensure)
    handles = [engine.submit(GenerationRequest(f"r{i}", p, GREEDY_N(20))) for i, p in enumerate(ps)]
    finishes = [drain(h)[1] for h in handles]
    assert calls["n"] >= 3, "the injected error was never reached"
    assert [f.finish_reason for f in finishes] == ["length"] * 4, [f.error for f in finishes]
    assert [f.text for f in finishes] == expected
    assert [f.completion_tokens for f in finishes] == [20] * 4
    assert engine._batch_cap < 4 or engine.busy_slots == 0


# -- prefix caching ----------------------------------------------------------------------


def test_a_prompt_sharing_a_prefix_with_a_finished_one_prefills_only_the_rest(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat's next turn reuses the keys and values its slot still holds, and answers
    as an engine that prefilled everything."""
    first = [{"role": "user", "content": "Tell me a story about cats and dogs"}]
    cold = make_engine(max_batch_size=2, prefix_caching=False)
    warm = make_engine(max_batch_size=2)
    answer = warm.generate(GenerationRequest("t1", warm.encode_chat(first), GREEDY)).text
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    ids = warm.encode_chat(second)
    prefilled = record_prefilled(warm, monkeypatch)
    got = warm.generate(GenerationRequest("t2", ids, GREEDY))
    shared = len(warm.encode_chat(first))  # at least the first turn's prompt
    assert warm.reused_tokens >= shared
    assert sum(prefilled) <= len(ids) - shared
    assert got.text == cold.generate(GenerationRequest("t2", ids, GREEDY)).text
    assert got.prompt_tokens == len(ids)
    assert cold.reused_tokens == 0


def test_requests_sharing_a_running_ones_long_prefix_copy_it_instead_of_prefilling(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many users behind one long system prompt or document: the first prefills it, the
    ones that arrive while it runs copy its keys and values, and answer as an engine
    that prefilled everything."""
    document = "Read this first. " + "The quick brown fox jumps over the lazy dog. " * 12
    questions = ["Who jumps?", "Over what?", "How fast?"]
    ids = [
        make_engine(start=False).encode_chat([{"role": "user", "content": document + q}])
        for q in questions
    ]
    shared = 0
    while ids[0][shared] == ids[1][shared] == ids[2][shared]:
        shared += 1
    assert shared > 100
    cold = make_engine(max_batch_size=4, prefix_caching=False)
    warm = make_engine(max_batch_size=4)
    prefilled = record_prefilled(warm, monkeypatch)
    long = SamplingParams(max_new_tokens=200, temperature=0)
    first = warm.submit(GenerationRequest("a", ids[0], long))
    assert first.next_event(timeout=30) is not None  # its prompt is in its slot now
    later = [warm.submit(GenerationRequest(f"b{i}", ids[i], GREEDY)) for i in (1, 2)]
    answers = [drain(handle)[1] for handle in later]
    assert drain(first)[1].finish_reason == "length"  # it ran all along
    assert warm.copied_tokens >= 2 * shared
    assert sum(prefilled) <= len(ids[0]) + sum(len(i) - shared for i in ids[1:])
    for i, answer in zip((1, 2), answers, strict=True):
        assert answer.text == cold.generate(GenerationRequest("c", ids[i], GREEDY)).text
        assert answer.prompt_tokens == len(ids[i])
    assert cold.copied_tokens == cold.reused_tokens == 0


def test_a_seeded_sampled_request_never_reuses_a_held_prefix(make_engine: MakeEngine) -> None:
    """Its draws must be the same on a fresh worker as on one whose slots hold its prompt."""
    engine = make_engine(max_batch_size=1)
    ids = prompts(engine, 2)[1]
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    first = engine.generate(GenerationRequest("a", ids, seeded)).text
    again = engine.generate(GenerationRequest("b", ids, seeded)).text
    assert engine.reused_tokens == 0
    assert again == first


def test_a_prompt_equal_to_a_held_one_still_runs_its_last_token(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=1)
    ids = prompts(engine, 2)[1]
    before = engine.generate(GenerationRequest("a", ids, GREEDY)).text
    again = engine.generate(GenerationRequest("b", ids, GREEDY))
    assert engine.reused_tokens == len(ids) - 1
    assert again.text == before


# -- chunked prefill, token budget, resume --------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> None:
    from models.engine import Engine as EngineClass

    engine = EngineClass(tiny, max_batch_size=4, max_input_tokens=512, max_step_tokens=16)
    engine.start()
    try:
        short, long = prompts(engine, 1)[0], prompts(engine, 40)[39]
        assert len(long) > 64
        alone = [
            engine.generate(GenerationRequest("a", p, GREEDY_N(30))).text for p in (short, long)
        ]
        steps: list[tuple[int, int]] = []
        original = engine.runtime.forward

        def forward(step: StepInput, cache: Any) -> torch.Tensor:
            steps.append((len(step.decode_slots), int(step.token_ids.shape[0])))
            return original(step, cache)

        monkeypatch.setattr(engine.runtime, "forward", forward)
        first = engine.submit(GenerationRequest("short", short, GREEDY_N(30)))
        assert isinstance(first.next_event(timeout=30), TokenEvent)
        second = engine.submit(GenerationRequest("long", long, GREEDY_N(30)))
        texts = [drain(h)[1].text for h in (first, second)]
        # (the first event of ``first`` was read above; its finish text holds it all)
        assert texts == alone
        assert max(tokens for _, tokens in steps) <= 16
        mixed = [s for s in steps if s[0] == 1 and s[1] > 1]
        assert len(mixed) >= len(long) // 16 - 1, (
            "the long prompt did not share steps with decoding"
        )
    finally:
        engine.stop(timeout=10)


def test_a_resumed_greedy_request_ends_as_the_uninterrupted_one(make_engine: MakeEngine) -> None:
    engine = make_engine()
    p = prompts(engine, 3)[2]
    tokens, whole = drain(engine.submit(GenerationRequest("whole", p, GREEDY_N(30))))
    for cut in (1, len(tokens) // 2, len(tokens) - 1):
        ids = tuple(ids_of(tokens[:cut]))
        text = "".join(e.text for e in tokens[:cut])
        rest, finish = drain(
            engine.submit(GenerationRequest(f"r{cut}", p, GREEDY_N(30), ids, text))
        )
        assert finish.text == whole.text
        assert text + "".join(e.text for e in rest) == whole.text
        assert ids + tuple(ids_of(rest)) == tuple(ids_of(tokens))
        assert finish.completion_tokens == whole.completion_tokens == 30
        assert finish.finish_reason == "length"


def test_a_resumed_seeded_request_draws_the_same_tokens(make_engine: MakeEngine) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    tokens, whole = drain(engine.submit(GenerationRequest("whole", p, params)))
    cut = len(tokens) // 2
    ids = tuple(ids_of(tokens[:cut]))
    text = "".join(e.text for e in tokens[:cut])
    noise = [engine.submit(GenerationRequest(f"n{i}", p, SamplingParams(seed=i))) for i in range(2)]
    rest, finish = drain(engine.submit(GenerationRequest("resumed", p, params, ids, text)))
    assert finish.text == whole.text
    assert ids + tuple(ids_of(rest)) == tuple(ids_of(tokens))
    for h in noise:
        drain(h)


def test_a_resumed_seeded_request_replays_its_tokens_one_a_step(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its first step prefills the prompt only: the resumed tokens then go one a step,
    as the uninterrupted run computed them, so its cache is that run's to the bit (a
    long seeded run resumed early drifted from its reference when they were prefilled
    with the prompt: 400 tokens, cut at 50, first difference at token 298)."""
    engine = make_engine()
    p = prompts(engine, 1)[0]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    tokens, whole = drain(engine.submit(GenerationRequest("whole", p, params)))
    cut = 20
    done = tuple(ids_of(tokens[:cut]))
    text = "".join(e.text for e in tokens[:cut])
    steps: list[tuple[int, list[int]]] = []
    original = engine.runtime.forward

    def forward(step: StepInput, cache: Any) -> torch.Tensor:
        steps.append((len(step.decode_slots), [c.length for c in step.chunks]))
        return original(step, cache)

    monkeypatch.setattr(engine.runtime, "forward", forward)
    rest, finish = drain(engine.submit(GenerationRequest("resumed", p, params, done, text)))
    assert done + tuple(ids_of(rest)) == tuple(ids_of(tokens))
    assert finish.text == whole.text
    assert steps[0] == (0, [len(p)])
    assert all(step == (1, []) for step in steps[1:])


def test_a_resume_that_already_reached_the_end_finishes_at_once(make_engine: MakeEngine) -> None:
    engine = make_engine()
    p = prompts(engine, 1)[0]
    tokens, whole = drain(engine.submit(GenerationRequest("whole", p, GREEDY_N(10))))
    request = GenerationRequest("done", p, GREEDY_N(10), tuple(ids_of(tokens)), whole.text)
    rest, finish = drain(engine.submit(request))
    assert rest == []
    assert (finish.finish_reason, finish.text, finish.completion_tokens) == (
        "length",
        whole.text,
        10,
    )


def test_a_resumed_tail_held_back_as_a_stop_string_is_still_checked(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> None:
    script = tiny.tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    prompt = prompts(make_engine(start=False), 1)[0]
    engine = scripted_engine(make_engine, monkeypatch, prompt, script)
    params = SamplingParams(max_new_tokens=len(script), temperature=0, stop=("two three",))
    # The earlier attempt emitted "one" and held back " two" (a possible stop string).
    upto_two = tiny.tokenizer("one two", add_special_tokens=False)["input_ids"]
    assert script[: len(upto_two)] == upto_two
    rest, finish = drain(
        engine.submit(GenerationRequest("held", prompt, params, tuple(upto_two), "one"))
    )
    assert (finish.finish_reason, finish.text) == ("stop_sequence", "one ")
    assert "".join(e.text for e in rest) == " "


def test_a_generation_cut_inside_a_character_does_not_end_with_a_replacement_char(
    make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> None:
    script = tiny.tokenizer("안녕하세요 👋🏽", add_special_tokens=False)["input_ids"]
    prompt = prompts(make_engine(start=False), 1)[0]
    engine = scripted_engine(make_engine, monkeypatch, prompt, script)
    cuts = []
    for n in range(1, len(script) + 1):
        tokens, finish = drain(engine.submit(GenerationRequest(f"c{n}", prompt, GREEDY_N(n))))
        assert finish.finish_reason == "length"
        assert "\ufffd" not in finish.text
        assert finish.text == "".join(e.text for e in tokens)
        assert "안녕하세요 👋🏽".startswith(finish.text)
        cuts.append(finish.text)
    assert cuts[-1] == "안녕하세요 👋🏽"
    assert len(set(cuts)) < len(cuts), "no cut fell inside a character"


def test_a_seeded_request_resumed_after_any_number_of_tokens_draws_the_same_tokens(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    p = prompts(engine, 2)[1]
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    tokens, whole = drain(engine.submit(GenerationRequest("whole", p, params)))
    ids = ids_of(tokens)
    for cut in range(1, len(tokens)):
        done = tuple(ids_of(tokens[:cut]))
        text = "".join(e.text for e in tokens[:cut])
        rest, finish = drain(engine.submit(GenerationRequest(f"r{cut}", p, params, done, text)))
        assert done + tuple(ids_of(rest)) == tuple(ids), f"resumed after {cut} events"
        assert finish.text == whole.text


FREEZE_SCRIPT = """
import gc, weakref
import torch  # a loaded process's heap of module objects
from models.engine import freeze_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

live = [Node() for _ in range(10_000)]
before = len(gc.get_objects())
dead = cycle()  # garbage the allocation count has not yet sent the collector to
freeze_heap()
assert dead() is None, "garbage from before the freeze was kept"
assert gc.get_freeze_count() >= len(live), gc.get_freeze_count()
walked = len(gc.get_objects())
assert walked * 100 < before, (walked, before)
later = cycle()
gc.collect()
assert later() is None, "a cycle made after the freeze was not collected"
"""


def test_freezing_the_heap_keeps_no_garbage_and_leaves_the_collector_little_to_walk() -> None:
    # A subprocess: a freeze is for the whole process, and this one runs the suite.
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", FREEZE_SCRIPT], check=True, cwd=root, timeout=120)
