"""Decode and speculative-verify steps of dense decoder layers (Llama / Qwen2 / Qwen3)
straight through the compiled CPU kernels.

A decode step of a small model spends as much time in Python as in its kernels: per layer
about ten ``nn.Module`` calls, each kernel wrapper re-checking dtypes, strides and devices,
the dispatch choosing a backend, the forward context looking up its layer. For steps whose
every row is a decode row on the CPU in bf16 with the C++ kernels on, :class:`DensePlan`
checks all of that once per model (and the per-step metadata once per step), then calls the
same C functions with the same arguments the wrappers would pass, in the same order: the
result is bit for bit the module path's (tested), with ~10 ctypes calls per layer and little
else. A step qualifies when every row attends as a decode row: plain decode steps, and the
short chunks of speculative verify steps (``input_batch.SHORT_CHUNK_AS_DECODE``), whose rows
each read their request's block table up to their own position. Linears of up to
``GEMV_MAX_ROWS`` rows call the GEMV directly; larger steps call the layer's own ``forward``
(the routing ``cpu_ops.use_fast_linears`` set up), so their bits are the module path's too.
Anything outside those conditions (float32, FP8 KV cache, tensor parallelism, Triton,
prefill rows, more than ``MAX_ROWS`` rows, kernels off) takes the module path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.kernels import dispatch

_BF16 = 1  # cpu_ops' dtype code
# Steps of more rows than this take the module path: by then the linears' time dwarfs the
# Python the plan saves (and a plan step holds every layer's activations of one row set).
MAX_ROWS = 256


def _gemv_ready(lin) -> bool:
    ready = getattr(lin, "pf_gemv", None)
    return (type(lin) is torch.nn.Linear and ready is not None and ready[0] is lin.weight
            and ready[1] is lin.bias)


class _Layer:
    """One decoder layer's fixed arguments (weights' pointers and sizes)."""

    __slots__ = ("name", "in_w", "in_eps", "post_w", "post_eps", "qkv", "o", "gu", "down",
                 "H", "KVH", "D", "q_size", "kv_size", "qw", "kw", "qk_eps", "cos", "sin",
                 "rot", "scale", "inter", "mods", "keep")

    def __init__(self, layer) -> None:
        a, m = layer.self_attn, layer.mlp
        self.name = a.layer_name
        self.in_w = layer.input_layernorm.weight.data_ptr()
        self.in_eps = float(layer.input_layernorm.eps)
        self.post_w = layer.post_attention_layernorm.weight.data_ptr()
        self.post_eps = float(layer.post_attention_layernorm.eps)
        lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        self.qkv, self.o, self.gu, self.down = (
            (lin.weight.data_ptr(), lin.bias.data_ptr() if lin.bias is not None else None,
             lin.weight.shape[0], lin.weight.shape[1]) for lin in lins)
        self.H, self.KVH, self.D = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.q_size, a.kv_size
        self.qw = a.q_norm.weight.data_ptr() if a.q_norm is not None else None
        self.kw = a.k_norm.weight.data_ptr() if a.k_norm is not None else None
        self.qk_eps = float(a.q_norm.eps) if a.q_norm is not None else 0.0
        self.cos, self.sin = a.rotary.cos.data_ptr(), a.rotary.sin.data_ptr()
        self.rot = a.rotary.cos.shape[1]
        self.scale = float(a.scale)
        self.inter = m.inter
        self.mods = lins  # steps of more than GEMV_MAX_ROWS rows call their forwards
        # The tensors behind the pointers stay alive (and identical) while the plan is used.
        self.keep = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                     a.rotary.cos, a.rotary.sin,
                     *(p for lin in lins for p in (lin.weight, lin.bias))]


def _project(gemv, small: bool, spec: tuple, mod, inp: torch.Tensor, nt: int
             ) -> tuple[torch.Tensor, int]:
    """One linear of a plan step on ``inp`` (rows, in): the GEMV on the weight's pointers
    (``spec`` = weight, bias, out, in) when the step is ``small`` enough for it, else the
    layer's own forward (the routing ``use_fast_linears`` set up). Returns (output, rc)."""
    if not small:
        return mod.forward(inp), 0
    w, b, n, k = spec
    t = inp.shape[0]
    out = torch.empty((t, n), dtype=torch.bfloat16)
    return out, gemv(inp.data_ptr(), inp.stride(0), w, b, out.data_ptr(), n, t, n, k, nt)


def _layer_ok(layer, lib) -> bool:
    a, m = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    qk = [n for n in (a.q_norm, a.k_norm) if n is not None]
    return (a.fused_rope and a.rotary is not None and m.act is F.silu
            and all(_gemv_ready(lin) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj,
                                                 m.down_proj))
            and all(not n.zero_centered and n.weight.dtype == torch.bfloat16
                    and n.weight.is_contiguous() for n in norms + qk)
            and all(n.weight.numel() == a.head_dim for n in qk)
            and a.rotary.cos.dtype == torch.float32 and a.rotary.cos.is_contiguous()
            and a.rotary.sin.is_contiguous()
            and a.head_dim <= lib.pf_max_head_dim()
            and a.num_heads % a.num_kv_heads == 0
            and a.num_heads // a.num_kv_heads <= lib.pf_max_group())


