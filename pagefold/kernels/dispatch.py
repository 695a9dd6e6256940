"""The one place that chooses which kernels run: ``PAGEFOLD_KERNELS``.

* ``auto`` (default): the best for the tensors' device: Triton on CUDA (when ``triton``
  imports), the compiled C++ kernels on the CPU (``pagefold/ops/<op>/cpu.py``), else torch.
* ``triton``: the Triton kernels on any device; without CUDA they run under Triton's
  interpreter (``TRITON_INTERPRET=1`` is set before ``triton`` is first imported; slow, for
  tests). An error if ``triton`` cannot be imported.
* ``cpu``: the C++ kernels where they apply, torch elsewhere (never Triton).
* ``torch``: the pure-torch fallbacks only.

``PAGEFOLD_CPU_KERNELS=0`` still switches the C++ kernels off whatever the mode. The mode is
read once, at import; :func:`set_mode` changes it for this process (tests compare paths).

This module holds the mode policy only; each op's entry (:mod:`pagefold.ops`) asks
:func:`use_triton` and owns the rest of its route.
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
    global _triton_ok
    if _triton_ok is None:
        try:
            prepare_interpreter()
            import triton.language  # noqa: F401 - the ops import their Triton modules lazily

            _triton_ok = True
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


set_mode(os.environ.get("PAGEFOLD_KERNELS", "auto"))
