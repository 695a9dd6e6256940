"""Gated DeltaNet (the gated delta rule with its depthwise conv): the one entry models call.

:func:`gdn_mixer` owns the choice of route for a layer's step over its pages:

* ``PAGEFOLD_KERNELS`` selects Triton for the device (:mod:`pagefold.kernels.dispatch`): the
  paged kernels of :mod:`.triton` (the token loop for decode batches, the chunked WY form
  for prefill chunks and in-step checkpoint captures; a verify step keeps every token's
  state and only reads the pages);
* else the compiled CPU layer (:mod:`.cpu`, ``csrc/gdn.cpp``) where it takes the inputs;
* else the torch forms of :mod:`.reference` on states gathered from the pages: the per-token
  (verify) form, the recurrent form for decode, the chunked form for prefill chunks.

The torch forms (``gdn_naive`` the reference) are re-exported for tests and benchmarks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.kernels import dispatch
from pagefold.ops.conv1d import causal_conv1d, causal_conv1d_state_at
from pagefold.ops.gdn import cpu
from pagefold.ops.gdn.reference import (
    GDN_KERNELS,
    gdn_chunked,
    gdn_naive,
    gdn_recurrent,
    gdn_verify,
    gdn_verify_naive,
    l2norm,
    torch_chunk_size,
)

__all__ = ["GDN_KERNELS", "gdn_chunked", "gdn_mixer", "gdn_naive", "gdn_recurrent",
           "gdn_verify", "gdn_verify_naive", "l2norm"]


def _paged(ctx, layer_name: str, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
           heads: dict) -> torch.Tensor | None:
    """The routes on the states in their pages (Triton or compiled); None: the torch route."""
    view, meta = ctx.state(layer_name)
    after = meta.capture_after
    capture = None if after is None else (after, meta.capture_pages)
    if dispatch.use_triton(mixed.device):
        from pagefold.ops.gdn import triton as gdn_triton  # imports triton: only when chosen

        if not ctx.verify:
            return gdn_triton.gdn_layer(view, meta.page_ids, meta.has_initial_state,
                                        meta.cu_seqlens, mixed, a, b, conv_weight, A_log,
                                        dt_bias, **heads, capture=capture)
        initial = (ctx.initial_states or {}).get(layer_name)
        res = gdn_triton.gdn_verify_layer(
            view, meta.page_ids, None if initial is not None else meta.has_initial_state,
            meta.cu_seqlens, mixed, a, b, conv_weight, A_log, dt_bias, **heads,
            initial=initial)
        if res is None:
            return None
        ctx.store_token_states(layer_name, res[1])
        return res[0]
    if ctx.verify:
        return None
    return cpu.gdn_layer(view, meta.page_ids, meta.has_initial_state, meta.cu_seqlens, mixed,
                         a, b, conv_weight, A_log, dt_bias, **heads, capture=capture)


def gdn_mixer(ctx, layer_name: str, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
              conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              num_k_heads: int, num_v_heads: int, head_k_dim: int,
              head_v_dim: int) -> torch.Tensor:
    """A GDN layer's step: the conv (SiLU) of ``mixed`` (T, conv_dim) = ``[q | k | v]``, the
    gates ``g = -exp(A_log) softplus(a + dt_bias)`` (float32), ``beta = sigmoid(b)`` and the
    delta rule (q/k L2-normalised, ``Dk ** -0.5``) over the layer's states in ``ctx`` (a
    :class:`~pagefold.executor.forward_context.ForwardContext`: states, captures, verify).
    Returns o (T, Hv, Dv) in mixed's dtype; the states (checkpoints, or a verify step's
    per-token states) are stored through ``ctx``."""
    heads = dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                 head_v_dim=head_v_dim)
    o = _paged(ctx, layer_name, mixed, a, b, conv_weight, A_log, dt_bias, heads)
    if o is not None:
        return o
    meta = ctx.state(layer_name)[1]
    after = meta.capture_after
    states = ctx.load_states(layer_name)
    t = mixed.shape[0]
    capture, conv_ck = None, None
    if after is not None:
        conv_ck = causal_conv1d_state_at(mixed, states["conv"], meta.cu_seqlens, after)
        capture = (after, torch.empty((after.shape[0], *states["ssm"].shape[1:]),
                                      dtype=torch.float32, device=mixed.device))
    # State after every token in a verify step: the commit selects the accepted one.
    mixed, conv_state = causal_conv1d(mixed, conv_weight, None, states["conv"],
                                      meta.cu_seqlens, "silu", decode=meta.all_decode,
                                      verify=ctx.verify)
    kd = num_k_heads * head_k_dim
    q, k, v = mixed.split([kd, kd, num_v_heads * head_v_dim], dim=-1)
    rep = num_v_heads // num_k_heads
    q = q.reshape(t, num_k_heads, head_k_dim)
    k = k.reshape(t, num_k_heads, head_k_dim)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    v = v.reshape(t, num_v_heads, head_v_dim)
    beta = b.sigmoid()
    # float32 like transformers: in half precision exp(A_log) could overflow.
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if ctx.verify:
        o, ssm_state = gdn_verify(q, k, v, g, beta, states["ssm"], meta.cu_seqlens,
                                  use_qk_l2norm=True)
        ctx.store_token_states(layer_name, {"conv": conv_state, "ssm": ssm_state})
        return o
    if meta.all_decode:
        o, ssm_state = gdn_recurrent(q, k, v, g, beta, states["ssm"], meta.cu_seqlens,
                                     use_qk_l2norm=True, capture=capture)
    else:
        o, ssm_state = gdn_chunked(q, k, v, g, beta, states["ssm"], meta.cu_seqlens,
                                   use_qk_l2norm=True,
                                   chunk_size=torch_chunk_size(meta.cu_seqlens),
                                   capture=capture)
    ctx.store_states(layer_name, {"conv": conv_state, "ssm": ssm_state})
    if capture is not None:
        ctx.store_checkpoints(layer_name, {"conv": conv_ck, "ssm": capture[1]})
    return o
