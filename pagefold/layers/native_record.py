"""What a layer module tells the compiled decode step (``decode_native``) about itself.

A module that the native step can run has two public methods:

* ``native_record(hidden) -> (kind, ints, floats) | None``: its fixed arguments (weights'
  pointers and sizes, keyed by ``decode_native.FIELDS`` / ``FLOATS``; ``kind`` one of
  ``decode_native.KINDS``), checked once per model; None where the kernels do not take the
  module as it is (another dtype, a layout the kernel lacks, tensor parallelism, ...).
* ``native_dyn(step) -> list[int] | None``: its per-step values (a KV cache, a state pool's
  pages, ``-exp(A_log)``) from a :class:`Step`; None where this step's cache, states or
  metadata do not suit the kernels (the step then takes the module path).

A norm in front of a part has ``native_norm() -> (weight pointer, eps, mode) | None``.

A record's ints may hold ``gemv_rows``: the most rows every GEMV in it takes (the driver runs a
step through the records' GEMVs only up to the least of them).

The helpers here are what the modules share to build those: a linear's GEMV readiness, the
two-linears record, the attention record, and :class:`Step` with its per-step lookups. The
records pass exactly the arguments the modules' own kernel calls pass, so the native step's
results are the module path's bits.
"""

from __future__ import annotations

import weakref

import torch

from pagefold.csrc import cpu_ops

STATE_CODE = {torch.float32: 0, torch.bfloat16: 1}  # the state kernels' ssm dtype codes
MAX_GEMV_ROWS = 1 << 30  # no record limits the rows (none has linears)
# An attention group's decode metadata in the step's group array: block tables, their row
# stride, sequence lengths, KV starts, slots, requests (``Step.attention_dyn``).
GROUP_VALUES = 6


def gemv_ready(lin) -> bool:
    """``lin`` is a plain linear whose weights its GEMV takes as they are (``use_fast_linears``
    routed it and its weights are unchanged since)."""
    ready = getattr(lin, "pf_gemv", None)
    return (type(lin) is torch.nn.Linear and ready is not None and ready[0] is lin.weight
            and ready[1] is lin.bias and ready[2].address != 0)


def gemv_of(lin) -> tuple[int, int]:
    """A :func:`gemv_ready` linear's GEMV: (function address, most rows it takes)."""
    choice = lin.pf_gemv[2]
    return choice.address, choice.max_rows


def matrix(lin) -> tuple[int, int, int, int] | None:
    """A linear's matrix as a record takes it: (weight address, bias address or 0, GEMV
    address, most rows), or None where the driver cannot run it. A bf16 ``nn.Linear``'s weight
    address is its tensor and its GEMV the kernel chosen for its shape; a quantized layer
    (GGUF, GPTQ / AWQ / int8 / int4 / FP8) answers ``native_matrix()`` with a descriptor of its
    format (``quantization.native_matrix``) and ``pf_linear_quant``: one GEMV signature."""
    if gemv_ready(lin):
        g, rows = gemv_of(lin)
        return (lin.weight.data_ptr(), lin.bias.data_ptr() if lin.bias is not None else 0, g,
                rows)
    fn = getattr(lin, "native_matrix", None)
    return fn() if fn is not None else None


def matrix_shape(lin) -> tuple[int, int]:
    """(outputs, inputs) of a linear :func:`matrix` took."""
    if type(lin) is torch.nn.Linear:
        return tuple(lin.weight.shape)
    return lin.out_features, lin.in_features


def bf16_vector(t: torch.Tensor | None) -> bool:
    """A bf16 contiguous tensor (a norm weight, a bias) the kernels read as it is."""
    return t is not None and t.dtype == torch.bfloat16 and t.is_contiguous()


