"""The few-row bf16 product kernels this build may offer, as one table (:data:`CANDIDATES`).

Each :class:`Candidate` names a compiled GEMV (all take ``pf_linear_bf16``'s arguments: x, x
stride, w, bias, y, y stride, M, N, K, threads), the most rows it is meant for, its
float32-output twin where there is one (an lm_head's unrounded logits), and a predicate "can
run here" (the build has it, the OS granted the AMX tile state). :func:`available` lists the
candidates that can run and pass :func:`self_check` (a small awkward product against a
torch float32 reference), so a kernel this CPU cannot run, or one that computes wrong
results, is never handed out. :func:`flag_default` is the choice CPU flags alone would
make (the choice before measurements; the chooser keeps it unless another is clearly
faster). :mod:`pagefold.csrc.gemv_choice` measures and picks among them per weight shape.

Every candidate keeps a row's bits independent of how many rows share a call (tested), so a
speculative verify step computes what decode steps would, as long as one weight uses one
kernel for all its GEMV rows.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagefold.csrc import gemm

# Rows up to which a kernel is offered at all (the tile kernel's limit; the others take any
# count, but past ~32 rows the GEMM library wins on every CPU measured).
MAX_ROWS = 32


@dataclass(frozen=True)
class Candidate:
    """A compiled GEMV. ``default_rows``: its row limit when chosen by flags or forced (the
    limits the project measured by hand, ``cpu_ops``' constants before measurement)."""

    name: str
    symbol: str
    default_rows: int
    f32_symbol: str | None
    runnable: Callable[[ctypes.CDLL], bool]
    what: str


def _kinds(lib: ctypes.CDLL) -> int:
    return int(lib.pf_gemv_kinds())


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("amx", "pf_linear_bf16_amx", 32, None, lambda lib: bool(lib.pf_amx_ready()),
              "AMX tiles (16 weight rows x 32 k per tile; the OS must grant the tile state)"),
    Candidate("avx512bf16", "pf_linear_bf16", 2, None, lambda lib: bool(_kinds(lib) & 1),
              "AVX512-BF16 dot products (vdpbf16ps)"),
    Candidate("fma", "pf_linear_bf16_fma", 32, "pf_linear_bf16_fma_f32out",
              lambda lib: bool(_kinds(lib) & 2), "AVX2 + FMA, weights widened in registers"),
    # pf_linear_bf16 without AVX512-BF16 or FMA in the build: a plain loop, the last resort.
    Candidate("scalar", "pf_linear_bf16", 2, None, lambda lib: not _kinds(lib) & 3,
              "portable scalar loop"),
)
NAMES = tuple(c.name for c in CANDIDATES)


def by_name(name: str) -> Candidate:
    for c in CANDIDATES:
        if c.name == name:
            return c
    raise KeyError(name)


def call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out_dtype: torch.dtype = torch.bfloat16,
         fill: float | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` through the GEMV ``fn`` (a ctypes function with
    ``pf_linear_bf16``'s arguments), or None when the inputs are not ones it takes (dtype,
    device, strides, sizes) or the kernel declines them (nothing written then)."""
    if (weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.shape[0] < 1 or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.dim() != 2 or not weight.is_contiguous() or x.stride(1) != 1
            or x.shape[1] != weight.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.numel() != weight.shape[0]))):
        return None
    n, k = weight.shape
    m = x.shape[0]
    # ``fill``: the output's values before the call (the self-check fills NaN, so an output
    # the kernel leaves unwritten fails it instead of showing a reused buffer's old values).
    y = (torch.empty((m, n), dtype=out_dtype) if fill is None
         else torch.full((m, n), fill, dtype=out_dtype))
    rc = fn(x.data_ptr(), x.stride(0), weight.data_ptr(),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m, n, k,
            torch.get_num_threads())
    return y if rc == 0 else None


# The self-check's product: K not a multiple of any vector width or of the AMX tile's 32, N
# not a multiple of the 16-row tiles, rows on both sides of 16, a bias.
_CHECK_N, _CHECK_K, _CHECK_ROWS = 37, 100, (1, 3, 17)


def self_check(fn, rows_limit: int = MAX_ROWS, f32: bool = False) -> bool:
    """Whether ``fn`` computes ``x @ w.T + b`` within bf16 rounding of the float32 product on
    a small awkward shape (and, for a float32-output twin, within float32 rounding)."""
    g = torch.Generator().manual_seed(45)
    w = (torch.randn(_CHECK_N, _CHECK_K, generator=g) * _CHECK_K**-0.5).bfloat16()
    b = torch.randn(_CHECK_N, generator=g).bfloat16()
    x = torch.randn(max(_CHECK_ROWS), _CHECK_K, generator=g).bfloat16()
    for m in _CHECK_ROWS:
        if m > rows_limit:
            continue
        ref = x[:m].double() @ w.double().t() + b.double()
        got = call(fn, x[:m], w, b, torch.float32 if f32 else torch.bfloat16,
                   fill=float("nan"))
        if got is None or not torch.isfinite(got).all():
            return False
        tol = 1e-5 if f32 else 2 ** -7  # one bf16 ulp relative (8 bits of mantissa)
        if ((got.double() - ref).abs() > tol * (1.0 + ref.abs())).any():
            return False
    return True


def available(lib: ctypes.CDLL | None,
              check: Callable[[Candidate, ctypes.CDLL], bool] | None = None
              ) -> list[Candidate]:
    """The candidates ``lib`` can run here that pass ``check`` (default :func:`self_check` on
    the kernel and its float32 twin), in :data:`CANDIDATES` order; [] without the library."""
    if lib is None:
        return []
    out = []
    for c in CANDIDATES:
        try:
            ok = c.runnable(lib) and (check or _check)(c, lib)
        except (AttributeError, OSError):  # an older build without the symbol
            ok = False
        if ok:
            out.append(c)
    return out


def _check(c: Candidate, lib: ctypes.CDLL) -> bool:
    return self_check(getattr(lib, c.symbol), MAX_ROWS) and (
        c.f32_symbol is None or self_check(getattr(lib, c.f32_symbol), MAX_ROWS, f32=True))


def flag_default(names: list[str] | tuple[str, ...]) -> str | None:
    """The kernel CPU flags alone pick among ``names`` (the runnable ones): the AVX2 + FMA
    kernel where the CPU has no native bf16 GEMM; where it has, the AMX tiles, else the
    dot-product GEMV; the scalar loop last; None when none runs."""
    order = (["amx", "avx512bf16", "scalar", "fma"] if gemm.cpu_has_fast_bf16()
             else ["fma", "avx512bf16", "scalar"])
    for name in order:
        if name in names:
            return name
    return None
