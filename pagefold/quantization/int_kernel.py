"""Integer and FP8 weights in the compiled kernel's layout, and their product.

:class:`IntWeight` is built once at load from any :class:`~.formats.IntFormat` (GPTQ, AWQ,
compressed-tensors int, int8 / int4 on load, FP8): per output row the codes in input order
(4-bit codes two to a byte; FP8 weights keep their float8_e4m3fn bytes), and per row and group
of inputs a float32 scale and zero, so ``w = scale * (code - zero)`` (FP8: zeros 0). A shard
whose groups are permuted (GPTQ act-order) has its codes reordered so each group's inputs are
contiguous, and the product gathers ``x``'s columns in that order (``perm``): the same sums,
grouped.

``matmul`` runs ``ops.quant.triton.qgemm`` where the Triton kernels run (CUDA, or the
interpreter in tests), else ``pf_qgemv_int`` (``csrc/quant.cpp``) on the CPU for float32 rows
up to ``KERNEL_MAX_ROWS`` and for bf16 rows up to the weight's :attr:`choice` (measured at load,
:mod:`.qgemv_choice`), else :meth:`IntWeight.dequantize` one tile at a time and ``F.linear``
in the activations' dtype (float32 rows: the reference the kernel is tested against; float32
sums; the kernel's summation order differs, so the two agree to float32 rounding, not
bitwise).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.kernels import dispatch
from pagefold.quantization.formats import IntFormat, decode_codes
from pagefold.quantization.native_matrix import QuantMatrix, describe
from pagefold.quantization.qgemv_choice import KERNEL_MAX_ROWS, flags_pick

__all__ = ["IntWeight", "KERNEL_MAX_ROWS"]

TILE_ROWS = 2048


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


class IntWeight:
    """A linear's integer weight (``n`` x ``k``) in kernel layout, shard by shard."""

    def __init__(self, method: IntFormat, tensors: dict[str, torch.Tensor],
                 shards: dict[str, tuple[int, int]], n: int, k: int) -> None:
        self.bits, self.fp8, self.n, self.k = method.bits, method.fp8, n, k
        codes, scales, zeros = [], [], []
        self.segments: list[tuple[int, int, torch.Tensor | None]] = []  # (row0, rows, perm)
        group = None
        for i, (off, rows) in enumerate(shards.values()):
            q, s, z, g = method.int_parts(tensors, slice(off, off + rows), i, n, k)
            perm = None
            if not torch.equal(g, torch.arange(k) // (k // s.shape[1])):
                perm = torch.argsort(g, stable=True)
                q = q[:, perm]
            gs = k // s.shape[1]
            if group is not None and gs != group:
                raise ValueError("shards of one layer with different group sizes")
            group = gs
            codes.append(q.to(torch.uint8))
            scales.append(s.float())
            zeros.append(z.float())
            self.segments.append((off, rows, perm))
        self.group = group
        q = torch.cat(codes)
        self.codes = _pack_nibbles(q) if self.bits == 4 else q.contiguous()
        self.scale = torch.cat(scales).contiguous()
        self.zero = torch.cat(zeros).contiguous()
        self._native: tuple[QuantMatrix, int] | bool | None = None
        # bf16 rows' (kernel, most rows): ``int`` or ``torch`` (decoded tiles), set by
        # ``qgemv_choice.choose`` at load (the flags' choice when nothing chose).
        self.choice: tuple[str, int] | None = None

    def bf16_choice(self) -> tuple[str, int]:
        """The (kernel, most rows) of bf16 rows (fixed once asked: the native driver's
        records and the module path must agree)."""
        if self.choice is None:
            self.choice = flags_pick(self)
        return self.choice

    @staticmethod
    def kernel_names() -> list[str]:
        return ["int"]

    def signature(self) -> str:
        """What besides (N, K) decides a product's speed: code kind and bits, group."""
        return f"int b{self.bits}{' fp8' if self.fp8 else ''} g{self.group}"

    def arrays(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.zero

    def twin(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> IntWeight:
        """A weight of this one's format and shape over other arrays (timing streams them)."""
        other = copy.copy(self)
        other.codes, other.scale, other.zero, other._native = codes, scale, zero, None
        return other

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def native(self) -> tuple[QuantMatrix, int] | None:
        """This weight's descriptor for the native decode driver and the GEMV that takes it
        (``native_matrix.describe``: ``pf_qgemv_int`` on bf16 rows widened to float32, as
        :meth:`matmul`'s kernel), or None for permuted (act-order) shards or a layout the
        kernel refuses. One call over every shard's rows equals the per-shard calls (each
        output is its own row's sum)."""
        if self._native is None:
            ok = (self.bf16_choice()[0] != "torch"
                  and all(perm is None for _, _, perm in self.segments) and self.bits in (4, 8)
                  and (not self.fp8 or self.bits == 8) and self.k % self.group == 0
                  and (self.bits == 8 or (self.group % 2 == 0 and self.k % 2 == 0)))
            got = describe("int", self.codes, self.scale, self.zero, self.bits, self.group,
                           int(self.fp8)) if ok else None
            self._native = got if got is not None else False
        return self._native or None

    def dequantize(self, rows: slice) -> torch.Tensor:
        """Float32 weight rows in the stored (grouped) input order of their shard."""
        c = self.codes[rows]
        q = _unpack_nibbles(c) if self.bits == 4 else c
        g = torch.arange(self.k) // self.group
        return (decode_codes(q, self.fp8) - self.zero[rows][:, g]) * self.scale[rows][:, g]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """The few-row kernel's product for ``x``, or None above its rows."""
        if x.dtype != torch.float32:
            name, rows = self.bf16_choice()
            if name == "torch" or x.dim() != 2 or x.shape[0] > rows:
                return None
        return self.product(x, "int")

    def product(self, x: torch.Tensor, name: str) -> torch.Tensor | None:
        """``x @ w.T`` (``x`` 2-D) by one path: ``int`` (the compiled kernel; None where it
        does not take the arguments) or ``torch`` (decoded tiles in ``x``'s dtype)."""
        if name == "torch":
            return self._tiles(x)
        lib = cpu_ops.kernels()
        if (lib is None or x.device.type != "cpu" or x.dim() != 2
                or not 1 <= x.shape[0] <= KERNEL_MAX_ROWS):
            return None
        xf = x.float().contiguous()
        y = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        nt = torch.get_num_threads()
        for off, rows, perm in self.segments:
            xs = xf if perm is None else xf[:, perm].contiguous()
            rc = lib.pf_qgemv_int(
                xs.data_ptr(), xs.shape[0], self.k, rows,
                self.codes[off].data_ptr(), self.bits, int(self.fp8), self.group,
                self.scale[off].data_ptr(), self.zero[off].data_ptr(), y[:, off:].data_ptr(),
                self.n, nt)
            if rc != 0:
                return None
        return y.to(x.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` through decoded float32 tiles (float32 sums, one rounding)."""
        xf = x.float()
        y = x.new_empty((*x.shape[:-1], self.n), dtype=torch.float32)
        for off, rows, perm in self.segments:
            xs = xf if perm is None else xf[..., perm]
            for r0 in range(off, off + rows, TILE_ROWS):
                r1 = min(off + rows, r0 + TILE_ROWS)
                y[..., r0:r1] = F.linear(xs, self.dequantize(slice(r0, r1)))
        return y.to(x.dtype)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        from pagefold.ops.quant.triton import qgemm  # imports triton: only where it runs

        x2 = x.reshape(-1, self.k).float()
        y = torch.empty((x2.shape[0], self.n), dtype=torch.float32, device=x.device)
        for off, rows, perm in self.segments:
            xs = x2 if perm is None else x2[:, perm.to(x.device)]
            qgemm(xs, self.codes[off:off + rows], self.scale[off:off + rows],
                  self.zero[off:off + rows], self.bits, self.fp8, self.group,
                  y[:, off:off + rows])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.use_triton(x.device):
            return self._triton(x)
        y = self._kernel(x)
        if y is not None:
            return y
        if x.dtype == torch.float32 or x.dim() != 2:
            return self.reference(x)
        return self._tiles(x)

    def _tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill-sized bf16 batches: decoded tiles in the activations' dtype (oneDNN)."""
        y = x.new_empty((x.shape[0], self.n))
        for off, rows, perm in self.segments:
            xs = x if perm is None else x[:, perm]
            for r0 in range(off, off + rows, TILE_ROWS):
                r1 = min(off + rows, r0 + TILE_ROWS)
                y[:, r0:r1] = F.linear(xs, self.dequantize(slice(r0, r1)).to(x.dtype))
        return y
