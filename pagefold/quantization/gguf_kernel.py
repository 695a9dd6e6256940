"""A GGUF weight kept quantized, in the compiled kernel's layout, and its product.

:class:`GGUFWeight` holds a linear's (or an embedding's) ``n`` x ``k`` weight as unsigned
codes per row (4-bit codes two to a byte in GGUF's order per group of 32, 5/6/8-bit codes
one to a byte) and per row and
group of inputs a ``scale`` and ``min``: ``w = scale * code + min``; float32, or float16
where every value is one (Q4_0 / Q4_1 / Q8_0: the blocks' own f16 scales)
(:mod:`.gguf_blocks` decodes each GGUF type into that form, losslessly). A layer fused from
tensors of different types (``qkv_proj`` with a Q6_K ``v_proj`` beside Q4_K ``q``/``k``) takes
the widest codes and the smallest group of its parts: the same weights, in one layout.

``matmul`` runs ``pf_qgemv_affine`` (``csrc/gguf_quant.cpp``) for 1..``KERNEL_MAX_ROWS`` rows
on the CPU, else decodes one tile of output rows at a time and multiplies with ``F.linear``
(:meth:`GGUFWeight.reference`: float32 sums; the kernel's summation order differs, so the two
agree to float32 rounding, not bitwise). ``rows`` decodes gathered rows (embedding lookups).

Activations: float32 rows always take the float32 kernel (the exactness tests hold float32
models to transformers on the decoded weights). bf16 rows take the weight's :attr:`choice`
(:mod:`.qgemv_choice`: measured at load): ``pf_qgemv_affine_q8`` (``csrc/qgemv_q8.cpp``: the
rows quantized to int8 per group of 32, integer dot products, as llama.cpp multiplies its
quantized weights, where a compiled form takes the codes: ``q8_bits``, their own width; every
kept type on AVX-512 VNNI, all but Q8_0's 8-bit codes on AVX2; Q6_K's groups of 16 too),
``pf_qgemm_affine_q8`` (``q8mm``, ``csrc/qgemm_amx.cpp``: the same int8 activations on the AMX
tile unit from a few rows up, for CPUs with AMX-INT8; the codes read in this same layout) or
``pf_qgemv_affine``, up to the chosen rows, and decoded
tiles with ``F.linear`` above. The module path and the native decode driver
(:meth:`GGUFWeight.native`) take the same kernel, so they agree bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.quantization.gguf_blocks import (
    CODE_BITS,
    GROUP,
    HALF_SCALES,
    KERNEL_BITS,
    decode_rows,
)
from pagefold.quantization.native_matrix import QuantMatrix, describe
from pagefold.quantization.qgemv_choice import KERNEL_MAX_ROWS, flags_pick

__all__ = ["GGUFWeight", "KERNEL_MAX_ROWS", "layout", "layout_bytes"]

TILE_ROWS = 2048


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(R, k) codes < 16 -> (R, k / 2) bytes, per group of 32 as GGUF packs them: byte ``j``
    holds input ``j`` (low nibble) and input ``j + 16`` (high)."""
    c = codes.reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    b = packed.reshape(packed.shape[0], -1, 1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(packed.shape[0], -1)


def layout(kinds: Iterable[str]) -> tuple[int, int, bool]:
    """(code bits, group, float16 scales) of a weight from parts of GGUF types ``kinds``: the
    widest codes (4-bit two to a byte, else one a byte), the smallest group, and float16
    scales and mins only where every part's are float16 values (``HALF_SCALES``; a K type's
    ``d`` times its 6-bit sub-block scale is not, in general: float32)."""
    kinds = list(kinds)
    return (max(KERNEL_BITS[k] for k in kinds), min(GROUP[k] for k in kinds),
            all(k in HALF_SCALES for k in kinds))


def layout_bytes(kinds: Iterable[str], n: int, k: int) -> int:
    """Bytes :class:`GGUFWeight` holds for an ``n`` x ``k`` weight of parts of GGUF types
    ``kinds`` (its codes, scales and mins; what ``pagefold capacity`` counts, without the
    weight's data: exact unless a float16-scaled type's ``-8 d`` / ``-128 d`` overflows
    float16, when the weight holds float32 scales)."""
    bits, group, half = layout(kinds)
    scale_bytes = 2 if half else 4
    return n * (k // 2 if bits == 4 else k) + 2 * n * (k // group) * scale_bytes


class GGUFWeight:
    """An ``n`` x ``k`` weight from GGUF parts ``[(kind, raw rows), ...]`` stacked in order
    (each raw (rows, row_bytes) uint8 of ``kind``); ``kinds`` counts the parts per type."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]], k: int, what: str = "?") -> None:
        self.k = k
        self.kinds: dict[str, int] = {}
        for kind, _ in parts:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.bits, self.group, half = layout(self.kinds)
        # the int8-activation kernel's ``bits``: 4 (nibbles), or the codes' bits (one a byte)
        self.q8_bits = 4 if self.bits == 4 else max(CODE_BITS[kind] for kind, _ in parts)
        codes, scales, mins = [], [], []
        for kind, raw in parts:
            q, s, m = decode_rows(kind, raw, k, what)
            rep = GROUP[kind] // self.group  # a coarser part's scale repeats per finer group
            codes.append(q)
            scales.append(s.repeat_interleave(rep, 1) if rep > 1 else s)
            mins.append(m.repeat_interleave(rep, 1) if rep > 1 else m)
        q = torch.cat(codes)
        self.n = q.shape[0]
        self.codes = _pack_nibbles(q) if self.bits == 4 else q.contiguous()
        self.scale = torch.cat(scales).contiguous()
        self.min = torch.cat(mins).contiguous()
        # Q4_0 / Q4_1 / Q8_0 scales and mins are float16 values (d, m, -8 d, -128 d): held as
        # float16 (a quarter of a Q4_1 weight's bytes) unless one does not convert back exactly
        # (-8 d or -128 d past float16's range: a corrupt-looking but readable file).
        if half:
            half_s, half_m = self.scale.half(), self.min.half()
            if torch.equal(half_s.float(), self.scale) and torch.equal(half_m.float(), self.min):
                self.scale, self.min = half_s, half_m
        # bf16 rows' (kernel, most rows): ``q8`` / ``q8mm`` / ``float`` / ``torch`` (tiles), set
        # by ``qgemv_choice.choose`` at load (the flags' choice when nothing chose).
        self.choice: tuple[str, int] | None = None
        self._native: tuple[QuantMatrix, int] | bool | None = None

    def bf16_choice(self) -> tuple[str, int]:
        """The (kernel, most rows) of bf16 rows (fixed once asked: the native driver's
        records and the module path must agree)."""
        if self.choice is None:
            self.choice = flags_pick(self)
        return self.choice

    def kernel_names(self) -> list[str]:
        """The few-row kernels for bf16 rows, the flags' pick first: int8 activations where a
        compiled form takes the codes (``q8_bits`` of them, in groups of ``group``), on AMX
        tiles where the CPU has them (``q8mm``: the GEMV's own form and bits below 16 rows,
        3-5x its speed from 16 rows, measured on a Sapphire Rapids Xeon)."""
        lib = cpu_ops.kernels()
        q8 = lib is not None and bool(lib.pf_qgemv_q8_takes(self.q8_bits, self.group))
        tiles = lib is not None and bool(lib.pf_qgemm_q8_takes(self.q8_bits, self.group))
        return ["q8mm"] * (q8 and tiles) + ["q8"] * q8 + ["float"]

    def signature(self) -> str:
        """What besides (N, K) decides a product's speed: code bits, group, scale width."""
        return (f"gguf b{self.q8_bits} g{self.group} "
                f"{str(self.scale.dtype).removeprefix('torch.')}")

    def arrays(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.min

    def twin(self, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> GGUFWeight:
        """A weight of this one's format and shape over other arrays (timing streams them)."""
        other = copy.copy(self)
        other.codes, other.scale, other.min, other._native = codes, scale, mins, None
        return other

    def native(self) -> tuple[QuantMatrix, int] | None:
        """This weight's descriptor for the native decode driver on bf16 rows and the GEMV
        that takes it (``native_matrix.describe``), or None where the few-row kernel does not
        take the weight (then neither does the module path's: it decodes tiles)."""
        if self._native is None:
            name = self.bf16_choice()[0]
            ok = (self.bits in (4, 8) and self.k % self.group == 0
                  and (self.bits == 8 or self.group == 32) and name != "torch")
            fmt = {"q8": "affine_q8", "q8mm": "affine_q8mm"}.get(name, "affine")
            got = describe(fmt, self.codes, self.scale, self.min,
                           self.bits if fmt == "affine" else self.q8_bits, self.group,
                           int(self.scale.dtype == torch.float16)) if ok else None
            self._native = got if got is not None else False
        return self._native or None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor
                ) -> torch.Tensor:
        q = _unpack_nibbles(codes) if self.bits == 4 else codes
        r = q.shape[0]
        w = (q.float().reshape(r, -1, self.group) * scale.float()[..., None]
             + mins.float()[..., None])
        return w.reshape(r, self.k)

    def dequantize(self, rows: slice) -> torch.Tensor:
        """Float32 weight rows ``rows``."""
        return self._decode(self.codes[rows], self.scale[rows], self.min[rows])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 weight rows at ``ids`` (any shape; result ``(*ids.shape, k)``)."""
        flat = ids.reshape(-1).long()
        w = self._decode(self.codes[flat], self.scale[flat], self.min[flat])
        return w.reshape(*ids.shape, self.k)

    def product(self, x: torch.Tensor, name: str) -> torch.Tensor | None:
        """``x @ w.T`` (``x`` 2-D) by one path: kernel ``q8``, ``q8mm`` or ``float`` (float32
        result; None where it does not take the arguments) or ``torch`` (decoded tiles,
        ``x``'s dtype)."""
        if name == "torch":
            return self._tiles(x)
        lib = cpu_ops.kernels()
        if (lib is None or x.device.type != "cpu" or x.dim() != 2
                or not 1 <= x.shape[0] <= KERNEL_MAX_ROWS):
            return None
        xf = x.float().contiguous()
        y = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        fn = {"q8": lib.pf_qgemv_affine_q8, "q8mm": lib.pf_qgemm_affine_q8}.get(
            name, lib.pf_qgemv_affine)
        rc = fn(xf.data_ptr(), xf.shape[0], self.k, self.n, self.codes.data_ptr(),
                self.q8_bits if name in ("q8", "q8mm") else self.bits, self.group,
                self.scale.data_ptr(), self.min.data_ptr(),
                int(self.scale.dtype == torch.float16), y.data_ptr(), self.n,
                torch.get_num_threads())
        return y if rc == 0 else None

    def _tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Decoded tiles of output rows times ``x`` in ``x``'s dtype (prefill-sized batches);
        bf16 tiles decoded by ``pf_affine_decode_bf16`` where it runs (the same bits as
        :meth:`dequantize` rounded to bf16)."""
        y = x.new_empty((*x.shape[:-1], self.n))
        lib = cpu_ops.kernels() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
        for r0 in range(0, self.n, TILE_ROWS):
            r1 = min(self.n, r0 + TILE_ROWS)
            w = self._decode_bf16(lib, r0, r1) if lib is not None else None
            if w is None:
                w = self.dequantize(slice(r0, r1)).to(x.dtype)
            y[..., r0:r1] = F.linear(x, w)
        return y

    def _decode_bf16(self, lib, r0: int, r1: int) -> torch.Tensor | None:
        out = torch.empty((r1 - r0, self.k), dtype=torch.bfloat16)
        rc = lib.pf_affine_decode_bf16(
            self.codes[r0].data_ptr(), self.bits, self.group, self.scale[r0].data_ptr(),
            self.min[r0].data_ptr(), int(self.scale.dtype == torch.float16), r1 - r0, self.k,
            out.data_ptr(), self.k, torch.get_num_threads())
        return out if rc == 0 else None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """The few-row kernel's product for ``x``, or None above its rows."""
        if x.dtype == torch.float32:
            return self.product(x, "float")
        name, rows = self.bf16_choice()
        if name == "torch" or x.dim() != 2 or x.shape[0] > rows:
            return None
        return self.product(x, name)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` in float32 through decoded tiles of output rows."""
        xf = x.float()
        y = xf.new_empty((*x.shape[:-1], self.n))
        for r0 in range(0, self.n, TILE_ROWS):
            r1 = min(self.n, r0 + TILE_ROWS)
            y[..., r0:r1] = F.linear(xf, self.dequantize(slice(r0, r1)))
        return y

    def matmul(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """``x @ w.T`` in ``x``'s dtype (float32 with ``float_out``: logits)."""
        y = self._kernel(x)
        if y is None:
            y = self.reference(x) if x.dtype == torch.float32 or x.dim() != 2 else self._tiles(x)
        return y.float() if float_out else y.to(x.dtype)
