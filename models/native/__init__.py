"""The engine's own CPU kernels (``qgemm.c``), compiled for this machine on first use.

:func:`library` compiles ``qgemm.c`` with the system's C compiler
(``$CC``, else ``cc``/``gcc``), ``-O3 -march=native -fopenmp`` (and no fused
multiply-add contraction, so that every row's arithmetic is the same), into a cache
folder keyed by the source, the compiler and the CPU's flags, and loads it
with :mod:`ctypes`. It takes about a second once per machine; later loads
reuse the file. Where no compiler is found, or compiling fails, it returns
``None`` once and logs why, and the engine keeps PyTorch's own int4 kernel.
``SWITCHYARD_NATIVE_KERNELS=0`` turns the native kernels off.

The cache folder is ``$SWITCHYARD_NATIVE_CACHE``, else
``~/.cache/switchyard/native``, else one in the system's temporary folder
(the first that can be written: a container's root file system may be
read-only).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qgemm.c")

HUGE_PAGE = 2 << 20
"""The size of a transparent huge page on x86-64 (and of the arenas' alignment)."""

KV_DTYPE = torch.float16
"""The KV cache's dtype for these kernels: keys and values are stored as IEEE half
floats (``sy_half``), which halves what decode attention reads each step."""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []


def enabled() -> bool:
    """Whether the native kernels may be used (``SWITCHYARD_NATIVE_KERNELS``, default on)."""
    return os.environ.get("SWITCHYARD_NATIVE_KERNELS", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` where they cannot be built or are turned off."""
    with _lock:
        if not _loaded:
            _loaded.append(_load() if enabled() else None)
        return _loaded[0]


def has_panels() -> bool:
    """Whether the kernels are here with panels (AVX2 or AVX512-VNNI): what the
    ``Q4_1A8`` kind (quantization ``int4-a8``) needs."""
    lib = library()
    return lib is not None and bool(lib.sy_panels())


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("SWITCHYARD_NATIVE_CACHE"):
        dirs.append(Path(os.environ["SWITCHYARD_NATIVE_CACHE"]))
    dirs.append(Path.home() / ".cache" / "switchyard" / "native")
    dirs.append(Path(tempfile.gettempdir()) / f"switchyard-native-{os.getuid()}")
    return dirs


def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): the engine uses PyTorch's int4 kernel")
        return None
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s unusable (%s): the engine uses PyTorch's int4 kernel", cc, exc)
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    for folder in _cache_dirs():
        target = folder / f"qgemm-{key}.so"
        try:
            if not target.exists():
                _build(cc, folder, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("native kernels not built in %s: %s", folder, exc)
            continue
        _declare(lib)
        return lib
    log.warning("native kernels unavailable: the engine uses PyTorch's int4 kernel")
    return None


def _build(cc: str, folder: Path, target: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.part")
    os.close(fd)
    try:
        command = [cc, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run(
            [*command, "-o", partial, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        os.replace(partial, target)  # atomic: workers starting together share one file
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{cc} failed: {exc.stderr.strip()[-500:]}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    signatures: dict[str, tuple[list[Any], Any]] = {
        "sy_qgemm": ([i, p, i, i, p, i, p], i),
        "sy_pgemm": ([i, p, i, i, p, p, p, i, p], i),
        "sy_decode_layers": ([p, i, p, p, i, i, i, i, i, i, p, p, p, p, i, f], i),
        "sy_add_rms_norm": ([p, p, i, i, p, f, p], None),
        "sy_silu_mul": ([p, i, i, p], None),
        "sy_argmax_rows": ([p, i, i, p], None),
        "sy_decode_attention": ([p, i, i, i, i, i, p, i, p, p, f, p], i),
        "sy_rope_store": ([p, i, i, i, i, i, p, p, p, p, i], None),
    }
    for name in ("sy_block_q4_1_size", "sy_block_q8_0_size", "sy_avx2", "sy_panels"):
        signatures[name] = ([], i)
    signatures["sy_layer_size"] = ([], i)
    for name, (args, result) in signatures.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result


class Matrix(ctypes.Structure):
    """``sy_matrix``: a weight in panels (``models.quant.NativeLinear`` with ``panels``)."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("kind", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
    ]


class Layer(ctypes.Structure):
    """``sy_layer``: one decoder layer's weights and its slice of the KV cache."""

    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("qkv_bias", ctypes.c_void_p),
        ("qkv", Matrix),
        ("o", Matrix),
        ("gate_up", Matrix),
        ("down", Matrix),
        ("kv", ctypes.c_void_p),
    ]


class Ops:
    """The forward pass's elementwise parts and decode attention, in ``qgemm.c``.

    Every tensor is float32, on the CPU, and contiguous where the methods say so.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` in place (when given), then RMSNorm of ``x`` times ``weight``."""
        rows, dim = x.shape
        out = torch.empty_like(x)
        # Held in a name: a temporary's memory would be freed before the call.
        delta = None if delta is None else delta.to(torch.float32).contiguous()
        self.lib.sy_add_rms_norm(
            x.data_ptr(),
            None if delta is None else delta.data_ptr(),
            rows,
            dim,
            weight.data_ptr(),
            eps,
            out.data_ptr(),
        )
        return out

    def argmax_rows(self, logits: torch.Tensor) -> list[int]:
        """Each row's index of its first largest value (``torch.argmax(-1)``'s) of
        ``[rows, n]`` float32, contiguous."""
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self.lib.sy_argmax_rows(logits.data_ptr(), rows, n, out.data_ptr())
        return out.tolist()

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[rows, 2 * inter]`` (gate, then up)."""
        rows, width = gate_up.shape
        gate_up = gate_up.to(torch.float32).contiguous()
        out = gate_up.new_empty(rows, width // 2)
        self.lib.sy_silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        positions: torch.Tensor,
        slots: torch.Tensor,
        freqs: torch.Tensor,
        kv: torch.Tensor,
    ) -> None:
        """Rotate q and k of ``qkv`` (``[rows, (heads + 2 kv_heads) * hd]``, rows
        contiguous) in place by ``freqs`` (``[positions, hd / 2, 2]``: cos, sin) at
        ``positions``, and write each row's keys and values into ``kv``
        (``[slots, 2 * kv_heads, length, hd]``, :data:`KV_DTYPE`) at its slot and
        position (int64s), rounded to nearest."""
        _check_cache(kv)
        rows, width = qkv.shape
        hd = width // (heads + 2 * kv_heads)
        if qkv.stride(1) != 1:
            raise ValueError("qkv rows must be contiguous")
        positions = positions.to(torch.int64).contiguous()  # held: see add_rms_norm
        slots = slots.to(torch.int64).contiguous()
        self.lib.sy_rope_store(
            qkv.data_ptr(),
            rows,
            qkv.stride(0),
            heads,
            kv_heads,
            hd,
            positions.data_ptr(),
            slots.data_ptr(),
            freqs.data_ptr(),
            kv.data_ptr(),
            kv.shape[2],
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_heads: int,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per row (``q``: ``[rows, heads, hd]``, rows may be strided) over
        positions ``0 .. lengths[r] - 1`` of slot ``slots[r]`` of ``kv``
        (``[slots, 2 * kv_heads, length, hd]``, :data:`KV_DTYPE`, contiguous); ``slots``
        and ``lengths`` are int64."""
        _check_cache(kv)
        rows, heads, hd = q.shape
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        out = q.new_empty(rows, heads, hd)
        status = self.lib.sy_decode_attention(
            q.data_ptr(),
            rows,
            q.stride(0),
            heads,
            kv_heads,
            hd,
            kv.data_ptr(),
            kv.shape[2],
            slots.data_ptr(),
            lengths.data_ptr(),
            scale,
            out.data_ptr(),
        )
        if status:
            raise MemoryError("decode attention: out of memory")
        return out

    def layer_table(self, layers: Sequence[Any]) -> ctypes.Array[Layer] | None:
        """``layers`` (``models.llama``'s, float32) as ``sy_decode_layers`` takes them, or
        ``None`` unless every linear layer is a ``NativeLinear`` in panels. The
        table points into the layers' tensors: it lives as long as they do."""
        table = (Layer * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                linear = getattr(layer, name)
                if not getattr(linear, "panels", False):
                    return None
                setattr(
                    entry,
                    name,
                    Matrix(
                        linear.codes.data_ptr(),
                        linear.d.data_ptr(),
                        linear.m.data_ptr(),
                        linear.kind,
                        linear.out_features,
                        linear.in_features,
                    ),
                )
            entry.norm1, entry.norm2 = layer.norm1.data_ptr(), layer.norm2.data_ptr()
            entry.eps1, entry.eps2 = layer.eps1, layer.eps2
            entry.qkv_bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
        return table

    def decode_layers(
        self,
        table: ctypes.Array[Layer],
        kv: Sequence[torch.Tensor],
        x: torch.Tensor,
        delta: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        heads: int,
        kv_heads: int,
        freqs: torch.Tensor,
        scale: float,
    ) -> None:
        """Every layer of a step of rows (one token per row, decoding or prefilled, in
        ``slots`` at ``positions``, each attending its slot up to its position):
        ``x`` (``[rows, hidden]``, float32, contiguous) updated in place, ``delta``
        set to the last layer's MLP output (not added to ``x``).
        ``kv`` is the cache's tensor per layer (``[slots, 2 * kv_heads, length, hd]``,
        :data:`KV_DTYPE`)."""
        rows, hidden = x.shape
        hd = kv[0].shape[-1]
        for entry, layer_kv in zip(table, kv, strict=True):
            _check_cache(layer_kv)
            entry.kv = layer_kv.data_ptr()  # the cache may have grown since the last step
        positions = positions.to(torch.int64).contiguous()  # held: see add_rms_norm
        lengths = positions + 1
        slots = slots.to(torch.int64).contiguous()
        status = self.lib.sy_decode_layers(
            ctypes.addressof(table),
            len(table),
            x.data_ptr(),
            delta.data_ptr(),
            rows,
            hidden,
            heads,
            kv_heads,
            hd,
            table[0].gate_up.n // 2,
            positions.data_ptr(),
            slots.data_ptr(),
            lengths.data_ptr(),
            freqs.data_ptr(),
            kv[0].shape[2],
            scale,
        )
        if status:
            raise MemoryError("decode layers: out of memory")


def _check_cache(kv: torch.Tensor) -> None:
    """The kernels read and write ``kv``'s memory as contiguous half floats."""
    if kv.dtype != KV_DTYPE or not kv.is_contiguous():
        raise ValueError(f"the KV cache must be a contiguous {KV_DTYPE} tensor, not {kv.dtype}")


def huge_page_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (a ``uint8`` tensor) on transparent huge pages where the
    system gives them on request.

    Every decoding step streams all the weights: on 4 KiB pages that is a TLB
    miss every 4 KiB, and on Linux's usual setting
    (``/sys/kernel/mm/transparent_hugepage/enabled``: ``madvise``) a plain
    allocation never gets 2 MiB pages. With the default model's weights on
    huge pages, decoding steps of 1 to 16 rows took 1-12 % less time on a
    2-core Xeon (the same process, the two placements alternated). The
    memory is a private anonymous mapping, 2 MiB-aligned and advised
    ``MADV_HUGEPAGE``; where huge pages are off (``never``) it is ordinary
    memory. The tensor keeps the mapping alive.
    """
    length = max(nbytes, 1) + HUGE_PAGE
    region = mmap.mmap(
        -1,
        length,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous, any dtype and shape), side by side in one
    :func:`huge_page_arena`, each at a 64-byte boundary."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    arena = huge_page_arena(total)
    copies = []
    for t, at in zip(tensors, offsets, strict=True):
        size = t.numel() * t.element_size()
        copy = arena[at : at + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
