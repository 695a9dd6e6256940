"""The compiled CPU elementwise kernels (``csrc/layers.cpp``, ``gated_norm.cpp``) through
ctypes: RMSNorm (with the residual add), q/k norm + RoPE, SiLU-and-mul, the gated RMSNorms and
the sigmoid output gate. Each returns None (nothing written) when the kernel does not take the
inputs; the caller then takes its torch path."""

from __future__ import annotations

import torch

from pagefold.csrc.cpu_ops import DTYPE_CODE, NORM_FLOAT_WEIGHT, kernels, ptr, rows_ok, usable

__all__ = ["NORM_FLOAT_WEIGHT", "gated_norm_gate_first", "qk_norm_rope", "rms_norm",
           "rms_norm_gated", "sigmoid_gate", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool | int,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm over the last dim (see ``pagefold.layers.norm``); with ``residual``,
    ``residual += x`` (rounded to the dtype, in place) is what gets normalised. Returns the
    normalised tensor, or None when not handled (nothing written). ``zero_centered`` may be
    :data:`NORM_FLOAT_WEIGHT` instead: ``(x / rms(x) * weight)`` rounded once."""
    lib = kernels()
    if lib is None or x.numel() == 0:
        return None
    d = x.shape[-1]
    x2 = x.reshape(-1, d) if x.dim() != 2 else x
    if residual is not None:
        if residual.shape != x.shape:
            return None
        r2 = residual.view(-1, d) if residual.dim() != 2 else residual
    else:
        r2 = None
    code = usable(x2, weight) if r2 is None else usable(x2, weight, r2)
    if (code is None or not rows_ok(x2) or (r2 is not None and not rows_ok(r2))
            or not weight.is_contiguous() or weight.numel() != d):
        return None
    out = torch.empty(x2.shape, dtype=x.dtype)
    rc = lib.pf_rms_norm(code, ptr(x2), x2.stride(0),
                         ptr(r2) if r2 is not None else None,
                         r2.stride(0) if r2 is not None else 0, ptr(weight), ptr(out), d,
                         x2.shape[0], d, float(eps), int(zero_centered), torch.get_num_threads())
    return out.view(x.shape) if rc == 0 else None


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_off: int, q_head_stride: int, k_off: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, zero_centered: bool
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-head q/k RMSNorm (when weights are given) then neox RoPE on the first
    ``cos.shape[1]`` channels, read from the fused projection ``qkv`` (T, width): query head
    ``h`` at column ``q_off + h * q_head_stride``, kv head ``j`` at ``k_off + j * head_dim``.
    ``cos``/``sin``: float32 (max_positions, rotary_dim) tables. Returns fresh contiguous
    ``q (T, H, D)``, ``k (T, KVH, D)``, or None when not handled."""
    lib = kernels()
    if lib is None:
        return None
    ws = [w for w in (q_weight, k_weight) if w is not None]
    code = usable(qkv, *ws)
    if (code is None or not rows_ok(qkv) or positions.dtype != torch.int64
            or positions.device.type != "cpu" or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or (q_weight is None) != (k_weight is None)
            or any(not w.is_contiguous() or w.numel() != head_dim for w in ws)):
        return None
    t = qkv.shape[0]
    positions = positions.contiguous()
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype)
    rc = lib.pf_qk_norm_rope(
        code, ptr(qkv), qkv.stride(0), q_off, q_head_stride, k_off, ptr(positions),
        ptr(cos), ptr(sin), cos.shape[1],
        ptr(q_weight) if q_weight is not None else None,
        ptr(k_weight) if k_weight is not None else None, float(eps), int(zero_centered),
        ptr(q), ptr(k), t, num_heads, num_kv_heads, head_dim, torch.get_num_threads())
    return (q, k) if rc == 0 else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` (T, 2I) = [gate | up], rounded like the torch ops
    (silu's result, then the product). Returns (T, I), or None when not handled."""
    lib = kernels()
    if lib is None:
        return None
    code = usable(gate_up)
    if code is None or not rows_ok(gate_up) or gate_up.shape[1] % 2:
        return None
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, i), dtype=gate_up.dtype)
    rc = lib.pf_silu_mul(code, ptr(gate_up), gate_up.stride(0), ptr(out), n, i,
                         torch.get_num_threads())
    return out if rc == 0 else None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    """``weight * rmsnorm(x) * silu(gate)`` per (token, head) row of ``x``/``gate`` (N, H, D),
    each with contiguous rows (any token and head strides), rounded as
    ``pagefold.models.qwen3_5.RMSNormGated``. Returns (N, H, D), or None when not handled."""
    lib = kernels()
    if lib is None or x.dim() != 3 or gate.shape != x.shape or x.numel() == 0:
        return None
    code = usable(x, gate, weight)
    if (code is None or x.stride(2) != 1 or gate.stride(2) != 1 or not weight.is_contiguous()
            or weight.numel() != x.shape[2]):
        return None
    n, h, d = x.shape
    out = torch.empty((n, h, d), dtype=x.dtype)
    rc = lib.pf_rms_norm_gated(code, ptr(x), x.stride(0), x.stride(1), ptr(gate),
                               gate.stride(0), gate.stride(1), ptr(weight), ptr(out), n, h, d,
                               float(eps), torch.get_num_threads())
    return out if rc == 0 else None


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """``o * sigmoid(gate)`` through ``pf_sigmoid_gate`` for bf16 ``o`` (T, H * D) and
    ``gate`` (T, H, D) (contiguous heads), rounded as torch rounds it (the sigmoid to bf16,
    then the product) but with the kernels' own ``exp``; None when not handled."""
    t, h, d = gate.shape
    lib = kernels() if o.device.type == "cpu" else None
    if (lib is None or o.dtype != torch.bfloat16 or gate.dtype != o.dtype
            or not o.is_contiguous() or o.shape != (t, h * d) or gate.stride(2) != 1 or t == 0):
        return None
    out = torch.empty_like(o)
    rc = lib.pf_sigmoid_gate(1, ptr(o), o.stride(0), ptr(gate), gate.stride(0), gate.stride(1),
                             ptr(out), out.stride(0), t, h, d, torch.get_num_threads())
    return out if rc == 0 else None


def gated_norm_gate_first(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                          group: int, eps: float) -> torch.Tensor | None:
    """Mamba-2's gate-first gated RMSNorm through ``pf_gated_norm_gate_first`` (the same steps
    and roundings as the torch form, equal up to float32 rounding), or None (nothing done)
    when the kernel does not take the inputs: kernels off, dtypes other than all float32, all
    bf16 or float32 x with bf16 gate and weight (the prefill's float32 y), rows not
    contiguous."""
    lib = kernels()
    codes = (DTYPE_CODE.get(x.dtype), DTYPE_CODE.get(gate.dtype), DTYPE_CODE.get(weight.dtype))
    if (lib is None or None in codes or codes[1] != codes[2] or x.stride(1) != 1
            or gate.dim() != 2 or gate.stride(1) != 1 or not weight.is_contiguous()
            or gate.device.type != "cpu"):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.pf_gated_norm_gate_first(*codes, ptr(x), x.stride(0), ptr(gate), gate.stride(0),
                                      ptr(weight), ptr(out), x.shape[0], x.shape[1], group,
                                      float(eps), torch.get_num_threads())
    return out if rc == 0 else None
