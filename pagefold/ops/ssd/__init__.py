"""Mamba-2 state space duality (SSD) scan with its depthwise conv: the one entry models call.

:func:`mamba2_mixer` owns the choice of route for a mixer's step over its pages:

* ``PAGEFOLD_KERNELS`` selects Triton for the device (:mod:`pagefold.kernels.dispatch`): the
  paged conv + scan of :mod:`.triton` (token loop for decode, chunked for prefill chunks
  and in-step checkpoint captures; a verify step keeps every token's state, pages only read);
* else, for a plain CPU decode step, the compiled step on the paged states (:mod:`.cpu`,
  ``csrc/mamba2.cpp``);
* else the torch forms of :mod:`.reference` on states gathered from the pages (the chunked form
  runs the compiled scan, ``csrc/ssd.cpp``, where it takes the inputs): per-token (verify),
  recurrent (decode) or chunked (prefill chunks, checkpoint captures written to their pages).

The torch forms (``ssd_naive`` the reference) are re-exported for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagefold.kernels import dispatch
from pagefold.ops.conv1d import causal_conv1d, causal_conv1d_state_at
from pagefold.ops.ssd import cpu
from pagefold.ops.ssd.reference import (
    SSD_KERNELS,
    SSDKernel,
    ssd_chunked,
    ssd_naive,
    ssd_recurrent,
    ssd_verify,
    ssd_verify_naive,
)

__all__ = ["SSD_KERNELS", "SSDKernel", "mamba2_mixer", "ssd_chunked", "ssd_naive",
           "ssd_recurrent", "ssd_scan", "ssd_verify", "ssd_verify_naive"]


def ssd_scan(*args, decode: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of a step on dense states (``ssd_naive``'s signature): the recurrent form
    for decode (one token per sequence), else the chunked form."""
    return (ssd_recurrent if decode else ssd_chunked)(*args, **kwargs)


def _triton(ctx, layer_name: str, xbc: torch.Tensor, dt: torch.Tensor, conv_weight,
            conv_bias, A: torch.Tensor, D, heads: dict, model_dtype: torch.dtype
            ) -> torch.Tensor | None:
    """The Triton route (``dt`` discretised); None: not addressable, take the torch route."""
    from pagefold.ops.ssd import triton as ssd_triton  # imports triton: only when chosen

    view, meta = ctx.state(layer_name)
    if ctx.verify:
        initial = (ctx.initial_states or {}).get(layer_name)
        res = ssd_triton.mamba_verify_layer(
            view, meta.page_ids, None if initial is not None else meta.has_initial_state,
            meta.cu_seqlens, xbc, conv_weight, conv_bias, dt, A, D, **heads, initial=initial)
        if res is None:
            return None
        ctx.store_token_states(layer_name, res[1])
        return res[0]
    after = meta.capture_after
    # y in the dtype the torch route gives it (see mamba2_mixer).
    return ssd_triton.mamba_scan_layer(
        view, meta.page_ids, meta.has_initial_state, meta.cu_seqlens, xbc, conv_weight,
        conv_bias, dt, A, D, **heads,
        y_dtype=model_dtype if meta.all_decode else torch.float32,
        capture=None if after is None else (after, meta.capture_pages))


def mamba2_mixer(ctx, layer_name: str, xbc: torch.Tensor, dt: torch.Tensor, *,
                 conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                 dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
                 discretize: Callable[[torch.Tensor, bool], torch.Tensor], num_heads: int,
                 head_dim: int, n_groups: int, state_size: int, chunk_size: int,
                 model_dtype: torch.dtype) -> torch.Tensor:
    """A Mamba-2 mixer's step: SiLU(conv(``xbc``)) = ``[x | B | C]``, the time step
    ``discretize(dt, verify)`` (the model's softplus and clamp of the raw ``dt`` (T, H)),
    ``A = -exp(A_log)`` and the SSD scan with the D term over the layer's states in ``ctx``
    (a :class:`~pagefold.executor.forward_context.ForwardContext`: states, captures, verify).
    Returns y (T, H, P) or (T, H * P): in ``model_dtype`` for decode and verify steps, float32
    for prefill chunks (transformers' chunked scan keeps y in float32 up to the gated norm,
    its decode update rounds it first). The states go back through ``ctx``."""
    view, meta = ctx.state(layer_name)
    A = -torch.exp(A_log.float())
    heads = dict(num_heads=num_heads, head_dim=head_dim, n_groups=n_groups,
                 state_size=state_size)
    after = meta.capture_after
    if dispatch.use_triton(xbc.device):
        y = _triton(ctx, layer_name, xbc, discretize(dt, ctx.verify), conv_weight, conv_bias,
                    A, D, heads, model_dtype)
        if y is not None:
            return y
    if (meta.all_decode and not ctx.verify and after is None and xbc.device.type == "cpu"
            and ctx.initial_states is None):
        # Compiled decode step on the states in their pages (no gather / scatter).
        y = cpu.mamba2_decode(view, meta.page_ids, meta.has_initial_state, xbc, dt,
                              conv_weight, conv_bias, dt_bias, A_log, D, **heads)
        if y is not None:
            return y
    states = ctx.load_states(layer_name)
    kernel = ssd_verify if ctx.verify else ssd_recurrent if meta.all_decode else ssd_chunked
    capture, conv_ck, extra, paged = None, None, {}, False
    if after is not None:
        paged = kernel is ssd_chunked
        if paged:  # the varlen conv and the chunked scan write into the checkpoint pages
            conv_ck = (after, view.paged(meta.capture_pages, "conv"))
            capture = (after, view.paged(meta.capture_pages, "ssm"))
        else:
            conv_ck = causal_conv1d_state_at(xbc, states["conv"], meta.cu_seqlens, after)
            capture = (after, torch.empty((after.shape[0], *states["ssm"].shape[1:]),
                                          dtype=torch.float32, device=xbc.device))
        extra["capture"] = capture
    # State after every token in a verify step: the commit selects the accepted one.
    xbc, conv_state = causal_conv1d(xbc, conv_weight, conv_bias, states["conv"],
                                    meta.cu_seqlens, activation="silu",
                                    decode=meta.all_decode, verify=ctx.verify,
                                    capture=conv_ck if paged else None)
    t, inter, gn = xbc.shape[0], num_heads * head_dim, n_groups * state_size
    xs, b, cmat = xbc.split([inter, gn, gn], dim=-1)
    dt = discretize(dt, ctx.verify)
    # Feeding x in the matching dtype makes the kernels return y as described above (a
    # no-op in float32).
    xs = xs.reshape(t, num_heads, head_dim)
    if not meta.all_decode and not ctx.verify:
        xs = xs.float()
    y, ssm_state = kernel(
        xs, dt, A, b.reshape(t, n_groups, state_size), cmat.reshape(t, n_groups, state_size),
        D, states["ssm"].float(), meta.cu_seqlens,
        dt_bias=None, dt_softplus=False, chunk_size=chunk_size, **extra,
    )
    if ctx.verify:
        ctx.store_token_states(layer_name, {"conv": conv_state, "ssm": ssm_state})
    else:
        ctx.store_states(layer_name, {"conv": conv_state, "ssm": ssm_state})
    if capture is not None:
        if paged:  # both components are in the pages: the gaps are left to zero
            ctx.store_checkpoints(layer_name, {}, written=("conv", "ssm"))
        else:
            ctx.store_checkpoints(layer_name, {"conv": conv_ck, "ssm": capture[1]})
    return y
