"""The fast decode path of Nemotron-H (Mamba-2 hybrid): its blocks straight through the
compiled kernels, as ``decode_fast`` does for dense models.

A Nemotron-H block is ``x + mixer(norm(x))`` with one mixer per block. The plan carries the
stream as ``(last mixer output, residual)`` and folds each add into the next norm
(``pf_rms_norm`` with the residual: the sum rounded to bf16 as the module's add rounds it,
then the norm in its float32-weight mode, as ``NemotronHRMSNorm`` computes it). Mixers:

* Mamba-2: ``in_proj``, the conv and SSM update on the states in their pages
  (``pf_mamba2_decode``, the arguments ``cpu_ops.mamba2_decode`` passes), the gated RMSNorm
  module on ``(y, z)``, ``out_proj``;
* attention (no RoPE): ``qkv_proj``, the K/V write and the paged decode attention reading q,
  k and v where they lie in the projection's rows, ``o_proj``;
* MLP: ``up_proj``, the module's own activation (relu^2), ``down_proj``; a MoE block runs its
  own forward.

The same C functions with the same arguments as the module path, in the same order: the
same bits (tested). Steps that take the module path instead: any prefill row, speculative
verify steps, drafts with given initial states, prefix-cache checkpoint captures, states or
caches the kernels do not take, and what ``decode_fast`` excludes (float32, TP, Triton, ...).
"""

from __future__ import annotations

import torch

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.layers import activations
from pagefold.layers.decode_fast import (
    BF16,
    ModuleMlp,
    Norm,
    Step,
    _norm_ok,
    _spec,
    attn_step_usable,
    cache_dyn,
    gemv_ready,
    heads_ok,
    step_possible,
)
from pagefold.layers.decode_fast_hybrid import _state_step, state_dyn
from pagefold.layers.decode_native import NativeBlocks, linears


class _Norm(Norm):
    """A ``NemotronHRMSNorm``: the weight multiply in float32 (the kernel's mode 2)."""

    __slots__ = ()

    def __init__(self, norm) -> None:
        super().__init__(norm)
        self.zc = cpu_ops.NORM_FLOAT_WEIGHT


