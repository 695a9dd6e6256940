"""The compiled CPU kernels' library (built on first use by :mod:`pagefold.csrc.build`, called
through ctypes), the helpers every ctypes wrapper shares, and the generic bf16 GEMV / linear
routing. The wrappers of each op live with the op (``pagefold/ops/<op>/cpu.py``).

``attention.cpp`` (paged decode attention, the K/V write), ``prefill.cpp`` (prefill
attention over the paged cache, one query row at a time, AVX512-BF16), ``prefill_blocked.cpp``
(the same blocked: 32 query lanes x 32-key blocks on AMX tiles or AVX512-BF16 dot products),
``layers.cpp`` (RMSNorm with the residual add, q/k norm + RoPE, SiLU-and-mul, the gated
RMSNorm of GDN outputs, the bf16 small-M products), ``gemv_amx.cpp`` (the small-M products on
AMX), ``gdn.cpp`` (the Gated DeltaNet layer on paged states), ``mamba2.cpp`` (the Mamba-2
decode step), ``ssd.cpp`` (the chunked Mamba-2 SSD scan of prefills), ``conv.cpp`` (the
varlen causal conv of prefills) and ``gated_norm.cpp`` (Mamba-2's gated RMSNorm), with
``common.h``, use no torch or Python headers: one ``g++`` call builds them in a few seconds.

Fallback: when the build fails (no compiler) or ``PAGEFOLD_CPU_KERNELS=0``, :func:`kernels`
returns ``None`` and callers take their pure-torch path; the reason is logged once. The
kernels link the OpenMP runtime by soname, so they share the one torch already loaded.

Every wrapper returns ``False`` / ``None`` (and writes nothing) when the inputs fall outside
what the kernel handles (another device or dtype, unusual strides or sizes), so the caller can
always fall back to torch. Tensors are passed by pointer: the wrappers check dtypes and
strides before every call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from pagefold.csrc import build, gemm

logger = logging.getLogger("pagefold")

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


_ENABLED = os.environ.get("PAGEFOLD_CPU_KERNELS", "1") != "0"


def enabled() -> bool:
    """False when ``PAGEFOLD_CPU_KERNELS=0`` at import, or after :func:`set_enabled` (False)."""
    return _ENABLED


def set_enabled(on: bool) -> None:
    """Switch the kernels on or off for this process (tests compare both paths)."""
    global _ENABLED
    _ENABLED = bool(on)


def kernels() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call; ``None`` means use torch."""
    global _lib, _tried
    if not _ENABLED:
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = build.load()
                _choose_gemv(lib)
                _lib = lib
            except Exception as e:  # noqa: BLE001 - any failure means the torch fallback
                logger.warning("pagefold CPU kernels unavailable, using the torch path: %s", e)
            _tried = True
    return _lib


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()

