"""The CPU decode step of any model whose blocks have compiled kernels, in one C call
(``csrc/decode_step.cpp``, ``pf_blocks_decode``).

The module path calls about ten kernels per layer through ctypes, and each ctypes call
converts its ~12 arguments in ~4-5 us: on a 30-layer model (SmolLM2-135M) that is ~1.5 ms of a
~15 ms batch-1 step, with the Python around it (module calls, wrappers re-checking their
inputs, the forward context's lookups) more. Here a model's blocks are packed once into int64
and float records, and a step passes the rows, the positions, each attention group's decode
metadata and each block's per-step values: the C side makes the module path's kernel calls in
the module path's order with the same arguments, so the results are its bits (tested:
``tests/layers/test_decode_native.py`` runs every covered family with this on and off).

The protocol (see :mod:`pagefold.layers.native_record`):

* a decoder layer lists its blocks in order with ``native_blocks() -> [(norm, part), ...]``,
  each block being ``part(norm(x + residual))``;
* a norm has ``native_norm()``, a part ``native_record(hidden)`` and ``native_dyn(step)``.

A model whose every block answers runs its decode steps of up to :data:`MAX_ROWS` rows here
(:func:`run`); any other model, or a step that does not qualify (prefill rows, a float32 or
FP8 cache, Triton, a verify step through a state layer, ...), takes the module path. The
driver's linears are each matrix's own GEMV (the kernel chosen for its shape, its address in
the record) up to the fewest rows any of them takes (``gemv_rows``); above, each linear's own
forward and each sparse MoE block's own forward (:class:`ModuleCallbacks`: the batched GEMM and
the grouped experts the module path routes them to, so the same bits).
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagefold.csrc import cpu_ops
from pagefold.distributed.parallel_state import tp_size
from pagefold.kernels import dispatch
from pagefold.layers import native_record
from pagefold.layers.native_record import Step

# ``PAGEFOLD_NATIVE_DECODE=0`` keeps the module path (to compare the two; tests flip this).
ENABLED = os.environ.get("PAGEFOLD_NATIVE_DECODE", "1") != "0"

# decode_step.cpp's enum Kind, Field, FloatField and Dyn, in order (checked against the
# library's ``pf_blocks_decode_fields`` when a model's blocks are packed).
KINDS = {"attention": 1, "mlp_silu": 2, "mlp_relu2": 3, "mamba2": 4, "gdn": 5, "moe": 6}
FIELDS = (
    "kind", "norm_w", "norm_zc", "w0", "b0", "n0", "w1", "b1", "k1",
    "heads", "kv_heads", "head_dim", "q_size", "kv_size", "q_head_stride", "q_norm_w",
    "k_norm_w", "qk_zc", "cos", "sin", "rot", "gated",
    "conv_dim", "conv_k", "ssm_heads", "ssm_head_dim", "ssm_groups", "ssm_state", "conv_w",
    "conv_b", "dt_bias", "d_skip", "gnorm_w", "gnorm_group", "k_heads", "k_head_dim",
    "top_k", "norm_topk", "experts_gu", "experts_down", "moe_inter", "shared_gu", "shared_down",
    "shared_inter", "shared_gate",
    "g0", "g1", "g_experts_gu", "g_experts_down", "g_shared_gu", "g_shared_down", "g_shared_gate",
)
FLOATS = ("norm_eps", "eps2", "scale")
DYN = 11
# Steps of more rows than this take the module path (the linears' time dwarfs the Python saved,
# and the driver's scratch holds every role's rows).
MAX_ROWS = 256
# The driver's linear: decode_step.cpp's GemvFn (x, x stride, w, bias, y, y stride, M, N, K,
# threads).
LINEAR_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int)
# A sparse MoE block run by its own forward: decode_step.cpp's MoeFn (block, rows, t, d, dst).
MOE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_void_p)


def _code() -> int:
    return (len(FIELDS) * 100 + len(FLOATS)) * 100 + DYN


def _rows(address: int, m: int, n: int, stride: int) -> torch.Tensor:
    """The (m, n) bf16 rows at ``address`` (row stride ``stride``) as a tensor, no copy."""
    buf = (ctypes.c_uint16 * ((m - 1) * stride + n)).from_address(address)
    return torch.frombuffer(buf, dtype=torch.bfloat16).as_strided((m, n), (stride, 1))


class ModuleCallbacks:
    """For steps above the GEMVs' rows: the blocks' linears as the driver's GEMV function
    pointer (``linear``), each through its own ``forward`` (the routing ``use_fast_linears``
    set up: the batched GEMM), found by its weight's address, and the sparse MoE blocks
    through their own forward (``moe``: their experts leave the few-row kernel there); the
    results are copied into the driver's rows, so they are the module path's (a quantized
    linear is found by its descriptor's address). An exception inside is kept in ``error``
    (the driver sees a nonzero result)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.by_weight = {m.weight.data_ptr(): m for p in parts for m in p.modules()
                          if type(m) is torch.nn.Linear}
        for p in parts:  # quantized matrices: keyed by their descriptor's address
            for m in p.modules():
                got = native_record.matrix(m) if hasattr(m, "native_matrix") else None
                if got is not None:
                    self.by_weight[got[0]] = m
        self.error: BaseException | None = None
        # Kept: the pointers live as long as this object.
        self.linear_fn, self.moe_fn = LINEAR_FN(self._linear), MOE_FN(self._moe)
        self.linear = ctypes.cast(self.linear_fn, ctypes.c_void_p)
        self.moe = ctypes.cast(self.moe_fn, ctypes.c_void_p)

    def _linear(self, x, x_stride, w, bias, y, y_stride, m, n, k, nthreads) -> int:
        try:
            out = self.by_weight[w](_rows(x, m, k, x_stride))
            _rows(y, m, n, y_stride).copy_(out)
            return 0
        except BaseException as e:  # noqa: BLE001 - re-raised by NativeBlocks.forward
            self.error = e
            return 1

    def _moe(self, block, h, t, d, dst) -> int:
        try:
            _rows(dst, t, d, d).copy_(self.parts[block](_rows(h, t, d, d)))
            return 0
        except BaseException as e:  # noqa: BLE001 - re-raised by NativeBlocks.forward
            self.error = e
            return 1


class NativeBlocks:
    """The packed records of a model's ``(norm, part)`` blocks, or unusable (``ok`` False: no
    kernels, tensor parallelism, or a norm or part the kernels do not take). The records
    hold pointers: the modules' tensors must stay as they are while this is used (the
    cache in :func:`run` rebuilds it when ``use_fast_linears`` routed the linears anew)."""

    def __init__(self, blocks: list, hidden: int) -> None:
        lib = cpu_ops.kernels()
        self.lib, self.hidden, self.ok = lib, hidden, False
        self.parts = [part for _, part in blocks]
        if (lib is None or getattr(lib, "pf_blocks_decode", None) is None or not blocks
                or tp_size() != 1):
            return
        if lib.pf_blocks_decode_fields() != _code():
            raise RuntimeError("pf_blocks_decode's block record differs from decode_native's")
        recs, self.gemv_rows = [], native_record.MAX_GEMV_ROWS
        for norm, part in blocks:
            n = getattr(norm, "native_norm", None)
            rec = getattr(part, "native_record", None)
            n = n() if n is not None else None
            r = rec(hidden) if rec is not None else None
            if n is None or r is None:
                return
            kind, ints, flts = r
            self.gemv_rows = min(self.gemv_rows, ints.get("gemv_rows", 0))
            recs.append(({**ints, "kind": KINDS[kind], "norm_w": n[0], "norm_zc": n[2]},
                         {**flts, "norm_eps": n[1]}))
        vals = [r[0].get(f, 0) for r in recs for f in FIELDS]
        self.blocks = (ctypes.c_int64 * len(vals))(*vals)
        flts = [float(r[1].get(f, 0.0)) for r in recs for f in FLOATS]
        self.floats = (ctypes.c_float * len(flts))(*flts)
        self.callbacks = ModuleCallbacks(self.parts)
        self.max_block = lib.pf_max_block()
        self.finals: dict[int, tuple | None] = {}
        # The per-step values go into these two arrays, made once: building a ctypes array
        # from ~50 ints costs ~4-6 us a step, a slice assignment into a kept one ~1 (the
        # driver reads them only during the call, and a step's groups are at most one per
        # part). Their addresses are passed as plain ints (the cheapest ``c_void_p``).
        self.dyn_buf = (ctypes.c_int64 * (DYN * len(self.parts)))()
        self.groups_buf = (ctypes.c_int64 * max(native_record.GROUP_VALUES * len(self.parts), 1))()
        self.dyn_addr = ctypes.addressof(self.dyn_buf)
        self.groups_addr = ctypes.addressof(self.groups_buf)
        # The last part's output where the final norm runs in the call: scratch the caller
        # never sees (only the normalised rows are returned), so kept from step to step
        # rather than allocated each one (an allocation costs ~4-6 us in a decode step, whose
        # caches the weights' streaming has emptied). Grown to the most rows seen.
        self.scratch = torch.empty(0, hidden, dtype=torch.bfloat16)
        # The last step's context and the tensors behind its per-step values: a decode
        # burst's later forwards (``ctx.burst_step``) pass the same context with its
        # metadata advanced in place, so the values in ``dyn_buf`` / ``groups_buf`` (pointers
        # and sizes) stand as they are.
        self._last: tuple | None = None
        self.ok = True

    def final_record(self, norm: torch.nn.Module) -> tuple | None:
        """``norm.native_norm()`` (weight pointer, eps, mode), asked once per norm (the
        records' pointers are fixed while this object is used, as the blocks' norms' are)."""
        key = id(norm)
        if key not in self.finals:
            fn = getattr(norm, "native_norm", None)
            self.finals[key] = fn() if fn is not None else None
        return self.finals[key]

    def usable(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """The per-step conditions on the rows: bf16 on the CPU, contiguous, not too many,
        kernels on, no Triton."""
        t = x.shape[0]
        return (ENABLED and self.ok and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and 1 <= t <= MAX_ROWS and x.is_contiguous()
                and x.shape[1] == self.hidden and cpu_ops.kernels() is not None
                and (residual is None or residual.is_contiguous())
                and not dispatch.use_triton(x.device))

    def check(self, rc: int, what: str) -> None:
        """After a driver call: re-raise what a callback raised, else fail on a nonzero
        result (``callbacks.error`` is reset before each call)."""
        if self.callbacks.error is not None:
            raise self.callbacks.error
        if rc:
            raise RuntimeError(f"a CPU kernel refused checked inputs in the {what}")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx,
                residual: torch.Tensor | None = None, final: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """Every block on ``x`` (T, hidden) as the module path runs them, ``usable`` holding;
        returns ``(last part's output, residual)``, whose sum is the blocks' output (``x`` or
        ``residual`` takes the residual stream in place, as the module path's first add), or
        None where a part's ``native_dyn`` declined this step (nothing has run then). With
        ``final`` (a norm's ``native_norm()``: weight pointer, eps, mode) the same call also
        applies that norm to the sum, as the module path's final fused add + norm, and
        returns the normalised rows alone."""
        t = x.shape[0]
        last = self._last
        if not (ctx.burst_step and last is not None and last[0] is ctx and last[1] is positions
                and last[2] == t):
            self._last = None
            st = Step(self.lib, ctx, t, positions, self.max_block)
            dyn: list[int] = []
            for p in self.parts:
                d = p.native_dyn(st)
                if d is None:
                    return None
                dyn += d + [0] * (DYN - len(d))
            groups = st.group_values() or [0]
            self.dyn_buf[:len(dyn)] = dyn
            self.groups_buf[:len(groups)] = groups
            self._last = (ctx, positions, t, st)  # st.keep: the tensors behind the pointers
        st = self._last[3]
        if final is None:
            out = torch.empty_like(x)
            normed = None
        else:
            if self.scratch.shape[0] < t:
                self.scratch = torch.empty_like(x)
            out, normed = self.scratch, torch.empty_like(x)
        gemv = t <= self.gemv_rows  # each matrix's own GEMV (from the records), else callbacks
        cb = self.callbacks
        cb.error = None
        rc = self.lib.pf_blocks_decode(
            self.blocks, self.floats, len(self.parts), self.dyn_addr, self.groups_addr,
            None if gemv else cb.linear, x.data_ptr(),
            residual.data_ptr() if residual is not None else None, out.data_ptr(), t,
            x.shape[1], st.pos, torch.get_num_threads(), None if gemv else cb.moe,
            *(final if final is not None else (None, 0.0, 0)),
            normed.data_ptr() if normed is not None else None)
        self.check(rc, "native decode step")
        if normed is not None:
            return normed
        return out, (residual if residual is not None else x)


# decode_step.cpp's GreedyField count (checked against ``pf_blocks_greedy_fields``).
GREEDY_FIELDS = 25


class GreedyStep:
    """Later steps of a run of greedy decode steps over the same rows, each in one C call
    (``pf_blocks_greedy``): the embedding rows of the step's ids copied out of the table (the
    lookup), :meth:`NativeBlocks.forward` with the final norm, the head's GEMV and the argmax,
    which is what the model's forward and ``CausalLMHead.greedy_tokens`` make, with the same
    kernels and arguments. Valid while ``native``'s last step is the one it was made after:
    the caller advances that step's ids, positions and metadata in place between calls (the
    per-step values in ``native``'s buffers point at them) and runs no other step of this
    model in between (a call then raises rather than read another step's values)."""

    def __init__(self, native: NativeBlocks, input_ids: torch.Tensor, final: tuple,
                 table: torch.Tensor, head: tuple) -> None:
        lib = native.lib
        if lib.pf_blocks_greedy_fields() != GREEDY_FIELDS:
            raise RuntimeError("pf_blocks_greedy's plan differs from decode_native's")
        choice, weight, bias = head
        t, d, vocab = input_ids.shape[0], native.hidden, weight.shape[0]
        self.native, self.last, self.lib = native, native._last, lib
        self.x = torch.empty(t, d, dtype=torch.bfloat16)
        self.out = torch.empty(t, d, dtype=torch.bfloat16)
        self.normed = torch.empty(t, d, dtype=torch.bfloat16)
        self.logits = torch.empty(t, vocab, dtype=torch.bfloat16)
        self.tokens = (ctypes.c_int64 * t)()
        # Kept: the tensors behind the plan's pointers.
        self.keep = (input_ids, table, weight, bias, choice)
        cb = native.callbacks
        self.gemv = t <= native.gemv_rows  # as forward: the records' GEMVs, else callbacks
        vals = [
            ctypes.addressof(native.blocks), ctypes.addressof(native.floats), len(native.parts),
            native.dyn_addr, native.groups_addr, 0 if self.gemv else cb.linear.value,
            0 if self.gemv else cb.moe.value, self.x.data_ptr(), self.out.data_ptr(), t, d,
            self.last[3].pos, torch.get_num_threads(), final[0], final[2],
            self.normed.data_ptr(), table.data_ptr(), table.shape[0], input_ids.data_ptr(),
            choice.address, weight.data_ptr(), bias.data_ptr() if bias is not None else 0,
            vocab, self.logits.data_ptr(), ctypes.addressof(self.tokens)]
        self.plan = (ctypes.c_int64 * GREEDY_FIELDS)(*vals)
        self.addr, self.eps = ctypes.addressof(self.plan), float(final[1])

    def __call__(self) -> list[int]:
        """The next step's greedy token of each row (its ids and metadata already advanced)."""
        if self.native._last is not self.last:
            raise RuntimeError("another step ran between a greedy run's steps")
        cb = self.native.callbacks
        cb.error = None
        rc = self.lib.pf_blocks_greedy(self.addr, self.eps)
        if rc == -2:  # refused before any kernel (or callback) ran
            raise ValueError("a token id outside the embedding table in a greedy step")
        self.native.check(rc, "greedy decode step")
        return self.tokens[:]


def greedy_run(owner: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
               final_norm: torch.nn.Module, table: torch.Tensor, head: tuple
               ) -> GreedyStep | None:
    """A :class:`GreedyStep` for ``owner``'s next steps after the one it just ran natively in
    ``ctx`` on ``positions`` with ``final_norm`` fused (:func:`run`), embedding ``input_ids``
    from ``table``; None where that step was not native (or not with that norm) or the ids or
    table are not ones the C side reads as they are."""
    cached = owner.__dict__.get("_pf_native_blocks")
    native = cached[3] if cached is not None else None
    if native is None or _routing(cached[0]) != cached[1]:
        return None
    last, t = native._last, input_ids.shape[0]
    final = native.final_record(final_norm)
    if (last is None or last[0] is not ctx or last[1] is not positions or last[2] != t
            or final is None or input_ids.dtype != torch.int64 or input_ids.dim() != 1
            or not input_ids.is_contiguous() or table.dtype != torch.bfloat16
            or table.dim() != 2 or table.shape[1] != native.hidden or not table.is_contiguous()
            or head[1].shape[1] != native.hidden):
        return None
    return GreedyStep(native, input_ids, final, table, head)


def model_blocks(layers) -> list | None:
    """Every ``(norm, part)`` block of ``layers`` in order, or None when a layer does not
    list its blocks."""
    blocks = []
    for layer in layers:
        fn = getattr(layer, "native_blocks", None)
        got = fn() if fn is not None else None
        if got is None:
            return None
        blocks += got
    return blocks


def _routing(linears: tuple) -> tuple:
    """The GEMV routing of ``linears`` (``use_fast_linears`` sets a new ``pf_gemv`` on every
    linear when it runs again: the first and last block's stand for all)."""
    return tuple(id(getattr(m, "pf_gemv", None)) for m in linears)


def run(owner: torch.nn.Module, layers, x: torch.Tensor, positions: torch.Tensor, ctx,
        final_norm: torch.nn.Module | None = None
        ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """``owner``'s decoder ``layers`` on the embeddings ``x`` in one native step, or None where
    the step takes the module path (nothing has run then). Returns ``(last part's output,
    residual)``: the final norm of their sum is the model's output; given ``final_norm`` (a
    norm whose forward with a residual is the fused add + norm) whose ``native_norm``
    answers, that output itself, one tensor (the norm runs in the same C call). The packed
    records are kept on ``owner`` and rebuilt when the linears' GEMV routing changed."""
    if not ENABLED or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not len(layers):
        return None
    if ctx.lora_rows:  # LoRA terms come from the linears' hooks: the module path runs them
        return None
    if getattr(ctx, "aux_layers", None) is not None:
        return None  # an EAGLE-3 drafter reads layer inputs: the layers must run one by one
    cached = owner.__dict__.get("_pf_native_blocks")
    if cached is None:
        blocks = model_blocks(layers)
        lins = () if blocks is None else tuple(
            m for _, part in blocks[:1] + blocks[-1:] for m in part.modules()
            if type(m) is torch.nn.Linear)
        cached = (lins, _routing(lins), blocks,
                  None if blocks is None else NativeBlocks(blocks, x.shape[1]))
        owner.__dict__["_pf_native_blocks"] = cached
    lins, key, blocks, native = cached
    if native is None:
        return None
    if _routing(lins) != key:
        native = NativeBlocks(blocks, x.shape[1])
        owner.__dict__["_pf_native_blocks"] = (lins, _routing(lins), blocks, native)
    if not native.usable(x, None):
        return None
    final = native.final_record(final_norm) if final_norm is not None else None
    return native.forward(x, positions, ctx, final=final)
