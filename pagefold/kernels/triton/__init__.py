"""Triton kernels over pagefold's pages (the GPU path; on the CPU through Triton's interpreter).

Importing this package imports ``triton``: :mod:`pagefold.kernels.dispatch` does so only when
the Triton back end is selected, after setting ``TRITON_INTERPRET=1`` on a machine without
CUDA (the interpreter mode is fixed when the kernels are decorated, at import).
"""
