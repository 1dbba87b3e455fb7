"""The generation engine: continuous batching over one loaded model.

One step-loop thread owns the model. Requests are submitted from any thread
and wait in a FIFO; the loop admits them into free slots of the KV cache
(:class:`~models.llama.SlotCache`) as long as the batch has room. Each step
is one forward pass over a flat batch of tokens (:mod:`models.llama`): one
token for every decoding sequence plus chunks of the prompts being prefilled,
up to a budget of ``max_step_tokens`` tokens — so a long prompt is prefilled
over several steps while the running streams keep decoding (chunked prefill),
and several new prompts are prefilled together. Joining or leaving the batch
copies nothing: a slot is taken, or given back.

Sampling is batched: greedy rows take one argmax for the whole batch, the
others sample on the device from per-request generators, and the step's
tokens reach the host in one transfer (:func:`~models.sampling.sample_rows`).

Events reach the caller through a :class:`RequestHandle`: zero or more
:class:`TokenEvent` followed by exactly one :class:`FinishEvent`.

A request may resume an earlier attempt (``resume_ids``): its prompt and the
tokens already emitted are prefilled, and it goes on as if it had never
stopped — same remaining budget, same stop-string state, same random stream
for a seeded request.

Failure isolation: an error in one request's own work (sampling,
detokenizing) fails that request alone; an error in a step that prefills new
prompts fails those new requests and the decoding ones go on; an error in a
decode-only step fails the requests of that step and the loop goes on
serving. A CUDA out-of-memory error sends the newest half of the batch back
to the head of the queue (their caches are recomputed when they return) and
lowers the batch cap, which grows back a slot at a time; a request the loop
has taken always gets a finish event.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from models.detokenize import IncrementalDetokenizer, StopStringFilter
from models.errors import EngineClosed, EngineError, InvalidRequest, PromptTooLong
from models.llama import Chunk, LlamaRuntime, SlotCache, StepInput
from models.loader import LoadedModel
from models.sampling import Sampler, SamplingParams, sample_rows

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineError",
    "FinishEvent",
    "GenerationRequest",
    "InvalidRequest",
    "PromptTooLong",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
]

log = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
"""Seconds of recent decoding that :meth:`Engine.tokens_per_second` averages over."""

OOM_REGROW_STEPS = 64
"""Decoding steps after an out-of-memory error before the batch may take one more request."""

DEFAULT_STEP_TOKENS = 256
"""Tokens one step may run (decoding rows plus prefill chunks) unless the caller says."""

COPY_PREFIX_MIN_TOKENS = 16
"""Prompt tokens a copy from a running sequence's slot must save (:meth:`Engine._pick_slot`).

