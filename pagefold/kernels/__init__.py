"""The kernel mode policy (:mod:`.dispatch`, ``PAGEFOLD_KERNELS``); the kernels themselves live
with their ops in :mod:`pagefold.ops`, the compiled CPU library in :mod:`pagefold.csrc`."""
