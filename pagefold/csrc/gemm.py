"""bf16 matrix products on CPUs whose GEMM library has no native bf16 dot product.

oneDNN multiplies bf16 matrices fast only with AVX512-BF16 or AMX. Elsewhere (AVX2 parts,
AVX512 parts without BF16) torch's bf16 GEMM converts inside its inner loop and runs several
times slower than float32: measured on a 2-core AVX2 EPYC, ~20 GFLOP/s bf16 against ~165
GFLOP/s float32 for ``256 x 576 @ 576 x 1536``. There :func:`linear` converts the weight to
float32 one slice at a time (a reused scratch buffer of at most ``SLICE_ELEMS`` elements, so
the extra memory is a few MiB however large the weight), multiplies in float32 and rounds the
result to bf16 once: float32 sums and one rounding, the same arithmetic contract as oneDNN's
bf16 matmul (only the summation order differs).

Converting costs one pass over the weight, so it pays only when enough rows share it:
``MIN_ROWS`` (prefill chunks, large decode batches); decode steps of a few rows keep the bf16
GEMV / GEMM.

On by default where the CPU lacks native bf16 GEMM (``PAGEFOLD_BF16_UPCAST=0`` turns it off,
``=force`` turns it on anywhere, for tests). It was opt-in until the twelfth session because
its last-bit roundings differ from oneDNN's, and on a borderline prompt of the trained SmolLM2
in bf16 ("What is the capital of France?") that flipped the first token ("L'Étoile, ..."
instead of "The capital of France is Paris."). That flip was an exact tie of bf16-rounded
logits (both -1.876), not a worse product: the lm_head now returns float32 logits on these
CPUs (``cpu_ops.use_fast_linears``), which answers "Paris" either way. float32 models never
take this path.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

MIN_ROWS = 16
SLICE_ELEMS = 1 << 20  # 4 MiB of float32 weight per slice: stays in the last-level cache

_scratch = threading.local()


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX (torch's probes); ``PAGEFOLD_NATIVE_BF16=0``/``1`` overrides, e.g.
    to measure with ``ONEDNN_MAX_CPU_ISA=AVX2`` how a CPU without them behaves."""
    flag = os.environ.get("PAGEFOLD_NATIVE_BF16")
    if flag in ("0", "1"):
        return flag == "1"
    cpu = torch.cpu
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None and fn():
            return True
    return False


def upcast_enabled() -> bool:
    """Whether bf16 products of ``MIN_ROWS`` or more rows go through float32 here: by default
    on CPUs without native bf16 GEMM; ``PAGEFOLD_BF16_UPCAST=0`` never, ``=force`` always."""
    flag = os.environ.get("PAGEFOLD_BF16_UPCAST", "auto")
    if flag == "force":
        return True
    return flag != "0" and not cpu_has_fast_bf16()


def _buffer(n: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        # A normal tensor even when first made under inference mode: it is written both
        # inside and outside it.
        with torch.inference_mode(False):
            buf = torch.empty(n, dtype=torch.float32)
        _scratch.buf = buf
    return buf[:n]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_float: bool = False) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for 2-D bf16 ``x`` of at least ``MIN_ROWS`` rows on the CPU,
    through float32 weight slices; ``None`` when the inputs or this CPU call for the plain
    path (another dtype or device, few rows, native bf16 GEMM, the path turned off).
    ``out_float``: return the float32 sums unrounded (an lm_head's logits)."""
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.shape[0] < MIN_ROWS or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.dim() != 2 or not upcast_enabled()):
        return None
    n, k = weight.shape
    xf = x.float()
    step = max(1, SLICE_ELEMS // max(k, 1))
    if step >= n:  # one slice: the product lands straight in the output
        wf = _buffer(n * k).view(n, k)
        wf.copy_(weight)
        y = torch.addmm(bias.float(), xf, wf.t()) if bias is not None else xf @ wf.t()
        return y if out_float else y.to(torch.bfloat16)
    out = torch.empty((x.shape[0], n), dtype=torch.float32 if out_float else torch.bfloat16)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        wf = _buffer((n1 - n0) * k).view(n1 - n0, k)
        wf.copy_(weight[n0:n1])
        p = torch.addmm(bias[n0:n1].float(), xf, wf.t()) if bias is not None else xf @ wf.t()
        out[:, n0:n1].copy_(p)
    return out


def matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) through :func:`linear` where it applies, else
    :func:`onednn_linear`; for expert weights and other matrices that are not ``nn.Linear``
    modules."""
    y = linear(x, weight) if x.dim() == 2 else None
    return onednn_linear(x, weight) if y is None else y


# oneDNN makes (JIT-compiles) and caches a primitive per product shape, rows included, and
# making one costs far more than the product: measured on the AMX Xeon at 2 threads, a new row
# count took 2.1-2.9 ms against 0.15-0.35 ms cached for 768 x 256 at ~500 rows, 20-25 ms
# against 6-10 ms for 10240 x 1024, 12-18 ms against 3.4-4 ms for 1024 x 5120. Prefill chunks
# and mixed steps bring a new row count almost every step (a prompt's length, the decode rows
# beside it, the tokens each MoE expert drew), so each would pay it. Rows above
# EXACT_ROWS are rounded up to one of ROWS_PER_OCTAVE sizes per power of two (at most 1/8
# more rows, ~6% on average; the padding rows are zeros and their outputs dropped): a few
# dozen shapes per matrix, made once. A row's result does not depend on the rows beside it
# (tested), so the kept rows are the unpadded product's bits.
EXACT_ROWS = 32
ROWS_PER_OCTAVE = 8


def bucket_rows(m: int) -> int:
    """The rows a oneDNN product of ``m`` rows runs with: ``m`` up to :data:`EXACT_ROWS`, else
    ``m`` rounded up to a multiple of ``2**floor(log2 m) / ROWS_PER_OCTAVE``."""
    if m <= EXACT_ROWS:
        return m
    step = (1 << (m.bit_length() - 1)) // ROWS_PER_OCTAVE
    return -(-m // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or oneDNN's product with ``packed`` (``weight`` reordered
    once: ``cpu_ops.prepack``), with a 2-D bf16 CPU ``x``'s rows padded to
    :func:`bucket_rows` and the result's extra rows dropped (a view of the first rows)."""
    m = x.shape[0] if x.dim() == 2 else 0
    rows = bucket_rows(m)
    if rows != m and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        padded = x.new_empty((rows, x.shape[1]))
        padded[:m].copy_(x)
        padded[m:].zero_()
        x = padded
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    return y if y.shape[0] == m or m == 0 else y[:m]
