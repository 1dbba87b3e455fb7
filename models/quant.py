"""Weight formats for the engine's linear layers: dense, and 4-bit weight-only.

:class:`Int4Linear` stores a weight as 4-bit codes in groups of 32 along the
input dimension, each group with a scale and a zero point (asymmetric,
``w = (q - 8) * scale + zero``), and multiplies with PyTorch's own int4 kernels
(``_weight_int4pack_mm_for_cpu``: the kernel torchao's int4 weight-only CPU
layout calls). Activations enter the kernel
in bfloat16 and accumulate in float32.

Quantizing is round-to-nearest over each group's own minimum and maximum.
A weight that came from a GGUF ``Q4_1`` tensor (blocks of 32 values
``q * d + m``, ``q`` in 0..15) is found again code for code: the block's
minimum is ``m`` and its maximum ``15 d + m``, so the codes and the affine map
are those of the file; only the scale and zero point are rounded to bfloat16,
which the kernel requires.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from models import native

GROUP_SIZE = 32
"""Input features sharing one scale and zero point (GGUF's Q4_0/Q4_1 block)."""


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def dense_dtype() -> torch.dtype:
    """The dtype of the quantized layers' dense copies, for steps of many rows.

    bfloat16 where the CPU has bfloat16 instructions; float32 elsewhere, where
    PyTorch emulates bfloat16 matmuls and they run 2-4x slower than float32
    (one thread, 3072x576 at 16/32 rows: bf16 2245/4240 us, fp32 858/1193 us,
    on an AVX-512 Xeon without BF16). float32 holds the dequantized weight
    exactly; bfloat16 rounds it.
    """
    return torch.bfloat16 if native_bf16() else torch.float32


def int4_max_rows(dense: torch.dtype) -> int:
    """Rows (tokens) up to which the int4 kernel runs; above, the dense copy does.

    PyTorch's int4 CPU kernel costs about the same per row at any batch (one
    thread, 3072x576: 98/222/444/875 us at 1/4/8/16 rows). A bfloat16 copy on
    a CPU with AVX512-BF16 grows slowly (143/176/236/361 us) and whole decoding
    steps of SmolLM2-135M were fastest with the switch above 8 rows. A float32
    copy reads 8 times the int4 bytes per step and PyTorch's float32 matmul is
    slow below 16 rows: whole steps (2 threads, no BF16) ran faster on int4 up
    to 32 decoding rows and 40-token prefills (bench/README.md).
    """
    return 8 if dense == torch.bfloat16 else 32


def int8_max_rows(dense: torch.dtype) -> int:
    """As :func:`int4_max_rows` for :class:`Int8Linear`, which runs the int4 kernel twice.

    SmolLM2-135M's output layer (49152x576, one thread, no BF16): int8 15.8 /
    23.1 / 30.7 ms at 8 / 12 / 16 rows, float32 29.6 / 39.6 / 21.8 ms.
    """
    return 8 if dense == torch.bfloat16 else 12


FLOAT32_PADDED_ROWS = range(8, 16)
"""Row counts at which PyTorch's float32 CPU matmul takes a slower kernel than at 16 rows
(a 49152x576 weight, one thread: 8.9 / 19.7 / 29.6 / 39.6 / 21.8 ms at 1 / 4 / 8 / 12 /
16 rows); :func:`dense_matmul` pads them to 16."""


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in the weight's dtype (on a CPU, float32 inputs of 8 to 15 rows
    padded to 16)."""
    x = x.to(weight.dtype)
    rows = x.shape[0]
    if (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and rows in FLOAT32_PADDED_ROWS
    ):
        padded = x.new_zeros(FLOAT32_PADDED_ROWS.stop, x.shape[1])
        padded[:rows] = x
        return F.linear(padded, weight)[:rows]
    return F.linear(x, weight)


class Linear(Protocol):
    """``y = x @ W.T`` for ``x`` of shape ``[tokens, in_features]``."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """A plain weight in ``dtype``; the input is cast to it."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        # A copy of its own: the source may be a memory map of the checkpoint.
        self.weight = weight.detach().to(dtype, copy=True).contiguous()
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight)


def int4_supported(device: torch.device, in_features: int) -> bool:
    """Whether :class:`Int4Linear` can hold a weight with ``in_features`` inputs on ``device``."""
    # CPU only for now: the CUDA tinygemm kernel takes another packing, not
    # yet checked on a GPU (the CUDA path runs dense bfloat16).
    return device.type == "cpu" and in_features % GROUP_SIZE == 0


