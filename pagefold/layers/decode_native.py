"""A dense model's decode step in one C call (``csrc/decode_step.cpp``, ``pf_dense_decode``).

:class:`~pagefold.layers.decode_fast.DensePlan` calls about ten kernels per layer through
ctypes, and each ctypes call converts its ~12 arguments in ~4-5 us: on a 30-layer model
(SmolLM2-135M) that is ~1.5 ms of a ~15 ms batch-1 step, with the Python around it more.
:class:`NativeDense` packs each layer's fixed arguments (the pointers and sizes the plan's
parts already hold) into one int64 record and its floats into another, once per plan; a step
then passes the rows, positions, each attention group's decode metadata and each layer's cache,
and the C side makes the plan's calls in the plan's order with the plan's arguments. Same
kernels, same arguments: the same bits (``tests/test_decode_native.py``).

Used for the steps whose linears take the GEMV (``Step.small``) with contiguous rows; larger
steps keep the Python plan, whose linears route through each layer's own forward.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagefold.csrc import cpu_ops

# ``PAGEFOLD_NATIVE_DECODE=0`` keeps the Python plan (to compare the two; tests flip this).
ENABLED = os.environ.get("PAGEFOLD_NATIVE_DECODE", "1") != "0"

# The record's fields, in ``decode_step.cpp``'s ``enum Field`` order (checked against the
# library's ``pf_dense_decode_fields`` when a plan is built).
LAYER_FIELDS = (
    "in_norm_w", "in_norm_zc", "post_norm_w", "post_norm_zc",
    "qkv_w", "qkv_b", "qkv_n", "o_w", "o_b",
    "heads", "kv_heads", "head_dim", "q_size", "kv_size", "q_head_stride", "q_norm_w",
    "k_norm_w", "qk_zc", "cos", "sin", "rot", "group",
    "gate_up_w", "gate_up_b", "inter", "down_w", "down_b",
)
LAYER_FLOATS = ("in_eps", "post_eps", "qk_eps", "scale")
GROUP_FIELDS = 6  # Step.attn_group's tuple


def _record(la, hidden: int) -> tuple[dict, tuple] | None:
    """One ``_DenseLayer``'s fields, or None where its shapes are not the driver's (the
    driver takes every linear's input width from the layer: hidden, heads x head_dim, inter)."""
    a, m = la.attn, la.mlp
    qkv_w, qkv_b, qkv_n, qkv_k = a.qkv
    o_w, o_b, o_n, o_k = a.o
    gu_w, gu_b, gu_n, gu_k = m.gu
    dn_w, dn_b, dn_n, dn_k = m.down
    if (qkv_k, o_n, o_k, gu_k, gu_n, dn_n, dn_k) != (
            hidden, hidden, a.H * a.D, hidden, 2 * m.inter, hidden, m.inter) or a.gated:
        return None
    fields = {
        "in_norm_w": la.norm_in.w, "in_norm_zc": la.norm_in.zc,
        "post_norm_w": la.norm_post.w, "post_norm_zc": la.norm_post.zc,
        "qkv_w": qkv_w, "qkv_b": qkv_b or 0, "qkv_n": qkv_n, "o_w": o_w, "o_b": o_b or 0,
        "heads": a.H, "kv_heads": a.KVH, "head_dim": a.D, "q_size": a.q_size,
        "kv_size": a.kv_size, "q_head_stride": a.q_hs, "q_norm_w": a.qw or 0,
        "k_norm_w": a.kw or 0, "qk_zc": a.zc, "cos": a.cos, "sin": a.sin, "rot": a.rot,
        "group": 0, "gate_up_w": gu_w, "gate_up_b": gu_b or 0, "inter": m.inter,
        "down_w": dn_w, "down_b": dn_b or 0,
    }
    return fields, (la.norm_in.eps, la.norm_post.eps, a.qk_eps, a.scale)


class NativeDense:
    """The packed records of a DensePlan's layers, or unusable (``ok`` False: the library
    lacks the driver or a layer's shapes are not the driver's)."""

    def __init__(self, lib, layers: list, hidden: int) -> None:
        self.lib, self.hidden, self.ok = lib, hidden, False
        self.names = [la.attn.name for la in layers]
        fn = getattr(lib, "pf_dense_decode", None) if lib is not None else None
        if fn is None or not layers:
            return
        if lib.pf_dense_decode_fields() != len(LAYER_FIELDS) * 100 + len(LAYER_FLOATS):
            raise RuntimeError("pf_dense_decode's layer record differs from decode_native's")
        recs = [_record(la, hidden) for la in layers]
        if any(r is None for r in recs):
            return
        ints = [r[0][f] for r in recs for f in LAYER_FIELDS]
        self.layers = (ctypes.c_int64 * len(ints))(*ints)
        flts = [v for r in recs for v in r[1]]
        self.floats = (ctypes.c_float * len(flts))(*flts)
        self.stride = len(LAYER_FIELDS)
        self.group_at = LAYER_FIELDS.index("group")
        self.groups_seen: list[int] = [0] * len(layers)
        self.ok = True

    def usable(self, x: torch.Tensor, residual: torch.Tensor | None, small: bool) -> bool:
        return (ENABLED and self.ok and small and x.is_contiguous() and x.shape[1] == self.hidden
                and (residual is None or residual.is_contiguous()))

    def forward(self, st, x: torch.Tensor, ctx, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on ``x`` as ``DensePlan.forward`` would run them (``usable`` holds)."""
        lg, attn = ctx.cache.layer_group, ctx.cache.attn
        gids = [lg[n] for n in self.names]
        if gids != self.groups_seen:  # the runner's cache grouped the layers anew
            for i, g in enumerate(gids):
                self.layers[i * self.stride + self.group_at] = g
            self.groups_seen = gids
        groups = [0] * (GROUP_FIELDS * (max(gids) + 1))
        for g in set(gids):
            groups[g * GROUP_FIELDS:(g + 1) * GROUP_FIELDS] = [
                v or 0 for v in st.attn_group(self.names[gids.index(g)])]
        caches = []
        for n in self.names:
            c = attn[n]
            caches += (c.data_ptr(), c.shape[1])
        out = torch.empty_like(x)
        rc = self.lib.pf_dense_decode(
            self.layers, self.floats, len(self.names), (ctypes.c_int64 * len(caches))(*caches),
            (ctypes.c_int64 * len(groups))(*groups), cpu_ops.gemv_address(),
            x.data_ptr(), residual.data_ptr() if residual is not None else None,
            out.data_ptr(), x.shape[0], x.shape[1], st.pos, st.nt)
        if rc:
            raise RuntimeError("a CPU kernel refused checked inputs in the native decode step")
        return out, (residual if residual is not None else x)
