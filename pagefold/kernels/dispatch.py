"""The one place that chooses which kernels run: ``PAGEFOLD_KERNELS``.

* ``auto`` (default): the best for the tensors' device: Triton on CUDA (when ``triton``
  imports), the compiled C++ kernels on the CPU (:mod:`pagefold.csrc.cpu_ops`), else torch.
* ``triton``: the Triton kernels on any device; without CUDA they run under Triton's
  interpreter (``TRITON_INTERPRET=1`` is set before ``triton`` is first imported; slow, for
  tests). An error if ``triton`` cannot be imported.
* ``cpu``: the C++ kernels where they apply, torch elsewhere (never Triton).
* ``torch``: the pure-torch fallbacks only.

``PAGEFOLD_CPU_KERNELS=0`` still switches the C++ kernels off whatever the mode. The mode is
read once, at import; :func:`set_mode` changes it for this process (tests compare paths).

The ``*`` ops below have the signatures of their :mod:`pagefold.csrc.cpu_ops` counterparts and
the same contract (``None`` / ``False``: not handled, the caller takes its torch path); the
layers call these instead of ``cpu_ops`` so that the choice is made here only.
"""

from __future__ import annotations

import os
import sys

import torch

from pagefold.csrc import cpu_ops

MODES = ("auto", "triton", "cpu", "torch")

_CPU_ENV = cpu_ops.enabled()  # False under PAGEFOLD_CPU_KERNELS=0
_mode = "auto"
_triton_ok: bool | None = None
_T = None  # the namespace of Triton entry points, once imported


def mode() -> str:
    return _mode


def set_mode(m: str) -> None:
    """Select the kernels for this process (one of :data:`MODES`)."""
    global _mode
    m = (m or "auto").strip().lower()
    if m not in MODES:
        raise ValueError(f"PAGEFOLD_KERNELS must be one of {MODES}, got {m!r}")
    _mode = m
    cpu_ops.set_enabled(_CPU_ENV and m in ("auto", "cpu"))
    if m == "triton":
        _load_triton(required=True)


def prepare_interpreter() -> None:
    """Without CUDA, make Triton interpret the kernels: must run before pagefold's Triton
    modules are imported (kernels are bound to compiled or interpreted mode when decorated)."""
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton.language" in sys.modules:
        # Triton's own library functions (tl.sum, tl.max, ...) were bound to compiled mode
        # when it was imported: too late to interpret now.
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sum, InterpretedFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; set it "
                               "in the environment to run the Triton kernels without CUDA")


def _load_triton(required: bool = False) -> bool:
    global _triton_ok, _T
    if _triton_ok is None:
        try:
            prepare_interpreter()
            from pagefold.kernels.triton import ops as t_ops

            _T, _triton_ok = t_ops, True
        except ImportError as e:
            _triton_ok = False
            if required:
                raise RuntimeError(f"PAGEFOLD_KERNELS=triton but triton is unavailable: {e}") \
                    from e
    if required and not _triton_ok:
        raise RuntimeError("PAGEFOLD_KERNELS=triton but triton is unavailable")
    return bool(_triton_ok)


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the Triton kernels."""
    if _mode == "triton":
        return _load_triton(required=True)
    if _mode == "auto" and device.type == "cuda":
        return _load_triton()
    return False


def backend(device: torch.device) -> str:
    """``"triton"``, ``"cpu"`` or ``"torch"``: what hot paths on ``device`` run."""
    if use_triton(device):
        return "triton"
    if device.type == "cpu" and cpu_ops.kernels() is not None:
        return "cpu"
    return "torch"


# --- ops: one routing per hot path ------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    if use_triton(x.device):
        return _T.rms_norm(x, weight, eps, zero_centered, residual=residual)
    return cpu_ops.rms_norm(x, weight, eps, zero_centered, residual=residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    if use_triton(gate_up.device):
        return _T.silu_and_mul(gate_up)
    return cpu_ops.silu_and_mul(gate_up)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor] | None:
    if use_triton(qkv.device):
        return _T.qk_norm_rope(qkv, positions, cos, sin, **kw)
    return cpu_ops.qk_norm_rope(qkv, positions, cos, sin, **kw)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    if use_triton(x.device):
        return _T.rms_norm_gated(x, gate, weight, eps)
    return cpu_ops.rms_norm_gated(x, gate, weight, eps)


def gdn(view, page_ids, has_initial_state, cu_seqlens, mixed, a, b, conv_weight, A_log,
        dt_bias, **kw) -> torch.Tensor | None:
    """A Gated DeltaNet layer (conv + delta rule) over its pages; see ``cpu_ops.gdn``. On
    Triton: the chunked (WY) kernel when the batch holds a prefill chunk or state captures
    (``capture=``, prefix-cache checkpoints inside the step; ``kernels.triton.state_steps``),
    the token loop for all-decode batches (``kernels.triton.gdn.gdn_layer``)."""
    if use_triton(mixed.device):
        return _T.gdn_layer(view, page_ids, has_initial_state, cu_seqlens, mixed, a, b,
                            conv_weight, A_log, dt_bias, **kw)
    return cpu_ops.gdn(view, page_ids, has_initial_state, cu_seqlens, mixed, a, b,
                       conv_weight, A_log, dt_bias, **kw)


def gdn_verify(view, page_ids, has_initial_state, cu_seqlens, mixed, a, b, conv_weight, A_log,
               dt_bias, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A GDN layer's speculative verify pass (Triton only; None: the torch path):
    ``(o, {"conv": (T, C, K-1), "ssm": (T, H, Dk, Dv)})``, the states after every token, as
    ``spec_decode.state_verify``'s kernels give them; nothing is stored in the pages."""
    if use_triton(mixed.device):
        return _T.gdn_verify_layer(view, page_ids, has_initial_state, cu_seqlens, mixed, a, b,
                                   conv_weight, A_log, dt_bias, **kw)
    return None


def mamba_scan(view, page_ids, has_initial_state, cu_seqlens, xbc, conv_weight, conv_bias,
               dt, A, D, **kw) -> torch.Tensor | None:
    """A Mamba-2 mixer's conv + SSD scan over its pages (Triton only; None: torch path):
    the chunked SSD kernel for batches with a prefill chunk or state captures (``capture=``),
    the token loop for decode."""
    if use_triton(xbc.device):
        return _T.mamba_scan_layer(view, page_ids, has_initial_state, cu_seqlens, xbc,
                                   conv_weight, conv_bias, dt, A, D, **kw)
    return None


def mamba_verify(view, page_ids, has_initial_state, cu_seqlens, xbc, conv_weight, conv_bias,
                 dt, A, D, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A Mamba-2 mixer's speculative verify pass (Triton only; None: the torch path); see
    :func:`gdn_verify`."""
    if use_triton(xbc.device):
        return _T.mamba_verify_layer(view, page_ids, has_initial_state, cu_seqlens, xbc,
                                     conv_weight, conv_bias, dt, A, D, **kw)
    return None


def paged_attention(q, k, v, cache, meta, scale) -> torch.Tensor | None:
    """The Triton paged attention (None: the caller's own path)."""
    if use_triton(q.device):
        return _T.paged_attention(q, k, v, cache, meta, scale)
    return None


set_mode(os.environ.get("PAGEFOLD_KERNELS", "auto"))
