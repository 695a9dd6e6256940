"""Decode and speculative-verify steps of decoder layers straight through the compiled CPU
kernels: the shared parts, and the plan of dense decoder layers (Llama / Qwen2 / Qwen3).

A decode step of a small model spends as much time in Python as in its kernels: per layer
about ten ``nn.Module`` calls, each kernel wrapper re-checking dtypes, strides and devices,
the dispatch choosing a backend, the forward context looking up its layer. For steps whose
every row is a decode row on the CPU in bf16 with the C++ kernels on, a plan checks all of
that once per model (and the per-step metadata once per step), then calls the same C
functions with the same arguments the wrappers would pass, in the same order: the result is
bit for bit the module path's (tested), with ~10 ctypes calls per layer and little else.

The parts here (:class:`Norm`, :class:`Attention`, :class:`GatedMlp`, :class:`Step`) are the
shelf the plans are built from: :class:`DensePlan` here, the hybrid plans in
``decode_fast_hybrid``. A step qualifies when every row attends as a decode row: plain decode
steps, and the short chunks of speculative verify steps (``input_batch.SHORT_CHUNK_AS_DECODE``),
whose rows each read their request's block table up to their own position. Linears of up to
``GEMV_MAX_ROWS`` rows call the GEMV directly; larger steps call the layer's own ``forward``
(the routing ``cpu_ops.use_fast_linears`` set up), so their bits are the module path's too.
Anything outside those conditions (float32, FP8 KV cache, tensor parallelism, Triton,
prefill rows, more than ``MAX_ROWS`` rows, kernels off) takes the module path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.kernels import dispatch
from pagefold.layers import moe
from pagefold.layers.decode_native import NativeBlocks, linears

BF16 = 1  # cpu_ops' dtype code
# Steps of more rows than this take the module path: by then the linears' time dwarfs the
# Python the plan saves (and a plan step holds every layer's activations of one row set).
MAX_ROWS = 256
MAX_SCRATCH = 64  # scratch tensors a plan keeps (see Step.buf)


def gemv_ready(lin) -> bool:
    """``lin`` is a plain linear whose weights the GEMV takes as they are."""
    ready = getattr(lin, "pf_gemv", None)
    return (type(lin) is torch.nn.Linear and ready is not None and ready[0] is lin.weight
            and ready[1] is lin.bias)


def _spec(lin) -> tuple:
    """(weight pointer, bias pointer or None, out features, in features) of a linear."""
    return (lin.weight.data_ptr(), lin.bias.data_ptr() if lin.bias is not None else None,
            lin.weight.shape[0], lin.weight.shape[1])


def _norm_ok(norm) -> bool:
    return norm.weight.dtype == torch.bfloat16 and norm.weight.is_contiguous()


def heads_ok(a, lib) -> bool:
    """The decode attention kernel takes attention ``a``'s head size and GQA group."""
    return (a.head_dim <= lib.pf_max_head_dim() and a.num_heads % a.num_kv_heads == 0
            and a.num_heads // a.num_kv_heads <= lib.pf_max_group())


def cache_dyn(st: Step, name: str) -> list[int]:
    """An attention block's per-step ``decode_native`` values: its cache and block size."""
    c = st.ctx.cache.attn[name]
    return [c.data_ptr(), c.shape[1]]


def attn_step_usable(ctx, name: str, rows: int, max_block: int) -> bool:
    """Layer ``name``'s cache and this step's metadata suit the decode kernels: a contiguous
    bf16 cache of blocks up to ``max_block`` tokens, every one of ``rows`` a decode row."""
    c = ctx.cache.attn.get(name)
    if c is None or c.dtype != torch.bfloat16 or not c.is_contiguous() or c.shape[1] > max_block:
        return False
    meta = ctx.attn_meta[ctx.cache.layer_group[name]]
    return not meta.prefills and meta.decode_tok.numel() == rows


class Step:
    """One plan step's shared values: the library, threads, the GEMV, positions, and each
    attention group's metadata pointers (looked up once per step)."""

    __slots__ = ("lib", "nt", "gemv", "small", "t", "pos", "ctx", "groups", "keep", "scratch")

    def __init__(self, lib, x: torch.Tensor, positions: torch.Tensor, ctx,
                 scratch: dict | None = None) -> None:
        self.lib, self.nt, self.gemv = lib, torch.get_num_threads(), cpu_ops.gemv_function()
        self.scratch = scratch if scratch is not None else {}
        self.t = x.shape[0]
        self.small = self.t <= cpu_ops.GEMV_MAX_ROWS  # else each linear's routing (same bits)
        positions = positions.contiguous()
        self.pos, self.ctx = positions.data_ptr(), ctx
        self.groups: dict = {}
        self.keep = [positions]  # tensors behind this step's pointers

    def buf(self, tag: str | None, *shape: int) -> torch.Tensor:
        """A bf16 tensor of ``shape`` for one role (``tag``) inside a layer, kept by the plan
        and handed to every layer and step again (``torch.empty`` costs a few microseconds, a
        tenth of a small model's decode layer). A role's tensor is read only before the next
        layer writes the same role, so only temporaries take a tag; what leaves a layer for
        good (an MLP's output, the final norm's) is allocated afresh (``tag`` None)."""
        if tag is None:
            return torch.empty(shape, dtype=torch.bfloat16)
        key = (tag, shape)
        b = self.scratch.get(key)
        if b is None:
            if len(self.scratch) >= MAX_SCRATCH:  # many batch sizes seen: start over
                self.scratch.clear()
            b = self.scratch[key] = torch.empty(shape, dtype=torch.bfloat16)
        return b

    def project(self, spec: tuple, mod, inp: torch.Tensor, tag: str | None = None
                ) -> tuple[torch.Tensor, int]:
        """One linear on ``inp`` (rows, in): the GEMV on the weight's pointers (``spec`` =
        weight, bias, out, in) when the step is small enough for it, else the layer's own
        forward (the routing ``use_fast_linears`` set up). Returns (output, rc); the output
        is the ``tag`` scratch tensor (see :meth:`buf`) on the GEMV path."""
        if not self.small:
            return mod.forward(inp), 0
        w, b, n, k = spec
        t = inp.shape[0]
        out = self.buf(tag, t, n)
        return out, self.gemv(inp.data_ptr(), inp.stride(0), w, b, out.data_ptr(), n, t, n, k,
                              self.nt)

    def attn_group(self, name: str) -> tuple:
        """The decode metadata pointers of ``name``'s attention group: (tables, table stride,
        seq_lens, kv starts or None, slots, rows)."""
        gi = self.ctx.cache.layer_group[name]
        g = self.groups.get(gi)
        if g is None:
            meta = self.ctx.attn_meta[gi]
            tables = meta.decode_tables.contiguous()
            seq_lens = meta.decode_seq_lens.contiguous()
            kvs = meta.decode_kv_start
            kvs = kvs.contiguous() if kvs is not None else None
            slots = meta.slot_mapping.contiguous()
            self.keep += [tables, seq_lens, kvs, slots]
            g = self.groups[gi] = (tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                                   kvs.data_ptr() if kvs is not None else None,
                                   slots.data_ptr(), seq_lens.shape[0])
        return g


class Norm:
    """An RMSNorm's fixed arguments; ``run`` adds the residual first when there is one."""

    __slots__ = ("w", "eps", "zc", "keep")

    def __init__(self, norm) -> None:
        self.w, self.eps = norm.weight.data_ptr(), float(norm.eps)
        self.zc = int(bool(getattr(norm, "zero_centered", False)))
        self.keep = norm.weight

    def run(self, st: Step, x: torch.Tensor, residual: torch.Tensor | None,
            tag: str | None = "h") -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(norm(x + residual), x + residual, rc)``; the sum goes into ``residual``'s
        storage, rounded as a separate add (the first layer: residual None, ``x`` itself).
        The normed rows are the ``tag`` scratch tensor (None: a fresh one)."""
        t, d = x.shape
        h = st.buf(tag, t, d)
        if residual is None:
            rc = st.lib.pf_rms_norm(BF16, x.data_ptr(), x.stride(0), None, 0, self.w,
                                    h.data_ptr(), d, t, d, self.eps, self.zc, st.nt)
            return h, x, rc
        rc = st.lib.pf_rms_norm(BF16, x.data_ptr(), x.stride(0), residual.data_ptr(),
                                residual.stride(0), self.w, h.data_ptr(), d, t, d, self.eps,
                                self.zc, st.nt)
        return h, residual, rc


class Attention:
    """Paged attention of one layer: qkv, q/k norm + RoPE, K/V write, decode attention, an
    optional sigmoid output gate, o. ``gated``: the q rows hold per head ``[query | gate]``
    (Qwen3.5 / Qwen3-Next), the output is ``attn * sigmoid(gate)`` before ``o_proj``."""

    __slots__ = ("name", "qkv", "o", "H", "KVH", "D", "q_size", "kv_size", "q_hs", "qw", "kw",
                 "qk_eps", "zc", "cos", "sin", "rot", "scale", "gated", "mods", "keep")

    def __init__(self, a, gated: bool = False) -> None:
        self.name = a.layer_name
        self.mods = (a.qkv_proj, a.o_proj)  # steps of more than GEMV_MAX_ROWS rows
        self.qkv, self.o = _spec(a.qkv_proj), _spec(a.o_proj)
        self.H, self.KVH, self.D = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size, self.gated = a.q_size, a.kv_size, gated
        self.q_hs = 2 * a.head_dim if gated else a.head_dim
        self.qw = a.q_norm.weight.data_ptr() if a.q_norm is not None else None
        self.kw = a.k_norm.weight.data_ptr() if a.k_norm is not None else None
        self.qk_eps = float(a.q_norm.eps) if a.q_norm is not None else 0.0
        self.zc = int(bool(a.q_norm is not None and a.q_norm.zero_centered))
        self.cos, self.sin = a.rotary.cos.data_ptr(), a.rotary.sin.data_ptr()
        self.rot = a.rotary.cos.shape[1]
        self.scale = float(a.scale)
        # The tensors behind the pointers stay alive (and identical) while the plan is used.
        self.keep = [a.rotary.cos, a.rotary.sin,
                     *(n.weight for n in (a.q_norm, a.k_norm) if n is not None),
                     *(p for lin in self.mods for p in (lin.weight, lin.bias))]

    @staticmethod
    def ok(a, lib) -> bool:
        """The kernels take this layer as it is (checked once per plan)."""
        qk = [n for n in (a.q_norm, a.k_norm) if n is not None]
        rot = a.rotary.cos.shape[1] if a.rotary is not None else 0
        return (a.rotary is not None and gemv_ready(a.qkv_proj) and gemv_ready(a.o_proj)
                and all(_norm_ok(n) and n.weight.numel() == a.head_dim for n in qk)
                and len({bool(n.zero_centered) for n in qk}) <= 1
                and a.rotary.cos.dtype == torch.float32 and a.rotary.cos.is_contiguous()
                and a.rotary.sin.is_contiguous() and 0 < rot <= a.head_dim and rot % 2 == 0
                and heads_ok(a, lib))

    def usable(self, ctx, rows: int, max_block: int) -> bool:
        """This step's cache and metadata suit the kernels (checked once per step)."""
        return attn_step_usable(ctx, self.name, rows, max_block)

    def native(self, hidden: int) -> tuple | None:
        """The ``decode_native`` record."""
        lin = linears(self.qkv, self.o, hidden, self.H * self.D)
        if lin is None:
            return None
        return "attention", {
            **lin, "heads": self.H, "kv_heads": self.KVH, "head_dim": self.D,
            "q_size": self.q_size, "kv_size": self.kv_size, "q_head_stride": self.q_hs,
            "q_norm_w": self.qw or 0, "k_norm_w": self.kw or 0, "qk_zc": self.zc,
            "cos": self.cos, "sin": self.sin, "rot": self.rot, "gated": int(self.gated),
        }, {"eps2": self.qk_eps, "scale": self.scale}

    def native_dyn(self, st: Step) -> list[int]:
        return cache_dyn(st, self.name)

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        lib, t = st.lib, st.t
        g = st.attn_group(self.name)
        kv_cache = st.ctx.cache.attn[self.name]
        qkv, rc = st.project(self.qkv, self.mods[0], h, "qkv")
        q = st.buf("q", t, self.H, self.D)
        kk = st.buf("k", t, self.KVH, self.D)
        rc |= lib.pf_qk_norm_rope(BF16, qkv.data_ptr(), qkv.stride(0), 0, self.q_hs,
                                  self.q_size, st.pos, self.cos, self.sin, self.rot, self.qw,
                                  self.kw, self.qk_eps, self.zc, q.data_ptr(), kk.data_ptr(), t,
                                  self.H, self.KVH, self.D, st.nt)
        v = qkv[:, self.q_size + self.kv_size:]
        rc |= lib.pf_write_kv(BF16, kk.data_ptr(), v.data_ptr(), kk.stride(0), v.stride(0),
                              g[4], kv_cache.data_ptr(), t, self.KVH, self.D)
        o = st.buf("o", t, self.H, self.D)
        rc |= lib.pf_decode_attention(
            BF16, q.data_ptr(), q.stride(0), None, kv_cache.data_ptr(), g[0], g[1], g[2], g[3],
            o.data_ptr(), o.stride(0), g[5], self.H, self.KVH, self.D, kv_cache.shape[1],
            self.scale, st.nt)
        if self.gated:  # as the module (attention_gate): o * sigmoid(gate), in place
            rc |= lib.pf_sigmoid_gate(BF16, o.data_ptr(), o.stride(0), qkv.data_ptr() + 2 * self.D,
                                      qkv.stride(0), 2 * self.D, o.data_ptr(), o.stride(0), t,
                                      self.H, self.D, st.nt)
        out, r = st.project(self.o, self.mods[1], o.view(t, self.H * self.D), "mixer_out")
        return out, rc | r


class GatedMlp:
    """``down(silu(gate(x)) * up(x))`` of a :class:`~pagefold.layers.mlp.GatedMLP`."""

    __slots__ = ("gu", "down", "inter", "mods", "keep")

    def __init__(self, m) -> None:
        self.mods = (m.gate_up_proj, m.down_proj)
        self.gu, self.down = _spec(m.gate_up_proj), _spec(m.down_proj)
        self.inter = m.inter
        self.keep = [p for lin in self.mods for p in (lin.weight, lin.bias)]

    @staticmethod
    def ok(m) -> bool:
        return (getattr(m, "act", None) is F.silu and gemv_ready(getattr(m, "gate_up_proj", None))
                and gemv_ready(getattr(m, "down_proj", None)))

    def native(self, hidden: int) -> tuple | None:
        lin = linears(self.gu, self.down, hidden, self.inter)
        if lin is None or lin["n0"] != 2 * self.inter:
            return None
        return "mlp_silu", lin, {}

    def native_dyn(self, st: Step) -> list[int]:
        return []

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        gu, rc = st.project(self.gu, self.mods[0], h, "gate_up")
        act = st.buf("act", st.t, self.inter)
        rc |= st.lib.pf_silu_mul(BF16, gu.data_ptr(), gu.stride(0), act.data_ptr(), st.t,
                                 self.inter, st.nt)
        out, r = st.project(self.down, self.mods[1], act)
        return out, rc | r


class ModuleMlp:
    """Any other MLP (e.g. a sparse MoE block): its own forward, as the module path calls it.
    A :class:`~pagefold.layers.moe.SparseMoeBlock` also runs natively (``native``): the
    router's GEMV, ``pf_moe_route``, ``pf_moe_experts_few``, the shared expert and its gate,
    ``pf_moe_shared_add``: the kernels its forward calls on such rows."""

    __slots__ = ("mod",)

    def __init__(self, m) -> None:
        self.mod = m

    def native(self, hidden: int) -> tuple | None:
        m = self.mod
        if not isinstance(m, moe.SparseMoeBlock) or not _moe_native_ok(m, hidden):
            return None
        ex, sh, gate = m.experts, m.shared_expert, m.shared_expert_gate
        return "moe", {
            "w0": m.gate.weight.data_ptr(), "n0": ex.num_experts, "top_k": m.top_k,
            "norm_topk": int(m.norm_topk_prob), "experts_gu": ex.gate_up_proj.data_ptr(),
            "experts_down": ex.down_proj.data_ptr(), "moe_inter": ex.inter,
            "shared_gu": sh.gate_up_proj.weight.data_ptr() if sh is not None else 0,
            "shared_down": sh.down_proj.weight.data_ptr() if sh is not None else 0,
            "shared_inter": sh.inter if sh is not None else 0,
            "shared_gate": gate.weight.data_ptr() if gate is not None else 0,
        }, {}

    def native_dyn(self, st: Step) -> list[int]:
        return []

    def run(self, st: Step, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.mod(h), 0


def _moe_native_ok(m, hidden: int) -> bool:
    """The kernels take this MoE block's weights as its forward would (GEMV-routed linears
    without biases, bf16 stacked experts through ``pf_moe_experts_few``)."""
    ex, sh, gate = m.experts, m.shared_expert, m.shared_expert_gate
    lins = [m.gate, *((sh.gate_up_proj, sh.down_proj) if sh is not None else ()),
            *((gate,) if gate is not None else ())]
    return (moe.NATIVE and ex.use_gemv and tp_size() == 1
            and all(gemv_ready(lin) and lin.bias is None for lin in lins)
            and m.gate.weight.shape == (ex.num_experts, hidden)
            and all(w.dtype == torch.bfloat16 and w.is_contiguous()
                    for w in (ex.gate_up_proj, ex.down_proj))
            and ex.gate_up_proj.shape[2] == hidden
            and (sh is None or (sh.act is F.silu and sh.gate_up_proj.weight.shape[1] == hidden))
            and (gate is None or gate.weight.shape == (1, hidden)))


def mlp_part(m) -> GatedMlp | ModuleMlp:
    return GatedMlp(m) if GatedMlp.ok(m) else ModuleMlp(m)


def step_possible(x: torch.Tensor) -> bool:
    """The per-step conditions every plan shares: bf16 rows on the CPU, few enough, kernels
    on, no Triton."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and 1 <= x.shape[0] <= MAX_ROWS and cpu_ops.kernels() is not None
            and not dispatch.use_triton(x.device))


def cached_plan(owner, first, last, build: Callable[[], object]):
    """``owner``'s plan, built with ``build`` on first use and again whenever the GEMV weight
    of the linears ``first`` or ``last`` changed (``use_fast_linears`` ran again); None where
    the plan cannot apply (``ok`` False)."""
    key = (id(getattr(first, "pf_gemv", None)), id(getattr(last, "pf_gemv", None)))
    plan = owner.__dict__.get("_plan")
    if plan is None or plan[0] != key:
        plan = owner.__dict__["_plan"] = (key, build())
    return plan[1] if plan[1].ok else None


class _DenseLayer:
    __slots__ = ("norm_in", "norm_post", "attn", "mlp")

    def __init__(self, layer) -> None:
        self.norm_in = Norm(layer.input_layernorm)
        self.norm_post = Norm(layer.post_attention_layernorm)
        self.attn = Attention(layer.self_attn)
        self.mlp = GatedMlp(layer.mlp)


def _dense_ok(layer, lib) -> bool:
    a, m = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    return (a.fused_rope and Attention.ok(a, lib) and GatedMlp.ok(m)
            and all(not n.zero_centered and _norm_ok(n) for n in norms))


class DensePlan:
    """The fixed part of a dense model's fast decode path, or unusable (``ok`` False)."""

    def __init__(self, layers) -> None:
        lib = cpu_ops.kernels()
        self.lib = lib
        self.ok = bool(lib is not None and tp_size() == 1 and len(layers) > 0
                       and all(_dense_ok(la, lib) for la in layers))
        self.layers = [_DenseLayer(la) for la in layers] if self.ok else []
        self.max_block = lib.pf_max_block() if lib is not None else 0
        self.scratch: dict = {}
        blocks = [b for la in self.layers for b in ((la.norm_in, la.attn), (la.norm_post, la.mlp))]
        self.native = (NativeBlocks(lib, blocks, layers[0].input_layernorm.weight.numel())
                       if self.ok else None)

    def usable(self, x: torch.Tensor, ctx) -> bool:
        """This step can take the fast path (checked once per step)."""
        t = x.shape[0]
        return (self.ok and step_possible(x)
                and all(la.attn.usable(ctx, t, self.max_block) for la in self.layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on ``x`` (T, hidden); returns ``(mlp output, residual)`` as the
        layers' own forwards chain them. ``usable`` must hold."""
        st = Step(self.lib, x, positions, ctx, self.scratch)
        if self.native is not None and self.native.usable(x, residual, st.small):
            return self.native.forward(st, x, ctx, residual)  # the same calls, from C
        for la in self.layers:
            h, residual, rc = la.norm_in.run(st, x, residual)
            a_out, r = la.attn.run(st, h)
            h, residual, r2 = la.norm_post.run(st, a_out, residual)
            x, r3 = la.mlp.run(st, h)
            if rc | r | r2 | r3:
                raise RuntimeError(f"a CPU kernel refused checked inputs in {la.attn.name}")
        return x, residual
