"""The engine's own CPU kernels (``models/native/qgemm.c``) against PyTorch.

Each kernel is held to the arithmetic it promises: the grouped 4-bit and
8-bit matmuls (block and panel layouts) to a float32 matmul of the same
(dequantized) weights and the same 16-bit-quantized activations, the norms,
activation and decode attention to PyTorch's; and every one of them gives a
row the same bits whatever it is batched with, which the engine's "same seed,
same text, alone or batched" rests on. Without a C compiler the library is
absent and the runtime keeps PyTorch's int4 kernel.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from models import native
from models.llama import Chunk, LlamaRuntime, StepInput
from models.quant import (
    GROUP_SIZE,
    PANEL_WIDTH,
    Int4Linear,
    NativeLinear,
    pack_q4_1,
    place_on_huge_pages,
)
from tests.unit.test_llama_runtime import SHAPE, _model

lib = native.library()
pytestmark = pytest.mark.skipif(
    lib is None and shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler on this machine",
)


def test_the_library_builds_where_a_compiler_is() -> None:
    assert lib is not None, "cc/gcc is installed, but qgemm.c did not build (see the log)"


def _q16_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: 16 bits per block of 32, round half away from zero."""
    blocks = x.view(x.shape[0], -1, GROUP_SIZE)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    scaled = blocks / torch.where(d > 0, d, torch.ones_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * d).view_as(x)