class DensePlan:
    """The fixed part of a model's fast decode path, or unusable (``ok`` False)."""

    def __init__(self, layers) -> None:
        lib = cpu_ops.kernels()
        self.lib = lib
        self.ok = bool(lib is not None and tp_size() == 1 and len(layers) > 0
                       and all(_layer_ok(la, lib) for la in layers))
        self.layers = [_Layer(la) for la in layers] if self.ok else []
        self.max_block = lib.pf_max_block() if lib is not None else 0

    def usable(self, x: torch.Tensor, ctx) -> bool:
        """This step can take the fast path (checked once per step)."""
        if (not self.ok or x.dtype != torch.bfloat16 or x.device.type != "cpu"
                or not 1 <= x.shape[0] <= MAX_ROWS
                or cpu_ops.kernels() is None or dispatch.use_triton(x.device)):
            return False
        cache = ctx.cache
        for la in self.layers:
            c = cache.attn.get(la.name)
            meta = ctx.attn_meta[cache.layer_group[la.name]]
            if (c is None or c.dtype != torch.bfloat16 or not c.is_contiguous()
                    or meta.prefills or meta.decode_tok.numel() != x.shape[0]
                    or c.shape[1] > self.max_block):
                return False
        return True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on ``x`` (T, hidden); returns ``(mlp output, residual)`` as the
        layers' own forwards chain them. ``usable`` must hold."""
        lib, nt = self.lib, torch.get_num_threads()
        rms, gemv, rope = lib.pf_rms_norm, cpu_ops.gemv_function(), lib.pf_qk_norm_rope
        t = x.shape[0]
        small = t <= cpu_ops.GEMV_MAX_ROWS  # else each linear's own routing (same bits)
        positions = positions.contiguous()
        pos = positions.data_ptr()
        steps: dict[int, tuple] = {}  # per attention group: this step's metadata pointers
        cache = ctx.cache
        empty, bf16 = torch.empty, torch.bfloat16
        for la in self.layers:
            gi = cache.layer_group[la.name]
            g = steps.get(gi)
            if g is None:
                meta = ctx.attn_meta[gi]
                tables = meta.decode_tables.contiguous()
                seq_lens = meta.decode_seq_lens.contiguous()
                kvs = meta.decode_kv_start
                kvs = kvs.contiguous() if kvs is not None else None
                slots = meta.slot_mapping.contiguous()
                g = steps[gi] = (tables, seq_lens, kvs, slots, tables.data_ptr(),
                                 tables.stride(0), seq_lens.data_ptr(),
                                 kvs.data_ptr() if kvs is not None else None,
                                 slots.data_ptr(), seq_lens.shape[0])
            kv_cache = cache.attn[la.name]
            d_model = x.shape[1]
            # input norm (with the residual add after the first layer)
            h = empty((t, d_model), dtype=bf16)
            if residual is None:
                residual = x
                rc = rms(_BF16, x.data_ptr(), x.stride(0), None, 0, la.in_w, h.data_ptr(),
                         d_model, t, d_model, la.in_eps, 0, nt)
            else:
                rc = rms(_BF16, x.data_ptr(), x.stride(0), residual.data_ptr(),
                         residual.stride(0), la.in_w, h.data_ptr(), d_model, t, d_model,
                         la.in_eps, 0, nt)
            # qkv, q/k norm + RoPE, K/V write, attention
            qkv, r = _project(gemv, small, la.qkv, la.mods[0], h, nt)
            rc |= r
            q = empty((t, la.H, la.D), dtype=bf16)
            kk = empty((t, la.KVH, la.D), dtype=bf16)
            rc |= rope(_BF16, qkv.data_ptr(), qkv.stride(0), 0, la.D, la.q_size, pos, la.cos,
                       la.sin, la.rot, la.qw, la.kw, la.qk_eps, 0, q.data_ptr(),
                       kk.data_ptr(), t, la.H, la.KVH, la.D, nt)
            v = qkv[:, la.q_size + la.kv_size:]
            rc |= lib.pf_write_kv(_BF16, kk.data_ptr(), v.data_ptr(), kk.stride(0),
                                  v.stride(0), g[8], kv_cache.data_ptr(), t, la.KVH, la.D)
            o = empty((t, la.H, la.D), dtype=bf16)
            rc |= lib.pf_decode_attention(
                _BF16, q.data_ptr(), q.stride(0), None, kv_cache.data_ptr(), g[4], g[5], g[6],
                g[7], o.data_ptr(), o.stride(0), g[9], la.H, la.KVH, la.D, kv_cache.shape[1],
                la.scale, nt)
            a_out, r = _project(gemv, small, la.o, la.mods[1], o.view(t, la.H * la.D), nt)
            rc |= r
            # post-attention norm with the residual add, gated MLP
            h = empty((t, d_model), dtype=bf16)
            rc |= rms(_BF16, a_out.data_ptr(), a_out.stride(0), residual.data_ptr(),
                      residual.stride(0), la.post_w, h.data_ptr(), d_model, t, d_model,
                      la.post_eps, 0, nt)
            gu, r = _project(gemv, small, la.gu, la.mods[2], h, nt)
            rc |= r
            act = empty((t, la.inter), dtype=bf16)
            rc |= lib.pf_silu_mul(_BF16, gu.data_ptr(), gu.stride(0), act.data_ptr(), t,
                                  la.inter, nt)
            x, r = _project(gemv, small, la.down, la.mods[3], act, nt)
            rc |= r
            if rc:
                raise RuntimeError(f"a CPU kernel refused checked inputs in {la.name}")
        return x, residual
