"""Loading models from the catalog: sources, the converted-copy cache, errors."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from config import Catalog, ModelDefinition
from models.engine import Engine, FinishEvent, GenerationRequest, SamplingParams
from models.errors import ModelLoadError
from models.loader import (
    MARKER,
    LoadedModel,
    _valid_cache,
    _write_cache,
    load_model,
    resolve_device,
    resolve_dtype,
)


def definition(**fields: Any) -> ModelDefinition:
    return ModelDefinition.model_validate({"name": "x", **fields})


def test_tiny_random_model_is_ready_and_built_from_its_seed(
    tiny: LoadedModel, catalog: Catalog, model_cache_dir: Path
) -> None:
    assert tiny.name == "tiny-random"
    assert (tiny.device, tiny.dtype) == (torch.device("cpu"), torch.float32)
    assert not tiny.model.training
    assert tiny.model.config.vocab_size == len(tiny.tokenizer)
    assert tiny.model.config.eos_token_id == tiny.tokenizer.eos_token_id
    assert "<|im_start|>" in (tiny.tokenizer.chat_template or "")

    rng = torch.get_rng_state()
    again = load_model(catalog["tiny-random"], catalog, model_cache_dir)
    assert torch.equal(torch.get_rng_state(), rng), "loading reseeded the caller's RNG"
    assert torch.equal(tiny.runtime.embed, again.runtime.embed)
    for a, b in zip(tiny.runtime.layers, again.runtime.layers, strict=True):
        assert torch.equal(a.gate_up.weight, b.gate_up.weight)  # type: ignore[attr-defined]
    assert all(p.device.type == "meta" for p in tiny.model.parameters()), "weights kept twice"


def test_auto_device_and_dtype_on_this_machine() -> None:
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source": {"kind": "local", "path": "/no/such/folder"}}, "not a folder"),
        (
            {"source": {"kind": "gguf", "package": "no_such_package_xyz", "file": "a.gguf"}},
            "not installed",
        ),
        ({"source": {"kind": "gguf", "path": "/tmp", "file": "missing.gguf"}}, "not found"),
        ({"source": {"kind": "hub", "id": "nobody/not-in-the-cache-xyz"}}, "x:"),
        ({"source": {"kind": "random", "tokenizer_from": "nowhere"}}, "tokenizer_from"),
    ],
)
def test_bad_sources_raise_a_load_error_naming_the_model(
    catalog: Catalog, tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model(definition(**fields), catalog, tmp_path)
    assert caught.value.model == "x"
    assert message in str(caught.value)


def test_cache_is_written_atomically_and_stale_copies_are_replaced(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    folder = tmp_path / "m" / "tokenizer"
    fingerprint = {"format": 1, "source": "s", "size": 1, "mtime_ns": 1}
    threads = [
        threading.Thread(
            target=_write_cache, args=(folder, fingerprint), kwargs={"tokenizer": tiny.tokenizer}
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _valid_cache(folder, fingerprint) == folder
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokenizer"], "temp folders left"

    newer = {**fingerprint, "mtime_ns": 2}
    assert _valid_cache(folder, newer) is None
    _write_cache(folder, newer, tokenizer=tiny.tokenizer)
    assert json.loads((folder / MARKER).read_text()) == newer
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokenizer"]


def test_smollm2_from_gguf_answers_paris_and_reloads_from_its_cache(
    catalog: Catalog, model_cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model end to end (dequantizes once, ~20 s, then loads the cached copy)."""
    loaded = load_model(catalog["smollm2-135m"], catalog, model_cache_dir)
    assert (model_cache_dir / "smollm2-135m" / "model" / MARKER).is_file()

    engine = Engine(loaded, max_batch_size=2, max_input_tokens=2048)
    engine.start()
    try:
        ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        finish = engine.generate(
            GenerationRequest("paris", ids, SamplingParams(max_new_tokens=16, temperature=0))
        )
    finally:
        engine.stop()
    assert "Paris" in finish.text, finish.text
    del engine, loaded

    import models.loader

    calls: list[dict[str, Any]] = []
    original = models.loader.AutoModelForCausalLM.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(models.loader.AutoModelForCausalLM, "from_pretrained", spy)
    again = load_model(catalog["smollm2-135m"], catalog, model_cache_dir)
    assert calls and all("gguf_file" not in c for c in calls), "the cached copy was not used"
    assert again.model.config.model_type == "llama"
    assert not hasattr(again.model.config, "quantization_config")


