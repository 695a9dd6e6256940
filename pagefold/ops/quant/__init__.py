"""Weight-only quantized products on the GPU (:mod:`.triton`); the CPU's compiled kernel is
``csrc/quant.cpp`` and the torch reference ``quantization.int_kernel.IntWeight.reference``."""
