// The routed experts of a sparse MoE block for a few bf16 tokens (decode steps), in one call.
//
// pagefold.layers.moe's MoEExperts._few_rows groups the step's (token, slot) positions by
// expert on the host and, per expert, gathers its tokens, calls the GEMV for gate_up, the SiLU
// kernel, the GEMV for down, and adds the weighted rows into the output: a dozen Python and
// torch operations per expert, far more time than the products of small experts. This does the
// same in C: the same grouping (experts ascending, tokens ascending within one), the same
// GEMV (a function pointer: cpu_ops' choice for this CPU) and SiLU kernel, and the same
// roundings as the torch ops it replaces (y * w rounded to bf16, then added to the output row
// and rounded again, experts in ascending order into zeros): the Python path's bits.

#include "common.h"

#include <algorithm>
#include <cstring>
#include <vector>

extern "C" int pf_silu_mul(int dtype, const void* gu, int64_t stride, void* out, int64_t N,
                           int I, int nthreads);

namespace {
using GemvFn = int (*)(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                       int64_t y_stride, int M, int64_t N, int64_t K, int nthreads);
}  // namespace

using namespace pf;

extern "C" {

// x (t, hidden) bf16 rows x_stride apart; top_idx (t, k) int64 expert ids (distinct within a
// token) and top_w (t, k) bf16 weights, both contiguous; gate_up (E, 2 * inter, hidden) and
// down (E, hidden, inter) bf16 contiguous; out (t, hidden) contiguous, overwritten. Returns 0,
// -1 for an expert id out of range, or the kernels' nonzero code (nothing is then promised
// about out).
int pf_moe_experts_few(void* gemv_fn, const uint16_t* x, int64_t x_stride, int t, int k,
                       const int64_t* top_idx, const uint16_t* top_w, const uint16_t* gate_up,
                       const uint16_t* down, int E, int64_t hidden, int64_t inter,
                       uint16_t* out, int nthreads) {
  if (gemv_fn == nullptr || t < 1 || k < 1) return -1;
  const GemvFn gemv = reinterpret_cast<GemvFn>(gemv_fn);
  const int np = t * k;
  for (int p = 0; p < np; ++p)
    if (top_idx[p] < 0 || top_idx[p] >= E) return -1;
  std::vector<int> order(np);
  for (int p = 0; p < np; ++p) order[p] = p;
  std::stable_sort(order.begin(), order.end(),
                   [top_idx](int a, int b) { return top_idx[a] < top_idx[b]; });
  std::memset(out, 0, sizeof(uint16_t) * static_cast<size_t>(t) * hidden);
  std::vector<uint16_t> h(static_cast<size_t>(t) * hidden), gu(static_cast<size_t>(t) * 2 * inter),
      act(static_cast<size_t>(t) * inter), y(static_cast<size_t>(t) * hidden);
  int rc = 0;
  for (int i = 0; i < np;) {
    const int64_t e = top_idx[order[i]];
    int j = i + 1;
    while (j < np && top_idx[order[j]] == e) ++j;
    const int n = j - i;
    // Every token, in order (distinct ids per token): the rows as they are, else gathered.
    const uint16_t* hx = x;
    int64_t hs = x_stride;
    if (n != t) {
      for (int r = 0; r < n; ++r)
        std::memcpy(h.data() + r * hidden, x + (order[i + r] / k) * x_stride,
                    sizeof(uint16_t) * hidden);
      hx = h.data();
      hs = hidden;
    }
    rc |= gemv(hx, hs, gate_up + e * 2 * inter * hidden, nullptr, gu.data(), 2 * inter, n,
               2 * inter, hidden, nthreads);
    rc |= pf_silu_mul(1, gu.data(), 2 * inter, act.data(), n, static_cast<int>(inter), nthreads);
    rc |= gemv(act.data(), inter, down + e * hidden * inter, nullptr, y.data(), hidden, n, hidden,
               inter, nthreads);
    if (rc) return rc;
    for (int r = 0; r < n; ++r) {
      const int p = order[i + r];
      const float w = bf16_to_f32(top_w[p]);
      uint16_t* o = out + static_cast<int64_t>(p / k) * hidden;
      const uint16_t* yr = y.data() + static_cast<int64_t>(r) * hidden;
      for (int64_t d = 0; d < hidden; ++d)  // out += bf16(y * w), rounded as torch's add_
        o[d] = f32_to_bf16(bf16_to_f32(o[d]) + rnd<uint16_t>(bf16_to_f32(yr[d]) * w));
    }
    i = j;
  }
  return 0;
}

}  // extern "C"
