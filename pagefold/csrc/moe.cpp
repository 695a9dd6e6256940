// The routed experts of a sparse MoE block for a few bf16 tokens (decode steps), in one call.
//
// pagefold.layers.moe's MoEExperts._few_rows groups the step's (token, slot) positions by
// expert on the host and, per expert, gathers its tokens, calls the GEMV for gate_up, the SiLU
// kernel, the GEMV for down, and adds the weighted rows into the output: a dozen Python and
// torch operations per expert, far more time than the products of small experts. This does the
// same in C: the same grouping (experts ascending, tokens ascending within one), the same
// GEMVs (function pointers: the kernels chosen for the gate_up and the down shapes) and SiLU
// kernel, and the same roundings as the torch ops it replaces (y * w rounded to bf16, then
// added to the output row and rounded again, experts in ascending order into zeros): the
// Python path's bits. The few-token call and the many-token path share the two kernels that
// do it (pf_moe_experts_grouped for the products, pf_moe_combine for the sums).
//
// Also the block's router (softmax top-k) and its shared expert's gated add: kernels that the
// module path (SparseMoeBlock on bf16 CPU rows) and the native decode step both call, so the
// two give the same bits (their exp is the kernels' own, not torch's).

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using namespace pf;

extern "C" {

// gemv_gu / gemv_down: the GEMVs (GemvFn) of the gate_up and the down products. x (t, hidden)
// bf16 rows x_stride apart; top_idx (t, k) int64 expert ids (distinct within a
// token) and top_w (t, k) bf16 weights, both contiguous; gate_up (E, 2 * inter, hidden) and
// down (E, hidden, inter) bf16 contiguous; out (t, hidden) contiguous, overwritten. Returns 0,
// -1 for an expert id out of range, or the kernels' nonzero code (nothing is then promised
// about out). The many-token path's two calls on every run, with the grouping done here: the
// same gathers, products, SiLU kernel and sums.
int pf_moe_experts_few(void* gemv_gu, void* gemv_down, const uint16_t* x, int64_t x_stride,
                       int t, int k, const int64_t* top_idx, const uint16_t* top_w,
                       const uint16_t* gate_up, const uint16_t* down, int E, int64_t hidden,
                       int64_t inter, uint16_t* out, int nthreads) {
  if (gemv_gu == nullptr || gemv_down == nullptr || t < 1 || k < 1 || E < 1) return -1;
  const int64_t np = static_cast<int64_t>(t) * k;
  // Positions p = token * k + slot by expert, tokens ascending within one (a counting sort:
  // the stable order the many-token path's argsort gives).
  std::vector<int64_t> starts(static_cast<size_t>(E) + 1, 0), order(np);
  for (int64_t p = 0; p < np; ++p) {
    if (top_idx[p] < 0 || top_idx[p] >= E) return -1;
    ++starts[top_idx[p] + 1];
  }
  for (int e = 0; e < E; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < np; ++p) order[next[top_idx[p]]++] = p;
  std::vector<uint16_t> ys(static_cast<size_t>(np) * hidden);
  // Every run (at most t positions with distinct ids; np bounds it whatever the ids).
  int rc = pf_moe_experts_grouped(gemv_gu, gemv_down, x, x_stride, k, order.data(),
                                  starts.data(), E, 1, static_cast<int>(np), gate_up, down,
                                  hidden, inter, ys.data(), nthreads);
  if (rc) return rc;
  std::vector<int64_t> rows_at(np);
  for (int64_t j = 0; j < np; ++j)
    rows_at[j] = reinterpret_cast<int64_t>(ys.data() + j * hidden);
  return pf_moe_combine(rows_at.data(), order.data(), t, k, top_w, hidden, out, nthreads);
}

// The routed experts of a many-token step, in two calls around the GEMM library's products.
// pagefold.layers.moe_rows groups the step's positions p = token * k + slot by expert on the
// host (order: the positions sorted by expert, stably; starts: expert e's run is order[starts[e]
// .. starts[e + 1])) and writes every position's expert output into ys (t * k, hidden), row j
// holding order[j]'s (long runs' rows may live in their own products instead: pf_moe_combine
// reads row j at an address). pf_moe_experts_grouped fills the runs of min_rows..max_rows positions
// with the GEMVs, as pf_moe_experts_few would (the same gather, products, SiLU kernel and bits;
// a GEMV row's bits do not depend on the rows beside it); other runs are the caller's.
// pf_moe_combine then sums each token's weighted rows in ascending expert order into zeros,
// rounding as torch's `out.index_add_(rows, y * w)` per expert does.

// Runs of min_rows..max_rows positions, in parallel over experts (each GEMV on one thread)
// when there are enough of them, else one after another with the GEMVs' own threads. Returns
// 0, -1 for an argument out of range, or the kernels' nonzero code.
int pf_moe_experts_grouped(void* gemv_gu, void* gemv_down, const uint16_t* x, int64_t x_stride,
                           int k, const int64_t* order, const int64_t* starts, int E,
                           int min_rows, int max_rows, const uint16_t* gate_up,
                           const uint16_t* down, int64_t hidden, int64_t inter, uint16_t* ys,
                           int nthreads) {
  if (gemv_gu == nullptr || gemv_down == nullptr || k < 1 || min_rows < 1 ||
      max_rows < min_rows || E < 1)
    return -1;
  const GemvFn gemv_g = reinterpret_cast<GemvFn>(gemv_gu);
  const GemvFn gemv_dn = reinterpret_cast<GemvFn>(gemv_down);
  std::vector<int> small;
  int64_t longest = 0;  // the buffers' rows
  for (int e = 0; e < E; ++e) {
    const int64_t n = starts[e + 1] - starts[e];
    if (n < 0) return -1;
    if (n >= min_rows && n <= max_rows) {
      small.push_back(e);
      longest = std::max(longest, n);
    }
  }
  const int groups = static_cast<int>(small.size());
  const bool outer = nthreads > 1 && groups >= 2 * nthreads;
  const int inner = outer ? 1 : nthreads;
  int rc = 0;
#pragma omp parallel num_threads(nthreads) if (outer) reduction(| : rc)
  {
    std::vector<uint16_t> h(static_cast<size_t>(longest) * hidden),
        gu(static_cast<size_t>(longest) * 2 * inter), act(static_cast<size_t>(longest) * inter);
#pragma omp for schedule(dynamic, 1)
    for (int g = 0; g < groups; ++g) {
      const int e = small[g];
      const int64_t s = starts[e];
      const int n = static_cast<int>(starts[e + 1] - s);
      for (int r = 0; r < n; ++r)
        std::memcpy(h.data() + r * hidden, x + (order[s + r] / k) * x_stride,
                    sizeof(uint16_t) * hidden);
      int c = gemv_g(h.data(), hidden, gate_up + e * 2 * inter * hidden, nullptr, gu.data(),
                     2 * inter, n, 2 * inter, hidden, inner);
      c |= pf_silu_mul(1, gu.data(), 2 * inter, act.data(), n, static_cast<int>(inter), inner);
      c |= gemv_dn(act.data(), inter, down + e * hidden * inter, nullptr, ys + s * hidden,
                   hidden, n, hidden, inter, inner);
      rc |= c;
    }
  }
  return rc;
}

// out (t, hidden) = per token, from zeros, out += bf16(row j * w[p]) over its k positions p in
// ascending order of j (rank[p] = j where order[j] = p: ascending expert), each add rounded to
// bf16; row j is the hidden bf16 values at address rows[j] (the grouped buffer, or a long run's
// own product: no copy). top_w (t, k) and out contiguous; tokens split over nthreads. Returns
// -1 for an order that is not a permutation of 0 .. t * k - 1.
int pf_moe_combine(const int64_t* rows_at, const int64_t* order, int t, int k,
                   const uint16_t* top_w, int64_t hidden, uint16_t* out, int nthreads) {
  if (t < 0 || k < 1) return -1;
  const int64_t np = static_cast<int64_t>(t) * k;
  std::vector<int64_t> rank(np, -1);
  for (int64_t j = 0; j < np; ++j) {
    const int64_t p = order[j];
    if (p < 0 || p >= np || rank[p] != -1) return -1;
    rank[p] = j;
  }
  const bool par = nthreads > 1 && np * hidden >= (1 << 15);
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<int64_t> js(k);
    std::vector<int> slot(k);
    std::vector<float> wk(k);
    std::vector<const uint16_t*> rows(k);
#pragma omp for schedule(static)
    for (int i = 0; i < t; ++i) {
      for (int s = 0; s < k; ++s) js[s] = rank[static_cast<int64_t>(i) * k + s];
      // k is small: an insertion sort of the token's slots by rank.
      for (int s = 0; s < k; ++s) slot[s] = s;
      for (int a = 1; a < k; ++a)
        for (int b = a; b > 0 && js[slot[b]] < js[slot[b - 1]]; --b)
          std::swap(slot[b], slot[b - 1]);
      for (int a = 0; a < k; ++a) {
        wk[a] = bf16_to_f32(top_w[static_cast<int64_t>(i) * k + slot[a]]);
        rows[a] = reinterpret_cast<const uint16_t*>(rows_at[js[slot[a]]]);
      }
      // The sum holds a bf16 value: round y * w, add, round the sum (torch's bf16 add_).
      uint16_t* o = out + static_cast<int64_t>(i) * hidden;
      int64_t d = 0;
#if defined(PF_AVX512)
      for (; d < hidden; d += 16) {
        const __mmask16 m = lanes(hidden - d);
        __m512 acc = _mm512_setzero_ps();
        for (int a = 0; a < k; ++a)
          acc = vrnd<uint16_t>(_mm512_add_ps(
              acc, vrnd<uint16_t>(_mm512_mul_ps(vload(rows[a] + d, m), _mm512_set1_ps(wk[a])))));
        vstore(o + d, acc, m);
      }
#elif defined(PF_AVX2)
      for (; d + 8 <= hidden; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int a = 0; a < k; ++a)
          acc = v8rnd<uint16_t>(_mm256_add_ps(
              acc, v8rnd<uint16_t>(_mm256_mul_ps(v8load(rows[a] + d), _mm256_set1_ps(wk[a])))));
        v8store(o + d, acc);
      }
#endif
      for (; d < hidden; ++d) {
        float acc = 0.0f;
        for (int a = 0; a < k; ++a)
          acc = rnd<uint16_t>(acc + rnd<uint16_t>(bf16_to_f32(rows[a][d]) * wk[a]));
        o[d] = f32_to_bf16(acc);
      }
    }
  }
  return 0;
}

