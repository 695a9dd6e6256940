# Source this to run pagefold on an AMX host as on an AVX-512 CPU with AVX512-BF16 and no AMX
# (AMD Zen 4 / Zen 5's instruction set; not their cores or memory), e.g.:
#   . benchmarks/avx512_env.sh && python -m benchmarks.bf16_gemv
# The compiled kernels are built with -march=native minus AMX and AVX512-FP16 (a g++ wrapper
# whose --version differs, so the kernel cache keeps both builds), oneDNN is capped at
# AVX512_CORE_BF16 (no AMX tiles in torch's bf16 GEMM either).
_pf_cxx="${TMPDIR:-/tmp}/pagefold-gxx-avx512-noamx"
cat > "$_pf_cxx" <<'WRAP'
#!/bin/sh
if [ "$1" = "--version" ]; then echo "avx512 no-AMX wrapper"; exec g++ --version; fi
exec g++ "$@" -mno-amx-tile -mno-amx-bf16 -mno-amx-int8 -mno-avx512fp16
WRAP
chmod +x "$_pf_cxx"
export CXX="$_pf_cxx" ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1
unset _pf_cxx