A new request whose prompt begins with more tokens of a running sequence's
slot than of any free slot (a shared system prompt or document, requests
arriving together) copies those keys and values into its own slot, one copy a
layer, instead of prefilling them."""

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Chat-template end markers that end a generation when the template uses them."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt token ids and how to sample the continuation.

    ``resume_ids`` are tokens an earlier attempt of the same generation
    already emitted (exactly as generated) and ``resume_text`` the text it
    emitted: the engine prefills prompt + ``resume_ids`` and continues. The
    resumed tokens count toward ``max_new_tokens`` and the finish event's
    ``completion_tokens``; stop strings see their text; a seeded request
    draws the same random numbers an uninterrupted run would have.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume_ids: tuple[int, ...] = ()
    resume_text: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """Text to append to the output, with the token ids it came from.

    The text never contains (part of) a stop string and never ends inside a
    UTF-8 character; it is never empty. A resumed request's events carry only
    what the resumed attempt adds.
    """

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class FinishEvent:
    """The end of a request: why, its whole text and its token counts.

    ``finish_reason`` is ``length``, ``eos_token``, ``stop_sequence``,
    ``cancelled`` or ``error`` (then ``error`` says what went wrong). ``text``
    equals the request's ``resume_text`` followed by every :class:`TokenEvent`
    text of the request. ``completion_tokens`` counts every token sampled,
    resumed ones and end-of-sequence included.
    """

    finish_reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


Event = TokenEvent | FinishEvent


class RequestHandle:
    """The caller's side of a submitted request: its events, and cancellation."""

    def __init__(self, request_id: str, engine: Engine, seq: _Sequence) -> None:
        self.request_id = request_id
        self._engine = engine
        self._seq = seq
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._finish: FinishEvent | None = None
        self._finished = threading.Event()  # the FinishEvent is in the queue

    def _put(self, event: Event) -> None:
        self._events.put(event)
        if isinstance(event, FinishEvent):
            self._finished.set()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, waiting up to ``timeout`` seconds (``None``: forever).

        Returns ``None`` on timeout. Once the :class:`FinishEvent` has been
        returned, every later call returns it again at once.
        """
        if self._finish is not None:
            return self._finish
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, FinishEvent):
            self._finish = event
        return event

    def next_events(
        self, timeout: float | None = None, *, until_finished: bool = False
    ) -> list[Event]:
        """Every event there is, waiting up to ``timeout`` seconds when there is none.

        The wait ends at the first event, or with ``until_finished`` at the
        :class:`FinishEvent` only: token events that arrive meanwhile wait in
        the queue and are returned together at the end of the wait. A caller
        that gathers tokens before it passes them on (the worker's job
        threads, :mod:`workers.runner`) then wakes once per gathering window
        instead of once per token, leaving the cores to the engine's step.
        Returns ``[]`` on timeout; the :class:`FinishEvent`, when returned, is
        last, and every later call returns it alone.
        """
        if self._finish is None and until_finished and self._events.empty():
            self._finished.wait(timeout)
            timeout = 0
        first = self.next_event(timeout)
        if first is None:
            return []
        events = [first]
        while self._finish is None:
            event = self.next_event(0)
            if event is None:
                break
            events.append(event)
        return events

    def __iter__(self) -> Iterator[Event]:
        """Every remaining event, ending after the :class:`FinishEvent`."""
        while self._finish is None:
            event = self.next_event()
            if event is not None:
                yield event

    @property
    def finished(self) -> bool:
        """Whether the :class:`FinishEvent` has been returned to the caller."""
        return self._finish is not None

    def cancel(self) -> None:
        """Stop the request: it ends with ``cancelled`` within one step.

        Cancelling a finished request does nothing.
        """
        self._engine._cancel(self._seq)


@dataclass(eq=False)
class _Sequence:
    """A request's state inside the engine (owned by the step loop)."""

    request: GenerationRequest
    sampler: Sampler
    detokenizer: IncrementalDetokenizer
    stops: StopStringFilter
    submitted_at: float
    handle: RequestHandle | None = None
    generated: list[int] = field(default_factory=list)
    emitted: list[str] = field(default_factory=list)
    unsent_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # its row of the KV cache while admitted
    replay: bool = False  # resumed tokens are fed one a step (see Engine._feeds_one)
    computed: int = 0  # tokens of this sequence held in the KV cache
    cancelled: bool = False
    done: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def all_ids(self) -> list[int]:
        return [*self.request.prompt_ids, *self.generated]

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)

    def token_at(self, index: int) -> int:
        prompt = self.request.prompt_ids
        return prompt[index] if index < len(prompt) else self.generated[index - len(prompt)]


def freeze_heap() -> None:
    """Put what the process holds now out of the cyclic collector's reach.

    Call once the model is loaded and warm, before serving (vLLM's
    ``freeze_gc_heap`` does the same). A loaded worker tracks some 470,000
    objects (the model's modules, the tokenizer, Celery); a full collection
    walked them all in 218-250 ms (SmolLM2-135M, Zen 4) holding the GIL —
    twice in a run of 36 jobs — and the steps, the job threads and the
    claims stopped together: a job's first token came 312 ms after its claim
    and its neighbours' ``done`` 270 ms late. Frozen, a full collection walks
    only what was allocated since (1.3 ms in the same run). Garbage is collected first, so
    nothing unreachable is kept; objects freed by their reference count are
    freed as before.
    """
    gc.collect()
    gc.freeze()


