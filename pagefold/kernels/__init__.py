"""Kernel back ends beyond the pure-torch paths: the dispatch point (:mod:`.dispatch`) and the
Triton kernels (:mod:`.triton`). The compiled CPU kernels live in :mod:`pagefold.csrc`."""
