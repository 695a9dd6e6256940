"""The compiled CPU kernels' library (built on first use by :mod:`pagefold.csrc.build`, called
through ctypes), the helpers every ctypes wrapper shares, and the bf16 linear routing (each
weight's GEMV from :mod:`pagefold.csrc.gemv_choice`, oneDNN or the upcast GEMM above). The
wrappers of each op live with the op (``pagefold/ops/<op>/cpu.py``).

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

from pagefold.csrc import build, gemm, gemv_choice, gemv_registry, gemv_timing
from pagefold.csrc.gemv_choice import NO_GEMV, Choice

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
                _lib = build.load()
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

# The GEMV of each routed weight is gemv_choice's (measured per shape); products no model
# routed (``linear``, experts of a module never routed) take the process default: the forced
# kernel, else the flags' choice. Either keeps a row's bits independent of how many rows share
# a call, so verify steps compute what decode steps would.
PREPACK_LIMIT_BYTES = 2 << 30
_defaults: dict[str, Choice] = {}


def default_choice() -> Choice:
    """The GEMV (kernel, row limit) of unrouted products: ``PAGEFOLD_GEMV`` / the engine
    option's kernel, else the one CPU flags pick; ``NO_GEMV`` when the kernels are off."""
    lib = kernels()
    if lib is None:
        return NO_GEMV
    mode = gemv_choice.requested()
    got = _defaults.get(mode)
    if got is None:
        got = _defaults[mode] = gemv_choice.base_choice(lib)
    return got


def gemv_max_rows() -> int:
    """:func:`default_choice`'s row limit (0 without a GEMV)."""
    return default_choice().max_rows


def gemv_function():
    """:func:`default_choice`'s ctypes function (``pf_linear_bf16``'s arguments), or None
    when the kernels are off or there is no GEMV."""
    return default_choice().fn


def gemv_address() -> int | None:
    """:func:`gemv_function`'s address, for the C drivers that call it themselves
    (``pf_moe_experts_few``); None without one."""
    return default_choice().address or None


linear_call = gemv_registry.call
prepack = gemv_timing.prepack


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           choice: Choice | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for bf16 inputs of at most ``choice.max_rows`` rows (default
    :func:`default_choice`; decode steps of small batches, speculative verify steps), float32
    sums and one rounding, as oneDNN's bf16 matmul; None otherwise (more rows: the GEMM
    library is the faster one)."""
    c = choice or default_choice()
    if x.dtype != torch.bfloat16 or x.dim() != 2 or c.fn is None \
            or not 1 <= x.shape[0] <= c.max_rows:
        return None
    return linear_call(c.fn, x, weight, bias)


def linear_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor | None:
    """The AVX2 + FMA kernel itself for any number of rows, whatever this CPU's routing (for
    tests and benchmarks); None where it is not compiled in or the inputs are not handled."""
    lib = kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        return None
    return linear_call(lib.pf_linear_bf16_fma, x, weight, bias)


def float_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 choice: Choice | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as float32 (the sums unrounded) for bf16 inputs where the
    weight's GEMV (``choice``, default :func:`default_choice`) has a float32 twin (the AVX2
    + FMA kernel): the twin for up to its rows, and above them too unless the float32-upcast
    GEMM is on (then that, unrounded); None elsewhere. For lm_heads: bf16-rounded logits tie
    (SmolLM2's "The" and "L" at -1.876 on the demo question), and a tie is broken by token
    id, not by the model."""
    c = choice or default_choice()
    if c.f32 is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] < 1:
        return None
    if x.shape[0] <= c.max_rows or not gemm.upcast_enabled():
        return linear_call(c.f32, x, weight, bias, torch.float32)
    return gemm.linear(x, weight, bias, out_float=True)


def _gemv_ready(mod: torch.nn.Linear, choice: Choice) -> tuple | None:
    """``(weight, bias, choice)`` of ``mod`` when its GEMV takes them as they are (checked
    once per weight object: the per-call checks of :func:`linear` cost more than a small
    GEMV)."""
    w, b = mod.weight, mod.bias
    if (choice.fn is None or w.dtype != torch.bfloat16 or w.device.type != "cpu"
            or not w.is_contiguous() or w.dim() != 2
            or (b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()))):
        return None
    return (w, b, choice)


