// Depthwise causal conv over a flat varlen prefill batch (the compiled form of
// pagefold/layers/causal_conv1d.py's causal_conv1d_varlen, which stays the torch fallback).
//
// Per sequence s and channel c, token t (its window: the K-1 inputs before it, the sequence's
// conv state standing in front of its first token, then t itself):
//   acc = sum_j w[c][j] * in[t-(K-1)+j][c] (j ascending, float32; fused multiply-adds, so
//   the sums may differ from torch's in the last bit) + bias[c]; y = silu(acc) or acc,
//   rounded to T. The new state holds the sequence's last K-1 inputs (old state included when
//   it has fewer than K-1 new tokens).
//
// Token-major: rows of C channels are contiguous, so each product is a row operation; the
// work is split over (sequence, channel block) items.
//
// Captures (prefix-cache checkpoints): the state right after flat token cap_tok[m] (its
// sequence's last K-1 inputs up to it, the old state in front) is written straight into that
// checkpoint's pages, each item its channels' slice of it.

#include <algorithm>
#include <utility>
#include <vector>

#include "common.h"

namespace pf {
namespace {

constexpr int kBlock = 256;  // channels per item

// Where captured states go: capture m's (C, K-1) state in T at byte off of the state over
// pages[m * np .. m * np + np) of raw (pb bytes a page).
struct ConvPages {
  const int64_t* tok;
  int64_t M;
  uint8_t* raw;
  int64_t pb;
  const int64_t* pages;
  int np;
  int64_t off;
};

template <typename T>
void conv_varlen(const T* x, int64_t x_stride, const T* w, const T* bias, const T* state,
                 T* new_state, const int64_t* cu, int64_t S, T* y, int C, int K, bool silu,
                 const ConvPages* cap, int nthreads) {
  const int H = K - 1;
  const int nb = (C + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    std::vector<float> wf(static_cast<size_t>(K) * kBlock), bf(kBlock), acc(kBlock);
    std::vector<float> in(static_cast<size_t>(K) * kBlock);  // ring of the last K input rows
    std::vector<T> snap(cap ? static_cast<size_t>(H) * kBlock : 0);  // a capture's slice
    std::vector<std::pair<int64_t, int64_t>> caps;  // (local token, capture) of the sequence
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < S * nb; ++item) {
      const int64_t s = item / nb;
      const int c0 = static_cast<int>(item % nb) * kBlock;
      const int nc = C - c0 < kBlock ? C - c0 : kBlock;
      for (int c = 0; c < nc; ++c) {
        for (int j = 0; j < K; ++j) wf[j * kBlock + c] = load<T>(w, (c0 + c) * K + j);
        bf[c] = bias ? load<T>(bias, c0 + c) : 0.0f;
      }
      // Ring slot of input row r (r = -H .. n-1): (r + H) % K. Rows -H..-1: the old state.
      const T* st = state + s * static_cast<int64_t>(C) * H;
      for (int r = 0; r < H; ++r)
        for (int c = 0; c < nc; ++c)
          in[r * kBlock + c] = load<T>(st, static_cast<int64_t>(c0 + c) * H + r);
      const int64_t t0 = cu[s], n = cu[s + 1] - cu[s];
      caps.clear();
      for (int64_t m = 0; cap && m < cap->M; ++m)
        if (cap->tok[m] >= t0 && cap->tok[m] < t0 + n) caps.emplace_back(cap->tok[m] - t0, m);
      std::sort(caps.begin(), caps.end());
      size_t next = 0;
      for (int64_t t = 0; t < n; ++t) {
        float* cur = in.data() + ((t + H) % K) * kBlock;
        to_float<T>(x + (t0 + t) * x_stride + c0, cur, nc);
        T* yo = y + (t0 + t) * C + c0;
#if defined(PF_AVX512)
        for (int c = 0; c < nc; c += 16) {
          __m512 v = _mm512_setzero_ps();
          for (int j = 0; j < K; ++j)  // input row t - H + j
            v = _mm512_fmadd_ps(_mm512_loadu_ps(wf.data() + j * kBlock + c),
                                _mm512_loadu_ps(in.data() + ((t + j) % K) * kBlock + c), v);
          v = _mm512_add_ps(v, _mm512_loadu_ps(bf.data() + c));
          if (silu)
            v = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                               vexp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
          vstore<T>(yo + c, v, lanes(nc - c));
        }
#else
#pragma omp simd
        for (int c = 0; c < nc; ++c) acc[c] = 0.0f;
        for (int j = 0; j < K; ++j) {
          const float* row = in.data() + ((t + j) % K) * kBlock;  // input row t - H + j
          const float* wj = wf.data() + j * kBlock;
#pragma omp simd
          for (int c = 0; c < nc; ++c) acc[c] += wj[c] * row[c];
        }
        for (int c = 0; c < nc; ++c) {
          const float v = acc[c] + bf[c];
          store<T>(yo, c, silu ? v / (1.0f + exp_any(-v)) : v);
        }
#endif
        for (; next < caps.size() && caps[next].first == t; ++next) {
          // The state right after token t: input rows t-H+1 .. t (ring slots (t+1+r) % K).
          for (int r = 0; r < H; ++r) {
            const float* row = in.data() + ((t + 1 + r) % K) * kBlock;
            for (int c = 0; c < nc; ++c)
              store<T>(snap.data(), static_cast<int64_t>(c) * H + r, row[c]);
          }
          page_copy(cap->raw, cap->pages + caps[next].second * cap->np, cap->pb,
                    cap->off + static_cast<int64_t>(c0) * H * sizeof(T),
                    reinterpret_cast<uint8_t*>(snap.data()),
                    static_cast<int64_t>(nc) * H * sizeof(T), true);
        }
      }
      // New state: input rows n-H .. n-1 (ring slots (n - H + r + H) % K).
      T* ns = new_state + s * static_cast<int64_t>(C) * H;
      for (int r = 0; r < H; ++r) {
        const float* row = in.data() + ((n + r) % K) * kBlock;
        for (int c = 0; c < nc; ++c) store<T>(ns, static_cast<int64_t>(c0 + c) * H + r, row[c]);
      }
    }
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// Varlen causal conv of S sequences (cu: (S+1,) int64 bounds of the T = cu[S] tokens): row t
// of x (C wide, x_stride apart), weight (C, K), bias (C,) or NULL, state (S, C, K-1) the old
// windows (oldest first), new_state (S, C, K-1) and y (T, C) contiguous outputs, all in dtype
// (0 float32, 1 bf16); silu 1 applies SiLU. Captures (M of them, or 0): the state right after
// flat token cap_tok[m], (C, K-1) in dtype, at byte cap_off of the state over cap_pages[m *
// cap_np ..] (cap_np page ids) of cap_raw (cap_pb bytes a page). Returns -1 for shapes it
// does not handle.
int pf_conv_varlen(int dtype, const void* x, int64_t x_stride, const void* w, const void* bias,
                   const void* state, void* new_state, const int64_t* cu, int64_t S, void* y,
                   int C, int K, int silu, const int64_t* cap_tok, int64_t M, void* cap_raw,
                   int64_t cap_pb, const int64_t* cap_pages, int cap_np, int64_t cap_off,
                   int nthreads) {
  if ((dtype != 0 && dtype != 1) || K < 2 || C < 1 || S < 0 || M < 0) return -1;
  const int64_t esz = dtype == 0 ? 4 : 2;
  if (M > 0 && (cap_tok == nullptr || cap_raw == nullptr || cap_pages == nullptr ||
                cap_pb < 1 || cap_np < 1 || cap_off < 0 ||
                cap_off + static_cast<int64_t>(C) * (K - 1) * esz > cap_np * cap_pb))
    return -1;
  const ConvPages pg{cap_tok, M, static_cast<uint8_t*>(cap_raw), cap_pb, cap_pages, cap_np,
                     cap_off};
  const ConvPages* cap = M > 0 ? &pg : nullptr;
  if (dtype == 0)
    conv_varlen<float>(static_cast<const float*>(x), x_stride, static_cast<const float*>(w),
                       static_cast<const float*>(bias), static_cast<const float*>(state),
                       static_cast<float*>(new_state), cu, S, static_cast<float*>(y), C, K,
                       silu != 0, cap, nthreads);
  else
    conv_varlen<uint16_t>(static_cast<const uint16_t*>(x), x_stride,
                          static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
                          static_cast<const uint16_t*>(state),
                          static_cast<uint16_t*>(new_state), cu, S, static_cast<uint16_t*>(y),
                          C, K, silu != 0, cap, nthreads);
  return 0;
}

}  // extern "C"
