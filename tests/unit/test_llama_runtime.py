"""The engine's own forward pass against transformers' on the same weights.

``models.llama.LlamaRuntime`` reimplements the decoder of Llama-shaped models;
these tests hold it to the library's logits for each supported architecture
(random weights, float32, dense), through a chunked prefill and single-token
decoding steps, in one slot and in several at once, and hold the quantized
formats to their own exact arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from models import native
from models.llama import Chunk, LlamaRuntime, SlotCache, StepInput
from models.quant import GROUP_SIZE, DenseLinear, Int4Linear, Int8Linear

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _model(kind: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None))
    else:  # qwen2: q/k/v carry biases
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=False))
    return model.eval()


def _prefill(
    runtime: LlamaRuntime, cache: SlotCache, ids: list[int], slot: int, start: int
) -> torch.Tensor:
    step = StepInput(
        token_ids=torch.tensor(ids),
        positions=torch.arange(start, start + len(ids)),
        decode_slots=[],
        chunks=[Chunk(slot, start, len(ids))],
        logit_rows=list(range(len(ids))),
    )
    return runtime.forward(step, cache)


@pytest.mark.parametrize("native_ops", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_logits_match_transformers_through_chunked_prefill_and_batched_decoding(
    kind: str, native_ops: bool
) -> None:
    model = _model(kind)
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, 128, (23,), generator=gen).tolist()
    second = torch.randint(0, 128, (9,), generator=gen).tolist()
    with torch.inference_mode():
        expected_first = model(torch.tensor([first])).logits[0]
        expected_second = model(torch.tensor([second])).logits[0]
        runtime = LlamaRuntime(model, quantization=None)
        assert runtime.ops is None  # the float32 reference: PyTorch's operations
        tol = 1e-4
        if native_ops:
            lib = native.library()
            if lib is None:
                pytest.skip("the native kernels did not build here")
            # qgemm.c's norms, rotary embedding and attention, with their float16
            # cache, as every other CPU format runs them: keys and values
            # rounded to half floats (a relative 2^-11) move the logits a little.
            runtime.ops, runtime.kv_dtype = native.Ops(lib), native.KV_DTYPE
            tol = 5e-4
        cache = runtime.new_cache(4, 64)
        cache.ensure(32)
        # The first sequence in slot 2, prefilled in two chunks of 13 and 4.
        got = torch.cat(
            [
                _prefill(runtime, cache, first[:13], 2, 0),
                _prefill(runtime, cache, first[13:17], 2, 13),
            ]
        )
        torch.testing.assert_close(got, expected_first[:17], rtol=tol, atol=tol)
        # The second, in slot 0, prefilled in one chunk in the same step as the
        # first one's next token decodes.
        step = StepInput(
            token_ids=torch.tensor([first[17], *second[:5]]),
            positions=torch.tensor([17, *range(5)]),
            decode_slots=[2],
            chunks=[Chunk(0, 0, 5)],
            logit_rows=[0, 5],
        )
        got = runtime.forward(step, cache)
        torch.testing.assert_close(got[0], expected_first[17], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1], expected_second[4], rtol=tol, atol=tol)
        _prefill(runtime, cache, second[5:8], 0, 5)
        # Both decode together, slots in reverse order of the batch's rows.
        for i in range(3):
            step = StepInput(
                token_ids=torch.tensor([first[18 + i], second[8]])
                if i == 0
                else torch.tensor([first[18 + i], first[18 + i]]),
                positions=torch.tensor([18 + i, 8 + i]),
                decode_slots=[2, 0],
                chunks=[],
                logit_rows=[0, 1],
            )
            got = runtime.forward(step, cache)
            torch.testing.assert_close(got[0], expected_first[18 + i], rtol=tol, atol=tol)
            if i == 0:
                torch.testing.assert_close(got[1], expected_second[8], rtol=tol, atol=tol)
        # The first goes on alone: steps of one decoding token.
        for position in (21, 22):
            step = StepInput(
                token_ids=torch.tensor([first[position]]),
                positions=torch.tensor([position]),
                decode_slots=[2],
                chunks=[],
                logit_rows=[0],
            )
            got = runtime.forward(step, cache)
            torch.testing.assert_close(got[0], expected_first[position], rtol=tol, atol=tol)


def test_quantized_layers_compute_their_own_weights_at_every_batch_size() -> None:
    """Int4 and int8 layers equal a matmul with their dequantized weights, below and above
    the row count where they switch kernels."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 4 * GROUP_SIZE, generator=gen) * 0.05
    from models.quant import quantize_int4

    codes, _, _ = quantize_int4(weight)
    groups = (codes.view(96, -1, GROUP_SIZE) - 8).float()
    # Both dense copies: bfloat16 (CPUs with bf16 instructions) and float32 (others).
    for dense_dtype in (torch.bfloat16, torch.float32):
        int4, int8 = Int4Linear(weight, dense_dtype), Int8Linear(weight, dense_dtype)
        assert int4.dense.dtype == int8.dense.dtype == dense_dtype
        sz = int4.scales_and_zeros.float()
        w4 = (groups * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view_as(weight)
        switches = {int4.max_rows, int4.max_rows + 1, int8.max_rows, int8.max_rows + 1}
        for rows in sorted({1, *switches}):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            expected = x.bfloat16().float() @ w4.t()
            torch.testing.assert_close(int4(x).float(), expected, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(int8(x).float(), x @ weight.t(), rtol=3e-2, atol=3e-2)
    dense = DenseLinear(weight, torch.bfloat16)
    x = torch.randn(5, weight.shape[1], generator=gen)
    torch.testing.assert_close(dense(x).float(), x @ weight.t(), rtol=3e-2, atol=3e-2)
