"""A lean forward pass for Llama-shaped models over a flat batch of tokens.

The engine's hot path. One call runs every token of one scheduling step —
one token for each decoding sequence plus chunks of prompts being prefilled —
through the model as a single ``[tokens, hidden]`` matrix, so the weights are
read once per step whatever the mix (vLLM's flattened batch). Attention is the
only per-sequence part: the decoding rows attend together over their slots of
the KV cache; each prefill chunk attends over its own slot.

The KV cache is a :class:`SlotCache`: one row ("slot") per running sequence,
preallocated and grown by doubling, so a sequence joining or leaving copies
nothing. Weights are repacked once at load: q, k and v fused into one matrix,
gate and up into another, each a :class:`~models.quant.Linear` (dense or
4-bit). The residual stream, norms, rotary embedding and attention stay in
float32 (or the model's half dtype on a GPU). Where ``qgemm.c``'s kernels run
the step (a CPU, every format but the float32 reference), the cache holds
float16: decoding streams every key and value of its rows' slots each step,
and at a few hundred positions those bytes outweigh the 4-bit weights.

Models that are not Llama-shaped (checked by :func:`supports`) are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from models import native, sampling
from models.quant import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    NativeLinear,
    int4_supported,
    native_library,
    place_on_huge_pages,
)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
"""``config.model_type`` values whose decoder layers this module reproduces."""

INITIAL_CACHE_LENGTH = 256
"""Positions per slot the KV cache starts with; it doubles when a sequence outgrows it."""


def supports(model: PreTrainedModel) -> str | None:
    """``None`` if :class:`LlamaRuntime` can run ``model``, else why not."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    # Qwen2 configs name a window but use it only when use_sliding_window is set.
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", kind != "qwen2"):
        return "sliding-window attention is not supported"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope type {rope.get('rope_type')!r} changes with the sequence length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    return None


@dataclass
class Chunk:
    """Prompt tokens of one sequence prefilled in this step."""

    slot: int
    start: int  # position of its first token
    length: int


