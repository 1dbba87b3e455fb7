"""The generation engine: continuous batching over one loaded model.

One step-loop thread owns the model. Requests are submitted from any thread
and wait in a FIFO; between two decoding steps the loop admits as many as there
are free slots: it prefills each new request alone (batch 1, exactly as if it
ran alone), samples its first token, and merges its KV cache into the running
batch by left-padding both caches to a common length (an attention mask hides
the padding; position ids are given per row, so padding shifts nothing). Every
step then decodes one token for every running request in a single forward
pass. A request that finishes or is cancelled leaves at once: the batch is
index-selected without it, and columns that became padding for every row are
trimmed from the left.

Events reach the caller through a :class:`RequestHandle`: zero or more
:class:`TokenEvent` followed by exactly one :class:`FinishEvent`.

Failure isolation: an error in one request's own work (prefill, sampling,
detokenizing) fails that request alone; an error in the shared forward pass
fails the requests of that step and the loop goes on serving; a CUDA
out-of-memory error halves the batch, putting the other half back at the head
of the queue to be re-prefilled later, instead of failing anything. An
out-of-memory error while admitting a request (its prefill, or merging its
cache, which is all or nothing) puts that request back first in line and stops
the batch growing; a request the loop has taken always gets a finish event.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from models.batch import Batch, check_mergeable
from models.detokenize import IncrementalDetokenizer, StopStringFilter
from models.errors import EngineClosed, EngineError, InvalidRequest, PromptTooLong
from models.loader import LoadedModel
from models.sampling import Sampler, SamplingParams

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

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""Chat-template end markers that end a generation when the template uses them."""


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt token ids and how to sample the continuation."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """Text to append to the output, with the token ids it came from.

    The text never contains (part of) a stop string and never ends inside a
    UTF-8 character; it is never empty.
    """

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class FinishEvent:
    """The end of a request: why, its whole text and its token counts.

    ``finish_reason`` is ``length``, ``eos_token``, ``stop_sequence``,
    ``cancelled`` or ``error`` (then ``error`` says what went wrong). ``text``
    equals the concatenation of every :class:`TokenEvent` text of the request.
    ``completion_tokens`` counts every token sampled, end-of-sequence included.
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

    def _put(self, event: Event) -> None:
        self._events.put(event)

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
    position: int = 0  # tokens of this sequence held in the KV cache
    cancelled: bool = False
    done: bool = False

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def all_ids(self) -> list[int]:
        return [*self.request.prompt_ids, *self.generated]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError)


