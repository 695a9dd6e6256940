// Punica-style batched LoRA (pagefold/ops/lora): every row of a step carries the slot of its
// adapter (-1: the base model, no adapter); the slots' matrices are stacked.
//   shrink:  v[i, r] = sum_k x[i, k] * A[slot_i, r, k]            (float32 out; 0 for slot -1)
//   expand:  y[i, o] = TY(y[i, o] + sum_r v[i, r] * Bt[slot_i, r, o])  (rows of slot -1 untouched)
// Bt is B transposed, (R, O) per slot, so the expand runs along contiguous outputs.
// Sums run in float32 in k / r order (torch's reference sums in another order: equal up to
// float32 rounding). A row of slot -1 is never read or written by expand, so base rows keep
// their bits.

#include <algorithm>

#include "common.h"
#include "kernels.h"

namespace pf {
namespace {

template <typename T>
void shrink_rows(const T* x, int64_t xs, const T* a, const int64_t* idx, float* v, int64_t N,
                 int R, int K, int nthreads) {
  const bool par = nthreads > 1 && N * R * static_cast<int64_t>(K) >= (1 << 15);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t item = 0; item < N * R; ++item) {
    const int64_t i = item / R;
    const int r = static_cast<int>(item % R);
    const int64_t s = idx[i];
    if (s < 0) {
      v[item] = 0.0f;
      continue;
    }
    const T* xr = x + i * xs;
    const T* ar = a + (s * R + r) * static_cast<int64_t>(K);
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int k = 0; k < K; ++k) acc += load<T>(xr, k) * load<T>(ar, k);
    v[item] = acc;
  }
}

constexpr int kOutBlock = 256;  // outputs per work item (a float32 accumulator row)

template <typename T>
void expand_rows(T* y, int64_t ys, const float* v, const T* bt, const int64_t* idx, int64_t N,
                 int O, int R, int nthreads) {
  const int nb = (O + kOutBlock - 1) / kOutBlock;
  const bool par = nthreads > 1 && N * O * static_cast<int64_t>(R) >= (1 << 15);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t item = 0; item < N * nb; ++item) {
    const int64_t i = item / nb;
    const int o0 = static_cast<int>(item % nb) * kOutBlock;
    const int n = std::min(kOutBlock, O - o0);
    const int64_t s = idx[i];
    if (s < 0) continue;
    float acc[kOutBlock];
    for (int o = 0; o < n; ++o) acc[o] = 0.0f;
    for (int r = 0; r < R; ++r) {  // r in order: each output sums its terms as the scalar dot
      const float vr = v[i * R + r];
      const T* br = bt + (s * R + r) * static_cast<int64_t>(O) + o0;
#pragma omp simd
      for (int o = 0; o < n; ++o) acc[o] += vr * load<T>(br, o);
    }
    T* yr = y + i * ys + o0;
#pragma omp simd
    for (int o = 0; o < n; ++o) store<T>(yr, o, load<T>(yr, o) + acc[o]);
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// x (N, K) rows xs apart, a (S, R, K) contiguous, idx (N,) slots (-1: none), v (N, R) float32
// contiguous. dtype 0 float32, 1 bf16 (x and a alike). Returns -1 for another dtype.
int pf_lora_shrink(int dtype, const void* x, int64_t xs, const void* a, const int64_t* idx,
                   float* v, int64_t N, int R, int K, int nthreads) {
  if (dtype == 0)
    shrink_rows<float>(static_cast<const float*>(x), xs, static_cast<const float*>(a), idx, v, N,
                       R, K, nthreads);
  else if (dtype == 1)
    shrink_rows<uint16_t>(static_cast<const uint16_t*>(x), xs, static_cast<const uint16_t*>(a),
                          idx, v, N, R, K, nthreads);
  else
    return -1;
  return 0;
}

// y (N, O) rows ys apart (updated in place), v (N, R) float32 contiguous, bt (S, R, O)
// contiguous in y's dtype, idx (N,). Returns -1 for another dtype.
int pf_lora_expand(int dtype, void* y, int64_t ys, const float* v, const void* b,
                   const int64_t* idx, int64_t N, int O, int R, int nthreads) {
  if (dtype == 0)
    expand_rows<float>(static_cast<float*>(y), ys, v, static_cast<const float*>(b), idx, N, O, R,
                       nthreads);
  else if (dtype == 1)
    expand_rows<uint16_t>(static_cast<uint16_t*>(y), ys, v, static_cast<const uint16_t*>(b), idx,
                          N, O, R, nthreads);
  else
    return -1;
  return 0;
}

}  // extern "C"
