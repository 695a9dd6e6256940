"""The fast decode path of Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): GDN and gated
attention layers straight through the compiled kernels, as ``decode_fast`` does for dense
models.

A GDN layer's decode step is: the zero-centred input norm (with the residual add), ``in_proj``,
the conv and delta rule on the states in their pages (``pf_gdn``), the gated RMSNorm of the
output with ``z``, ``out_proj``; a gated attention layer's is the dense plan's attention with
the ``[query | gate]`` q rows and the sigmoid gate; each is followed by the post-attention
norm and the MLP (the gated SiLU MLP through the kernels, any other block, e.g. a sparse MoE,
through its own forward). The same C functions with the same arguments as the module path,
in the same order: the same bits (tested).

Steps that take the module path instead: any prefill row, speculative verify steps (the GDN
layers keep every token's state), drafts with given initial states, prefix-cache checkpoint
captures inside the step, states the kernel does not take, and what ``decode_fast`` excludes.
"""

from __future__ import annotations

import torch

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.layers.decode_fast import (
    BF16,
    Attention,
    Norm,
    Step,
    _norm_ok,
    _spec,
    gemv_ready,
    mlp_part,
    step_possible,
)
from pagefold.layers.decode_native import NativeBlocks, linears

_STATE_CODE = {torch.float32: 0, torch.bfloat16: 1}


class Gdn:
    """One Gated DeltaNet mixer's fixed arguments (weights' pointers and sizes)."""

    __slots__ = ("name", "inp", "out", "mods", "C", "V", "K", "Hk", "Hv", "Dk", "Dv", "scale",
                 "conv_w", "dt_bias", "a_log", "norm_w", "norm_eps", "keep")

    def __init__(self, g) -> None:
        self.name = g.layer_name
        self.mods = (g.in_proj, g.out_proj)
        self.inp, self.out = _spec(g.in_proj), _spec(g.out_proj)
        self.C, self.V, self.K = g.conv_dim, g.value_dim, g.kernel
        self.Hk, self.Hv, self.Dk, self.Dv = (g.num_k_heads, g.num_v_heads, g.head_k_dim,
                                              g.head_v_dim)
        self.scale = float(g.head_k_dim**-0.5)
        conv_w = g.conv1d.weight.view(g.conv_dim, g.kernel)
        self.conv_w, self.dt_bias = conv_w.data_ptr(), g.dt_bias.data_ptr()
        self.a_log = g.A_log  # -exp(A_log) taken per step: cached on the parameter
        self.norm_w, self.norm_eps = g.norm.weight.data_ptr(), float(g.norm.eps)
        self.keep = [conv_w, g.dt_bias, g.norm.weight,
                     *(p for lin in self.mods for p in (lin.weight, lin.bias))]

    @staticmethod
    def ok(g, lib) -> bool:
        """What ``cpu_ops.gdn`` and ``rms_norm_gated`` check of the weights, once per plan."""
        w = g.conv1d.weight
        return (gemv_ready(g.in_proj) and gemv_ready(g.out_proj)
                and g.in_proj.weight.shape[0] == g.conv_dim + g.value_dim + 2 * g.num_v_heads
                and w.dtype == torch.bfloat16 and w.is_contiguous() and g.conv1d.bias is None
                and g.dt_bias.dtype == torch.bfloat16 and g.dt_bias.is_contiguous()
                and g.head_k_dim <= lib.pf_max_head_dim() and g.kernel >= 2
                and _norm_ok(g.norm) and g.norm.weight.numel() == g.head_v_dim)

    def usable(self, ctx) -> bool:
        """This step's states and metadata suit the kernel (checked once per step)."""
        view, meta = ctx.state(self.name)
        found = cpu_ops.state_kernel(view)
        if found is None or not meta.all_decode or meta.capture_after is not None:
            return False
        _, conv, ssm, _ = found
        return (conv.dtype == torch.bfloat16 and conv.shape == (self.C, self.K - 1)
                and ssm.dtype in _STATE_CODE and ssm.shape == (self.Hv, self.Dk, self.Dv)
                and view.raw.is_contiguous())

    def native(self, hidden: int) -> tuple | None:
        """The ``decode_native`` record."""
        lin = linears(self.inp, self.out, hidden, self.V)
        if lin is None:
            return None
        return "gdn", {
            **lin, "conv_dim": self.C, "conv_k": self.K, "ssm_heads": self.Hv,
            "ssm_head_dim": self.Dv, "k_heads": self.Hk, "k_head_dim": self.Dk,
            "conv_w": self.conv_w, "dt_bias": self.dt_bias, "gnorm_w": self.norm_w,
        }, {"eps2": self.norm_eps, "scale": self.scale}

    def native_dyn(self, st: Step) -> list[int]:
        """:func:`state_dyn`, then cu_seqlens, requests and the ssm state's dtype code."""
        vals, s, ssm = state_dyn(st, self.name, self.a_log)
        return vals + [s[3], s[4], _STATE_CODE[ssm.dtype]]

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        lib, t = st.lib, st.t
        proj, rc = st.project(self.inp, self.mods[0], h, "in_proj")
        view, meta = st.ctx.state(self.name)
        s = _state_step(st, meta)
        _, _, ssm, offs = cpu_ops.state_kernel(view)
        neg_exp = cpu_ops.neg_exp(self.a_log)
        o = st.buf("gdn", t, self.Hv, self.Dv)
        base, row = proj.data_ptr(), proj.stride(0)
        b_ptr = base + 2 * (self.C + self.V)  # in_proj rows: mixed | z | b | a (bf16)
        rc |= lib.pf_gdn(
            BF16, _STATE_CODE[ssm.dtype], view.raw.data_ptr(), view.page_bytes, s[0], s[1],
            offs["conv"], offs["ssm"], s[2], s[3], base, row, b_ptr + 2 * self.Hv, b_ptr, row,
            self.conv_w, neg_exp.data_ptr(), self.dt_bias, o.data_ptr(), s[4], self.C, self.K,
            self.Hk, self.Hv, self.Dk, self.Dv, self.scale, None, None, None, st.nt)
        normed = st.buf("gdn_normed", t, self.Hv, self.Dv)
        rc |= lib.pf_rms_norm_gated(BF16, o.data_ptr(), self.Hv * self.Dv, self.Dv,
                                    base + 2 * self.C, row, self.Dv, self.norm_w,
                                    normed.data_ptr(), t, self.Hv, self.Dv, self.norm_eps,
                                    st.nt)
        out, r = st.project(self.out, self.mods[1], normed.view(t, self.V), "mixer_out")
        return out, rc | r


