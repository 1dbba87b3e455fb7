"""Sampling parameters and the per-request sampler.

Each request samples with its own :class:`torch.Generator`, reseeded for every
draw from the request's seed and the draw's index, so a seed gives the same
tokens whether the request runs alone, batched with others (up to the
last-bit differences of batched arithmetic) or resumed on another worker.
Order of the logits processing follows transformers: repetition penalty, temperature, top-k, top-p.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from config import sampling as bounds
from models.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those
    filters off; ``repetition_penalty`` 1 is none (the CTRL penalty, applied to
    prompt and generated tokens alike); ``stop`` holds up to 8 strings that end
    the generation and are never part of its text; ``seed`` makes sampling
    repeatable (``None``: a fresh random seed).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self, *, max_new_tokens_limit: int | None = None) -> None:
        """Raise :class:`InvalidRequest` naming the first field out of range."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidRequest("max_new_tokens", "must be an integer")
        if self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", "must be at least 1")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest("max_new_tokens", f"must be at most {max_new_tokens_limit}")
        if not _finite(self.temperature) or not 0 <= self.temperature <= bounds.MAX_TEMPERATURE:
            raise InvalidRequest("temperature", f"must be between 0 and {bounds.MAX_TEMPERATURE:g}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", "must be above 0 and at most 1")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 0 <= self.top_k <= bounds.MAX_TOP_K
        ):
            raise InvalidRequest("top_k", f"must be an integer from 0 (off) to {bounds.MAX_TOP_K}")
        if (
            not _finite(self.repetition_penalty)
            or not 0 < self.repetition_penalty <= bounds.MAX_REPETITION_PENALTY
        ):
            highest = bounds.MAX_REPETITION_PENALTY
            raise InvalidRequest("repetition_penalty", f"must be above 0 and at most {highest:g}")
        if not isinstance(self.stop, (tuple, list)):
            raise InvalidRequest("stop", "must be a sequence of strings")
        if len(self.stop) > bounds.MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {bounds.MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", "each stop string must be a non-empty string")
            if len(s) > bounds.MAX_STOP_CHARS:
                raise InvalidRequest(
                    "stop", f"each stop string must be at most {bounds.MAX_STOP_CHARS} characters"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= bounds.MAX_SEED
        ):
            raise InvalidRequest("seed", "must be an integer between 0 and 2**63 - 1")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SEED_MASK = bounds.MAX_SEED
TOP_P_HEAD = 1024
"""Candidates tried first for top-p; the full sort runs only if they hold too little mass."""


def draw_seed(base: int, index: int) -> int:
    """The seed of a request's ``index``-th draw (splitmix64 of both).

    Every draw depends only on the request's seed and the draw's index, so a
    request samples the same tokens alone, batched, or resumed after its
    ``index`` first tokens on another worker.
    """
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & SEED_MASK


class Sampler:
    """Chooses the next token of one request from its row of logits.

    Randomness comes from a generator reseeded for every draw from
    (seed, draw index) — see :func:`draw_seed`; an unseeded request gets a
    random seed of its own at creation. Sampling draws one exponential
    variate per candidate and takes ``argmax(p / E)`` (the exponential race,
    equivalent to drawing from ``p``), which needs no host round trip.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, device: torch.device, prompt_ids: list[int]
    ) -> None:
        self.params = params
        self.greedy = params.temperature == 0
        self.plain_greedy = self.greedy and params.repetition_penalty == 1.0
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        if not self.greedy:
            self._generator = torch.Generator(device=device)
        self._seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def observe(self, token_id: int) -> None:
        """Record a token of the sequence (for the repetition penalty)."""
        if self._seen is not None:
            self._seen[token_id] = True

    def sample(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """The ``index``-th token (0-dim tensor), from ``logits`` ``[vocab]`` (float32)."""
        p = self.params
        if self._seen is not None:
            penalty = p.repetition_penalty
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self._seen[: logits.shape[-1]], penalised, logits)
        if self.greedy:
            return logits.argmax()
        assert self._generator is not None
        logits = logits / p.temperature
        candidates: torch.Tensor | None = None
        if 0 < p.top_k < logits.shape[-1]:
            logits, candidates = logits.topk(p.top_k)  # sorted, descending
        if p.top_p < 1.0:
            if candidates is None:
                logits, candidates = _nucleus_head(logits, p.top_p)
            probs = logits.softmax(-1)
            # Keep the smallest head whose mass reaches top_p (always the first).
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(-1)
        self._generator.manual_seed(draw_seed(self.seed, index))
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        choice = (probs / noise).argmax()
        return candidates[choice] if candidates is not None else choice


def _nucleus_head(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted logits and ids of a head that surely holds the top-p nucleus.

    The top :data:`TOP_P_HEAD` candidates when their mass reaches ``top_p``
    (the usual case: a cheap partial sort), else the whole sorted row.
    """
    if logits.shape[-1] > TOP_P_HEAD:
        head, ids = logits.topk(TOP_P_HEAD)
        mass = (head - logits.logsumexp(-1)).exp().sum()
        if float(mass) >= top_p:
            return head, ids
    return logits.sort(descending=True)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's ``torch.argmax`` of ``logits`` ``[rows, vocab]``, in one host transfer."""
    return [int(t) for t in logits.argmax(-1).tolist()]


def sample_rows(
    samplers: list[Sampler],
    logits: torch.Tensor,
    indices: list[int],
    argmax: Callable[[torch.Tensor], list[int]] = argmax_rows,
) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]``, with one host transfer.

    A batch of plain greedy rows takes one batched ``argmax`` (:func:`argmax_rows`'s
    indices, computed where the caller has them fastest: the native kernels'
    :meth:`models.llama.LlamaRuntime.argmax_rows`); otherwise the greedy rows
    take one ``torch.argmax`` and the others sample row by row on the device.
    Raises what a row's sampler raises; callers that must isolate a bad row
    call :meth:`Sampler.sample` for it alone.
    """
    if all(s.plain_greedy for s in samplers):
        return argmax(logits)
    greedy = logits.argmax(-1)
    picks = [
        greedy[row] if s.plain_greedy else s.sample(logits[row], indices[row])
        for row, s in enumerate(samplers)
    ]
    return [int(t) for t in torch.stack(picks).tolist()]