def test_int4_weights_hold_q4_1_codes_exactly_and_still_generate(
    catalog: Catalog, model_cache_dir: Path
) -> None:
    import torch

    from models import native
    from models.quant import GROUP_SIZE, Int4Linear, NativeLinear, quantize_int4

    # A weight made the way GGUF Q4_1 makes one: codes 0..15, a half-precision
    # scale and minimum per block of 32, each block using codes 0 and 15.
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k), generator=gen)
    codes[:, ::GROUP_SIZE], codes[:, 1::GROUP_SIZE] = 0, 15
    d = (torch.rand(n, k // GROUP_SIZE, generator=gen) / 50).half().float()
    m = (-torch.rand(n, k // GROUP_SIZE, generator=gen) / 5).half().float()
    weight = (codes.view(n, -1, GROUP_SIZE) * d[..., None] + m[..., None]).view(n, k)
    found, scales, zeros = quantize_int4(weight)
    assert torch.equal(found, codes.int())
    rebuilt = (found.view(n, -1, GROUP_SIZE) - 8) * scales.t()[..., None] + zeros.t()[..., None]
    assert torch.allclose(rebuilt.view(n, k), weight, atol=1e-6)
    x = torch.randn(3, k, generator=gen)
    layer = Int4Linear(weight)
    expected = x.bfloat16().float() @ weight.t()
    assert torch.allclose(layer(x).float(), expected, rtol=2e-2, atol=2e-2)

    quantized = catalog["tiny-random"].model_copy(update={"quantization": "int4"})
    loaded = load_model(quantized, catalog, model_cache_dir)
    assert loaded.quantization == "int4"
    # The engine's own kernel where the machine builds it, else PyTorch's.
    kernel = NativeLinear if native.library() is not None else Int4Linear
    assert isinstance(loaded.runtime.layers[0].qkv, kernel)
    engine = Engine(loaded, max_batch_size=2, max_input_tokens=512)
    engine.start()
    try:
        ids = engine.encode_chat([{"role": "user", "content": "hello"}])
        params = SamplingParams(max_new_tokens=6, temperature=0)
        first = engine.generate(GenerationRequest("a", ids, params))
        second = engine.generate(GenerationRequest("b", ids, params))
    finally:
        engine.stop()
    assert first.finish_reason in ("length", "eos_token")
    assert first.completion_tokens > 0 and first.text == second.text


def test_int4_a8_serves_sampled_requests_alone_and_batched_alike(
    catalog: Catalog, model_cache_dir: Path
) -> None:
    """The 8-bit-activation choice (``quantization: int4-a8``) through the engine: a
    seeded sampled request draws the same text alone and beside others."""
    from models import native
    from models.quant import NativeLinear

    if not native.has_panels():
        pytest.skip("int4-a8 needs the native kernels' panels (AVX2 or AVX512-VNNI)")

    definition = catalog["tiny-random"].model_copy(update={"quantization": "int4-a8"})
    loaded = load_model(definition, catalog, model_cache_dir)
    assert loaded.quantization == "int4-a8"
    assert loaded.runtime.layers[0].gate_up.kind == NativeLinear.Q4_1A8
    engine = Engine(loaded, max_batch_size=4, max_input_tokens=512)
    engine.start()
    try:
        ids = engine.encode_chat([{"role": "user", "content": "hello"}])
        params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=7)
        alone = engine.generate(GenerationRequest("a", ids, params))
        others = [
            engine.submit(GenerationRequest(f"o{i}", ids[:-1], SamplingParams(max_new_tokens=8)))
            for i in range(3)
        ]
        together = engine.generate(GenerationRequest("b", ids, params))
        for other in others:
            assert any(isinstance(event, FinishEvent) for event in other)
    finally:
        engine.stop()
    assert alone.completion_tokens > 0 and alone.text == together.text


def test_quantization_auto_is_int4_on_a_cpu_and_none_asked_is_dense(
    catalog: Catalog, model_cache_dir: Path
) -> None:
    from models.quant import DenseLinear

    auto = load_model(
        catalog["tiny-random"].model_copy(update={"quantization": "auto"}), catalog, model_cache_dir
    )
    assert auto.quantization == "int4"
    dense = load_model(catalog["tiny-random"], catalog, model_cache_dir)
    assert dense.quantization is None and isinstance(dense.runtime.layers[0].qkv, DenseLinear)