class Mamba:
    """One Mamba-2 mixer's fixed arguments (weights' pointers and sizes)."""

    __slots__ = ("name", "inp", "out", "mods", "norm", "inter", "C", "K", "H", "Dh", "G", "Ns",
                 "conv_w", "conv_b", "dt_bias", "a_log", "D", "keep")

    def __init__(self, m) -> None:
        c = m.cfg
        self.name, self.norm = m.layer_name, m.norm
        self.mods = (m.in_proj, m.out_proj)
        self.inp, self.out = _spec(m.in_proj), _spec(m.out_proj)
        self.inter, self.C, self.K = c.intermediate, c.conv_dim, c.conv_kernel
        self.H, self.Dh, self.G, self.Ns = c.num_heads, c.head_dim, c.n_groups, c.state_size
        conv_w = m.conv1d.weight.view(c.conv_dim, c.conv_kernel)
        self.conv_w = conv_w.data_ptr()
        self.conv_b = m.conv1d.bias.data_ptr() if m.conv1d.bias is not None else None
        # As cpu_ops.mamba2_decode passes them: float32 copies (taken once here).
        dt_bias = m.dt_bias.detach().float().contiguous()
        D = m.D.detach().float().contiguous()
        self.dt_bias, self.D = dt_bias.data_ptr(), D.data_ptr()
        self.a_log = m.A_log  # -exp(A_log) taken per step: cached on the parameter
        self.keep = [conv_w, m.conv1d.bias, dt_bias, D,
                     *(p for lin in self.mods for p in (lin.weight, lin.bias))]

    @staticmethod
    def ok(m) -> bool:
        """What ``cpu_ops.mamba2_decode`` checks of the weights, once per plan."""
        w, b = m.conv1d.weight, m.conv1d.bias
        return (gemv_ready(m.in_proj) and gemv_ready(m.out_proj) and not m.shared_group
                and w.dtype == torch.bfloat16 and w.is_contiguous()
                and (b is None or (b.dtype == torch.bfloat16 and b.is_contiguous()))
                and m.in_proj.weight.shape[0] == (m.cfg.intermediate + m.cfg.conv_dim
                                                  + m.cfg.num_heads))

    def usable(self, ctx, rows: int) -> bool:
        """This step's states and metadata suit the kernel (checked once per step)."""
        view, meta = ctx.state(self.name)
        found = cpu_ops.state_kernel(view)
        if (found is None or not meta.all_decode or meta.capture_after is not None
                or meta.page_ids.shape[0] != rows):
            return False
        _, conv, ssm, _ = found
        return (conv.dtype == torch.bfloat16 and conv.shape == (self.C, self.K - 1)
                and ssm.dtype == torch.float32 and ssm.shape == (self.H, self.Dh, self.Ns)
                and view.raw.is_contiguous())

    def native(self, hidden: int) -> tuple | None:
        """The ``decode_native`` record, where the gated norm is the kernel's bf16 gate-first
        form (what ``GatedRMSNorm`` runs on these rows)."""
        lin = linears(self.inp, self.out, hidden, self.inter)
        n = self.norm
        if (lin is None or n.norm_before_gate or n.spans_ranks
                or n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous()):
            return None
        return "mamba2", {
            **lin, "conv_dim": self.C, "conv_k": self.K, "ssm_heads": self.H,
            "ssm_head_dim": self.Dh, "ssm_groups": self.G, "ssm_state": self.Ns,
            "conv_w": self.conv_w, "conv_b": self.conv_b or 0, "dt_bias": self.dt_bias,
            "d_skip": self.D, "gnorm_w": n.weight.data_ptr(), "gnorm_group": n.group_size,
        }, {"eps2": float(n.eps)}

    def native_dyn(self, st: Step) -> list[int]:
        return state_dyn(st, self.name, self.a_log)[0]

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        t = st.t
        proj, rc = st.project(self.inp, self.mods[0], h, "in_proj")
        view, meta = st.ctx.state(self.name)
        s = _state_step(st, meta)
        _, _, _, offs = cpu_ops.state_kernel(view)
        neg_exp = cpu_ops.neg_exp(self.a_log)
        y = st.buf("ssm_y", t, self.inter)
        base, row = proj.data_ptr(), proj.stride(0)
        xbc = base + 2 * self.inter  # in_proj rows: z | xBC | dt (bf16)
        rc |= st.lib.pf_mamba2_decode(
            BF16, view.raw.data_ptr(), view.page_bytes, s[0], s[1], offs["conv"], offs["ssm"],
            s[2], xbc, row, xbc + 2 * self.C, row, self.conv_w, self.conv_b, self.dt_bias,
            neg_exp.data_ptr(), self.D, y.data_ptr(), t, self.C, self.K, self.H, self.Dh,
            self.G, self.Ns, st.nt)
        normed = self.norm(y, proj[:, :self.inter])
        out, r = st.project(self.out, self.mods[1], normed, "mixer_out")
        return out, rc | r


class Attention:
    """Paged attention without RoPE: qkv, K/V write, decode attention, o."""

    __slots__ = ("name", "qkv", "o", "H", "KVH", "D", "q_size", "kv_size", "scale", "mods",
                 "keep")

    def __init__(self, a) -> None:
        self.name = a.layer_name
        self.mods = (a.qkv_proj, a.o_proj)
        self.qkv, self.o = _spec(a.qkv_proj), _spec(a.o_proj)
        self.H, self.KVH, self.D = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size, self.scale = a.q_size, a.kv_size, float(a.scale)
        self.keep = [p for lin in self.mods for p in (lin.weight, lin.bias)]

    @staticmethod
    def ok(a, lib) -> bool:
        return (a.rotary is None and a.q_norm is None and a.k_norm is None
                and gemv_ready(a.qkv_proj) and gemv_ready(a.o_proj) and heads_ok(a, lib))

    def usable(self, ctx, rows: int, max_block: int) -> bool:
        return attn_step_usable(ctx, self.name, rows, max_block)

    def native(self, hidden: int) -> tuple | None:
        """The ``decode_native`` record: no q/k norm, no RoPE (``rot`` 0)."""
        lin = linears(self.qkv, self.o, hidden, self.H * self.D)
        if lin is None:
            return None
        return "attention", {**lin, "heads": self.H, "kv_heads": self.KVH, "head_dim": self.D,
                             "q_size": self.q_size, "kv_size": self.kv_size}, {
                                 "scale": self.scale}

    def native_dyn(self, st: Step) -> list[int]:
        return cache_dyn(st, self.name)

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        lib, t = st.lib, st.t
        g = st.attn_group(self.name)
        kv_cache = st.ctx.cache.attn[self.name]
        qkv, rc = st.project(self.qkv, self.mods[0], h, "qkv")
        base, row = qkv.data_ptr(), qkv.stride(0)
        k = base + 2 * self.q_size
        rc |= lib.pf_write_kv(BF16, k, k + 2 * self.kv_size, row, row, g[4],
                              kv_cache.data_ptr(), t, self.KVH, self.D)
        o = st.buf("o", t, self.H, self.D)
        rc |= lib.pf_decode_attention(
            BF16, base, row, None, kv_cache.data_ptr(), g[0], g[1], g[2], g[3], o.data_ptr(),
            o.stride(0), g[5], self.H, self.KVH, self.D, kv_cache.shape[1], self.scale, st.nt)
        out, r = st.project(self.o, self.mods[1], o.view(t, self.H * self.D), "mixer_out")
        return out, rc | r


