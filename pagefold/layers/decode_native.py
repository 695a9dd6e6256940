"""A decode step's blocks in one C call (``csrc/decode_step.cpp``, ``pf_blocks_decode``).

The plans of ``decode_fast`` call about ten kernels per layer through ctypes, and each ctypes
call converts its ~12 arguments in ~4-5 us: on a 30-layer model (SmolLM2-135M) that is ~1.5 ms
of a ~15 ms batch-1 step, with the Python around it more. :class:`NativeBlocks` packs each
block's fixed arguments (the pointers and sizes the plan's parts already hold) into one int64
record and its floats into another, once per plan; a step then passes the rows, positions,
each attention group's decode metadata and each block's per-step values (a KV cache, a state
pool's pages), and the C side makes the plan's calls in the plan's order with the plan's
arguments. Same kernels, same arguments: the same bits (``tests/layers/test_decode_fast.py``
runs every plan with this on and off).

A block is ``part(norm(x + residual))``; a plan part that can run natively has
``native() -> (kind, ints, floats) | None`` and ``native_dyn(step) -> [ints]``. Dense layers are
two blocks (attention, gated MLP), Qwen3.5's and Qwen3-Next's two (GDN or gated attention,
gated MLP or sparse MoE), Nemotron-H's one (Mamba-2, attention or relu^2 MLP). Used
for the steps whose linears take the GEMV (``Step.small``) with contiguous rows; larger steps
keep the Python plan, whose linears route through each layer's own forward.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagefold.csrc import cpu_ops

# ``PAGEFOLD_NATIVE_DECODE=0`` keeps the Python plans (to compare the two; tests flip this).
ENABLED = os.environ.get("PAGEFOLD_NATIVE_DECODE", "1") != "0"

# decode_step.cpp's enum Kind, Field, FloatField and Dyn, in order (checked against the
# library's ``pf_blocks_decode_fields`` when a plan is built).
KINDS = {"attention": 1, "mlp_silu": 2, "mlp_relu2": 3, "mamba2": 4, "gdn": 5, "moe": 6}
FIELDS = (
    "kind", "norm_w", "norm_zc", "w0", "b0", "n0", "w1", "b1", "k1",
    "heads", "kv_heads", "head_dim", "q_size", "kv_size", "q_head_stride", "q_norm_w",
    "k_norm_w", "qk_zc", "cos", "sin", "rot", "group", "gated",
    "conv_dim", "conv_k", "ssm_heads", "ssm_head_dim", "ssm_groups", "ssm_state", "conv_w",
    "conv_b", "dt_bias", "d_skip", "gnorm_w", "gnorm_group", "k_heads", "k_head_dim",
    "top_k", "norm_topk", "experts_gu", "experts_down", "moe_inter", "shared_gu", "shared_down",
    "shared_inter", "shared_gate",
)
FLOATS = ("norm_eps", "eps2", "scale")
DYN = 11
GROUP_FIELDS = 6  # Step.attn_group's tuple


def linears(first: tuple, second: tuple, hidden: int, inner: int) -> dict | None:
    """The record's two linears from ``decode_fast._spec`` tuples, or None unless the first
    maps ``hidden`` -> its outputs and the second ``inner`` -> ``hidden`` (the driver takes
    every linear's input width from the block)."""
    w0, b0, n0, k0 = first
    w1, b1, n1, k1 = second
    if (k0, n1, k1) != (hidden, hidden, inner):
        return None
    return {"w0": w0, "b0": b0 or 0, "n0": n0, "w1": w1, "b1": b1 or 0, "k1": inner}


def _code() -> int:
    return (len(FIELDS) * 100 + len(FLOATS)) * 100 + DYN


class NativeBlocks:
    """The packed records of a plan's ``(norm, part)`` blocks, or unusable (``ok`` False: the
    library lacks the driver or a part cannot run natively)."""

    def __init__(self, lib, blocks: list, hidden: int) -> None:
        self.lib, self.hidden, self.ok = lib, hidden, False
        fn = getattr(lib, "pf_blocks_decode", None) if lib is not None else None
        if fn is None or not blocks:
            return
        if lib.pf_blocks_decode_fields() != _code():
            raise RuntimeError("pf_blocks_decode's block record differs from decode_native's")
        recs = []
        for norm, part in blocks:
            native = getattr(part, "native", None)
            r = native(hidden) if native is not None else None
            if r is None:
                return
            kind, ints, flts = r
            ints = {**ints, "kind": KINDS[kind], "norm_w": norm.w, "norm_zc": norm.zc}
            recs.append((ints, {**flts, "norm_eps": norm.eps}))
        vals = [r[0].get(f, 0) for r in recs for f in FIELDS]
        self.blocks = (ctypes.c_int64 * len(vals))(*vals)
        flts = [float(r[1].get(f, 0.0)) for r in recs for f in FLOATS]
        self.floats = (ctypes.c_float * len(flts))(*flts)
        self.parts = [part for _, part in blocks]
        # Attention blocks: their group field follows the runner's cache grouping.
        self.attn = [(i, p.name) for i, p in enumerate(self.parts)
                     if recs[i][0]["kind"] == KINDS["attention"]]
        self.group_at = FIELDS.index("group")
        self.groups_seen: list[int] = []
        self.ok = True

    def usable(self, x: torch.Tensor, residual: torch.Tensor | None, small: bool) -> bool:
        return (ENABLED and self.ok and small and x.is_contiguous() and x.shape[1] == self.hidden
                and (residual is None or residual.is_contiguous()))

    def _groups(self, st, ctx) -> list[int]:
        """Each attention group's decode metadata (``Step.attn_group``), by group index; the
        records' group fields set anew when the runner's cache grouped the layers anew."""
        if not self.attn:
            return [0] * GROUP_FIELDS
        lg = ctx.cache.layer_group
        gids = [lg[name] for _, name in self.attn]
        if gids != self.groups_seen:
            for (i, _), g in zip(self.attn, gids, strict=True):
                self.blocks[i * len(FIELDS) + self.group_at] = g
            self.groups_seen = gids
        groups = [0] * (GROUP_FIELDS * (max(gids) + 1))
        for g, (_, name) in zip(gids, self.attn, strict=True):
            groups[g * GROUP_FIELDS:(g + 1) * GROUP_FIELDS] = [
                v or 0 for v in st.attn_group(name)]
        return groups

    def forward(self, st, x: torch.Tensor, ctx, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block on ``x`` as the plan's Python loop would run them (``usable`` holds);
        returns ``(last part's output, residual)``."""
        groups = self._groups(st, ctx)
        dyn: list[int] = []
        for p in self.parts:
            d = p.native_dyn(st)
            dyn += d + [0] * (DYN - len(d))
        out = torch.empty_like(x)
        rc = self.lib.pf_blocks_decode(
            self.blocks, self.floats, len(self.parts), (ctypes.c_int64 * len(dyn))(*dyn),
            (ctypes.c_int64 * len(groups))(*groups), cpu_ops.gemv_address(), x.data_ptr(),
            residual.data_ptr() if residual is not None else None, out.data_ptr(), x.shape[0],
            x.shape[1], st.pos, st.nt)
        if rc:
            raise RuntimeError("a CPU kernel refused checked inputs in the native decode step")
        return out, (residual if residual is not None else x)