def linears(first, second, hidden: int, inner: int) -> dict | None:
    """The record's two linears: ``first`` (hidden -> its outputs) and ``second`` (``inner``
    -> hidden), bf16 or quantized (:func:`matrix`), or None unless both take a GEMV with
    those widths (the driver takes every
    linear's input width from the block)."""
    m0, m1 = matrix(first), matrix(second)
    if m0 is None or m1 is None:
        return None
    (n0, k0), (n1, k1) = matrix_shape(first), matrix_shape(second)
    if (k0, n1, k1) != (hidden, hidden, inner):
        return None
    return {"w0": m0[0], "b0": m0[1], "n0": n0, "w1": m1[0], "b1": m1[1], "k1": inner,
            "g0": m0[2], "g1": m1[2], "gemv_rows": min(m0[3], m1[3])}


def attention_record(hidden: int, *, qkv, o, heads: int, kv_heads: int, head_dim: int,
                     q_size: int, kv_size: int, q_norm, k_norm, rotary, scale: float,
                     gated: bool) -> tuple | None:
    """The record of a paged attention block: qkv, q/k RMSNorm (both or neither, one flavour)
    and RoPE on the first ``rot`` channels of each head (``rotary`` None: no RoPE, then no
    q/k norm: q, k and v are read where they lie in qkv's rows), the K/V write, decode
    attention, an optional sigmoid output gate (``gated``: each head's q rows are
    ``[query | gate]``), o. None where the kernels do not take it."""
    lib = cpu_ops.kernels()
    lin = linears(qkv, o, hidden, heads * head_dim)
    if lib is None or lin is None or (q_norm is None) != (k_norm is None):
        return None
    if (head_dim > lib.pf_max_head_dim() or heads % kv_heads
            or heads // kv_heads > lib.pf_max_group()):
        return None
    rec = {**lin, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "q_size": q_size,
           "kv_size": kv_size, "q_head_stride": 2 * head_dim if gated else head_dim,
           "gated": int(gated)}
    flts = {"scale": float(scale)}
    if rotary is None:
        return ("attention", rec, flts) if q_norm is None and not gated else None
    cos, sin = rotary.cos, rotary.sin
    rot = cos.shape[1]
    if not (cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and 0 < rot <= head_dim and rot % 2 == 0):
        return None
    rec.update(cos=cos.data_ptr(), sin=sin.data_ptr(), rot=rot)
    if q_norm is not None:
        if not (all(bf16_vector(n.weight) and n.weight.numel() == head_dim
                    for n in (q_norm, k_norm)) and q_norm.zero_centered == k_norm.zero_centered
                and q_norm.eps == k_norm.eps):
            return None
        rec.update(q_norm_w=q_norm.weight.data_ptr(), k_norm_w=k_norm.weight.data_ptr(),
                   qk_zc=int(bool(q_norm.zero_centered)))
        flts["eps2"] = float(q_norm.eps)
    return "attention", rec, flts


# A state view's layout as the decode kernels take it, per (view, caller's shapes): fixed
# while the view is (the cache's spec and components do not change), so asked once per layer
# rather than every step. Weak keys: a dropped engine's views (and their pages) are not kept.
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_layout(view, conv_shape: tuple, ssm_shape: tuple, ssm_dtypes: tuple
                 ) -> tuple[int, int, int] | None:
    """(conv offset, ssm offset, ssm dtype code) of ``view``'s state (a ``StateView``) when
    its conv component is bf16 of ``conv_shape`` and its ssm component of ``ssm_shape`` in
    one of ``ssm_dtypes``, else None (also without the kernels: then nothing is kept)."""
    key = (conv_shape, ssm_shape, ssm_dtypes)
    hit = _LAYOUTS.get(view)
    if hit is not None and hit[0] == key:
        return hit[1]
    found = cpu_ops.state_kernel(view)
    if found is None:
        return None
    _, conv, ssm, offs = found
    got = None
    if (conv.dtype == torch.bfloat16 and conv.shape == conv_shape and ssm.dtype in ssm_dtypes
            and ssm.shape == ssm_shape):
        got = (offs["conv"], offs["ssm"], STATE_CODE[ssm.dtype])
    _LAYOUTS[view] = (key, got)
    return got


class Step:
    """One native step's shared values: the library, the rows, the positions, and the
    per-step lookups the parts' ``native_dyn`` make (each attention group's decode metadata
    and each state group's pages, looked up once per step). ``keep`` holds the tensors
    behind the pointers until the step has run."""

    __slots__ = ("lib", "ctx", "t", "pos", "max_block", "groups", "states", "keep")

    def __init__(self, lib, ctx, t: int, positions: torch.Tensor, max_block: int) -> None:
        """``max_block``: the decode attention kernel's largest cache block (``pf_max_block``)."""
        positions = positions.contiguous()
        self.lib, self.ctx, self.t, self.pos = lib, ctx, t, positions.data_ptr()
        self.max_block = max_block
        self.groups: dict[int, tuple[int, list[int]]] = {}  # cache group -> (index, values)
        self.states: dict[int, tuple] = {}
        self.keep: list = [positions]

    def attention_dyn(self, name: str) -> list[int] | None:
        """Attention layer ``name``'s per-step values (its cache, block size, group index),
        or None unless its cache is contiguous bf16 in blocks the kernel takes and every row
        of this step attends as a decode row (decode steps, short verify chunks)."""
        ctx = self.ctx
        c = ctx.cache.attn.get(name)
        if (c is None or c.dtype != torch.bfloat16 or not c.is_contiguous()
                or c.shape[1] > self.max_block):
            return None
        gid = ctx.cache.layer_group[name]
        g = self.groups.get(gid)
        if g is None:
            meta = ctx.attn_meta[gid]
            if meta.prefills or meta.decode_tok.numel() != self.t:
                return None
            tables = meta.decode_tables.contiguous()
            seq_lens = meta.decode_seq_lens.contiguous()
            kvs = meta.decode_kv_start
            kvs = kvs.contiguous() if kvs is not None else None
            slots = meta.slot_mapping.contiguous()
            self.keep += [tables, seq_lens, kvs, slots]
            g = self.groups[gid] = (len(self.groups), [
                tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                kvs.data_ptr() if kvs is not None else 0, slots.data_ptr(), seq_lens.shape[0]])
        return [c.data_ptr(), c.shape[1], g[0]]

    def group_values(self) -> list[int]:
        """Every attention group's decode metadata, in the order of their indices."""
        return [v for _, vals in sorted(self.groups.values()) for v in vals]

    def state_dyn(self, name: str, a_log: torch.Tensor, conv_shape: tuple, ssm_shape: tuple,
                  ssm_dtypes: tuple) -> list[int] | None:
        """State layer ``name``'s per-step values as its decode kernel takes them (the state
        pool, page bytes, pages, pages per state, conv and ssm offsets, fresh flags,
        ``-exp(A_log)``, cu_seqlens, requests, the ssm dtype code), or None unless this is a
        plain decode step (no verify, no given initial states, no checkpoint captures, one
        row per request) on a bf16 conv state of ``conv_shape`` and an ssm state of
        ``ssm_shape`` in one of ``ssm_dtypes``."""
        ctx = self.ctx
        if ctx.verify or ctx.initial_states is not None:
            return None
        view, meta = ctx.state(name)
        layout = state_layout(view, conv_shape, ssm_shape, ssm_dtypes)
        if (layout is None or not meta.all_decode or meta.capture_after is not None
                or meta.page_ids.shape[0] != self.t or not view.raw.is_contiguous()):
            return None
        s = self.states.get(id(meta))
        if s is None:
            pages = meta.page_ids.contiguous()
            cu = meta.cu_seqlens  # .to(dtype) alone costs a few us a layer in a ~1 ms step
            cu = (cu if cu.dtype == torch.int64 else cu.to(torch.int64)).contiguous()
            fresh = (None if meta.all_initial_state
                     else cpu_ops.fresh_flags(meta.has_initial_state))
            self.keep += [pages, cu, fresh, meta]
            s = self.states[id(meta)] = (pages.data_ptr(), pages.shape[1],
                                         fresh.data_ptr() if fresh is not None else 0,
                                         cu.data_ptr(), pages.shape[0])
        neg_exp = cpu_ops.neg_exp(a_log)
        self.keep.append(neg_exp)
        return [view.raw.data_ptr(), view.page_bytes, s[0], s[1], layout[0], layout[1],
                s[2], neg_exp.data_ptr(), s[3], s[4], layout[2]]
