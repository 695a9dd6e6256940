"""Weight formats: how each quantized format stores a linear's weight and how it decodes.

A :class:`QuantMethod` names the tensors a checkpoint holds for one linear layer of ``n``
output rows and ``k`` inputs (:class:`ParamSpec`: shape, dtype, and along which dimension the
output rows run, so a fused layer such as ``qkv_proj`` places each checkpoint shard's rows),
and decodes them into the float32 weight (``dequantize``): the reference every kernel of the
format is tested against. Formats, as their checkpoints store them:

* ``gptq``: ``qweight`` (k * bits / 32, n) int32 packed along the inputs (value ``i`` of a word
  at bits ``i * bits``), ``qzeros`` (groups, n * bits / 32) int32 packed along the outputs,
  stored minus one (GPTQ's v1 checkpoint format), ``scales`` (groups, n), optional ``g_idx``
  (k,) the group of each input (act-order; default ``input // group_size``);
  ``w = scales[g] * (q - (zero + 1))``.
* ``awq`` (GEMM layout): ``qweight`` (k, n / 8) and ``qzeros`` (groups, n / 8) int32, 4-bit
  values packed along the outputs in AWQ's order (nibble ``i`` holds output
  ``8 * word + AWQ_ORDER[i]``), ``scales`` (groups, n); ``w = scales[g] * (q - zero)``.
* ``compressed-tensors`` pack-quantized (W4A16 / W8A16, symmetric): ``weight_packed``
  (n, k * bits / 32) int32 packed along the inputs, values offset by ``2 ** (bits - 1)``,
  ``weight_scale`` (n, groups), optional ``weight_g_idx`` (k,) and ``weight_shape`` (2,);
  ``w = scale[g] * (u - 2 ** (bits - 1))``.
* ``fp8``: ``weight`` (n, k) float8_e4m3fn with ``weight_scale`` per tensor (a scalar per
  checkpoint shard), per channel (n, 1), or per block (``weight_scale_inv``, (ceil(n / bn),
  ceil(k / bk))); ``w = weight * scale``. Also compressed-tensors' float-quantized format.

Invariants: ``dequantize`` reads only the named tensors; a layout the format cannot decode (a
group size that does not divide the inputs, bits other than 4 / 8, an asymmetric
compressed-tensors weight) is refused with a :class:`QuantizationError` naming the layer and
the format before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AWQ_ORDER", "QuantizationError", "ParamSpec", "QuantMethod", "GPTQ", "AWQ",
           "PackedInt", "FP8", "IntFormat", "unpack_along_last"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantizationError(ValueError):
    """A quantized checkpoint or option pagefold cannot load (the message names what)."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One stored tensor of a quantized linear.

    ``out_dim``: the dimension along which output rows run (a fused layer's shard fills its
    rows there, ``out_div`` output rows per element: packed words); None: one value per
    checkpoint shard (a per-tensor scale, an input permutation), kept as ``(shards, *shape)``.
    ``optional``: a checkpoint may omit it (``fill`` then gives its value)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None = 0
    out_div: int = 1
    optional: bool = False