def _fast_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.dtype == torch.bfloat16:
        ready = self.pf_gemv
        if self.pf_float_out:
            y = float_logits(x, self.weight, self.bias, ready[2] if ready else NO_GEMV)
            if y is not None:
                return y
        w, b = self.weight, self.bias
        if ready is not None and x.shape[0] <= ready[2].max_rows and ready[0] is w \
                and ready[1] is b and x.is_cpu and x.stride(1) == 1 and x.shape[0] >= 1 \
                and x.shape[1] == w.shape[1]:
            # The checks of linear() done once (same weight objects): straight to the GEMV.
            n, k = w.shape
            m = x.shape[0]
            y = torch.empty((m, n), dtype=torch.bfloat16)
            if ready[2].fn(x.data_ptr(), x.stride(0), w.data_ptr(),
                           b.data_ptr() if b is not None else None, y.data_ptr(), n, m, n, k,
                           torch.get_num_threads()) == 0:
                return y
        y = gemm.linear(x, self.weight, self.bias)  # no native bf16 GEMM on this CPU
        if y is not None:
            return y
        # oneDNN, its rows padded to a few sizes (gemm.bucket_rows: no new primitive a step).
        return gemm.onednn_linear(x, self.weight, self.bias, self.pf_packed_weight)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _bf16_cpu_matrix(w: torch.Tensor) -> bool:
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2


def use_fast_linears(model: torch.nn.Module, prepack_limit: int = PREPACK_LIMIT_BYTES) -> int:
    """Route this model's ``nn.Linear`` layers (the instances, not the class) through the
    fastest CPU path for bf16 inputs: each weight's own GEMV up to its rows (chosen per
    weight shape by :func:`pagefold.csrc.gemv_choice.choose`: measured, cached), else oneDNN
    with the weight reordered once into its blocked layout (``F.linear`` reorders it on every
    call, which for decode-sized batches costs more than the product); on CPUs with no native
    bf16 GEMM, :func:`pagefold.csrc.gemm.linear` above the GEMV's rows (float32 sums and one
    rounding, as oneDNN; the packed copies are then not made). The oneDNN results are the
    same bits as ``F.linear``. The reordered copies double the linear weights' memory, so
    they are made only when those weights total at most ``prepack_limit`` bytes. lm_heads
    (``pf_logits``, set by ``layers.vocab.lm_head_linear``) return float32 logits where
    :func:`float_logits` applies. Modules with stacked matrices of their own (MoE experts)
    take part through two methods: ``gemv_shapes() -> [(N, K), ...]`` and
    ``set_gemv_choices([Choice, ...])`` (same order). Call again after changing weights.
    Returns how many linears were routed."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    stacked = [m for m in model.modules() if hasattr(m, "gemv_shapes")]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # Where bf16 products go through float32 (gemm.py), a packed bf16 copy would only cost
    # memory.
    pack = total <= prepack_limit and not gemm.upcast_enabled()
    lib = kernels()
    shapes = [tuple(m.weight.shape) for m in linears if _bf16_cpu_matrix(m.weight)]
    shapes += [s for m in stacked for s in m.gemv_shapes()]
    choices = (gemv_choice.choose(lib, shapes, sources=list(model.parameters()))
               if lib is not None and shapes else {})
    for mod in linears:
        w = mod.weight
        # lm_heads (a target's, a draft's): float32 logits where the products are pagefold's
        # own (float_logits), so bf16 rounding never ties them.
        mod.pf_float_out = getattr(mod, "pf_logits", False)
        mod.pf_packed_weight = (prepack(w.detach()) if pack and w.dtype == torch.bfloat16
                                and w.device.type == "cpu" else None)
        choice = choices.get(tuple(w.shape), NO_GEMV) if _bf16_cpu_matrix(w) else NO_GEMV
        mod.pf_gemv = _gemv_ready(mod, choice)
        mod.forward = _fast_linear_forward.__get__(mod)
    for mod in stacked:
        mod.set_gemv_choices([choices.get(s, NO_GEMV) for s in mod.gemv_shapes()])
    return len(linears)