def rows_ok(t: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


def usable(*ts: torch.Tensor) -> int | None:
    """The dtype code when every tensor is on the CPU with one supported dtype, else None."""
    dt = ts[0].dtype
    if any(t.device.type != "cpu" or t.dtype != dt for t in ts):
        return None
    return DTYPE_CODE.get(dt)


# rms_norm's mode for a weight multiply in float32 before the cast (Nemotron-H's norm).
NORM_FLOAT_WEIGHT = 2

# State spec -> (conv component, ssm component, offsets by name): fixed per spec.
_STATE_LAYOUT: dict = {}


def page_write(raw: torch.Tensor, page_ids: torch.Tensor, off: int,
               data: torch.Tensor | None, nbytes: int, stream: bool = False) -> bool:
    """Bytes ``[off, off + nbytes)`` of the states over ``page_ids`` (N, pages) of ``raw``
    (num_blocks, page_bytes) uint8 := the rows of ``data`` (N, nbytes) uint8, or zeros
    (``data`` None); ``stream``: non-temporal stores. False (nothing written) when not
    handled: kernels off, not on the CPU, non-contiguous tensors."""
    lib = kernels()
    if (lib is None or raw.device.type != "cpu" or not raw.is_contiguous()
            or (data is not None and (data.dtype != torch.uint8 or data.stride(1) != 1
                                      or tuple(data.shape) != (page_ids.shape[0], nbytes)))):
        return False
    ids = page_ids.to(torch.int64).contiguous()
    n = ids.shape[0]
    rc = lib.pf_page_write(
        ptr(raw), raw.shape[1], ptr(ids), n, ids.shape[1], off,
        ptr(data) if data is not None else None, data.stride(0) if data is not None else 0,
        nbytes, int(stream), torch.get_num_threads())
    return rc == 0


def state_kernel(view) -> tuple | None:
    """(library, conv component, ssm component, {name: byte offset}) for a kernel on a conv +
    SSM state (the layout found once per spec); None without the kernels or for specs without
    both components."""
    lib = kernels()
    if lib is None:
        return None
    layout = _STATE_LAYOUT.get(view.spec)
    if layout is None:
        spec = view.spec
        try:
            layout = (spec.component("conv"), spec.component("ssm"),
                      dict(zip((c.name for c in spec.components), spec.offsets)))
        except KeyError:
            return None
        _STATE_LAYOUT[spec] = layout
    return (lib, *layout)


def fresh_flags(has_initial_state: torch.Tensor) -> torch.Tensor | None:
    """(N,) uint8 of the sequences starting fresh (their pages read as zeros), None if none."""
    if bool(has_initial_state.all()):
        return None
    return (~has_initial_state).to(torch.uint8).contiguous()


def neg_exp(a_log: torch.Tensor) -> torch.Tensor:
    """``-exp(A_log)`` in float32, computed once per parameter and kept on it (recomputed
    after an in-place change, seen by the tensor's version counter)."""
    try:
        version = a_log._version
    except RuntimeError:  # an inference-mode tensor has no version counter: no caching
        return (-a_log.float().exp()).contiguous()
    hit = getattr(a_log, "_pf_neg_exp", None)
    if hit is not None and hit[0] == version:
        return hit[1]
    val = (-a_log.detach().float().exp()).contiguous()
    a_log._pf_neg_exp = (version, val)
    return val

# Rows up to which bf16 linears take the compiled GEMV, not the GEMM library. With native bf16
# (AVX512-BF16 / AMX) oneDNN is as fast from 3 rows on. Elsewhere its bf16 GEMM costs about a
# weight pass per row, and the AVX2 kernel (weights read once per call) stays 3-4x ahead up to
# FMA_MAX_ROWS (benchmarks/bf16_gemv.py: decode batches, verify steps, short prefill chunks);
# the float32-upcast GEMM (gemm.py, on by default there) takes more rows. In isolation it
# caught up at ~20-24 rows, but in a model, whose weights stream from memory, a batch-32
# SmolLM2 decode step took 140-183 ms with the kernel against 193-200 ms with the upcast from
# 21 rows (Zen 3, interleaved): the kernel keeps its 32 either way. With AMX the tile kernel
# (gemv_amx.cpp) costs about one weight pass for 1 to 16 rows (~1.2 for 17 to 32: each
# weight tile times two x tiles), below both the AVX512-BF16 GEMV (compute bound from ~2
# rows) and oneDNN (a fixed per-call cost):
# AMX_MAX_ROWS (``PAGEFOLD_AMX=0`` keeps the AVX512-BF16 GEMV, for comparisons).
FMA_MAX_ROWS = 32
AMX_MAX_ROWS = 32
NATIVE_MAX_ROWS = 2
GEMV_MAX_ROWS = NATIVE_MAX_ROWS if gemm.cpu_has_fast_bf16() else FMA_MAX_ROWS
PREPACK_LIMIT_BYTES = 2 << 30
_gemv = None  # the C function linear() and the native decode step call (set with the library)
_gemv_f32 = None  # its float32-output twin where there is one (the AVX2 + FMA kernel)


def _choose_gemv(lib: ctypes.CDLL) -> None:
    """Pick the GEMV and its row limit for this CPU: the AVX2 + FMA kernel where the CPU has
    no native bf16 GEMM and the build has the kernel; the AMX tile kernel where the build has
    it and the OS grants the tile state; else ``pf_linear_bf16`` (AVX512-BF16, or a scalar
    loop: then only for ``NATIVE_MAX_ROWS`` rows). Each keeps a row's bits independent of how
    many rows share a call, so verify steps compute what decode steps would."""
    global _gemv, _gemv_f32, GEMV_MAX_ROWS
    _gemv_f32 = None
    if not gemm.cpu_has_fast_bf16() and lib.pf_gemv_kinds() & 2:
        _gemv, _gemv_f32 = lib.pf_linear_bf16_fma, lib.pf_linear_bf16_fma_f32out
        GEMV_MAX_ROWS = FMA_MAX_ROWS
    elif (gemm.cpu_has_fast_bf16() and os.environ.get("PAGEFOLD_AMX", "1") != "0"
          and lib.pf_amx_ready()):
        _gemv, GEMV_MAX_ROWS = lib.pf_linear_bf16_amx, AMX_MAX_ROWS
    else:
        _gemv, GEMV_MAX_ROWS = lib.pf_linear_bf16, NATIVE_MAX_ROWS


def gemv_function():
    """The ctypes function behind :func:`linear` (``pf_linear_bf16``'s arguments), or None
    when the kernels are off."""
    return _gemv if kernels() is not None else None


_gemv_addr: tuple = (None, None)


def gemv_address() -> ctypes.c_void_p | None:
    """:func:`gemv_function`'s address, for the C drivers that call it themselves
    (``pf_dense_decode``, ``pf_moe_experts_few``); None when the kernels are off."""
    global _gemv_addr
    fn = gemv_function()
    if fn is None:
        return None
    if _gemv_addr[0] is not fn:
        _gemv_addr = (fn, ctypes.cast(fn, ctypes.c_void_p))
    return _gemv_addr[1]


def linear_call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    if (weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.shape[0] < 1 or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.dim() != 2 or not weight.is_contiguous() or x.stride(1) != 1
            or x.shape[1] != weight.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.numel() != weight.shape[0]))):
        return None
    n, k = weight.shape
    m = x.shape[0]
    y = torch.empty((m, n), dtype=out_dtype)
    rc = fn(ptr(x), x.stride(0), ptr(weight), ptr(bias) if bias is not None else None,
            ptr(y), n, m, n, k, torch.get_num_threads())
    return y if rc == 0 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for bf16 inputs of at most ``GEMV_MAX_ROWS`` rows (decode steps
    of small batches, speculative verify steps), float32 sums and one rounding, as oneDNN's
    bf16 matmul; None otherwise (more rows: the GEMM library is the faster one)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or kernels() is None \
            or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return None
    return linear_call(_gemv, x, weight, bias)