def _q8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the ``Q4_1A8`` kernel sees it: 8 bits per block of 32, round half away
    from zero."""
    blocks = x.view(x.shape[0], -1, GROUP_SIZE)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * d).view_as(x)


@pytest.mark.parametrize("kind", [NativeLinear.Q4_1, NativeLinear.Q8_0, NativeLinear.Q4_1A8])
@pytest.mark.parametrize("outputs", [72, 96])
def test_grouped_matmuls_compute_their_weights_and_give_a_row_the_same_bits_in_any_batch(
    kind: int, outputs: int
) -> None:
    """72 outputs take the block kernel; 96 (a multiple of 16) the panel kernel where
    the CPU has AVX2 or AVX512-VNNI. ``Q4_1A8`` (8-bit activations) exists in panels
    only: elsewhere the layer is ``Q4_1``."""
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(outputs, 6 * GROUP_SIZE, generator=gen) * 0.05
    layer = NativeLinear(weight, kind, lib, dense=torch.float32, max_rows=40)
    assert layer.panels == (outputs % PANEL_WIDTH == 0 and bool(lib.sy_panels()))
    if kind == NativeLinear.Q4_1A8:
        assert layer.kind == (NativeLinear.Q4_1A8 if layer.panels else NativeLinear.Q4_1)
    x = torch.randn(37, weight.shape[1], generator=gen)
    got = layer(x)
    seen = _q8_activations(x) if layer.kind == NativeLinear.Q4_1A8 else _q16_activations(x)
    exact = seen @ layer.dense.t()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    reference = x @ weight.t()  # the original weight: 4 or 8 bits lose a little of it
    error = float((got - reference).norm() / reference.norm())
    assert error < (0.01 if kind == NativeLinear.Q8_0 else 0.1), error
    if layer.kind == NativeLinear.Q4_1A8:  # 8-bit activations lose more than 16-bit ones
        sixteen = NativeLinear(weight, NativeLinear.Q4_1, lib)(x)
        assert float((got - sixteen).norm() / sixteen.norm()) > 1e-3
    for rows in (1, 2, 3, 4, 5, 8, 17):
        for start in (0, 3):
            assert torch.equal(layer(x[start : start + rows]), got[start : start + rows])
    # Above max_rows the dense copy serves.
    torch.testing.assert_close(
        NativeLinear(weight, kind, lib, dense=torch.float32, max_rows=4)(x),
        x @ layer.dense.t(),
    )


def test_q4_1_blocks_hold_a_gguf_q4_1_weight_exactly() -> None:
    assert lib is not None
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 4 * GROUP_SIZE
    codes = torch.randint(0, 16, (n, k), generator=gen)
    codes[:, ::GROUP_SIZE], codes[:, 1::GROUP_SIZE] = 0, 15
    d = (torch.rand(n, k // GROUP_SIZE, generator=gen) / 50).half().float()
    m = (-torch.rand(n, k // GROUP_SIZE, generator=gen) / 5).half().float()
    weight = (codes.view(n, -1, GROUP_SIZE) * d[..., None] + m[..., None]).view(n, k)
    blocks, rebuilt = pack_q4_1(weight)
    assert torch.equal(rebuilt, weight)
    assert blocks.shape == (n, k // GROUP_SIZE, lib.sy_block_q4_1_size())


def test_norm_and_activation_match_pytorch() -> None:
    assert lib is not None
    ops = native.Ops(lib)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    delta = torch.randn(5, 64, generator=gen)
    weight = torch.rand(64, generator=gen)
    expected = F.rms_norm(x + delta, (64,), weight, 1e-5)
    residual = x.clone()
    torch.testing.assert_close(ops.add_rms_norm(residual, delta, weight, 1e-5), expected)
    torch.testing.assert_close(residual, x + delta)
    gate_up = torch.randn(3, 2 * 48, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "hd"),
    # scalar head size; pairs of heads; SmolLM2's groups of 3; 4 (3 + 1) and 6 (3 + 3)
    [(4, 2, 16), (4, 2, 64), (9, 3, 64), (4, 1, 64), (6, 1, 64)],
)
def test_decode_attention_matches_pytorch_and_gives_a_row_its_bits_alone(
    heads: int, kv_heads: int, hd: int
) -> None:
    assert lib is not None
    ops = native.Ops(lib)
    gen = torch.Generator().manual_seed(heads * 100 + hd)
    length = 160
    # The kernels' cache holds half floats; the reference reads the same values.
    kv = torch.randn(3, 2 * kv_heads, length, hd, generator=gen).to(native.KV_DTYPE)
    # Decoding rows of their own slots, then three rows of one slot at consecutive
    # positions (a prompt being prefilled: attended together, lengths differing).
    slots = torch.tensor([2, 0, 1, 1, 1])
    lengths = torch.tensor([7, 150, 70, 71, 72])
    q = torch.randn(len(slots), heads, hd, generator=gen) * 2
    got = ops.decode_attention(q, kv, kv_heads, slots, lengths, hd**-0.5)
    for row in range(len(slots)):
        slot, n = int(slots[row]), int(lengths[row])
        exact = kv.float()
        keys, values = exact[slot : slot + 1, :kv_heads, :n], exact[slot : slot + 1, kv_heads:, :n]
        want = F.scaled_dot_product_attention(
            q[row][None, :, None], keys, values, scale=hd**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(got[row], want[0, :, 0], rtol=1e-5, atol=1e-5)
        alone = ops.decode_attention(
            q[row : row + 1], kv, kv_heads, slots[row : row + 1], lengths[row : row + 1], hd**-0.5
        )
        assert torch.equal(alone[0], got[row])
    with pytest.raises(ValueError, match="KV cache"):
        ops.decode_attention(q, kv.float(), kv_heads, slots, lengths, hd**-0.5)


def test_greedy_argmax_picks_pytorchs_index_with_ties_infinities_and_nans() -> None:
    """Greedy decoding's token: the first largest value's index, a NaN the largest,
    as ``torch.argmax`` — across the vector loop, its lanes and the tail."""
    assert lib is not None
    ops = native.Ops(lib)
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(3, 49152, generator=gen)]
    for n in (1, 7, 8, 9, 17, 64, 131):
        cases.append(torch.randn(4, n, generator=gen))
        cases.append(torch.randint(-2, 2, (4, n), generator=gen).float())  # ties
        cases.append(torch.full((2, n), float("-inf")))
        with_nan = torch.randn(4, n, generator=gen)
        with_nan[:, n // 2] = float("nan")
        with_nan[1, -1] = float("nan")  # row 1 has two; row 3 only one in the tail
        with_nan[3, n // 2] = 0.0
        cases.append(with_nan)
        with_inf = torch.randn(2, n, generator=gen)
        with_inf[:, (3 * n) // 4] = float("inf")
        cases.append(with_inf)
    for x in cases:
        assert ops.argmax_rows(x) == x.argmax(-1).tolist(), x


def test_the_cache_stores_keys_and_values_as_rounded_half_floats() -> None:
    """sy_rope_store writes each row's keys and values to its slot and position as
    float16, rounded to nearest even like PyTorch's cast, and leaves the rest."""
    assert lib is not None
    ops = native.Ops(lib)
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, hd, length = 2, 1, 16, 8
    qkv = torch.randn(3, (heads + 2 * kv_heads) * hd, generator=gen) * 300
    qkv[0, -hd:] = torch.tensor([65519.0, 65520.0, 1e-7, -3e-8, 2.0**-24, 0.0, -0.0, 1 / 3] * 2)
    freqs = torch.stack([torch.ones(length, hd // 2), torch.zeros(length, hd // 2)], -1)
    kv = torch.full((4, 2 * kv_heads, length, hd), 7.0, dtype=native.KV_DTYPE)
    positions, slots = torch.tensor([5, 0, 2]), torch.tensor([3, 1, 3])
    ops.rope_store(qkv, heads, kv_heads, positions, slots, freqs, kv)  # cos 1, sin 0: no turn
    for row in range(3):
        stored = kv[int(slots[row]), :, int(positions[row])].reshape(-1)
        expected = qkv[row, heads * hd :].to(native.KV_DTYPE)
        assert torch.equal(stored.view(torch.int16), expected.view(torch.int16)), row
    untouched = torch.ones_like(kv, dtype=torch.bool)
    untouched[slots, :, positions] = False
    assert bool((kv[untouched] == 7.0).all())


def _tiny_llama() -> PreTrainedModel:
    return _model("llama")  # the random Llama the runtime's own tests hold to transformers


@pytest.mark.parametrize("quantization", ["int4", "int4-a8"])
def test_an_int4_runtime_decodes_a_row_to_the_same_bits_alone_or_batched(
    quantization: str,
) -> None:
    """The whole step, native kernels throughout: a sequence's logits do not depend on
    the other sequences decoding beside it, with 16-bit or 8-bit activations."""
    model = _tiny_llama()
    with torch.inference_mode():
        runtime = LlamaRuntime(model, quantization=quantization)
        assert isinstance(runtime.layers[0].qkv, NativeLinear)
        if quantization == "int4-a8" and runtime.native_layers is not None:
            assert runtime.layers[0].down.kind == NativeLinear.Q4_1A8
            assert runtime.lm_head.kind == NativeLinear.Q8_0  # 16-bit activations
        assert runtime.ops is not None
        cache = runtime.new_cache(4, 64)
        cache.ensure(32)
        prompts = [[5, 9, 2, 77, 31], [8, 8, 1], [100, 3, 64, 2], [7]]
        for slot, ids in enumerate(prompts):
            runtime.forward(
                StepInput(
                    torch.tensor(ids), torch.arange(len(ids)), [], [Chunk(slot, 0, len(ids))], []
                ),
                cache,
            )
        lengths = [len(p) for p in prompts]

        def decode(slots: list[int]) -> torch.Tensor:
            step = StepInput(
                torch.tensor([11 + s for s in slots]),
                torch.tensor([lengths[s] for s in slots]),
                slots,
                [],
                list(range(len(slots))),
            )
            return runtime.forward(step, cache)

        together = decode([3, 1, 0, 2])
        for row, slot in enumerate([3, 1, 0, 2]):
            assert torch.equal(decode([slot])[0], together[row])
        if runtime.native_layers is not None:
            # Every layer in one call (panels): the same bits as layer by layer.
            fused = runtime.native_layers
            runtime.native_layers = None
            try:
                assert torch.equal(decode([3, 1, 0, 2]), together)
            finally:
                runtime.native_layers = fused


@pytest.mark.parametrize(
    ("head_dim", "quantization"), [(16, "int4"), (64, "int4"), (64, "int4-a8")]
)
def test_a_step_on_two_threads_gives_each_row_its_bits_alone(
    head_dim: int, quantization: str
) -> None:
    """Eight decoding rows on two threads: each thread takes four rows through every
    layer (``sy_decode_layers``' split); four rows (one register tile), three, or one
    share one parallel region for the whole step (``layers_in_team``), five split
    3 + 2. Every row's logits are those it gets decoded alone and those of the
    layer-by-layer path. Heads of 64 are attended a group at a time
    (``attend_rows``), others one by one."""
    torch.manual_seed(0)
    heads = 2  # sharing one key and value head
    shape = {**SHAPE, "hidden_size": heads * head_dim, "num_attention_heads": heads}
    shape["num_key_value_heads"] = 1
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False)).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            runtime = LlamaRuntime(model, quantization=quantization)
            if runtime.native_layers is None:
                pytest.skip("no panels on this CPU: no fused step to split")
            cache = runtime.new_cache(8, 64)
            cache.ensure(32)
            prompts = [[5 + s, 9, 2 * s + 1, 77][: 1 + s % 4] for s in range(8)]
            for slot, ids in enumerate(prompts):
                chunk = Chunk(slot, 0, len(ids))
                runtime.forward(
                    StepInput(torch.tensor(ids), torch.arange(len(ids)), [], [chunk], []), cache
                )

            def decode(slots: list[int]) -> torch.Tensor:
                step = StepInput(
                    torch.tensor([11 + s for s in slots]),
                    torch.tensor([len(prompts[s]) for s in slots]),
                    slots,
                    [],
                    list(range(len(slots))),
                )
                return runtime.forward(step, cache)

            order = [6, 2, 7, 0, 5, 1, 3, 4]
            together = decode(order)
            few = decode(order[:3])
            for row, slot in enumerate(order):
                assert torch.equal(decode([slot])[0], together[row])
            assert torch.equal(few, together[:3])
            for n in (4, 5):
                assert torch.equal(decode(order[:n]), together[:n])
            fused = runtime.native_layers
            runtime.native_layers = None
            try:
                assert torch.equal(decode(order), together)
                assert torch.equal(decode(order[:3]), few)
            finally:
                runtime.native_layers = fused
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("quantization", ["int4", "int4-a8"])
def test_a_prefilled_token_gets_the_bits_of_the_same_token_decoded_alone(
    quantization: str,
) -> None:
    """With every layer in one call, a prompt's tokens are rows like decoding ones: one
    chunk, two chunks beside a decoding row, or one token a step give the same logits
    and the same cache, to the bit; and the same function as the layer-by-layer path.
    On two threads the chunks are split by rows (``sy_decode_layers``), the threads
    meeting after every layer's cache write, before any row attends."""
    model = _tiny_llama()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with torch.inference_mode():
        runtime = LlamaRuntime(model, quantization=quantization)
        if runtime.native_layers is None:
            pytest.skip("no panels on this CPU: prefill runs layer by layer")
        prompt = [5, 9, 2, 77, 31, 4, 8]
        n = len(prompt)
        cache = runtime.new_cache(5, 64)
        cache.ensure(32)

        def run(decode_slots: list[int], chunks: list[Chunk], ids: list[int]) -> torch.Tensor:
            positions = [n for _ in decode_slots] + [
                c.start + i for c in chunks for i in range(c.length)
            ]
            step = StepInput(
                torch.tensor(ids), torch.tensor(positions), decode_slots, chunks, [len(ids) - 1]
            )
            return runtime.forward(step, cache)[0]

        whole = run([], [Chunk(0, 0, n)], prompt)
        run([], [Chunk(4, 0, n)], prompt)  # slot 4: a sequence decoding beside slot 1's
        run([], [Chunk(1, 0, 3)], prompt[:3])
        split = run([4], [Chunk(1, 3, n - 3)], [12, *prompt[3:]])
        for position, token in enumerate(prompt):
            step = StepInput(torch.tensor([token]), torch.tensor([position]), [2], [], [0])
            alone = runtime.forward(step, cache)[0]
        assert torch.equal(split, whole) and torch.equal(alone, whole)
        for layer_kv in cache.kv:
            assert torch.equal(layer_kv[1, :, :n], layer_kv[0, :, :n])
            assert torch.equal(layer_kv[2, :, :n], layer_kv[0, :, :n])
        fused = runtime.native_layers
        runtime.native_layers = None
        try:
            torch.testing.assert_close(
                run([], [Chunk(3, 0, n)], prompt), whole, rtol=1e-4, atol=1e-4
            )
        finally:
            runtime.native_layers = fused
            torch.set_num_threads(threads)


def test_without_a_compiler_the_runtime_keeps_pytorchs_int4_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert native._load() is None
    monkeypatch.setattr(native, "_loaded", [None])
    with torch.inference_mode():
        runtime = LlamaRuntime(_tiny_llama(), quantization="int4")
    assert isinstance(runtime.layers[0].qkv, Int4Linear)
    assert runtime.ops is None
    # 8-bit activations exist in the native kernels only: a clear refusal, not int4.
    with pytest.raises(ValueError, match="int4-a8 needs the native kernels"):
        LlamaRuntime(_tiny_llama(), quantization="int4-a8")


def test_the_setting_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("0", False), ("false", False), ("1", True), ("true", True)):
        monkeypatch.setenv("SWITCHYARD_NATIVE_KERNELS", value)
        assert native.enabled() is on