class Engine:
    """Continuous-batching text generation over one :class:`LoadedModel`.

    ``max_batch_size`` bounds the requests decoded together (the others wait in
    FIFO order); ``max_input_tokens`` bounds a prompt; ``max_new_tokens``, when
    given, bounds what a request may ask for. Call :meth:`start` once, then
    :meth:`submit` from any thread; :meth:`stop` ends the loop.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int,
        max_input_tokens: int,
        max_new_tokens: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if max_input_tokens < 1:
            raise ValueError("max_input_tokens must be at least 1")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.max_batch_size = max_batch_size
        self.max_input_tokens = max_input_tokens
        self.max_new_tokens = max_new_tokens
        embeddings: Any = self.model.get_input_embeddings()
        self.vocab_size = int(embeddings.weight.shape[0])
        self.eos_token_ids = frozenset(self._find_eos_ids())
        self._cache_kwarg = (
            "cache"
            if "cache" in inspect.signature(self.model.forward).parameters
            else "past_key_values"
        )
        self._check_cache_layout()

        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._batch: Batch[_Sequence] = Batch()
        self._batch_cap = max_batch_size  # lowered after an out-of-memory error
        self._steps_at_cap = 0
        self._admitting: _Sequence | None = None  # being prefilled, not yet in the batch
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._rate: deque[tuple[float, int]] = deque()
        self._started_at = time.monotonic()

    # -- public API -------------------------------------------------------------

    def start(self) -> None:
        """Start the step-loop thread (once)."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine has been stopped")
            if self._thread is not None:
                return
            self._started_at = time.monotonic()
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
            leftovers = list(self._batch.seqs) + list(self._waiting)
            self._batch.clear()
            self._waiting.clear()
        for seq in leftovers:
            self._finish(seq, "cancelled")

    @property
    def busy_slots(self) -> int:
        """Requests being decoded now (not counting those waiting for a slot)."""
        # Read both under the lock: the step loop moves a sequence from
        # ``_admitting`` into the batch under it, so it is counted once.
        with self._lock:
            admitting = self._admitting
            seqs = list(self._batch.seqs)
        busy = sum(1 for seq in seqs if not seq.done)
        if admitting is not None and not admitting.done and admitting not in seqs:
            busy += 1
        return busy

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
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequest("prompt", f"token id {t!r} is outside the vocabulary")

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

    def _check_cache_layout(self) -> None:
        if not check_mergeable(self.model.config):
            raise EngineError(
                "this model's KV cache is not a plain per-layer cache (sliding window or "
                "recurrent layers); the batching engine cannot merge it"
            )

    # -- the step loop -----------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not self._stopping and not self._waiting and not self._batch.seqs:
                        self._lock.wait()
                    if self._stopping:
                        return
                try:
                    self._admit()
                    self._drop_cancelled()
                    if self._batch.seqs:
                        self._decode_step()
                except Exception as exc:  # the loop must outlive any bug
                    log.exception("engine step failed")
                    self._fail_batch(f"{type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, oldest first."""
        while True:
            with self._lock:
                if self._stopping or not self._waiting or len(self._batch) >= self._batch_cap:
                    return
                seq = self._waiting.popleft()
                self._admitting = seq
            try:
                admitted = self._admit_one(seq)
            except BaseException as exc:  # never lose a request the loop took
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
                raise
            finally:
                with self._lock:
                    self._admitting = None
            if not admitted:
                return

    def _admit_one(self, seq: _Sequence) -> bool:
        """Prefill ``seq`` and merge it into the batch; False if it was put back (OOM)."""
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return True
        try:
            cache, logits = self._prefill(seq)
        except Exception as exc:  # one request's failure is its own
            if _is_oom(exc) and self._batch.seqs:
                self._put_back(seq)
                return False
            log.warning("prefill of %s failed: %s", seq.request.request_id, exc)
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            return True
        seq.position = len(seq.all_ids())
        self._process_row(seq, logits)
        self._count_tokens(1)
        if seq.done:
            return True
        try:
            with self._lock:
                self._batch.add(seq, cache, seq.position)
        except Exception as exc:  # the merge left the batch as it was
            del cache
            if _is_oom(exc):
                # Its first token is out: the next prefill (prompt + that token)
                # picks the sequence up where it stopped.
                self._put_back(seq)
                return False
            log.warning("merging %s into the batch failed: %s", seq.request.request_id, exc)
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
        return True

    def _put_back(self, seq: _Sequence) -> None:
        """Out of memory admitting ``seq``: it waits first in line; the batch stops growing."""
        self._empty_device_cache()
        log.warning(
            "out of memory admitting %s beside %d requests; it waits for a free slot",
            seq.request.request_id,
            len(self._batch),
        )
        with self._lock:
            self._waiting.appendleft(seq)
            self._batch_cap = max(1, len(self._batch))
            self._steps_at_cap = 0

    def _prefill(self, seq: _Sequence) -> tuple[DynamicCache, torch.Tensor]:
        """Run a sequence's tokens alone; return its cache and last-position logits."""
        ids = torch.tensor([seq.all_ids()], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache}
        )
        return cache, out.logits[0, -1].float()

    def _drop_cancelled(self) -> None:
        batch = self._batch
        if not any(s.cancelled for s in batch.seqs):
            return
        keep = []
        for row, seq in enumerate(batch.seqs):
            if seq.cancelled:
                self._finish(seq, "cancelled")
            else:
                keep.append(row)
        with self._lock:
            batch.keep(keep)

    def _decode_step(self) -> None:
        """One forward pass over the batch, one new token for every row."""
        batch = self._batch
        assert batch.mask is not None
        width = batch.mask.shape[1]
        device = batch.mask.device
        input_ids = torch.tensor(
            [[s.generated[-1]] for s in batch.seqs], dtype=torch.long, device=device
        )
        positions = torch.tensor(
            [[s.position] for s in batch.seqs], dtype=torch.long, device=device
        )
        mask = F.pad(batch.mask, (0, 1), value=1)
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: batch.cache},
            )
            logits = out.logits[:, -1].float()
        except Exception as exc:  # shared: fail this step's requests
            if _is_oom(exc) and len(batch) > 1:
                self._halve_batch(width)
                return
            log.warning("decode step of %d requests failed: %s", len(batch), exc)
            self._fail_batch(f"{type(exc).__name__}: {exc}")
            return
        batch.mask = mask
        keep = []
        for row, seq in enumerate(batch.seqs):
            seq.position += 1
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            self._process_row(seq, logits[row])
            if not seq.done:
                keep.append(row)
        self._count_tokens(len(batch))
        with self._lock:
            batch.keep(keep)
            self._regrow_cap()

    def _regrow_cap(self) -> None:
        """After an out-of-memory error, let the batch grow back a slot at a time."""
        if self._batch_cap >= self.max_batch_size:
            return
        self._steps_at_cap += 1
        if not self._batch.seqs or self._steps_at_cap >= OOM_REGROW_STEPS:
            self._batch_cap = self.max_batch_size if not self._batch.seqs else self._batch_cap + 1
            self._steps_at_cap = 0

    def _process_row(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample one token for ``seq`` and emit its text; failures fail ``seq`` alone."""
        try:
            self._advance(seq, seq.sampler.sample(logits))
        except Exception as exc:  # one request's failure is its own
            log.warning("request %s failed: %s", seq.request.request_id, exc)
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

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

    def _fail_batch(self, message: str) -> None:
        with self._lock:
            seqs = list(self._batch.seqs)
            self._batch.clear()
        for seq in seqs:
            self._finish(seq, "error", error=message)

    def _halve_batch(self, width: int) -> None:
        """After an out-of-memory error: keep half the rows, requeue the rest first."""
        self._empty_device_cache()
        batch = self._batch
        batch.crop(width)
        half = len(batch) // 2
        requeue = batch.seqs[half:]
        log.warning("out of memory with %d requests; continuing with %d", len(batch), half)
        with self._lock:
            batch.keep(list(range(half)))
            self._waiting.extendleft(reversed(requeue))
            self._batch_cap = max(1, half)
            self._steps_at_cap = 0

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