def state_dyn(st: Step, name: str, a_log) -> tuple[list[int], tuple, torch.Tensor]:
    """A state layer's per-step ``decode_native`` values as its kernel call passes them (the
    state pool, page bytes, pages, pages per state, conv and ssm offsets, fresh flags,
    ``-exp(A_log)``), with the step's :func:`_state_step` tuple and the ssm component."""
    view, meta = st.ctx.state(name)
    s = _state_step(st, meta)
    _, _, ssm, offs = cpu_ops.state_kernel(view)
    return ([view.raw.data_ptr(), view.page_bytes, s[0], s[1], offs["conv"], offs["ssm"],
             s[2] or 0, cpu_ops.neg_exp(a_log).data_ptr()], s, ssm)


def _state_step(st: Step, meta) -> tuple:
    """A state group's per-step pointers, once per step: (pages, pages per state, fresh
    flags or None, cu_seqlens, requests)."""
    key = ("state", id(meta))
    s = st.groups.get(key)
    if s is None:
        pages = meta.page_ids.contiguous()
        cu = meta.cu_seqlens.to(torch.int64).contiguous()
        fresh = cpu_ops.fresh_flags(meta.has_initial_state)
        st.keep += [pages, cu, fresh]
        s = st.groups[key] = (pages.data_ptr(), pages.shape[1],
                              fresh.data_ptr() if fresh is not None else None, cu.data_ptr(),
                              pages.shape[0])
    return s


class _HybridLayer:
    __slots__ = ("name", "norm_in", "norm_post", "mixer", "mlp")

    def __init__(self, layer) -> None:
        self.norm_in = Norm(layer.input_layernorm)
        self.norm_post = Norm(layer.post_attention_layernorm)
        if layer.layer_type == "linear_attention":
            self.mixer = Gdn(layer.linear_attn)
        else:
            self.mixer = Attention(layer.self_attn, gated=True)
        self.name = self.mixer.name
        self.mlp = mlp_part(layer.mlp)


def _hybrid_ok(layer, lib) -> bool:
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(_norm_ok(n) for n in norms):
        return False
    if layer.layer_type == "linear_attention":
        return Gdn.ok(layer.linear_attn, lib)
    return layer.layer_type == "full_attention" and Attention.ok(layer.self_attn, lib)


class HybridPlan:
    """The fixed part of a GDN hybrid's fast decode path, or unusable (``ok`` False)."""

    def __init__(self, layers) -> None:
        lib = cpu_ops.kernels()
        self.lib = lib
        self.ok = bool(lib is not None and tp_size() == 1 and len(layers) > 0
                       and all(_hybrid_ok(la, lib) for la in layers))
        self.layers = [_HybridLayer(la) for la in layers] if self.ok else []
        self.max_block = lib.pf_max_block() if lib is not None else 0
        self.scratch: dict = {}
        blocks = [b for la in self.layers for b in ((la.norm_in, la.mixer), (la.norm_post, la.mlp))]
        self.native = (NativeBlocks(lib, blocks, layers[0].input_layernorm.weight.numel())
                       if self.ok else None)

    def usable(self, x: torch.Tensor, ctx) -> bool:
        """This step can take the fast path (checked once per step)."""
        if not (self.ok and step_possible(x)) or ctx.verify or ctx.initial_states is not None:
            return False
        t = x.shape[0]
        for la in self.layers:
            m = la.mixer
            if not (m.usable(ctx) if isinstance(m, Gdn) else m.usable(ctx, t, self.max_block)):
                return False
        return True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on ``x`` (T, hidden); returns ``(last MLP output, residual)``, whose
        sum is what the layers' own forwards return. ``usable`` must hold."""
        st = Step(self.lib, x, positions, ctx, self.scratch)
        if self.native is not None and self.native.usable(x, None, st.small):
            return self.native.forward(st, x, ctx, None)  # the same calls, from C
        residual = None
        for la in self.layers:
            h, residual, rc = la.norm_in.run(st, x, residual)
            m_out, r = la.mixer.run(st, h)
            h, residual, r2 = la.norm_post.run(st, m_out, residual)
            x, r3 = la.mlp.run(st, h)
            if rc | r | r2 | r3:
                raise RuntimeError(f"a CPU kernel refused checked inputs in {la.name}")
        return x, residual
