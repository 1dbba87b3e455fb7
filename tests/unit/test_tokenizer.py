"""/tokenize's torch-free tokenizer encodes exactly as the engine's transformers tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.tokenizer import TextTokenizer, tokenizer_folder
from config import load_catalog
from config.settings import PROJECT_ROOT

STATE = PROJECT_ROOT / ".switchyard"


@pytest.fixture(scope="module")
def folder() -> Path:
    catalog = load_catalog(PROJECT_ROOT / "config" / "models")
    found = tokenizer_folder(catalog["tiny-random"], catalog, STATE)
    if found is None:
        pytest.skip("smollm2-135m's tokenizer is not cached yet (start a worker once)")
    return found


CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Héllo 👋 <|im_end|>"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "  spaces\n\nand lines  "},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_match_transformers(folder: Path, messages: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = list(reference(text, add_special_tokens=False)["input_ids"])
    assert TextTokenizer.load(folder).encode_chat(messages) == expected


@pytest.mark.parametrize("prompt", ["hello world", "Ünïcode ✓ and\ttabs", "<|im_start|>user"])
def test_prompt_ids_match_transformers(folder: Path, prompt: str) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = list(reference(prompt, add_special_tokens=True)["input_ids"])
    assert TextTokenizer.load(folder).encode_prompt(prompt) == expected


@pytest.mark.parametrize("messages", CHATS)
def test_files_a_worker_publishes_encode_the_same(
    folder: Path, messages: list[dict[str, str]]
) -> None:
    """What a worker saves from its loaded tokenizer (and publishes to Redis) encodes alike."""
    from transformers import AutoTokenizer

    from fleet.tokenizers import saved_tokenizer_files

    reference = AutoTokenizer.from_pretrained(str(folder))
    files = saved_tokenizer_files(reference)
    assert "tokenizer.json" in files
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = list(reference(text, add_special_tokens=False)["input_ids"])
    assert TextTokenizer.from_files(files).encode_chat(messages) == expected
    assert TextTokenizer.from_files(files).encode_prompt("Héllo") == list(
        reference("Héllo", add_special_tokens=True)["input_ids"]
    )
