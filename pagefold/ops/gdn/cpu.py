"""The compiled Gated DeltaNet layer (``csrc/gdn.cpp``) through ctypes."""

from __future__ import annotations

import torch

from pagefold.csrc.cpu_ops import (
    DTYPE_CODE,
    fresh_flags,
    neg_exp,
    ptr,
    rows_ok,
    state_kernel,
    usable,
)

__all__ = ["gdn_layer"]


def gdn_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
              cu_seqlens: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
              scale: float | None = None,
        capture: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A Gated DeltaNet layer's conv and delta rule over a flat varlen batch (prefill chunks
    and decode tokens alike), token-recurrent per sequence, reading each sequence's conv and
    SSM states from their pages once and writing them back once (no gather, no scatter).

    ``view``: the layer's :class:`~pagefold.executor.cache_tensors.StateView`; ``page_ids``
    (N, pages_per_state); ``cu_seqlens`` (N+1,); ``mixed`` (T, conv_dim) the conv input;
    ``a``, ``b`` (T, Hv); ``conv_weight`` (conv_dim, K). Equals ``causal_conv1d_*`` +
    ``gdn_recurrent`` / ``gdn_chunked`` (L2 norm on q/k, ``scale`` default ``Dk ** -0.5``) +
    storing both states, up to float32 rounding. Returns ``o`` (T, Hv, Dv) in mixed's dtype,
    or None when not handled (nothing written).

    ``capture=(after (M,), pages (M, pages_per_state))``: the states right after flat token
    ``after[m]`` also go to ``pages[m]`` (a prefix-cache checkpoint inside the chunk), the
    same bytes a call ending after that token leaves in the sequence's own pages.
    """
    found = state_kernel(view)
    if found is None:
        return None
    lib, conv, ssm, offs = found
    t, c = mixed.shape
    k = conv_weight.shape[1]
    pb = view.page_bytes
    ssm_code = DTYPE_CODE.get(ssm.dtype)
    code = usable(mixed, a, b, conv_weight, dt_bias)
    if (code is None or ssm_code is None or conv.dtype != mixed.dtype
            or conv.shape != (c, k - 1) or ssm.shape != (num_v_heads, head_k_dim, head_v_dim)
            or 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim != c or k < 2
            or not view.raw.is_contiguous() or not rows_ok(mixed)
            or a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0)
            or not conv_weight.is_contiguous() or not dt_bias.is_contiguous()
            or cu_seqlens.device.type != "cpu"):
        return None
    pages = page_ids.contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    fresh = fresh_flags(has_initial_state)
    neg_exp_alog = neg_exp(A_log)
    out = torch.empty((t, num_v_heads, head_v_dim), dtype=mixed.dtype)
    cap_cu = cap_off = cap_pages = None
    if capture is not None:
        after, cpages = capture
        after, perm = after.to(torch.int64).sort()  # grouped by sequence, offsets ascending
        cap_pages = cpages.to(torch.int64)[perm].contiguous()
        cap_cu = torch.searchsorted(after, cu).contiguous()
        seq = torch.searchsorted(cu[1:], after, right=True)
        cap_off = (after - cu[seq]).contiguous()
    rc = lib.pf_gdn(
        code, ssm_code, ptr(view.raw), pb, ptr(pages), pages.shape[1], offs["conv"],
        offs["ssm"], ptr(fresh) if fresh is not None else None, ptr(cu), ptr(mixed),
        mixed.stride(0), ptr(a), ptr(b), a.stride(0), ptr(conv_weight), ptr(neg_exp_alog),
        ptr(dt_bias), ptr(out), pages.shape[0], c, k, num_k_heads, num_v_heads, head_k_dim,
        head_v_dim, float(head_k_dim**-0.5 if scale is None else scale),
        ptr(cap_cu) if cap_cu is not None else None,
        ptr(cap_off) if cap_off is not None else None,
        ptr(cap_pages) if cap_pages is not None else None, torch.get_num_threads())
    return out if rc == 0 else None