def lower_priority(nice: int) -> None:
    """Lower the calling thread's OS priority by ``nice`` (0: leave it).

    On Linux the nice value belongs to the thread, and threads it starts
    afterwards (the OpenMP team of its first parallel region) inherit it: the
    engine's compute yields its cores at once to the API, Redis, the database
    and the worker's job threads when they wake, and takes what they leave.
    Elsewhere, or where the OS refuses, the thread keeps its priority.
    """
    if nice <= 0 or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(
            os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice)
        )
    except OSError as exc:
        log.warning("the engine keeps its priority: %s", exc)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Plan:
    """What one step runs: its sequences (decoding first) and the tokens of each."""

    seqs: list[_Sequence]
    counts: list[int]
    step: StepInput
    sampled: list[_Sequence]  # those whose last token is in this step: they get a new one
    decoding: int  # the first ``decoding`` of ``seqs`` are decoding rows

    @property
    def prefilling(self) -> list[_Sequence]:
        return self.seqs[self.decoding :]


class Engine:
    """Continuous-batching text generation over one :class:`LoadedModel`.

    ``max_batch_size`` bounds the requests decoded together (the others wait in
    FIFO order); ``max_input_tokens`` bounds a prompt; ``max_new_tokens``, when
    given, bounds what a request may ask for; ``max_step_tokens`` bounds the
    tokens of one forward pass (decoding rows plus prefill chunks). Call
    :meth:`start` once, then :meth:`submit` from any thread; :meth:`stop` ends
    the loop.

    With ``prefix_caching`` a slot keeps the keys and values of the sequence
    that last used it, and a new request takes the free slot whose tokens share
    the longest prefix with its own: it prefills only the rest (a chat's
    earlier turns, a shared system prompt). Otherwise the free slot freed
    longest ago. When a running sequence's slot holds a longer prefix of the
    new prompt (requests sharing a long system prompt or document, arriving
    together), those keys and values are copied into the new slot instead of
    prefilled (:data:`COPY_PREFIX_MIN_TOKENS`). A seeded sampled request
    always prefills in full: its draws must be the same on any worker, fresh
    or resumed, and reused keys and values may differ from a fresh prefill's
    in the last bits.

    ``nice`` lowers the step loop's priority on a CPU (:func:`lower_priority`):
    a worker's engine shares its cores with the API and Redis, whose short
    bursts of work would otherwise wait behind a step.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int,
        max_input_tokens: int,
        max_new_tokens: int | None = None,
        max_step_tokens: int | None = None,
        prefix_caching: bool = True,
        nice: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if max_input_tokens < 1:
            raise ValueError("max_input_tokens must be at least 1")
        self.loaded = loaded
        self.model = loaded.model
        self.runtime: LlamaRuntime = loaded.runtime
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = max_batch_size
        self.max_input_tokens = max_input_tokens
        self.max_new_tokens = max_new_tokens
        self.max_step_tokens = max(max_step_tokens or DEFAULT_STEP_TOKENS, max_batch_size)
        self.vocab_size = self.runtime.vocab_size
        self.eos_token_ids = frozenset(self._find_eos_ids())
        longest = max_input_tokens + (max_new_tokens or self.runtime.max_positions)
        self._cache: SlotCache = self.runtime.new_cache(max_batch_size, longest)

        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # admitted, in admission order
        # Prefilling requests of a step that failed: one of them may be the
        # cause, so they are prefilled one per step until each passes or fails alone.
        self._suspects: set[_Sequence] = set()
        self._batch_cap = max_batch_size  # lowered after an out-of-memory error
        self.prefix_caching = prefix_caching
        # Per slot: the tokens whose keys and values it holds at positions 0..n-1
        # while free, and when it was freed (the slot freed longest ago goes first).
        self._held: list[list[int]] = [[] for _ in range(max_batch_size)]
        self._held_epoch = 0  # the cache's epoch they were held in
        self._freed_at = [0] * max_batch_size
        self._leaves = 0
        self.reused_tokens = 0  # prompt tokens not prefilled again, since the start
        self.copied_tokens = 0  # of those, copied from another running sequence's slot
        self._steps_at_cap = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._rate: deque[tuple[float, int]] = deque()
        self._started_at = time.monotonic()
        self._threads = torch.get_num_threads()
        # On a GPU the loop launches kernels and waits for them: a launch
        # delayed behind the API would idle the device, so it keeps its priority.
        self._nice = nice if torch.device(self.device).type == "cpu" else 0

    # -- public API -------------------------------------------------------------

    def start(self) -> None:
        """Start the step-loop thread (once)."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine has been stopped")
            if self._thread is not None:
                return
            self._started_at = time.monotonic()
            self._threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._run, name="switchyard-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop after its current step; every unfinished request ends ``cancelled``.

        Later :meth:`submit` calls raise :class:`EngineClosed`.
        """
        with self._lock:
            self._stopping = True
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            leftovers = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for seq in leftovers:
            self._finish(seq, "cancelled")

    @property
    def busy_slots(self) -> int:
        """Requests being decoded now (not counting those waiting for a slot)."""
        with self._lock:
            return sum(1 for seq in self._running if not seq.done)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last few seconds (0 when idle)."""
        now = time.monotonic()
        with self._lock:
            while self._rate and self._rate[0][0] < now - THROUGHPUT_WINDOW_S:
                self._rate.popleft()
            total = sum(n for _, n in self._rate)
        span = min(THROUGHPUT_WINDOW_S, max(now - self._started_at, 1e-3))
        return total / span

    def encode_prompt(self, text: str, *, truncate: bool = False) -> list[int]:
        """Token ids of a plain-text prompt (with the tokenizer's special tokens).

        Over ``max_input_tokens`` raises :class:`PromptTooLong`, unless
        ``truncate``: then the oldest tokens are dropped.
        """
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if len(ids) > self.max_input_tokens:
            if not truncate:
                raise PromptTooLong(len(ids), self.max_input_tokens)
            ids = ids[-self.max_input_tokens :]
        return ids

    def encode_chat(self, messages: list[dict[str, str]], *, truncate: bool = False) -> list[int]:
        """Token ids of a chat rendered by the model's template, ready for the answer.

        Over ``max_input_tokens`` raises :class:`PromptTooLong`, unless
        ``truncate``: then the oldest non-system messages are dropped (never the
        last one), and if the system messages plus the last one are still too
        long, the last message's text is cut from its beginning. The system
        messages and the template's framing are always kept; if they alone are
        too long, :class:`PromptTooLong` is raised anyway.
        """
        if not messages:
            raise InvalidRequest("messages", "no messages")
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidRequest("messages", "each message needs a string role and content")
        ids = self._render(messages)
        if len(ids) <= self.max_input_tokens:
            return ids
        if not truncate:
            raise PromptTooLong(len(ids), self.max_input_tokens, field="messages")
        system = [m for m in messages if m["role"] == "system"]
        others = [m for m in messages if m["role"] != "system"]
        while len(others) > 1:
            others = others[1:]
            ids = self._render(system + others)
            if len(ids) <= self.max_input_tokens:
                return ids
        last = others[-1]
        # Everything the template puts before the last message's text is the
        # common prefix of renderings with and without that text.
        framing = self._render([*system, {"role": last["role"], "content": ""}])
        head = 0
        while head < min(len(ids), len(framing)) and ids[head] == framing[head]:
            head += 1
        room = self.max_input_tokens - head
        tail = len(ids) - head
        if room <= 0 or tail <= 0:
            raise PromptTooLong(len(ids), self.max_input_tokens, field="messages")
        return ids[:head] + ids[len(ids) - min(room, tail) :]

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; return its handle at once (thread-safe).

        Raises :class:`InvalidRequest` for bad parameters or prompt,
        :class:`PromptTooLong` for a prompt over ``max_input_tokens``, and
        :class:`EngineClosed` after :meth:`stop`.
        """
        self._validate(request)
        seq = _Sequence(
            request=request,
            sampler=Sampler(request.params, self.vocab_size, self.device, request.prompt_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringFilter(request.params.stop),
            submitted_at=time.monotonic(),
        )
        handle = RequestHandle(request.request_id, self, seq)
        seq.handle = handle
        if request.resume_ids and self._resume(seq):
            return handle  # the earlier attempt had already reached its end
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine has been stopped")
            self._waiting.append(seq)
            self._lock.notify_all()
        return handle

    def generate(self, request: GenerationRequest) -> FinishEvent:
        """Submit ``request`` and wait for its :class:`FinishEvent`."""
        handle = self.submit(request)
        for event in handle:
            if isinstance(event, FinishEvent):
                return event
        raise EngineError("the request ended without a finish event")  # pragma: no cover

    # -- validation and templates --------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequest("request_id", "must be a non-empty string")
        request.params.validate(max_new_tokens_limit=self.max_new_tokens)
        ids = request.prompt_ids
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if len(ids) > self.max_input_tokens:
            raise PromptTooLong(len(ids), self.max_input_tokens)
        for name, tokens in (("prompt", ids), ("resume_ids", request.resume_ids)):
            for t in tokens:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequest(name, f"token id {t!r} is outside the vocabulary")
        if len(ids) + len(request.resume_ids) >= self._cache.max_length:
            raise PromptTooLong(
                len(ids) + len(request.resume_ids), self._cache.max_length - 1, field="resume_ids"
            )

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _find_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos: Any = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        template = getattr(self.tokenizer, "chat_template", None) or ""
        vocab = self.tokenizer.get_vocab()
        for marker in END_OF_TURN_TOKENS:
            if marker in template and marker in vocab:
                ids.add(int(vocab[marker]))
        return ids

    def _resume(self, seq: _Sequence) -> bool:
        """Replay an earlier attempt's tokens into ``seq``; True if that already ends it.

        The detokenizer and the repetition penalty see every resumed token;
        text those tokens produced that the earlier attempt had not emitted
        (held back as a possible stop string) goes through the stop filter
        again.
        """
        request = seq.request
        seq.replay = not seq.sampler.greedy and request.params.seed is not None
        pieces = []
        for token in request.resume_ids:
            seq.generated.append(token)
            seq.sampler.observe(token)
            pieces.append(seq.detokenizer.push(token))
        produced = "".join(pieces)
        if request.resume_text:
            seq.emitted.append(request.resume_text)
        held = ""
        if produced.startswith(request.resume_text):
            held = produced[len(request.resume_text) :]
        text, hit = seq.stops.feed(held)
        self._emit(seq, text)
        if hit:
            self._finish(seq, "stop_sequence", flush=False)
        elif seq.generated[-1] in self.eos_token_ids:
            self._finish(seq, "eos_token")
        elif len(seq.generated) >= seq.params.max_new_tokens:
            self._finish(seq, "length")
        return seq.done

    # -- the step loop -----------------------------------------------------------------

    def _run(self) -> None:
        # OpenMP's thread count is per calling thread: the loop's thread takes
        # the one its creator set (measured: 21.8 ms a step without, 12.6 with).
        torch.set_num_threads(self._threads)
        lower_priority(self._nice)  # before the first kernel: its OpenMP team inherits it
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self._stopping and not self._waiting and not self._running:
                        self._lock.wait()
                    if self._stopping:
                        return
                try:
                    self._admit()
                    self._drop_cancelled()
                    if self._running:
                        self._step()
                except Exception as exc:  # the loop must outlive any bug
                    log.exception("engine step failed")
                    self._fail(list(self._running), f"{type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Give waiting requests free slots, oldest first (their prefill runs in steps)."""
        with self._lock:
            if self._held_epoch != self._cache.epoch:  # the cache was released
                self._held = [[] for _ in range(self.max_batch_size)]
                self._held_epoch = self._cache.epoch
            if not self._waiting:
                return
            used = {seq.slot for seq in self._running}
            free = [slot for slot in range(self.max_batch_size) if slot not in used]
            while self._waiting and len(self._running) < self._batch_cap and not self._stopping:
                seq = self._waiting[0]
                if seq.cancelled:
                    self._waiting.popleft()
                    self._finish(seq, "cancelled")
                    continue
                self._waiting.popleft()
                seq.slot, seq.computed = self._pick_slot(free, seq)
                free.remove(seq.slot)
                self._held[seq.slot] = []  # its positions are the new sequence's from now on
                self.reused_tokens += seq.computed
                self._running.append(seq)

    def _pick_slot(self, free: list[int], seq: _Sequence) -> tuple[int, int]:
        """A free slot for ``seq`` and how many of its first tokens that slot holds:
        held from its last sequence, or copied from a running sequence's slot."""
        slot = min(free, key=lambda s: self._freed_at[s])
        if not self.prefix_caching or (seq.params.seed is not None and not seq.sampler.greedy):
            # A seeded draw must be the same on any worker, at any time: reused keys
            # and values may differ from a fresh prefill's in the last bits.
            return slot, 0
        ids, reuse = seq.all_ids(), 0
        for candidate in free:
            n = _common_prefix(ids, self._held[candidate])
            if n > reuse:
                slot, reuse = candidate, n
        # A running sequence's slot may begin with more of this prompt (requests
        # sharing a long prefix arrive together): copy those positions instead.
        source, longest = None, reuse
        for other in self._running:
            if other.slot is not None and other.computed > longest:
                n = _common_prefix(ids, other.all_ids()[: other.computed])
                if n > longest:
                    source, longest = other.slot, n
        longest = min(longest, len(ids) - 1)  # the last token runs: its logits are needed
        if (
            source is not None
            and longest - reuse >= COPY_PREFIX_MIN_TOKENS
            and self._cache.length >= longest
        ):
            self._cache.copy_prefix(source, slot, longest)
            self.copied_tokens += longest
            return slot, longest
        return slot, min(reuse, len(ids) - 1)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._finish(seq, "cancelled")
            self._leave(seq)

    def _leave(self, seq: _Sequence) -> None:
        self._suspects.discard(seq)
        with self._lock:
            if seq in self._running:
                self._running.remove(seq)
            if seq.slot is not None:
                # Positions 0..computed-1 hold its tokens (a failed step writes
                # only at or after computed, which it did not advance).
                self._held[seq.slot] = seq.all_ids()[: seq.computed]
                self._leaves += 1
                self._freed_at[seq.slot] = self._leaves
            seq.slot = None

    def _plan(self) -> _Plan:
        """Decoding rows first (in slot order), then prefill chunks within the token budget."""
        decoding = sorted(
            (s for s in self._running if self._feeds_one(s)),
            key=lambda s: s.slot if s.slot is not None else 0,
        )
        budget = self.max_step_tokens - len(decoding)
        seqs: list[_Sequence] = list(decoding)
        counts = [1] * len(decoding)
        ids: list[int] = [s.token_at(s.computed) for s in decoding]
        positions = [s.computed for s in decoding]
        chunks: list[Chunk] = []
        logit_rows = [i for i, s in enumerate(decoding) if s.computed + 1 == s.length]
        sampled = [decoding[i] for i in logit_rows]
        for seq in self._running:
            if seq in decoding or budget <= 0:
                continue
            if self._suspects and len(seqs) > len(decoding):
                break  # isolating a failure: one prefill per step
            todo = seq.all_ids()[seq.computed :]
            take = min(len(todo), budget)
            if seq.replay:  # the prompt only: resumed tokens go one a step (_feeds_one)
                take = min(take, max(1, len(seq.request.prompt_ids) - seq.computed))
            assert seq.slot is not None
            chunks.append(Chunk(seq.slot, seq.computed, take))
            start = len(ids)
            ids.extend(todo[:take])
            positions.extend(range(seq.computed, seq.computed + take))
            seqs.append(seq)
            counts.append(take)
            budget -= take
            if take == len(todo):
                logit_rows.append(start + take - 1)
                sampled.append(seq)
        step = StepInput(
            token_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            decode_slots=[s.slot for s in decoding if s.slot is not None],
            chunks=chunks,
            logit_rows=logit_rows,
        )
        return _Plan(seqs, counts, step, sampled, len(decoding))

    @staticmethod
    def _feeds_one(seq: _Sequence) -> bool:
        """Whether ``seq`` runs as a decoding row (one token) this step.

        A decoding sequence feeds its last token. A seeded sampled request
        resumed from an earlier attempt feeds its resumed tokens one a step
        too, as the uninterrupted run did, so that its cache — and so its
        random draws' outcome — is the uninterrupted run's to the last bit.
        """
        if not seq.computed:
            return False
        return seq.length - seq.computed == 1 or (
            seq.replay and seq.computed >= len(seq.request.prompt_ids)
        )

    def _step(self) -> None:
        """One forward pass over the plan, one new token for each sequence it completes."""
        plan = self._plan()
        if not plan.seqs:
            return
        try:
            self._cache.ensure(
                max(s.computed + n for s, n in zip(plan.seqs, plan.counts, strict=True))
            )
            logits = self.runtime.forward(plan.step, self._cache)
        except Exception as exc:  # shared: decide who pays for it
            self._step_failed(plan, exc)
            return
        if self.loaded.step_delay_s:
            time.sleep(self.loaded.step_delay_s)  # a paced test model
        for seq, n in zip(plan.seqs, plan.counts, strict=True):
            seq.computed += n
        self._suspects.difference_update(plan.prefilling)
        tokens = self._sample(plan.sampled, logits)
        for seq, token in zip(plan.sampled, tokens, strict=True):
            if token is None or seq.done:
                continue
            try:
                self._advance(seq, token)
            except Exception as exc:  # one request's failure is its own
                log.warning("request %s failed: %s", seq.request.request_id, exc)
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
        self._count_tokens(len(plan.sampled))
        for seq in plan.sampled:
            if not seq.done and seq.length >= self._cache.max_length:
                self._finish(seq, "length")  # the context window is full
        for seq in [s for s in self._running if s.done]:
            self._leave(seq)
        with self._lock:
            self._regrow_cap()

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[int | None]:
        """The step's tokens (one host transfer); a row whose sampling fails fails alone."""
        samplers = [s.sampler for s in seqs]
        indices = [len(s.generated) for s in seqs]
        try:
            return list(sample_rows(samplers, logits, indices, self.runtime.argmax_rows))
        except Exception:
            picked: list[int | None] = []
            for row, seq in enumerate(seqs):
                try:
                    picked.append(int(seq.sampler.sample(logits[row], indices[row])))
                except Exception as exc:  # one request's failure is its own
                    log.warning("sampling for %s failed: %s", seq.request.request_id, exc)
                    self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
                    picked.append(None)
            return picked

    def _step_failed(self, plan: _Plan, exc: Exception) -> None:
        """A forward pass raised: preempt on out of memory, else fail who brought it."""
        message = f"{type(exc).__name__}: {exc}"
        if _is_oom(exc) and len(self._running) > 1:
            self._preempt(exc)
            return
        prefilling = plan.prefilling
        if len(prefilling) == 1:
            # The one new prompt fails; the decoding rows (if any) retry without it.
            log.warning("prefill of %s failed: %s", prefilling[0].request.request_id, exc)
            self._suspects.discard(prefilling[0])
            self._fail(prefilling, message)
        elif prefilling:
            log.warning("a step prefilling %d requests failed: %s", len(prefilling), exc)
            self._suspects.update(prefilling)
        else:
            log.warning("a step of %d requests failed: %s", len(plan.seqs), exc)
            self._fail(plan.seqs, message)

    def _preempt(self, exc: Exception) -> None:
        """Out of memory: the newest half waits at the head of the queue, the cap drops."""
        self._empty_device_cache()
        running = list(self._running)
        keep = max(1, len(running) // 2)
        back = running[keep:]
        log.warning(
            "out of memory with %d requests (%s); continuing with %d", len(running), exc, keep
        )
        with self._lock:
            for seq in back:
                self._running.remove(seq)
                seq.slot, seq.computed = None, 0
            self._waiting.extendleft(reversed(back))
            self._batch_cap = keep
            self._steps_at_cap = 0

    def _regrow_cap(self) -> None:
        """After an out-of-memory error, let the batch grow back a slot at a time."""
        if self._batch_cap >= self.max_batch_size:
            return
        self._steps_at_cap += 1
        if not self._running or self._steps_at_cap >= OOM_REGROW_STEPS:
            self._batch_cap = self.max_batch_size if not self._running else self._batch_cap + 1
            self._steps_at_cap = 0

    def _fail(self, seqs: list[_Sequence], message: str) -> None:
        for seq in seqs:
            self._finish(seq, "error", error=message)
            self._leave(seq)
            self._suspects.discard(seq)

    def _advance(self, seq: _Sequence, token: int) -> None:
        seq.generated.append(token)
        seq.sampler.observe(token)
        if token in self.eos_token_ids:
            self._finish(seq, "eos_token")
            return
        seq.unsent_ids.append(token)
        piece = seq.detokenizer.push(token)
        if piece:
            text, hit = seq.stops.feed(piece)
            self._emit(seq, text)
            if hit:
                self._finish(seq, "stop_sequence", flush=False)
                return
        if len(seq.generated) >= seq.params.max_new_tokens:
            self._finish(seq, "length")

    def _emit(self, seq: _Sequence, text: str) -> None:
        if not text or seq.handle is None:
            return
        seq.emitted.append(text)
        seq.handle._put(TokenEvent(text, seq.unsent_ids))
        seq.unsent_ids = []

    def _finish(
        self, seq: _Sequence, reason: str, *, error: str | None = None, flush: bool = True
    ) -> None:
        """End ``seq`` once: release held-back text, then send its :class:`FinishEvent`."""
        if seq.done:
            return
        seq.done = True
        if flush and reason != "error" and self._flush(seq):
            reason = "stop_sequence"
        text = "".join(seq.emitted)
        if seq.handle is not None:
            seq.handle._put(
                FinishEvent(reason, text, len(seq.request.prompt_ids), len(seq.generated), error)
            )

    def _flush(self, seq: _Sequence) -> bool:
        """Emit what the detokenizer and the stop filter still hold; True if a stop string ends it.

        The final text is the tokenizer's decoding of every generated token, so
        that pieces withheld as an incomplete character are released as the
        tokenizer would render them.
        """
        done = "".join(seq.emitted)
        rest = seq.stops.flush()
        full = seq.detokenizer.full_text()
        if full.startswith(done):
            rest = full[len(done) :]
        stops = StopStringFilter(seq.params.stop)
        text, hit = stops.feed(rest)
        if not hit:
            text += stops.flush()
        self._emit(seq, text)
        return hit

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _count_tokens(self, n: int) -> None:
        with self._lock:
            self._rate.append((time.monotonic(), n))

    def _cancel(self, seq: _Sequence) -> None:
        seq.cancelled = True
        with self._lock:
            waiting = seq in self._waiting
            if waiting:
                # Not in the batch yet: end it now rather than when a slot frees.
                self._waiting.remove(seq)
        if waiting:
            self._finish(seq, "cancelled")
