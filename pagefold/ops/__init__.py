"""The kernel wing: one package per op (``gdn``, ``ssd``, ``conv1d``, ``selective_scan``,
``lightning``, ``kda``, ``attention``, ``elementwise``), each with its torch forms (naive /
recurrent / chunked / verify; ``torch.py``), its Triton forms (``triton.py``, imported only
when :mod:`pagefold.kernels.dispatch` selects Triton), its compiled CPU entry (``cpu.py``,
ctypes over :mod:`pagefold.csrc.cpu_ops`' library) and ONE public entry, the package itself,
which owns the choice of route (device, dtype, ``PAGEFOLD_KERNELS``, captures, verify).
Models and layers call the package and nothing below it. :mod:`.common` holds what the ops
share (capture destinations, the Triton paged-state addressing). Nothing here imports
:mod:`pagefold.layers` or :mod:`pagefold.models`.
"""