def linear_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor | None:
    """The AVX2 + FMA kernel itself for any number of rows, whatever this CPU's routing (for
    tests and benchmarks); None where it is not compiled in or the inputs are not handled."""
    lib = kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        return None
    return linear_call(lib.pf_linear_bf16_fma, x, weight, bias)


def float_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as float32 (the sums unrounded) for bf16 inputs, on CPUs whose
    bf16 products are pagefold's own float32 ones (no native bf16: the AVX2 + FMA kernel for
    up to ``GEMV_MAX_ROWS`` rows, the float32-upcast GEMM above); None elsewhere. For lm_heads:
    bf16-rounded logits tie (SmolLM2's "The" and "L" at -1.876 on the demo question), and a
    tie is broken by token id, not by the model."""
    if (_gemv_f32 is None or x.dtype != torch.bfloat16 or x.dim() != 2 or kernels() is None
            or x.shape[0] < 1):
        return None
    if x.shape[0] <= GEMV_MAX_ROWS or not gemm.upcast_enabled():
        return linear_call(_gemv_f32, x, weight, bias, torch.float32)
    return gemm.linear(x, weight, bias, out_float=True)


def _gemv_ready(mod: torch.nn.Linear) -> tuple | None:
    """``(weight, bias)`` of ``mod`` when the GEMV takes them as they are (checked once per
    weight object: the per-call checks of :func:`linear` cost more than a small GEMV)."""
    w, b = mod.weight, mod.bias
    if (_lib is None or w.dtype != torch.bfloat16 or w.device.type != "cpu"
            or not w.is_contiguous() or w.dim() != 2
            or (b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()))):
        return None
    return (w, b)


def _fast_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.dtype == torch.bfloat16:
        if self.pf_float_out:
            y = float_logits(x, self.weight, self.bias)
            if y is not None:
                return y
        if x.shape[0] <= GEMV_MAX_ROWS:
            ready = self.pf_gemv
            w, b = self.weight, self.bias
            if ready is not None and ready[0] is w and ready[1] is b and x.is_cpu \
                    and x.stride(1) == 1 and x.shape[0] >= 1 and x.shape[1] == w.shape[1]:
                # The checks of linear() done once (same weight objects): straight to the GEMV.
                n, k = w.shape
                m = x.shape[0]
                y = torch.empty((m, n), dtype=torch.bfloat16)
                if _gemv(x.data_ptr(), x.stride(0), w.data_ptr(),
                                       b.data_ptr() if b is not None else None, y.data_ptr(),
                                       n, m, n, k, torch.get_num_threads()) == 0:
                    return y
            y = linear(x, self.weight, self.bias)
            if y is not None:
                return y
        y = gemm.linear(x, self.weight, self.bias)  # no native bf16 GEMM on this CPU
        if y is not None:
            return y
        packed = self.pf_packed_weight
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    return torch.nn.functional.linear(x, self.weight, self.bias)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


def use_fast_linears(model: torch.nn.Module, prepack_limit: int = PREPACK_LIMIT_BYTES) -> int:
    """Route this model's ``nn.Linear`` layers (the instances, not the class) through the
    fastest CPU path for bf16 inputs: :func:`linear` for up to ``GEMV_MAX_ROWS`` rows, else
    oneDNN with the weight reordered once into its blocked layout (``F.linear`` reorders it
    on every call, which for decode-sized batches costs more than the product); on CPUs with
    no native bf16 GEMM, :func:`pagefold.csrc.gemm.linear` above ``GEMV_MAX_ROWS`` rows
    (float32 sums and one rounding, as oneDNN; the packed copies are then not made). The
    oneDNN results are the same bits as ``F.linear``. The reordered copies double the linear
    weights' memory, so they are made only when those weights total at most
    ``prepack_limit`` bytes. lm_heads (``pf_logits``, set by ``layers.vocab.lm_head_linear``)
    return float32 logits where :func:`float_logits` applies. Call again after changing
    weights. Returns how many layers were routed."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # Where bf16 products go through float32 (gemm.py), a packed bf16 copy would only cost
    # memory.
    pack = total <= prepack_limit and not gemm.upcast_enabled()
    for mod in linears:
        w = mod.weight
        # lm_heads (a target's, a draft's): float32 logits where the products are pagefold's
        # own (float_logits), so bf16 rounding never ties them.
        mod.pf_float_out = getattr(mod, "pf_logits", False)
        mod.pf_packed_weight = (prepack(w.detach()) if pack and w.dtype == torch.bfloat16
                                and w.device.type == "cpu" else None)
        mod.pf_gemv = _gemv_ready(mod) if kernels() is not None else None
        mod.forward = _fast_linear_forward.__get__(mod)
    return len(linears)