def test_weights_on_huge_pages_give_the_same_products() -> None:
    """place_on_huge_pages moves the codes and scales into one arena (64-byte
    aligned, the arena on a 2 MiB boundary) and the products keep their bits."""
    assert lib is not None
    gen = torch.Generator().manual_seed(2)
    layers = [
        NativeLinear(torch.randn(48, 64, generator=gen), NativeLinear.Q4_1, lib),
        NativeLinear(torch.randn(32, 96, generator=gen), NativeLinear.Q8_0, lib),
    ]
    xs = [torch.randn(5, layer.in_features, generator=gen) for layer in layers]
    before = [layer(x) for layer, x in zip(layers, xs, strict=True)]
    held = [
        t.clone()
        for layer in layers
        for t in (layer.codes, getattr(layer, "d", None))
        if t is not None
    ]
    place_on_huge_pages(layers)
    moved = [
        t for layer in layers for t in (layer.codes, getattr(layer, "d", None)) if t is not None
    ]
    assert all(
        torch.equal(a, b) and b.data_ptr() % 64 == 0 for a, b in zip(held, moved, strict=True)
    )
    assert moved[0].data_ptr() % native.HUGE_PAGE == 0
    for layer, x, want in zip(layers, xs, before, strict=True):
        assert torch.equal(layer(x), want)