@dataclass
class StepInput:
    """Every token of one step: decoding rows first, then prefill chunks in order.

    ``token_ids`` and ``positions`` have one entry per token; the first
    ``len(decode_slots)`` are decoding rows (one token each, in those slots);
    the rest are ``chunks`` back to back. ``logit_rows`` indexes the tokens
    whose next-token logits the step must return.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    decode_slots: list[int]
    chunks: list[Chunk]
    logit_rows: list[int]


class SlotCache:
    """Keys and values of every layer, ``kv[layer]``: ``[slots, 2 * kv_heads, length, head_dim]``.

    Per layer, the first ``kv_heads`` heads are the keys and the rest the
    values (``keys(layer)``, ``values(layer)`` are views), so one write stores
    both. A slot belongs to one running sequence; its positions ``0..n-1``
    hold that sequence's tokens. ``length`` grows by doubling (a copy of the
    whole cache, amortized) and never shrinks while the engine runs.
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_length: int,
    ) -> None:
        self.layers, self.slots = layers, slots
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_length = max_length
        self.length = 0
        self.kv: list[torch.Tensor] = []
        self.epoch = 0

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[layer][:, : self.kv_heads]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[layer][:, self.kv_heads :]

    def ensure(self, length: int) -> None:
        """Make room for ``length`` positions per slot (raises on out of memory)."""
        if length <= self.length:
            return
        if length > self.max_length:
            raise ValueError(f"{length} positions exceed the cache's limit of {self.max_length}")
        new = max(INITIAL_CACHE_LENGTH, self.length)
        while new < length:
            new *= 2
        new = min(new, self.max_length)
        shape = (self.slots, 2 * self.kv_heads, new, self.head_dim)
        kv = []
        for layer in range(self.layers):
            both = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.length:
                both[:, :, : self.length] = self.kv[layer]
            kv.append(both)
        self.kv, self.length = kv, new

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Copy positions ``0..length-1`` of slot ``source`` into slot ``target``, every layer."""
        for both in self.kv:
            both[target, :, :length] = both[source, :, :length]

    def release(self) -> None:
        """Drop every tensor (after an out-of-memory error); :meth:`ensure` reallocates.
        ``epoch`` counts the releases: what a slot held before is gone."""
        self.kv, self.length = [], 0
        self.epoch += 1


class _Layer:
    LINEARS = ("qkv", "o", "gate_up", "down")
    """The attributes holding the layer's :class:`~models.quant.Linear` weights."""

    def __init__(
        self,
        layer: Any,
        make: Any,
        residual: torch.dtype,
        q_heads: int,
        kv_heads: int,
    ) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm.weight.detach().to(residual, copy=True)
        self.norm2 = layer.post_attention_layernorm.weight.detach().to(residual, copy=True)
        self.eps1 = float(layer.input_layernorm.variance_epsilon)
        self.eps2 = float(layer.post_attention_layernorm.variance_epsilon)

        def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k = _pairs_side_by_side(q, q_heads), _pairs_side_by_side(k, kv_heads)
            return torch.cat([q, k, v]).detach()

        self.qkv: Linear = make(fused(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
        self.qkv_bias: torch.Tensor | None = None
        if attn.q_proj.bias is not None:
            bias = fused(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
            self.qkv_bias = bias.to(residual, copy=True)
        self.o: Linear = make(attn.o_proj.weight)
        self.gate_up: Linear = make(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down: Linear = make(mlp.down_proj.weight)


class LlamaRuntime:
    """The weights of a Llama-shaped model repacked for :meth:`forward`.

    ``quantization`` is ``"int4"`` (4-bit weight-only linear layers, see
    :mod:`models.quant`), ``"int4-a8"`` (the same weights multiplied with 8-bit
    activations, :attr:`~models.quant.NativeLinear.Q4_1A8`: the native kernels
    only) or ``None`` (dense in the model's dtype). With int4 or int4-a8
    the output projection — the largest matrix, which sets the decoding speed
    of a small model, and the one that suffers most from 4 bits — is 8-bit in
    groups of 32 (:class:`~models.quant.Int8Linear`; GGUF's ``Q8_0``).
    """

    def __init__(self, model: PreTrainedModel, *, quantization: str | None) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(reason)
        config = model.config
        inner: Any = model.model
        weight = inner.embed_tokens.weight.detach()
        self.device = weight.device
        self.dtype = weight.dtype
        # float32 keeps the reference's numerics on a CPU; a half dtype on a GPU.
        self.residual = self.dtype if self.device.type == "cuda" else torch.float32
        self.quantization = quantization
        hidden = int(config.hidden_size)
        # The engine's own kernels (models/native), where they build: a CPU only.
        lib = native_library() if self.device.type == "cpu" else None
        if quantization in ("int4", "int4-a8"):
            if not int4_supported(self.device, hidden):
                raise ValueError(f"int4 weights are not supported on {self.device} for this shape")
            if quantization == "int4-a8" and lib is None:
                raise ValueError("int4-a8 needs the native kernels (models/native): a CPU")
            kind = NativeLinear.Q4_1A8 if quantization == "int4-a8" else NativeLinear.Q4_1

            def make(w: torch.Tensor) -> Linear:
                if lib is not None:
                    return NativeLinear(w, kind, lib)
                return Int4Linear(w)

            def make_head(w: torch.Tensor) -> Linear:
                if lib is not None:
                    return NativeLinear(w, NativeLinear.Q8_0, lib)
                if self.device.type == "cpu":
                    return Int8Linear(w)
                return DenseLinear(w, self.dtype)

        elif quantization is None:

            def make(w: torch.Tensor) -> Linear:
                return DenseLinear(w, self.dtype)

            make_head = make
        else:
            raise ValueError(f"unknown quantization {quantization!r}")
        # Copies of their own, never views of the checkpoint's memory map (which
        # would keep the whole file resident once the model's weights are released).
        self.embed = weight.to(self.residual, copy=True)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.layers = [
            _Layer(layer, make, self.residual, self.heads, self.kv_heads) for layer in inner.layers
        ]
        self.norm = inner.norm.weight.detach().to(self.residual, copy=True)
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = make_head(model.get_output_embeddings().weight)
        if lib is not None:
            linears = [getattr(layer, name) for layer in self.layers for name in _Layer.LINEARS]
            place_on_huge_pages([*linears, self.lm_head])
        self.vocab_size = int(self.lm_head.out_features)
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // self.heads)
        self.hidden = hidden
        self.max_positions = int(config.max_position_embeddings)
        # The rotary tables of every position, from the model's own rotary module,
        # as complex numbers: q and k are stored with each rotated pair side by
        # side (:func:`_pairs_side_by_side`), so rotating is one complex product.
        positions = torch.arange(self.max_positions, device=self.device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        cos, sin = inner.rotary_emb(probe, positions)
        half = self.head_dim // 2
        self.freqs = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())
        self.scale = self.head_dim**-0.5
        # The norms, the MLP's activation, rotary embedding and decode attention in
        # qgemm.c too, where it loads and the residual stream is float32, with a
        # float16 cache. Not for the float32 reference (float32 weights, no
        # quantization): it stays PyTorch's arithmetic with a float32 cache.
        reference = quantization is None and self.dtype == torch.float32
        native_ops = self.residual == torch.float32 and not reference
        self.ops = native.Ops(lib) if lib is not None and native_ops else None
        self.kv_dtype = native.KV_DTYPE if self.ops is not None else self.residual
        self.freqs_pairs = torch.view_as_real(self.freqs).contiguous()  # [positions, hd / 2, 2]
        # Decoding steps run every layer in one call where every weight is in panels.
        self.native_layers = self.ops.layer_table(self.layers) if self.ops is not None else None

    def new_cache(self, slots: int, max_length: int) -> SlotCache:
        """An empty KV cache of ``slots`` sequences of up to ``max_length`` positions."""
        return SlotCache(
            len(self.layers),
            slots,
            self.kv_heads,
            self.head_dim,
            self.kv_dtype,
            self.device,
            min(max_length, self.max_positions),
        )

    def forward(self, step: StepInput, cache: SlotCache) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(step.logit_rows), vocab]``.

        Writes the keys and values of every token of the step into its slot
        at its position; the caller has made the cache long enough.
        """
        if self.native_layers is not None:
            return self._forward_layers_native(step, cache)
        n_decode = len(step.decode_slots)
        tokens = step.token_ids.shape[0]
        device = self.device
        pos = step.positions
        slots = torch.tensor(
            [*step.decode_slots, *(c.slot for c in step.chunks for _ in range(c.length))],
            dtype=torch.long,
            device=device,
        )
        freqs = self.freqs.index_select(0, pos)[:, None] if self.ops is None else self.freqs
        decode = _DecodeView(step.decode_slots, step.positions[:n_decode], device, self.ops)
        masks = [_chunk_mask(c, device) for c in step.chunks]
        h_q, h_kv, hd = self.heads, self.kv_heads, self.head_dim
        n_q, n_qk = h_q * hd, (h_q + h_kv) * hd
        x = self.embed.index_select(0, step.token_ids)
        delta: torch.Tensor | None = None  # the last layer's MLP output, not yet added to x
        for index, layer in enumerate(self.layers):
            kv = cache.kv[index]
            keys, values = cache.keys(index), cache.values(index)
            h = self._add_norm(x, delta, layer.norm1, layer.eps1)
            qkv = layer.qkv(h).to(self.residual)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            if self.ops is not None:
                self.ops.rope_store(qkv, h_q, h_kv, pos, slots, self.freqs_pairs, kv)
            else:
                _rotate(qkv[:, :n_qk].view(tokens, h_q + h_kv, hd // 2, 2), freqs)
                # Keys and values of every token into their slots, in one write.
                kv[slots, :, pos] = qkv[:, n_q:].view(tokens, 2 * h_kv, hd)
            q = qkv[:, :n_q].view(tokens, h_q, hd)
            if not step.chunks:
                out = decode.attend(q, kv, keys, values, self.scale)
            else:
                out = torch.empty(tokens, h_q, hd, dtype=self.residual, device=device)
                if n_decode:
                    out[:n_decode] = decode.attend(q[:n_decode], kv, keys, values, self.scale)
                at = n_decode
                for chunk, mask in zip(step.chunks, masks, strict=True):
                    end = chunk.start + chunk.length
                    ck = keys[chunk.slot : chunk.slot + 1, :, :end].to(self.residual)
                    cv = values[chunk.slot : chunk.slot + 1, :, :end].to(self.residual)
                    cq = q[at : at + chunk.length].transpose(0, 1)[None]
                    o = F.scaled_dot_product_attention(
                        cq, ck, cv, attn_mask=mask, scale=self.scale, enable_gqa=h_q != h_kv
                    )
                    out[at : at + chunk.length] = o[0].transpose(0, 1)
                    at += chunk.length
            attended = layer.o(out.reshape(tokens, h_q * hd))
            h = self._add_norm(x, attended, layer.norm2, layer.eps2)
            delta = layer.down(self._silu_mul(layer.gate_up(h)))
        return self._logits(step, x, delta)

    def _logits(self, step: StepInput, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The logits of ``step.logit_rows``: the last layer's ``delta`` added to those rows
        of ``x`` only, the final norm, the output layer.

        A step of decoding rows only (the usual one) needs every row, in order:
        no rows are gathered then, and with the native ops the sum and the norm
        are one call.
        """
        if len(step.logit_rows) != x.shape[0]:  # rows ascend: all of them is 0..n-1
            rows = torch.tensor(step.logit_rows, dtype=torch.long, device=self.device)
            x = x.index_select(0, rows)
            delta = None if delta is None else delta.index_select(0, rows)
        if self.ops is not None:
            last = self.ops.add_rms_norm(x, delta, self.norm, self.norm_eps)
        else:
            if delta is not None:
                x = x + delta.to(x.dtype)
            last = F.rms_norm(x, (self.hidden,), self.norm, self.norm_eps)
        return self.lm_head(last).float()

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """Each row's ``torch.argmax`` of :meth:`forward`'s logits, in the native
        kernels where they run (a tenth of a small model's step in PyTorch's)."""
        if self.ops is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            return self.ops.argmax_rows(logits)
        return sampling.argmax_rows(logits)

    def _forward_layers_native(self, step: StepInput, cache: SlotCache) -> torch.Tensor:
        """A step, every layer in one call to ``qgemm.c``
        (:meth:`models.native.Ops.decode_layers`), without Python between the kernels.

        A prompt token being prefilled is a row like a decoding one: its keys and
        values are stored at its position with every row's before any row attends,
        and it attends its slot's positions up to its own (causal). So each token's
        bits are those of the same token decoded alone: they depend neither on the
        batch nor on how the prompt was cut into chunks.
        """
        assert self.ops is not None and self.native_layers is not None
        x = self.embed.index_select(0, step.token_ids)
        delta = torch.empty_like(x)
        slots = [*step.decode_slots, *(c.slot for c in step.chunks for _ in range(c.length))]
        self.ops.decode_layers(
            self.native_layers,
            cache.kv,
            x,
            delta,
            torch.tensor(slots, dtype=torch.long),
            step.positions,
            self.heads,
            self.kv_heads,
            self.freqs_pairs,
            self.scale,
        )
        return self._logits(step, x, delta)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` (the residual connection, in place), then RMSNorm of ``x``."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, delta, weight, eps)
        if delta is not None:
            x.add_(delta.to(x.dtype))
        return F.rms_norm(x, (self.hidden,), weight, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class _DecodeView:
    """The decoding rows' attention: one query each, over the slots they own.

    With native ops (:class:`models.native.Ops`) each row attends its own slot
    in ``qgemm.c``; otherwise one SDPA call covers the slots ``0..span-1``.
    """

    def __init__(
        self,
        slots: Sequence[int],
        positions: torch.Tensor,
        device: torch.device,
        ops: native.Ops | None,
    ) -> None:
        self.n = len(slots)
        self.ops = ops
        if not self.n:
            return
        self.index = torch.tensor(list(slots), dtype=torch.long, device=device)
        if ops is not None:
            self.lengths = positions + 1
            return
        self.width = int(positions.max()) + 1
        # Rows in slots 0..n-1 in order use the cache as it is; otherwise the
        # queries are scattered into slot order and gathered back.
        self.span = max(slots) + 1
        self.direct = list(slots) == list(range(self.n))
        lengths = torch.zeros(self.span, dtype=torch.long, device=device)
        lengths[self.index] = positions + 1
        columns = torch.arange(self.width, device=device)
        self.mask = (columns[None] < lengths[:, None])[:, None, None]
        if not self.direct:
            self.mask[:, :, :, 0] = True  # idle slots attend somewhere; their output is dropped

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if self.ops is not None:
            kv_heads = kv.shape[1] // 2
            return self.ops.decode_attention(q, kv, kv_heads, self.index, self.lengths, scale)
        k = keys[: self.span, :, : self.width]
        v = values[: self.span, :, : self.width]
        if self.direct:
            queries = q[:, :, None]
        else:
            queries = q.new_zeros(self.span, q.shape[1], 1, q.shape[2])
            queries[self.index] = q[:, :, None]
        o = F.scaled_dot_product_attention(
            queries, k, v, attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        o = o[:, :, 0]
        return o if self.direct else o.index_select(0, self.index)


def _rotate(pairs: torch.Tensor, freqs: torch.Tensor) -> None:
    """Rotate ``pairs`` (``[tokens, heads, head_dim / 2, 2]``) in place by ``freqs``.

    ``freqs`` is ``[tokens, 1, head_dim / 2]`` complex: each pair is a complex
    number multiplied by its position's rotation, in float32.
    """
    if pairs.dtype == torch.float32:
        torch.view_as_complex(pairs).mul_(freqs)
    else:  # a half dtype on a GPU: rotate in float32, store back
        pairs.copy_(torch.view_as_real(torch.view_as_complex(pairs.float()) * freqs))


def _pairs_side_by_side(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (or its bias) reordered so rotary pairs are adjacent.

    Llama's rotary embedding turns dimension ``i`` of a head with dimension
    ``i + head_dim / 2``; stored as ``(i, i + head_dim / 2)`` side by side
    they read as one complex number. q and k are reordered alike, so every
    attention score ``q . k`` is unchanged; v is not touched.
    """
    head_dim = weight.shape[0] // heads
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    shaped = weight.reshape(heads, head_dim, *weight.shape[1:])
    return shaped.index_select(1, order.to(weight.device)).reshape(weight.shape)


def _chunk_mask(chunk: Chunk, device: torch.device) -> torch.Tensor:
    """Causal mask of a chunk over its slot: token ``i`` sees positions ``<= start + i``."""
    end = chunk.start + chunk.length
    rows = torch.arange(chunk.start, end, device=device)[:, None]
    return torch.arange(end, device=device)[None] <= rows
