"""The engine benchmark's long-context prompts (``python -m bench.engine --document N``)."""

from __future__ import annotations

from pathlib import Path

from bench.engine import PROMPTS, with_document

TEXT = (Path(__file__).parents[2] / "bench" / "quality.txt").read_text(encoding="utf-8").split()


def test_every_prompt_follows_the_same_document_of_the_asked_length() -> None:
    words = len(TEXT) * 2 + 5  # longer than the text: it repeats
    prompts = with_document(PROMPTS[:3], words)
    assert len(prompts) == 3
    for prompt, question in zip(prompts, PROMPTS[:3], strict=True):
        document, asked = prompt.split("\n\n")
        assert asked == question
        assert document.split() == (TEXT * 3)[:words]


def test_without_a_document_the_prompts_are_unchanged() -> None:
    assert with_document(PROMPTS, 0) == list(PROMPTS)