class Mlp:
    """``down(act(up(x)))`` of an ``UngatedMLP``, the activation the module's own."""

    __slots__ = ("up", "down", "act", "mods", "keep")

    def __init__(self, m) -> None:
        self.mods = (m.up_proj, m.down_proj)
        self.up, self.down, self.act = _spec(m.up_proj), _spec(m.down_proj), m.act
        self.keep = [p for lin in self.mods for p in (lin.weight, lin.bias)]

    @staticmethod
    def ok(m) -> bool:
        return gemv_ready(getattr(m, "up_proj", None)) and gemv_ready(getattr(m, "down_proj",
                                                                              None))

    def native(self, hidden: int) -> tuple | None:
        """The ``decode_native`` record, for relu^2 (``pf_relu2`` rounds as torch does)."""
        lin = linears(self.up, self.down, hidden, self.up[2])
        if lin is None or self.act is not activations._relu2:
            return None
        return "mlp_relu2", lin, {}

    def native_dyn(self, st: Step) -> list[int]:
        return []

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        u, rc = st.project(self.up, self.mods[0], h, "up")
        out, r = st.project(self.down, self.mods[1], self.act(u))
        return out, rc | r


def _part(block, lib):
    """The block's mixer part, or None when the kernels cannot take it."""
    m = block.mixer
    if block.kind == "mamba":
        return Mamba(m) if Mamba.ok(m) else None
    if block.kind == "attention":
        return Attention(m) if Attention.ok(m, lib) else None
    if block.kind == "mlp":
        return Mlp(m) if Mlp.ok(m) else None
    return ModuleMlp(m)


class NemotronHPlan:
    """The fixed part of a Nemotron-H model's fast decode path, or unusable (``ok`` False)."""

    def __init__(self, blocks, norm_f) -> None:
        lib = cpu_ops.kernels()
        self.lib = lib
        parts = [_part(b, lib) for b in blocks] if lib is not None else []
        self.ok = bool(lib is not None and tp_size() == 1 and len(blocks) > 0
                       and all(p is not None for p in parts)
                       and all(_norm_ok(b.norm) for b in blocks) and _norm_ok(norm_f))
        self.norms = [_Norm(b.norm) for b in blocks] if self.ok else []
        self.parts = parts if self.ok else []
        self.norm_f = _Norm(norm_f) if self.ok else None
        self.max_block = lib.pf_max_block() if lib is not None else 0
        self.scratch: dict = {}
        self.native = (NativeBlocks(lib, list(zip(self.norms, self.parts, strict=True)),
                                    norm_f.weight.numel()) if self.ok else None)

    def usable(self, x: torch.Tensor, ctx) -> bool:
        """This step can take the fast path (checked once per step)."""
        if not (self.ok and step_possible(x)) or ctx.verify or ctx.initial_states is not None:
            return False
        t = x.shape[0]
        for p in self.parts:
            if isinstance(p, Mamba) and not p.usable(ctx, t):
                return False
            if isinstance(p, Attention) and not p.usable(ctx, t, self.max_block):
                return False
        return True

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """Every block and the final norm on ``x`` (T, hidden) (the embeddings; its storage
        takes the residual stream). ``usable`` must hold."""
        # No RoPE: the step's positions are never read; the token ids stand in for them.
        st = Step(self.lib, x, input_ids, ctx, self.scratch)
        if self.native is not None and self.native.usable(x, None, st.small):
            out, residual = self.native.forward(st, x, ctx, None)  # the same calls, from C
        else:
            out, residual = x, None
            for norm, part in zip(self.norms, self.parts, strict=True):
                h, residual, rc = norm.run(st, out, residual)
                out, r = part.run(st, h)
                if rc | r:
                    raise RuntimeError("a CPU kernel refused checked inputs in a Nemotron-H "
                                       "block")
        h, _, rc = self.norm_f.run(st, out, residual, tag=None)  # leaves the plan: fresh
        if rc:
            raise RuntimeError("a CPU kernel refused checked inputs in the final norm")
        return h