class Int4Linear:
    """A weight quantized to 4 bits in groups of :data:`GROUP_SIZE`, asymmetric.

    Steps of up to ``max_rows`` tokens (:func:`int4_max_rows`) multiply with
    the int4 kernel; larger steps (batched decoding, prefill) with a dense
    copy of the dequantized weight in ``dense`` (default :func:`dense_dtype`),
    which the CPU's matmul serves faster at those sizes.
    """

    def __init__(self, weight: torch.Tensor, dense: torch.dtype | None = None) -> None:
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        self.device = weight.device
        if not int4_supported(self.device, self.in_features):
            raise ValueError(f"int4 weights need in_features divisible by {GROUP_SIZE}")
        codes, scales, zeros = quantize_int4(weight)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = self.scales_and_zeros.float()
        groups = (codes.view(self.out_features, -1, GROUP_SIZE) - 8).float()
        rebuilt = groups * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        self.dense = rebuilt.view(self.out_features, self.in_features).to(dense or dense_dtype())
        self.max_rows = int4_max_rows(self.dense.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return dense_matmul(x, self.dense)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros
        )


class Int8Linear:
    """A weight quantized to 8 bits in groups of :data:`GROUP_SIZE`, symmetric (GGUF ``Q8_0``).

    PyTorch has no grouped int8 kernel, so each code ``c`` in -128..127 is
    split into two 4-bit halves, ``c + 128 = 16 hi + lo``, and the product is
    two int4 matmuls: ``16 d (hi - 8)`` and ``d (lo - 8) + 8 d``, which sum
    to ``d c``. A ``Q8_0`` weight (the default model's tied embedding and
    output layer) is found again code for code. Above ``max_rows`` rows
    (:func:`int8_max_rows`) a dense copy serves, as for :class:`Int4Linear`.
    CPU only.
    """

    def __init__(self, weight: torch.Tensor, dense: torch.dtype | None = None) -> None:
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        if weight.device.type != "cpu" or self.in_features % GROUP_SIZE:
            raise ValueError(f"int8 weights need a CPU and in_features divisible by {GROUP_SIZE}")
        n, k = weight.shape
        groups = weight.view(n, k // GROUP_SIZE, GROUP_SIZE)
        scale = groups.abs().amax(-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(groups / scale[..., None]).clamp_(-128, 127).to(torch.int32) + 128
        hi, lo = (codes >> 4).view(n, k), (codes & 15).view(n, k)
        self.hi = torch.ops.aten._convert_weight_to_int4pack_for_cpu(hi.contiguous(), 1)
        self.lo = torch.ops.aten._convert_weight_to_int4pack_for_cpu(lo.contiguous(), 1)
        d = scale.t().contiguous()
        self.hi_sz = torch.stack([16 * d, torch.zeros_like(d)], -1).to(torch.bfloat16)
        self.lo_sz = torch.stack([d, 8 * d], -1).to(torch.bfloat16)
        rebuilt = (codes - 128).float() * scale[..., None]
        self.dense = rebuilt.view(n, k).to(dense or dense_dtype())
        self.max_rows = int8_max_rows(self.dense.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return dense_matmul(x, self.dense)
        x = x.to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        high = mm(x, self.hi, GROUP_SIZE, self.hi_sz).float()
        return high.add_(mm(x, self.lo, GROUP_SIZE, self.lo_sz))


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (int32, 0..15), scales and zeros ``[K/32, N]`` of ``weight``.

    ``weight ≈ (codes - 8) * scale + zero`` per group of 32 inputs, with the
    group's minimum at code 0 and its maximum at code 15.
    """
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(-1)
    high = groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15)
    codes = codes.to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    return codes, scale.t().contiguous(), zero.t().contiguous()


class NativeLinear:
    """A weight in GGUF's blocks of 32 (``Q4_1`` or ``Q8_0``), multiplied by ``qgemm.c``.

    The activations are quantized to 16 bits per block of 32 and each block's
    product is integer arithmetic (:mod:`models.native`; llama.cpp's 8-bit
    activations changed the default model's answers). ``Q4_1`` holds a 4-bit weight as
    ``w = d * q + m`` (``q`` in 0..15, ``d`` and ``m`` half-float values): a GGUF
    ``Q4_1`` tensor is found again code for code, and unlike
    :class:`Int4Linear` its scales keep the file's half-float precision.
    ``Q8_0`` holds ``w = d * q`` (``q`` in -127..127).

    Where the library has panels (``sy_panels``: AVX2 or AVX512-VNNI) and the
    outputs are a multiple of 16, the codes are laid out in panels of 16 outputs
    (:func:`pack_panels`) for ``sy_pgemm``; else in GGUF's own block order for
    ``sy_qgemm``. Both compute the same sums. The panel kernel serves steps of
    any size; with the block kernel, steps of more than ``max_rows`` tokens
    multiply with a dense copy, as :class:`Int4Linear`.
    """

    Q4_1, Q8_0, Q4_1A8 = 0, 1, 2
    """Kinds: ``Q4_1A8`` is ``Q4_1``'s weights, code for code, multiplied with 8-bit
    activations (``qgemm.c``'s ``vpdpbusd`` panels; quantization ``int4-a8``): a
    step of several rows is about a quarter cheaper in these layers, and the answers
    move away from the float32 rendition's (bench/README.md). Panels only: where
    the library has none, or the outputs are not a multiple of 16, the layer
    falls back to ``Q4_1`` (16-bit activations)."""

    def __init__(
        self,
        weight: torch.Tensor,
        kind: int,
        lib: ctypes.CDLL,
        dense: torch.dtype | None = None,
        max_rows: int | None = None,
    ) -> None:
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        if weight.device.type != "cpu" or self.in_features % GROUP_SIZE:
            raise ValueError(f"native weights need a CPU and in_features divisible by {GROUP_SIZE}")
        self.panels = bool(lib.sy_panels()) and self.out_features % PANEL_WIDTH == 0
        if kind == self.Q4_1A8 and not self.panels:
            kind = self.Q4_1
        self.kind, self.lib = kind, lib
        codes, d, m = quantize_q8_0(weight) if kind == self.Q8_0 else quantize_q4_1(weight)
        if self.panels:
            self.codes, self.d, self.m = pack_panels(kind, codes, d, m)
        else:
            self.codes = pack_blocks(kind, codes, d, m)
            size = lib.sy_block_q4_1_size() if kind == self.Q4_1 else lib.sy_block_q8_0_size()
            if self.codes.shape[-1] != size:
                raise ValueError(f"block of {self.codes.shape[-1]} bytes, the kernel's is {size}")
        # The panel kernel serves steps of any size (PANEL_ROWS): no dense copy,
        # unless a caller asks for the switch.
        self.dense: torch.Tensor | None = None
        if not self.panels or max_rows is not None:
            rebuilt = codes.float() * d[..., None] + (0 if m is None else m[..., None])
            self.dense = rebuilt.reshape(weight.shape).to(dense or dense_dtype())
        if max_rows is None:
            max_rows = PANEL_ROWS if self.panels else native_max_rows(dense or dense_dtype())
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > self.max_rows and self.dense is not None:
            return dense_matmul(x, self.dense)
        x = x.to(torch.float32).contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if self.panels:
            status = self.lib.sy_pgemm(
                self.kind,
                x.data_ptr(),
                rows,
                self.in_features,
                self.codes.data_ptr(),
                self.d.data_ptr(),
                self.m.data_ptr(),
                self.out_features,
                out.data_ptr(),
            )
        else:
            status = self.lib.sy_qgemm(
                self.kind,
                x.data_ptr(),
                rows,
                self.in_features,
                self.codes.data_ptr(),
                self.out_features,
                out.data_ptr(),
            )
        if status:
            raise MemoryError("qgemm: out of memory")
        return out


PANEL_WIDTH = 16
"""Outputs per panel (one AVX-512 vector of float32)."""

PANEL_ROWS = sys.maxsize
"""Rows up to which the panel kernel runs: all.

One thread, an AVX2 EPYC without AVX-512 (16 lanes as two vectors of 8), panel /
block kernel / PyTorch's float32 matmul of a dense copy at 1 / 4 / 8 / 16 / 64 rows:
3072x576 80 / 143 / 270 / 557 / 2242 against 313 / 560 / 799 / 1566 / 6444 and 214 /
561 / 1177 / 1159 / 4218 us; 576x1536 52 / 96 / 179 / 359 / 1442 against float32 88 /
265 / 547 / 509 / 1506 us; the 49152x576 output layer 2.5 / 2.9 / 5.1 / 9.1 / 33.2
against float32 10.9 / 28.0 / 39.2 / 40.1 / 99.8 ms.

One thread, an AVX512-VNNI/BF16 EPYC,
panel against PyTorch's bfloat16 matmul of a dense copy at 8 / 16 / 32 rows:
3072x576 168 / 330 / 662 against 241 / 367 / 637 us, 576x1536 118 / 234 / 465
against 129 / 193 / 318 us, the 49152x576 output layer 3.9 / 6.4 / 11.1 against
8.3 / 10.5 / 14.5 ms; two threads, at 64 / 128 / 256 rows (prefill), 3072x576 629
/ 1387 / 2557 against 741 / 1316 / 2404 us, 576x1536 385 / 766 / 1561 against
375 / 634 / 1178 us. A prefill costs at most a third more than bfloat16 and keeps
the weights' and activations' precision; the model needs no dense copy (270 MB
for SmolLM2-135M in bfloat16)."""


def native_max_rows(dense: torch.dtype) -> int:
    """Rows up to which :class:`NativeLinear`'s block kernel runs; above, the dense copy does.

    Against a float32 copy (an AVX2 EPYC, one thread, whole decoding steps of
    SmolLM2-135M) the kernel won at 8 rows (67-73 against 191-245 ms) and at 16
    (129-159 against 178-242 ms), so it serves up to int4's 32. The bfloat16
    copy's switch at 8 rows is int4's, not measured again with this kernel.
    """
    return int4_max_rows(dense)


def _float_bytes(values: torch.Tensor) -> torch.Tensor:
    """``[N, B]`` floats as ``[N, B, 4]`` bytes."""
    return values.float().contiguous().view(torch.uint8).view(*values.shape, 4)


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` as ``Q4_1``: codes ``[N, K/32, 32]`` (uint8, 0..15), scales
    ``d`` and minimums ``m`` ``[N, K/32]`` (half-float values), ``w = d * q + m``."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).to(torch.float16).float()
    m = low.to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((groups - m[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes, d, m


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """``weight`` ``[N, K]`` as ``Q8_0``: codes ``[N, K/32, 32]`` (int8, -127..127) and
    scales ``d`` ``[N, K/32]`` (half-float values), ``w = d * q``; no minimums."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    d = (groups.abs().amax(-1) / 127).to(torch.float16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, d, None


def pack_blocks(
    kind: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> torch.Tensor:
    """GGUF's block layout (bytes ``[N, K/32, 24]`` for ``Q4_1``, ``[N, K/32, 36]`` for
    ``Q8_0``: the scale(s) as floats, then the codes) for ``sy_qgemm``."""
    if kind == NativeLinear.Q4_1:
        assert m is not None
        half = GROUP_SIZE // 2
        qs = codes[..., :half] | (codes[..., half:] << 4)
        return torch.cat([_float_bytes(d), _float_bytes(m), qs], dim=-1).contiguous()
    return torch.cat([_float_bytes(d), codes.view(torch.uint8)], dim=-1).contiguous()


def place_on_huge_pages(linears: Sequence[Any]) -> None:
    """Move the codes and scales of every :class:`NativeLinear` among ``linears`` into
    one arena of transparent huge pages (:func:`models.native.on_huge_pages`):
    a decoding step streams them all."""
    held = [
        (linear, name)
        for linear in linears
        if isinstance(linear, NativeLinear)
        for name in ("codes", "d", "m")
        if isinstance(getattr(linear, name, None), torch.Tensor)
    ]
    if not held:
        return
    copies = native.on_huge_pages([getattr(linear, name) for linear, name in held])
    for (linear, name), copy in zip(held, copies, strict=True):
        setattr(linear, name, copy)


def pack_panels(
    kind: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The panel layout of ``qgemm.c`` for ``sy_pgemm``: codes ``[N/16, K/32, 256]``
    (``Q4_1``, ``Q4_1A8``: the same codes in another order) or ``[N/16, K/32, 512]``
    (``Q8_0``) bytes, ``d`` and ``m`` as ``[N/16, K/32, 16]`` half floats (``m``
    zeros for ``Q8_0``): they hold half floats' values, and stream in fewer bytes."""
    n, blocks, _ = codes.shape
    g = n // PANEL_WIDTH
    if kind == NativeLinear.Q4_1A8:
        # [g, lane, block, octet o, half h, j] -> [g, block, o, lane, j], q[8o + 4h + j]
        t = codes.view(g, PANEL_WIDTH, blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
        packed = (t[..., 0, :] | (t[..., 1, :] << 4)).reshape(g, blocks, 256)
    elif kind == NativeLinear.Q4_1:
        # [g, lane, block, double pair t, half h, j] -> [g, block, t, lane, j], q[4t + 2h + j]
        t = codes.view(g, PANEL_WIDTH, blocks, 8, 2, 2).permute(0, 2, 3, 1, 4, 5)
        packed = (t[..., 0, :] | (t[..., 1, :] << 4)).reshape(g, blocks, 256)
    else:
        # [g, lane, block, pair p, j] -> [g, block, p, lane, j], q[2p + j]
        pairs = codes.view(g, PANEL_WIDTH, blocks, 16, 2).permute(0, 2, 3, 1, 4)
        packed = pairs.reshape(g, blocks, 512).view(torch.uint8)

    def lanes(values: torch.Tensor) -> torch.Tensor:
        return values.view(g, PANEL_WIDTH, blocks).permute(0, 2, 1).to(torch.float16).contiguous()

    return packed.contiguous(), lanes(d), lanes(torch.zeros_like(d) if m is None else m)


def pack_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as ``Q4_1`` blocks ``[N, K/32, 24]`` (bytes), and the weight they hold."""
    codes, d, m = quantize_q4_1(weight)
    return pack_blocks(NativeLinear.Q4_1, codes, d, m), (
        codes.float() * d[..., None] + m[..., None]
    ).reshape(weight.shape)


def native_library() -> ctypes.CDLL | None:
    """The native kernels (:func:`models.native.library`), or ``None``."""
    return native.library()
