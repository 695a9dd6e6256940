"""GGUF (llama.cpp) quantized blocks decoded into integer codes with a scale and a minimum
per group of inputs: ``w = scale[g] * code + min[g]``.

A GGUF quantized tensor of ``k`` columns stores each row as ``k / block`` blocks of
``type_size`` bytes; :func:`decode_rows` turns rows of raw blocks (R, row_bytes) uint8 into
``codes`` (R, k) uint8 (unsigned), ``scale`` and ``min`` (R, k / group) float32. Losslessly:
every weight ``scale * code + min`` equals llama.cpp's value up to float32 rounding of that
one product and sum (the block's f16 scales and 6-bit sub-block scales multiply exactly in
float32). Types, as ggml lays them out:

* ``Q4_0`` (32 inputs, 18 bytes): f16 ``d``, 16 bytes of nibbles (low nibble of byte ``j``:
  input ``j``, high: ``j + 16``); ``w = d * (q - 8)``: group 32, scale ``d``, min ``-8 d``.
* ``Q4_1`` (32, 20): f16 ``d``, f16 ``m``, nibbles as Q4_0; ``w = d * q + m``.
* ``Q8_0`` (32, 34): f16 ``d``, 32 int8; ``w = d * q``: codes ``q + 128``, min ``-128 d``.
* ``Q4_K`` (256, 144): f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit scales and mins, 128
  bytes of nibbles (64 inputs per 32 bytes: low nibbles then high); group 32,
  ``w = d * sc * q - dmin * m``.
* ``Q5_K`` (256, 176): as Q4_K plus 32 bytes of fifth bits (bit ``j`` of byte ``l``: input
  ``32 j + l``); 5-bit codes.
* ``Q6_K`` (256, 210): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales,
  f16 ``d``; group 16, ``w = d * sc * (q - 32)``: 6-bit codes, min ``-32 d sc``.

``KERNEL_BITS`` says how the kernel stores a type's codes: 4-bit codes two to a byte, 5-, 6-
and 8-bit codes one to a byte (a 5/6-bit code spends a whole byte: simpler and faster to
decode than packing them, at 2-3 bits more per weight).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "CODE_BITS", "GGUFTypeError", "GROUP", "HALF_SCALES", "KERNEL_BITS",
           "TYPE_SIZE", "SUPPORTED", "decode_rows", "dequantize_rows", "row_bytes"]

SUPPORTED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
TYPE_SIZE = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
GROUP = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
KERNEL_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}
# Types whose scale and min per group are float16 values (the block's f16 ``d`` and ``m``,
# ``-8 d``, ``-128 d``): the kernel layout holds them as float16 (``gguf_kernel.layout``).
HALF_SCALES = ("Q4_0", "Q4_1", "Q8_0")
# The bits of a type's codes (every code is below 2 ** CODE_BITS): what the int8-activation
# kernel's forms check (AVX2's byte products take codes of at most 6 bits).
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


class GGUFTypeError(ValueError):
    """A GGUF tensor type or shape pagefold cannot keep quantized (message names it)."""


def row_bytes(kind: str, k: int, what: str = "?") -> int:
    """Bytes of one row of ``k`` inputs; refuses a type or width the format cannot hold."""
    if kind not in BLOCK:
        raise GGUFTypeError(f"{what}: GGUF type {kind} is not supported kept quantized "
                            f"(supported: {', '.join(SUPPORTED)}); load the file with "
                            "quantization='none' to dequantize it")
    if k % BLOCK[kind]:
        raise GGUFTypeError(f"{what}: GGUF {kind} rows of {k} inputs are not whole blocks of "
                            f"{BLOCK[kind]}")
    return k // BLOCK[kind] * TYPE_SIZE[kind]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian -> (...) float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """(nb, c * span) bytes -> (nb, c * 2 * span) codes: per run of ``span`` bytes, their low
    nibbles then their high nibbles."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, span)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(nb, -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (nb, 8)."""
    s = s.reshape(-1, 3, 4).to(torch.int32)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _decode_blocks(kind: str, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nb, type_size) blocks -> codes (nb, block) uint8, scale and min (nb, block / group)."""
    nb = b.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b[:, 0:2])[:, None]
        off = 2 if kind == "Q4_0" else 4
        q = _nibbles(b[:, off:], 16)
        mn = -8.0 * d if kind == "Q4_0" else _f16(b[:, 2:4])[:, None]
        return q, d, mn
    if kind == "Q8_0":
        d = _f16(b[:, 0:2])[:, None]
        q = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return q, d, -128.0 * d
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, m = _k_scales(b[:, 4:16])
        if kind == "Q4_K":
            q = _nibbles(b[:, 16:], 32)
        else:
            qh = b[:, 16:48].reshape(nb, 1, 32)
            hi = (qh >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
            q = _nibbles(b[:, 48:], 32) | (hi.reshape(nb, -1) << 4)
        return q, d * sc, -(dmin * m)
    if kind == "Q6_K":
        ql, qh = b[:, :128], b[:, 128:192]
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 208:210])[:, None]
        lo = _nibbles(ql, 64)  # per half of 128: low nibbles of 64 bytes, then high
        h = qh.reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8
                                                     ).reshape(1, 1, 4, 1)
        q = lo | ((h & 3).reshape(nb, -1) << 4)
        scale = d * sc
        return q, scale, -32.0 * scale
    raise GGUFTypeError(f"GGUF type {kind} is not supported kept quantized")


def decode_rows(kind: str, raw: torch.Tensor, k: int, what: str = "?"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of raw blocks (R, row_bytes) uint8 -> codes (R, k) uint8, scale and min (R, k /
    GROUP[kind]) float32; a row length that is not the type's, or non-finite scales, is a
    :class:`GGUFTypeError` naming ``what`` (a truncated, mislabelled or corrupt tensor)."""
    rb = row_bytes(kind, k, what)
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] != rb:
        raise GGUFTypeError(f"{what}: GGUF {kind} tensor of shape {tuple(raw.shape)} "
                            f"{raw.dtype}, expected (rows, {rb}) uint8 for {k} inputs "
                            "(truncated or corrupt file)")
    r = raw.shape[0]
    q, s, m = _decode_blocks(kind, raw.reshape(-1, TYPE_SIZE[kind]))
    if not (torch.isfinite(s).all() and torch.isfinite(m).all()):
        raise GGUFTypeError(f"{what}: GGUF {kind} blocks with non-finite scales (corrupt "
                            "file)")
    return (q.reshape(r, k).contiguous(), s.reshape(r, -1).contiguous(),
            m.reshape(r, -1).contiguous())


def dequantize_rows(kind: str, raw: torch.Tensor, k: int, what: str = "?") -> torch.Tensor:
    """Float32 weights (R, k) of raw rows: ``scale * code + min`` per group."""
    q, s, m = decode_rows(kind, raw, k, what)
    g = GROUP[kind]
    w = q.float().reshape(q.shape[0], -1, g) * s[..., None] + m[..., None]
    return w.reshape(q.shape[0], k)