// Router: per token, p = softmax(float(logits)) over E experts (float32, exp(x - max) / sum),
// the k largest in descending order (ties: the lower expert first), renormalised to sum 1 when
// norm (p / sum of the k, float32), weights rounded to bf16. logits (t, E) bf16 rows stride
// apart; idx (t, k) int64 and w (t, k) bf16 contiguous. Returns -1 for k outside [1, E].
// Tokens are independent: a long prefill's rows are split over nthreads.
int pf_moe_route(const uint16_t* logits, int64_t stride, int t, int E, int k, int norm,
                 int64_t* idx, uint16_t* w, int nthreads) {
  if (k < 1 || k > E || t < 0) return -1;
  const bool par = nthreads > 1 && static_cast<int64_t>(t) * E >= (1 << 14);
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<float> p(E);
    std::vector<int> order(E);
#pragma omp for schedule(static)
    for (int i = 0; i < t; ++i) {
      const uint16_t* l = logits + i * stride;
      float mx = -INFINITY;
      for (int e = 0; e < E; ++e) mx = std::max(mx, bf16_to_f32(l[e]));
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) {
        p[e] = exp_any(bf16_to_f32(l[e]) - mx);
        sum += p[e];
      }
      for (int e = 0; e < E; ++e) p[e] = p[e] / sum;
      for (int e = 0; e < E; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&p](int a, int b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      float top = 0.0f;
      for (int j = 0; j < k; ++j) top += p[order[j]];
      for (int j = 0; j < k; ++j) {
        idx[i * k + j] = order[j];
        w[i * k + j] = f32_to_bf16(norm ? p[order[j]] / top : p[order[j]]);
      }
    }
  }
  return 0;
}

