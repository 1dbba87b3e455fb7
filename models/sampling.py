"""Sampling parameters and the per-request sampler.

Each request samples with its own :class:`torch.Generator`, so a seed gives the
same tokens whether the request runs alone or batched with others (up to the
last-bit differences of batched arithmetic). Order of the logits processing
follows transformers: repetition penalty, temperature, top-k, top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.errors import InvalidRequest

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0


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
        if not _finite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest("temperature", f"must be between 0 and {MAX_TEMPERATURE:g}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", "must be above 0 and at most 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", "must be a non-negative integer (0 = off)")
        if (
            not _finite(self.repetition_penalty)
            or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise InvalidRequest(
                "repetition_penalty", f"must be above 0 and at most {MAX_REPETITION_PENALTY:g}"
            )
        if not isinstance(self.stop, (tuple, list)):
            raise InvalidRequest("stop", "must be a sequence of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", "each stop string must be a non-empty string")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequest(
                    "stop", f"each stop string must be at most {MAX_STOP_CHARS} characters"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise InvalidRequest("seed", "must be an integer between 0 and 2**63 - 1")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Sampler:
    """Chooses the next token of one request from its row of logits."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, device: torch.device, prompt_ids: list[int]
    ) -> None:
        self.params = params
        self.greedy = params.temperature == 0
        self._generator: torch.Generator | None = None
        if not self.greedy:
            self._generator = torch.Generator(device=device)
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)
        self._seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True

    def observe(self, token_id: int) -> None:
        """Record a token of the sequence (for the repetition penalty)."""
        if self._seen is not None:
            self._seen[token_id] = True

    def sample(self, logits: torch.Tensor) -> int:
        """The next token, from ``logits`` of shape ``[vocab]`` (float32)."""
        p = self.params
        if self._seen is not None:
            penalty = p.repetition_penalty
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self._seen[: logits.shape[-1]], penalised, logits)
        if self.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        candidates: torch.Tensor | None = None
        if 0 < p.top_k < logits.shape[-1]:
            logits, candidates = logits.topk(p.top_k)  # sorted, descending
        if p.top_p < 1.0:
            if candidates is None:
                logits, candidates = logits.sort(descending=True)
            probs = logits.softmax(-1)
            # Keep the smallest head whose mass reaches top_p (always the first).
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(-1)
        choice = int(torch.multinomial(probs, 1, generator=self._generator))
        return int(candidates[choice]) if candidates is not None else choice
