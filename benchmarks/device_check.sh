#!/usr/bin/env bash
# The device check: ONE call on the lent GPU machine (under 10 minutes), e.g. with the device
# tool:   run(command="bash benchmarks/device_check.sh", carry=[".whl"], timeout_s=590)
#
# 1. the exactness suite on CUDA (float32 tiny models; Triton kernels compiled, CUDA graphs on)
#    against transformers: the Triton kernel tests (state captures and verify passes
#    included), the Triton/CUDA-graph engine tests and the model suites (dense, Gated
#    DeltaNet, Mamba-2);
# 2. python -m benchmarks.chunked_kernels: prefill tokens/s and TFLOP/s of the chunked (WY /
#    SSD) Triton GDN and Mamba-2 kernels against their token loops (Qwen3-Next / Nemotron-H
#    layer shapes, 4 x 4096 tokens);
# 3. python -m benchmarks.device_check: bf16 exactness vs transformers on the GPU, then
#    pagefold vs transformers (batch-1 decode bandwidth vs the device copy, batch 64, prefill
#    FLOPs vs the bf16 matmul rate) on ~150M and ~1B shapes.
# Everything lands in $OUT (env.txt, pytest.log, chunked.log, bench.log,
# chunked_kernels.{json,md}, device_check.{json,md}). Time: 250 + 80 + 240 s at most.
#
# Wheels: the image has torch, triton and transformers. If its transformers lacks a model the
# tests build, run benchmarks/device_wheels.sh here first (it fills .whl/, git-ignored) and
# carry .whl: they are installed into /tmp/site below.
set -uo pipefail
OUT=${OUT:-/tmp/pagefold-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD" || exit 1
fi
unset TRITON_INTERPRET PAGEFOLD_KERNELS  # auto: CUDA -> Triton
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

timeout 250 python3 -m pytest -q -p no:cacheprovider -x --durations=10 \
  tests/test_triton_kernels.py tests/test_triton_chunked.py tests/test_triton_models.py \
  tests/test_triton_steps.py tests/test_triton_steps_engine.py tests/test_cuda_graphs.py \
  tests/test_engine_dense.py tests/test_models_gdn.py tests/test_models_mamba2.py \
  2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

timeout 80 python3 -m benchmarks.chunked_kernels --out "$OUT" 2>&1 | tee "$OUT/chunked.log"
echo "chunked exit: ${PIPESTATUS[0]}" | tee -a "$OUT/chunked.log"

timeout 240 python3 -m benchmarks.device_check --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