// The shared expert's add: out = T(routed + T(T(sigmoid(gate)) * shared)) per row (gate: one
// bf16 logit per row, gate_stride apart), or T(routed + shared) without a gate; as torch's
// `out + torch.sigmoid(g) * shared` rounds on bf16. (t, d) rows contiguous; out may be routed.
int pf_moe_shared_add(const uint16_t* routed, const uint16_t* shared, const uint16_t* gate,
                      int64_t gate_stride, uint16_t* out, int64_t t, int64_t d, int nthreads) {
  const bool par = nthreads > 1 && t * d >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < t; ++i) {
    const uint16_t* r = routed + i * d;
    const uint16_t* sh = shared + i * d;
    uint16_t* o = out + i * d;
    if (gate == nullptr) {
      for (int64_t c = 0; c < d; ++c) o[c] = f32_to_bf16(bf16_to_f32(r[c]) + bf16_to_f32(sh[c]));
      continue;
    }
    const float g = bf16_to_f32(gate[i * gate_stride]);
    const float sg = rnd<uint16_t>(1.0f / (1.0f + exp_any(-g)));
    for (int64_t c = 0; c < d; ++c)
      o[c] = f32_to_bf16(bf16_to_f32(r[c]) + rnd<uint16_t>(sg * bf16_to_f32(sh[c])));
  }
  return 0;
}

}  // extern "C"
