// Quantized matrices in the native decode driver (decode_step.cpp): a GemvFn whose weight
// argument is a QuantMatrix descriptor, so a record's matrix is bf16 (the weight itself, and
// pf_linear_bf16 / _fma / _amx) or quantized (this descriptor, and pf_linear_quant) under one
// signature, and a GGUF / GPTQ / AWQ / int8 / FP8 model runs the same driver as a bf16 one.
//
// pf_linear_quant does what the module path does with such a layer on bf16 rows
// (pagefold/quantization/gguf_kernel.py, int_kernel.py, gguf.py, linear.py): the rows widened
// to float32, the format's few-row kernel (float32 results), each result rounded to bf16
// (nearest even), then the bf16 bias added and rounded again (torch's bf16 add): the module
// path's bits.
#include <cstdint>
#include <memory>

#include "common.h"
#include "kernels.h"

namespace {

// Weight formats (pagefold/quantization/native_matrix.py's FORMATS).
enum Format : int64_t {
  kAffine = 1,    // GGUF codes, w = scale * code + min; float32 activations (pf_qgemv_affine)
  kAffineQ8 = 2,  // the same weights on int8 activations (pf_qgemv_affine_q8)
  kInt = 3,       // w = scale * (code - zero), integer or FP8 codes (pf_qgemv_int)
  kAffineQ8mm = 4,  // GGUF codes on int8 activations, AMX tiles from a few rows (qgemm_amx.cpp)
};

// Elements (rows x columns) from which pf_linear_quant widens the rows and rounds the results
// on its threads (below: one thread; a parallel region costs a few microseconds).
constexpr int64_t kParallelFrom = 16384;

// One matrix: its format, codes, per row and group scales and mins / zeros, code bits, group,
// and a flag (affine: float16 scales and mins; integer: FP8 codes).
struct QuantMatrix {
  int64_t format;
  const uint8_t* codes;
  const void* scale;
  const void* aux;
  int64_t bits, group, flag;
};

}  // namespace

extern "C" {

// The descriptor's size in int64 words: Python checks its ctypes mirror against it.
int pf_quant_matrix_words() { return static_cast<int>(sizeof(QuantMatrix) / sizeof(int64_t)); }

// y (M rows of N, stride y_stride, bf16) = x (M rows of K, stride x_stride, bf16) times the
// QuantMatrix at w, transposed, plus bias (N bf16, or null). 0 on success, nonzero when the
// format's kernel refuses the arguments (nothing written then).
int pf_linear_quant(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                    int64_t y_stride, int M, int64_t N, int64_t K, int nthreads) {
  const QuantMatrix& q = *static_cast<const QuantMatrix*>(w);
  if (M < 1 || N < 1 || K < 1) return 1;
  // Uninitialized: every element is written below / by the kernel. The widening and the
  // rounding back run on the call's threads from a size where a serial pass showed (a
  // 32-row step's outputs widened on one thread while the other waited: ~1 ms a SmolLM2
  // step); each element's value does not depend on the split.
  std::unique_ptr<float[]> xbuf(new float[static_cast<size_t>(M * K)]);
  std::unique_ptr<float[]> ybuf(new float[static_cast<size_t>(M * N)]);
  float* const xf = xbuf.get();
  float* const yf = ybuf.get();
  const uint16_t* xs = static_cast<const uint16_t*>(x);
#pragma omp parallel for num_threads(nthreads) schedule(static) \
    if (nthreads > 1 && M * K >= kParallelFrom)
  for (int64_t r = 0; r < M; ++r) pf::to_float(xs + r * x_stride, xf + r * K, K);
  int rc;
  switch (q.format) {
    case kAffine:
      rc = pf_qgemv_affine(xf, M, K, N, q.codes, static_cast<int32_t>(q.bits), q.group,
                           q.scale, q.aux, static_cast<int32_t>(q.flag), yf, N, nthreads);
      break;
    case kAffineQ8:
      rc = pf_qgemv_affine_q8(xf, M, K, N, q.codes, static_cast<int32_t>(q.bits),
                              q.group, q.scale, q.aux, static_cast<int32_t>(q.flag), yf,
                              N, nthreads);
      break;
    case kAffineQ8mm:
      rc = pf_qgemm_affine_q8(xf, M, K, N, q.codes, static_cast<int32_t>(q.bits),
                              q.group, q.scale, q.aux, static_cast<int32_t>(q.flag), yf,
                              N, nthreads);
      break;
    case kInt:
      rc = pf_qgemv_int(xf, M, K, N, q.codes, static_cast<int32_t>(q.bits),
                        static_cast<int32_t>(q.flag), q.group, static_cast<const float*>(q.scale),
                        static_cast<const float*>(q.aux), yf, N, nthreads);
      break;
    default:
      return 1;
  }
  if (rc) return rc;
  uint16_t* ys = static_cast<uint16_t*>(y);
  const uint16_t* b = static_cast<const uint16_t*>(bias);
#pragma omp parallel for num_threads(nthreads) schedule(static) \
    if (nthreads > 1 && M * N >= kParallelFrom)
  for (int64_t r = 0; r < M; ++r) {
    int64_t o = 0;
#if defined(PF_AVX512)
    // 16 at a time, the same roundings (vrnd / vstore round as f32_to_bf16 does)
    for (; o + 16 <= N; o += 16) {
      __m512 v = pf::vrnd<uint16_t>(_mm512_loadu_ps(yf + r * N + o));
      if (b) v = _mm512_add_ps(v, pf::vload<uint16_t>(b + o));
      pf::vstore<uint16_t>(ys + r * y_stride + o, v);
    }
#endif
    for (; o < N; ++o) {
      uint16_t v = pf::f32_to_bf16(yf[r * N + o]);
      if (b) v = pf::f32_to_bf16(pf::bf16_to_f32(v) + pf::bf16_to_f32(b[o]));
      ys[r * y_stride + o] = v;
    }
  }
  return 0;
}

}  // extern "C"
