# Source this to run pagefold on an AVX512-BF16 / AMX host as on a CPU without native bf16
# GEMM (AVX2 + FMA only), e.g. to measure the few-row bf16 kernel's routing:
#   . benchmarks/avx2_env.sh && python -m benchmarks.bf16_gemv
# The compiled kernels are built for x86-64-v3 (a g++ wrapper whose --version differs, so the
# kernel cache keeps both builds), oneDNN and torch's own kernels are capped at AVX2, and
# pagefold is told the CPU has no native bf16 GEMM. One thread: on a shared host it is the
# steadier measure (unset OMP_NUM_THREADS for torch's default).
_pf_cxx="${TMPDIR:-/tmp}/pagefold-gxx-x86-64-v3"
cat > "$_pf_cxx" <<'WRAP'
#!/bin/sh
if [ "$1" = "--version" ]; then echo "x86-64-v3 wrapper"; exec g++ --version; fi
exec g++ "$@" -march=x86-64-v3
WRAP
chmod +x "$_pf_cxx"
export CXX="$_pf_cxx" ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PAGEFOLD_NATIVE_BF16=0
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
unset _pf_cxx