def unpack_along_last(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                      ) -> torch.Tensor:
    """int32 words (..., m) -> their ``32 / bits`` unsigned values each, (..., m * 32 / bits)
    int32; value ``i`` of a word sits at bits ``[i * bits, (i + 1) * bits)``. ``order``: value
    ``i`` lands at position ``order[i]`` within its word's group (AWQ)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    vals = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inv = [0] * per
        for i, pos in enumerate(order):
            inv[pos] = i
        vals = vals[..., inv]
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per)


def _groups(k: int, group_size: int, layer: str, fmt: str) -> tuple[int, int]:
    g = k if group_size in (-1, 0, None) else group_size
    if g < 1 or k % g:
        raise QuantizationError(f"{layer}: {fmt} group size {group_size} does not divide its "
                                f"{k} input features")
    return g, k // g


def _bits(bits: int, allowed: tuple[int, ...], layer: str, fmt: str) -> int:
    if bits not in allowed:
        raise QuantizationError(f"{layer}: {fmt} with {bits}-bit weights is not supported "
                                f"(supported: {', '.join(map(str, allowed))})")
    return bits


class QuantMethod:
    """One format's storage and decoding for a linear of ``n`` outputs and ``k`` inputs."""

    name = "?"

    @property
    def label(self) -> str:
        """The format as logs name it (``gptq int4 g128``)."""
        bits, group = getattr(self, "bits", None), getattr(self, "group_size", None)
        if bits is None:
            return f"{self.name} ({getattr(self, 'scale', '')} scales)".replace(" ( scales)", "")
        return f"{self.name} int{bits}" + (f" g{group}" if group not in (None, -1, 0) else "")

    def params(self, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        raise NotImplementedError

    def tensor_names(self) -> set[str]:
        """The names of the format's tensors (for a layer of a width every group and block
        of this format divides)."""
        size = 256
        for v in (getattr(self, "group_size", None), *(getattr(self, "block", None) or ())):
            if v and v > 0:
                size = math.lcm(size, v)
        return set(self.params(size, size, "?"))

    def fill(self, name: str, n: int, k: int) -> torch.Tensor:
        """The value of optional tensor ``name`` (one shard's) when the checkpoint omits it."""
        raise KeyError(name)

    def dequantize(self, t: dict[str, torch.Tensor], rows: slice, shard: int, n: int,
                   k: int) -> torch.Tensor:
        """Float32 weight rows ``rows`` (all in checkpoint shard ``shard``) of a layer of
        ``n`` local outputs; ``t`` the layer's tensors as :meth:`params` names them."""
        raise NotImplementedError


class IntFormat(QuantMethod):
    """Integer weights with group scales and zero points: ``w = scale[g] * (code - zero[g])``
    with ``g`` the group of each input. ``int_parts`` gives a row range's unsigned codes
    (rows, k), scales and zeros (rows, groups) float32 and the inputs' groups (k,) int64:
    what the compiled kernel's layout is built from (``quantization.int_kernel``)."""

    bits = 4
    fp8 = False  # codes are float8_e4m3fn bytes, not unsigned integers

    def int_parts(self, t, rows, shard, n, k):
        raise NotImplementedError

    def dequantize(self, t, rows, shard, n, k):
        q, s, z, g = self.int_parts(t, rows, shard, n, k)
        return (decode_codes(q, self.fp8) - z[:, g]) * s[:, g]


def decode_codes(q: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Codes as float32: unsigned integers, or float8_e4m3fn bytes."""
    return q.view(torch.float8_e4m3fn).float() if fp8 else q.float()


@dataclass(frozen=True)
class GPTQ(IntFormat):
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    name = "gptq"

    def params(self, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        b = _bits(self.bits, (4, 8), layer, self.name)
        _, groups = _groups(k, self.group_size, layer, self.name)
        per = 32 // b
        if k % per or n % per:
            raise QuantizationError(f"{layer}: gptq {b}-bit needs in and out features divisible "
                                    f"by {per}, got {k} and {n}")
        return {"qweight": ParamSpec((k // per, n), torch.int32, out_dim=1),
                "qzeros": ParamSpec((groups, n // per), torch.int32, out_dim=1, out_div=per),
                "scales": ParamSpec((groups, n), torch.float16, out_dim=1),
                "g_idx": ParamSpec((k,), torch.int32, out_dim=None, optional=True)}

    def fill(self, name: str, n: int, k: int) -> torch.Tensor:
        if name != "g_idx":
            raise KeyError(name)
        g, _ = _groups(k, self.group_size, "?", self.name)
        return torch.arange(k, dtype=torch.int32) // g

    def int_parts(self, t, rows, shard, n, k):
        r0, r1 = rows.start, rows.stop
        per = 32 // self.bits
        q = unpack_along_last(t["qweight"][:, r0:r1].t().contiguous(), self.bits)  # (rows, k)
        zw = t["qzeros"][:, r0 // per:(r1 + per - 1) // per]
        z = unpack_along_last(zw, self.bits)[:, r0 % per:r0 % per + (r1 - r0)] + 1  # (G, rows)
        return q, t["scales"][:, r0:r1].float().t(), z.t().float(), t["g_idx"][shard].long()


@dataclass(frozen=True)
class AWQ(IntFormat):
    bits: int = 4
    group_size: int = 128
    name = "awq"

    def params(self, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        _bits(self.bits, (4,), layer, self.name)
        _, groups = _groups(k, self.group_size, layer, self.name)
        if n % 8:
            raise QuantizationError(f"{layer}: awq needs out features divisible by 8, got {n}")
        return {"qweight": ParamSpec((k, n // 8), torch.int32, out_dim=1, out_div=8),
                "qzeros": ParamSpec((groups, n // 8), torch.int32, out_dim=1, out_div=8),
                "scales": ParamSpec((groups, n), torch.float16, out_dim=1)}

    def int_parts(self, t, rows, shard, n, k):
        r0, r1 = rows.start, rows.stop
        lo, hi = r0 // 8, (r1 + 7) // 8
        cut = slice(r0 - 8 * lo, r0 - 8 * lo + (r1 - r0))
        q = unpack_along_last(t["qweight"][:, lo:hi], 4, AWQ_ORDER)[:, cut]  # (k, rows)
        z = unpack_along_last(t["qzeros"][:, lo:hi], 4, AWQ_ORDER)[:, cut]  # (G, rows)
        g = torch.arange(k) // (k // z.shape[0])
        return q.t(), t["scales"][:, r0:r1].float().t(), z.t().float(), g


@dataclass(frozen=True)
class PackedInt(IntFormat):
    """compressed-tensors' pack-quantized symmetric integer weights (and pagefold's own INT8 /
    INT4 weight-only quantization on load, stored the same way)."""

    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    name = "compressed-tensors"

    def params(self, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        b = _bits(self.bits, (4, 8), layer, self.name)
        _, groups = _groups(k, self.group_size, layer, self.name)
        per = 32 // b
        if k % per:
            raise QuantizationError(f"{layer}: {b}-bit packed weights need in features "
                                    f"divisible by {per}, got {k}")
        specs = {"weight_packed": ParamSpec((n, k // per), torch.int32),
                 "weight_scale": ParamSpec((n, groups), torch.float32),
                 "weight_shape": ParamSpec((2,), torch.int64, out_dim=None, optional=True)}
        if self.act_order:
            specs["weight_g_idx"] = ParamSpec((k,), torch.int32, out_dim=None)
        return specs

    def fill(self, name: str, n: int, k: int) -> torch.Tensor:
        if name != "weight_shape":
            raise KeyError(name)
        return torch.tensor([-1, k], dtype=torch.int64)  # rows: the shard's, checked elsewhere

    def int_parts(self, t, rows, shard, n, k):
        u = unpack_along_last(t["weight_packed"][rows], self.bits)  # (rows, k)
        s = t["weight_scale"][rows].float()  # (rows, groups)
        g = (t["weight_g_idx"][shard].long() if self.act_order
             else torch.arange(k) // (k // s.shape[1]))
        return u, s, torch.full_like(s, float(1 << (self.bits - 1))), g


@dataclass(frozen=True)
class FP8(IntFormat):
    """float8_e4m3fn weights; ``scale``: ``tensor`` (one per checkpoint shard), ``channel``
    (n, 1) or ``block`` (``block`` = (bn, bk), ``weight_scale_inv``). As integer-format parts:
    the weight's bytes are the codes, zero points 0, one group per scale."""

    scale: str = "tensor"
    block: tuple[int, int] | None = None
    name = "fp8"
    bits = 8
    fp8 = True

    @property
    def label(self) -> str:
        return f"fp8 ({self.scale} scales)"

    def params(self, n: int, k: int, layer: str) -> dict[str, ParamSpec]:
        w = ParamSpec((n, k), torch.float8_e4m3fn)
        if self.scale == "tensor":
            return {"weight": w, "weight_scale": ParamSpec((), torch.float32, out_dim=None)}
        if self.scale == "channel":
            return {"weight": w, "weight_scale": ParamSpec((n, 1), torch.float32)}
        if self.scale == "block" and self.block is not None:
            bn, bk = self.block
            if n % bn:
                raise QuantizationError(f"{layer}: fp8 block scales of {bn} rows do not "
                                        f"divide its {n} (local) output features")
            return {"weight": w, "weight_scale_inv":
                    ParamSpec((n // bn, -(-k // bk)), torch.float32, out_div=bn)}
        raise QuantizationError(f"{layer}: fp8 scale layout {self.scale!r} is not supported")

    def kernel_layout(self, k: int) -> bool:
        """Whether the scales form whole groups of inputs (the kernel's layout): not for
        blocks that do not divide the inputs."""
        return self.scale != "block" or k % self.block[1] == 0

    def int_parts(self, t, rows, shard, n, k):
        q = t["weight"][rows].view(torch.uint8)
        r = q.shape[0]
        g = torch.zeros(k, dtype=torch.int64)
        if self.scale == "tensor":
            s = t["weight_scale"][shard].float().expand(r, 1)
        elif self.scale == "channel":
            s = t["weight_scale"][rows].float()
        else:
            bn, bk = self.block
            r0, r1 = rows.start, rows.stop
            s = t["weight_scale_inv"][r0 // bn:(r1 + bn - 1) // bn].float()
            s = s.repeat_interleave(bn, 0)[r0 - (r0 // bn) * bn:][:r1 - r0]
            g = torch.arange(k) // bk
        return q, s.contiguous(), torch.zeros_like(s), g
