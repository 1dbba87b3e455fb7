"""Turning a growing list of token ids into text pieces, and stop strings.

:class:`IncrementalDetokenizer` decodes a small window of recent tokens per
step (the technique of vLLM and TGI), so its cost does not grow with the
output, and it waits while the window ends in an incomplete UTF-8 character.
:class:`StopStringFilter` holds back any tail of the text that could still
become a stop string, so a stop string is never emitted, even when it is split
across tokens.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
MAX_PENDING_TOKENS = 16
"""Tokens waited for to complete a character before a genuine U+FFFD is emitted."""


class IncrementalDetokenizer:
    """Decodes one sequence's generated tokens a piece at a time.

    The concatenation of the pieces equals ``tokenizer.decode(ids,
    skip_special_tokens=True)`` of all ids pushed so far (once the output does
    not end inside a character).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        # NUL is the one character a PostgreSQL text column cannot hold: a job
        # whose answer had one failed when its row was written. It is shown as
        # U+FFFD (one character for one: the offsets above hold), in the stream
        # and the record alike.
        return text.replace("\x00", REPLACEMENT_CHAR)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        text = self._decode(self.ids[self._prefix_offset :])
        if len(text) <= len(prefix):
            return ""
        waiting = len(self.ids) - self._read_offset
        if text.endswith(REPLACEMENT_CHAR) and waiting < MAX_PENDING_TOKENS:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return text[len(prefix) :]

    def full_text(self) -> str:
        """The decoding of every id pushed, in one call (used once, at the end).

        Tokens still waiting to complete a character are an incomplete
        character: a generation cut there ends before it, not with U+FFFD
        (as vLLM does).
        """
        text = self._decode(self.ids)
        if self._read_offset < len(self.ids) and text.endswith(REPLACEMENT_CHAR):
            settled = len(self._decode(self.ids[: self._read_offset]))
            while len(text) > settled and text.endswith(REPLACEMENT_CHAR):
                text = text[:-1]
        return text


class StopStringFilter:
    """Finds stop strings in a stream of text and holds back possible beginnings."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit, whether a stop string was hit).

        After a hit, the returned text is everything before the earliest stop
        string and the filter should not be fed again.
        """
        if not self.stops:
            return text, False
        pending = self._pending + text
        hit = -1
        for stop in self.stops:
            at = pending.find(stop)
            if at != -1 and (hit == -1 or at < hit):
                hit = at
        if hit != -1:
            self._pending = ""
            return pending[:hit], True
        hold = self._held_length(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """Release the held-back text (the generation ended without a stop)."""
        pending, self._pending = self._pending, ""
        return pending

    def _held_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
