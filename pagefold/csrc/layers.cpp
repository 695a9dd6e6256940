// Per-layer kernels: RMSNorm (optionally fused with the residual add), per-head q/k RMSNorm +
// RoPE, SiLU-and-mul, the gated RMSNorm of GDN outputs, and the bf16 few-row products (an
// AVX512-BF16 GEMV, an AVX2 + FMA kernel for CPUs without bf16 dot products); the Gated
// DeltaNet layer is in gdn.cpp. They round to the tensor dtype at the same points as the torch
// code they replace, so a bf16 model sees the same intermediate roundings (only float32
// summation order differs). Called through ctypes (see cpu_ops.py).

#include "common.h"
#include "kernels.h"

#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pf {
namespace {

#if defined(PF_AVX512)
// One bf16 head row of D (<= kMaxHeadDim) in registers, 16 lanes a chunk, the last one masked:
// RMSNorm when w is given (rms_row<uint16_t>'s operations and roundings, in the same order),
// then RoPE on the first 16 * RC channels (RC even, so each chunk lies in one half), with cos /
// sin already rounded to bf16 (cr, sr). The row is read once and written once (the general
// path below went through memory twice: ~110 cycles a 64-wide head row, now ~75).
inline void qk_row_bf16(const uint16_t* src, const uint16_t* w, const __m512* cr,
                        const __m512* sr, int D, int RC, float eps, bool zc, uint16_t* dst) {
  const int C = (D + 15) / 16;
  __m512 n[kMaxHeadDim / 16];
  for (int c = 0; c < C; ++c) n[c] = vload<uint16_t>(src + 16 * c, lanes(D - 16 * c));
  if (w) {
    __m512 ss = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) ss = _mm512_fmadd_ps(n[c], n[c], ss);
    const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
    const __m512 vr = _mm512_set1_ps(r), one = _mm512_set1_ps(1.0f);
    for (int c = 0; c < C; ++c) {
      const __m512 v = _mm512_mul_ps(n[c], vr);
      const __m512 wv = vload<uint16_t>(w + 16 * c, lanes(D - 16 * c));
      n[c] = vrnd<uint16_t>(zc ? _mm512_mul_ps(v, _mm512_add_ps(one, wv))
                               : _mm512_mul_ps(wv, vrnd<uint16_t>(v)));
    }
  }
  // torch: x * cos + rotate_half(x) * sin, cos/sin rounded to T, each product and the sum
  // rounded to T; channels past the rotary ones pass through.
  const int hc = RC / 2;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int c = 0; c < RC; ++c) {
    const __m512 rh = c < hc ? _mm512_castsi512_ps(_mm512_xor_si512(
                                   _mm512_castps_si512(n[c + hc]), sign))
                             : n[c - hc];
    const __m512 a = vrnd<uint16_t>(_mm512_mul_ps(n[c], cr[c]));
    const __m512 b = vrnd<uint16_t>(_mm512_mul_ps(rh, sr[c]));
    vstore<uint16_t>(dst + 16 * c, _mm512_add_ps(a, b));
  }
  for (int c = RC; c < C; ++c) vstore<uint16_t>(dst + 16 * c, n[c], lanes(D - 16 * c));
}
#endif

template <typename T>
void qk_rope_all(const T* qkv, int64_t row_stride, int64_t q_off, int64_t q_head_stride,
                 int64_t k_off, const int64_t* positions, const float* cos, const float* sin,
                 int rot, const T* qw, const T* kw, float eps, bool zc, T* q_out, T* k_out,
                 int64_t N, int H, int KVH, int D, int nthreads) {
  const bool par = nthreads > 1 && N * (H + KVH) * D >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < N; ++i) {
    alignas(64) float n[kMaxHeadDim];
    alignas(64) T tmp[kMaxHeadDim];
    const float* c = cos + positions[i] * rot;
    const float* s = sin + positions[i] * rot;
    const int half = rot / 2;
#if defined(PF_AVX512)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (half % 16 == 0) {  // every head of the token in registers (qk_row_bf16)
        __m512 cr[kMaxHeadDim / 16], sr[kMaxHeadDim / 16];
        for (int k = 0; k < rot / 16; ++k) {
          cr[k] = vrnd<T>(_mm512_loadu_ps(c + 16 * k));
          sr[k] = vrnd<T>(_mm512_loadu_ps(s + 16 * k));
        }
        for (int h = 0; h < H + KVH; ++h) {
          const bool is_q = h < H;
          qk_row_bf16(qkv + i * row_stride + (is_q ? q_off + h * q_head_stride
                                                   : k_off + static_cast<int64_t>(h - H) * D),
                      is_q ? qw : kw, cr, sr, D, rot / 16, eps, zc,
                      is_q ? q_out + (i * H + h) * D : k_out + (i * KVH + h - H) * D);
        }
        continue;
      }
    }
#endif
    for (int h = 0; h < H + KVH; ++h) {
      const bool is_q = h < H;
      const T* src = qkv + i * row_stride + (is_q ? q_off + h * q_head_stride
                                                  : k_off + static_cast<int64_t>(h - H) * D);
      T* dst = is_q ? q_out + (i * H + h) * D : k_out + (i * KVH + h - H) * D;
      const T* w = is_q ? qw : kw;
      if (w) {
        rms_row<T>(src, nullptr, w, tmp, D, eps, zc);
        for (int d = 0; d < D; ++d) n[d] = load<T>(tmp, d);
      } else {
        for (int d = 0; d < D; ++d) n[d] = load<T>(src, d);
      }
      // torch: x * cos + rotate_half(x) * sin, cos/sin rounded to T, each product and the sum
      // rounded to T; channels past rot pass through.
#if defined(PF_AVX2)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (half % 8 == 0) {  // each 8-lane chunk lies in one half: whole-vector rotate
          const __m256 sign = _mm256_set1_ps(-0.0f);
          for (int d = 0; d < rot; d += 8) {
            const __m256 rh = d < half ? _mm256_xor_ps(_mm256_load_ps(n + d + half), sign)
                                       : _mm256_load_ps(n + d - half);
            const __m256 a = v8rnd<T>(_mm256_mul_ps(_mm256_load_ps(n + d),
                                                    v8rnd<T>(_mm256_loadu_ps(c + d))));
            const __m256 b = v8rnd<T>(_mm256_mul_ps(rh, v8rnd<T>(_mm256_loadu_ps(s + d))));
            v8store<T>(dst + d, _mm256_add_ps(a, b));
          }
          for (int d = rot; d < D; ++d) store<T>(dst, d, n[d]);
          continue;
        }
      }
#endif
#pragma omp simd
      for (int d = 0; d < rot; ++d) {
        const float rh = d < half ? -n[d + half] : n[d - half];
        store<T>(dst, d, rnd<T>(n[d] * rnd<T>(c[d])) + rnd<T>(rh * rnd<T>(s[d])));
      }
      for (int d = rot; d < D; ++d) store<T>(dst, d, n[d]);
    }
  }
}

template <typename T>
void silu_mul_all(const T* gu, int64_t stride, T* out, int64_t N, int I, int nthreads) {
  const bool par = nthreads > 1 && N * I >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < N; ++i) {
    const T* g = gu + i * stride;
    const T* u = g + I;
    T* o = out + i * I;
#if defined(PF_AVX512)
    for (int d = 0; d < I; d += 16) {
      const __mmask16 m = lanes(I - d);
      const __m512 s = vrnd<T>(vsilu(vload<T>(g + d, m)));
      vstore<T>(o + d, _mm512_mul_ps(s, vload<T>(u + d, m)), m);
    }
#else
    int d0 = 0;
#if defined(PF_AVX2)
    for (; d0 + 8 <= I; d0 += 8)
      v8store<T>(o + d0, _mm256_mul_ps(v8rnd<T>(v8silu(v8load<T>(g + d0))), v8load<T>(u + d0)));
#endif
    for (int d = d0; d < I; ++d) {
      const float x = load<T>(g, d);
      store<T>(o, d, rnd<T>(x / (1.0f + exp_any(-x))) * load<T>(u, d));
    }
#endif
  }
}

// relu(x)^2 rounded once, as torch's F.relu(x).square_() on bf16 (relu exact, the square of a
// bf16 value exact in float32, then one rounding). NaN stays NaN.
template <typename T>
void relu2_all(const T* x, int64_t stride, T* out, int64_t N, int I, int nthreads) {
  const bool par = nthreads > 1 && N * I >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < N; ++i) {
    const T* xr = x + i * stride;
    T* o = out + i * I;
#pragma omp simd
    for (int d = 0; d < I; ++d) {
      const float v = load<T>(xr, d);
      const float r = v > 0.0f ? v : (v != v ? v : 0.0f);
      store<T>(o, d, r * r);
    }
  }
}

// out = T(o * T(sigmoid(g))) per row and head: Qwen3.5 / Qwen3-Next's attention output gate,
// rounded as torch's `o * torch.sigmoid(gate)` on bf16 (the sigmoid rounded, then the
// product). o's and out's heads are contiguous in their rows; g's heads ghs apart (the gate
// halves of the [query | gate] q rows). The module path and the native decode step both call
// this, so they give the same bits. out may be o.
template <typename T>
void sigmoid_gate_all(const T* o, int64_t os, const T* g, int64_t gs, int64_t ghs, T* out,
                      int64_t outs, int64_t N, int H, int D, int nthreads) {
  const bool par = nthreads > 1 && N * H * D >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t item = 0; item < N * H; ++item) {
    const int64_t i = item / H, h = item % H;
    const T* orow = o + i * os + h * D;
    const T* gr = g + i * gs + h * ghs;
    T* dst = out + i * outs + h * D;
#if defined(PF_AVX512)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int d = 0; d < D; d += 16) {
      const __mmask16 m = lanes(D - d);
      const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), vload<T>(gr + d, m)));
      const __m512 sg = vrnd<T>(_mm512_div_ps(one, _mm512_add_ps(one, e)));
      vstore<T>(dst + d, _mm512_mul_ps(vload<T>(orow + d, m), sg), m);
    }
#else
    int d0 = 0;
#if defined(PF_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; d0 + 8 <= D; d0 += 8) {
      const __m256 e = v8exp(_mm256_sub_ps(_mm256_setzero_ps(), v8load<T>(gr + d0)));
      const __m256 sg = v8rnd<T>(_mm256_div_ps(one, _mm256_add_ps(one, e)));
      v8store<T>(dst + d0, _mm256_mul_ps(v8load<T>(orow + d0), sg));
    }
#endif
    for (int64_t d = d0; d < D; ++d)
      store<T>(dst, d, load<T>(orow, d) * rnd<T>(1.0f / (1.0f + exp_any(-load<T>(gr, d)))));
#endif
  }
}

// One row of the GDN output norm (RMSNormGated: norm before gate), rounded as the torch module:
// h = T(w * T(x / rms(x))), out = T(h * silu(float(gate))).
template <typename T>
void rms_gated_row(const T* x, const T* gate, const T* w, T* out, int D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int d = 0; d < D; ++d) {
    const float v = load<T>(x, d);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#if defined(PF_AVX512)
  const __m512 vr = _mm512_set1_ps(r);
  for (int d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    const __m512 h = vrnd<T>(_mm512_mul_ps(vload<T>(w + d, m),
                                           vrnd<T>(_mm512_mul_ps(vload<T>(x + d, m), vr))));
    vstore<T>(out + d, _mm512_mul_ps(h, vsilu(vload<T>(gate + d, m))), m);
  }
#else
  int d0 = 0;
#if defined(PF_AVX2)
  const __m256 vr = _mm256_set1_ps(r);
  for (; d0 + 8 <= D; d0 += 8) {
    const __m256 h = v8rnd<T>(_mm256_mul_ps(v8load<T>(w + d0),
                                            v8rnd<T>(_mm256_mul_ps(v8load<T>(x + d0), vr))));
    v8store<T>(out + d0, _mm256_mul_ps(h, v8silu(v8load<T>(gate + d0))));
  }
#endif
  for (int d = d0; d < D; ++d) {
    const float h = rnd<T>(load<T>(w, d) * rnd<T>(load<T>(x, d) * r));
    const float g = load<T>(gate, d);
    store<T>(out, d, h * (g / (1.0f + exp_any(-g))));
  }
#endif
}

// y (M, N) = x (M, K) W^T (+ bias), bf16 in and out, float32 sums, one rounding at the end
// (as oneDNN's bf16 matmul). For the few-row products of decode steps, where a GEMM library's
// per-call set-up dominates and its GEMV path leaves memory bandwidth unused. Rows n0..n1.
//
// prefetch: the pass that reads these rows from memory (the first row group of a tile)
// fetches the next 4-row tile while it works on this one, four lines per 32 k (the next tile
// is contiguous with this one: 4 * K * 2 bytes over K / 32 steps). A tile's four rows are
// streams of K * 2 bytes (1-12 KB), too short for the hardware prefetchers to lock on; without
// this the kernel reached 0.62 of the read rate at 2 rows and 0.43 at 4 on a streamed head.
// The hint is T1 (into L2): on the AMX Xeon it kept more lines in flight than T0 (10-20%
// faster at 1-4 rows on weights streamed from 1 GiB) and the tile moves to L1 on its loads.
template <int M>
void gemv_bf16_rows(const uint16_t* x, int64_t xs, const uint16_t* w, const uint16_t* bias,
                    uint16_t* y, int64_t ys, int64_t n0, int64_t n1, int64_t K, bool prefetch) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t kmain = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - kmain)) - 1ull);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* wr = w + n * K;
    const char* ahead = prefetch ? reinterpret_cast<const char*>(wr + 4 * K) : nullptr;
    for (int64_t k = 0; k < K; k += 32) {
      const bool full = k < kmain;
      if (ahead)
        for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + k * 8 + l * 64, _MM_HINT_T1);
      __m512i wv[4];
      for (int r = 0; r < 4; ++r)
        wv[r] = full ? _mm512_loadu_si512(wr + r * K + k)
                     : _mm512_maskz_loadu_epi16(tail, wr + r * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512i xv = full ? _mm512_loadu_si512(x + m * xs + k)
                                : _mm512_maskz_loadu_epi16(tail, x + m * xs + k);
        for (int r = 0; r < 4; ++r)
          acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)wv[r], (__m512bh)xv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < 4; ++r) {
        float v = _mm512_reduce_add_ps(acc[m][r]);
        if (bias) v += bf16_to_f32(bias[n + r]);
        y[m * ys + n + r] = f32_to_bf16(v);
      }
  }
  for (; n < n1; ++n) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const bool full = k < kmain;
      const __m512i wv = full ? _mm512_loadu_si512(w + n * K + k)
                              : _mm512_maskz_loadu_epi16(tail, w + n * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512i xv = full ? _mm512_loadu_si512(x + m * xs + k)
                                : _mm512_maskz_loadu_epi16(tail, x + m * xs + k);
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)wv, (__m512bh)xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      float v = _mm512_reduce_add_ps(acc[m]);
      if (bias) v += bf16_to_f32(bias[n]);
      y[m * ys + n] = f32_to_bf16(v);
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float v = 0.f;
#pragma omp simd reduction(+ : v)
      for (int64_t k = 0; k < K; ++k) v += bf16_to_f32(x[m * xs + k]) * bf16_to_f32(w[n * K + k]);
      if (bias) v += bf16_to_f32(bias[n]);
      y[m * ys + n] = f32_to_bf16(v);
    }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#define PF_FMA_GEMV 1
// The bf16 product for CPUs without a bf16 dot product (AVX2 + FMA): y (M, N) = x (M, K) W^T
// (+ bias), float32 sums, one rounding at the end. oneDNN's bf16 GEMM there converts inside
// its inner loop and costs about one weight pass per row of x; here x is converted to float32
// once, and each group of kFmaRows weight rows is read from memory once per call, widened to
// float32 in registers (a bf16 is the top half of a float: a 16-bit shift), and multiplied
// into every row of x while it sits in L1. Threads split the output rows.
//
// Invariant (tested): output (m, n) is the same function of x row m and W row n whatever M is
// and wherever the row falls in a tile: one 8-lane float32 accumulator per output, fed
// fmadd(w, x, acc) over k in ascending chunks of 8 (the last chunk zero-padded), reduced in a
// fixed order, then + bias, then rounded. So M rows in one call equal M one-row calls, bit for
// bit, and a speculative verify step computes exactly what the decode steps it replaces would.
constexpr int kFmaRows = 4;  // weight rows per tile

inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// MB rows of x (float32, kp apart, zero past K) times NB weight rows (bf16, K apart; tail:
// each row's last K % 8 elements zero-padded to 8, or nullptr when K % 8 == 0).
// OutT: uint16_t (bf16, rounded once) or float (the sums as they are: float32 logits).
// ahead: the bytes after this tile's NB rows to prefetch (the next tile's rows, contiguous
// with these: one 64-byte line per 8 k, so a tile of 4 rows fetches one tile ahead) or null.
// A tile's rows are 4 streams of only 1-2 KB each, too short for the hardware prefetchers to
// lock on: without it one AVX2 core read ~7 GB/s of weights where it copies at ~12 (Zen 3).
// Hint T1 (into L2): on the AMX Xeon's AVX2 build 6-15% faster than T0 at 1-2 rows on weights
// streamed past the LLC; Zen 3, where T0 was tuned, was not at hand to measure it again.
template <int MB, int NB, typename OutT>
inline void fma_tile(const float* xf, int64_t kp, const uint16_t* w, int64_t K,
                     const uint16_t (*tail)[8], const uint16_t* bias, OutT* y, int64_t ys,
                     const char* ahead) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t kmain = K / 8 * 8;
  for (int64_t k = 0; k < kmain; k += 8) {
    // The next NB * K * 2 bytes over K / 8 steps: 2 * NB bytes per k, a line per step.
    if (ahead) _mm_prefetch(ahead + k * 2 * NB, _MM_HINT_T1);
    __m256 wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = widen_bf16x8(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * kp + k);
      for (int r = 0; r < NB; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (kmain < K) {
    __m256 wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = widen_bf16x8(tail[r]);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + m * kp + kmain);
      for (int r = 0; r < NB; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) {
      float v = hsum8(acc[m][r]);
      if (bias) v += bf16_to_f32(bias[r]);
      if constexpr (std::is_same_v<OutT, float>)
        y[m * ys + r] = v;
      else
        y[m * ys + r] = f32_to_bf16(v);
    }
}

// All M rows of x against weight rows n .. n+NB-1.
template <int NB, typename OutT>
void fma_rows(const float* xf, int64_t kp, const uint16_t* w, const uint16_t* bias,
              OutT* y, int64_t ys, int M, int64_t n, int64_t K, bool prefetch) {
  alignas(16) uint16_t tail[NB][8] = {};
  const int64_t kmain = K / 8 * 8;
  if (kmain < K)
    for (int r = 0; r < NB; ++r)
      std::memcpy(tail[r], w + (n + r) * K + kmain, (K - kmain) * sizeof(uint16_t));
  const uint16_t* wn = w + n * K;
  const uint16_t* bn = bias ? bias + n : nullptr;
  // Only the first pass over these rows prefetches the next tile (later passes find these
  // rows in cache).
  const char* ahead = prefetch ? reinterpret_cast<const char*>(wn + NB * K) : nullptr;
  int m = 0;
  // Three rows of x per pass keep 3 * NB + NB vector registers live (16 with NB = 4).
  for (; m + 3 <= M; m += 3, ahead = nullptr)
    fma_tile<3, NB, OutT>(xf + m * kp, kp, wn, K, tail, bn, y + m * ys + n, ys, ahead);
  if (M - m == 2)
    fma_tile<2, NB, OutT>(xf + m * kp, kp, wn, K, tail, bn, y + m * ys + n, ys, ahead);
  if (M - m == 1)
    fma_tile<1, NB, OutT>(xf + m * kp, kp, wn, K, tail, bn, y + m * ys + n, ys, ahead);
}

template <typename OutT>
void gemv_fma(const uint16_t* x, int64_t xs, const uint16_t* w, const uint16_t* bias,
              OutT* y, int64_t ys, int M, int64_t N, int64_t K, int nthreads) {
  const int64_t kp = (K + 7) / 8 * 8;
  std::vector<float> xf(static_cast<size_t>(M) * kp, 0.f);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * kp + k] = bf16_to_f32(x[m * xs + k]);
  const int64_t groups = N / kFmaRows;
  const bool par = nthreads > 1 && N * K >= (1 << 18);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t g = 0; g < groups; ++g)
    fma_rows<kFmaRows, OutT>(xf.data(), kp, w, bias, y, ys, M, g * kFmaRows, K,
                             g + 1 < groups);
  for (int64_t n = groups * kFmaRows; n < N; ++n)
    fma_rows<1, OutT>(xf.data(), kp, w, bias, y, ys, M, n, K, false);
}
#endif

// One block of output rows n0..n1 for every row of x, in groups of up to 4 rows; each call of
// gemv_bf16_rows covers n0..n1 for its group, prefetching only in the first group's.
inline void gemv_bf16_span(const uint16_t* x, int64_t xs, const uint16_t* w, const uint16_t* bias,
                           uint16_t* y, int64_t ys, int M, int64_t n0, int64_t n1, int64_t K,
                           bool prefetch) {
  for (int m = 0; m < M; m += 4) {
    const uint16_t* xm = x + m * xs;
    uint16_t* ym = y + m * ys;
    const bool pre = prefetch && m == 0;
    switch (M - m < 4 ? M - m : 4) {
      case 1: gemv_bf16_rows<1>(xm, xs, w, bias, ym, ys, n0, n1, K, pre); break;
      case 2: gemv_bf16_rows<2>(xm, xs, w, bias, ym, ys, n0, n1, K, pre); break;
      case 3: gemv_bf16_rows<3>(xm, xs, w, bias, ym, ys, n0, n1, K, pre); break;
      default: gemv_bf16_rows<4>(xm, xs, w, bias, ym, ys, n0, n1, K, pre);
    }
  }
}

// Threads split the output rows in blocks of 64, and only when there is enough weight to
// stream (2^18 elements, 512 KB). A streamed weight goes tile by tile: every row of x passes
// over one 4-row weight tile (in L1 after the first row group) before the next, so the weights
// stream from memory once per call and the first group's prefetch of the next tile overlaps all
// groups' work on this one. A smaller weight is in cache when a step comes back to it: each row
// group passes over the whole block, without prefetch (tile by tile with prefetch cost 6-25%
// at one row there). The same sums either way.
void gemv_bf16(const uint16_t* x, int64_t xs, const uint16_t* w, const uint16_t* bias,
               uint16_t* y, int64_t ys, int M, int64_t N, int64_t K, int nthreads) {
  const int64_t nb = (N + 63) / 64;
  const bool stream = N * K >= (1 << 18);
  const bool par = nthreads > 1 && stream;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t b1 = (b + 1) * 64 < N ? (b + 1) * 64 : N;
    if (!stream) {
      gemv_bf16_span(x, xs, w, bias, y, ys, M, b * 64, b1, K, false);
      continue;
    }
    // A block's last tile may be short: gemv_bf16_rows takes its rows one at a time.
    for (int64_t n0 = b * 64; n0 < b1; n0 += 4)
      gemv_bf16_span(x, xs, w, bias, y, ys, M, n0, n0 + 4 < b1 ? n0 + 4 : b1, K, true);
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

namespace {
// The two C entry points of gemv_fma (bf16 or float32 outputs); -1 where it is not built.
template <typename OutT>
int fma_entry(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
              int64_t y_stride, int M, int64_t N, int64_t K, int nthreads) {
#if defined(PF_FMA_GEMV)
  if (M < 1) return -1;
  gemv_fma(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(w),
           static_cast<const uint16_t*>(bias), static_cast<OutT*>(y), y_stride, M, N, K,
           nthreads);
  return 0;
#else
  (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)y_stride, (void)M, (void)N;
  (void)K, (void)nthreads;
  return -1;
#endif
}
}  // namespace

extern "C" {

// RMSNorm over N rows of D: x rows x_stride apart, out rows out_stride apart, res (rows
// res_stride apart) or NULL, weight (D); zero_centered is rms_row's mode (0, 1, or 2: the
// weight multiply in float32). Returns -1 for an unsupported dtype or mode.
int pf_rms_norm(int dtype, const void* x, int64_t x_stride, void* res, int64_t res_stride,
                const void* w, void* out, int64_t out_stride, int64_t N, int D, float eps,
                int zero_centered, int nthreads) {
  if ((dtype != 0 && dtype != 1) || zero_centered < 0 || zero_centered > 2) return -1;
  const bool par = nthreads > 1 && N * D >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < N; ++i) {
    if (dtype == 0) {
      rms_row<float>(static_cast<const float*>(x) + i * x_stride,
                     res ? static_cast<float*>(res) + i * res_stride : nullptr,
                     static_cast<const float*>(w), static_cast<float*>(out) + i * out_stride, D,
                     eps, zero_centered);
    } else {
      rms_row<uint16_t>(static_cast<const uint16_t*>(x) + i * x_stride,
                        res ? static_cast<uint16_t*>(res) + i * res_stride : nullptr,
                        static_cast<const uint16_t*>(w),
                        static_cast<uint16_t*>(out) + i * out_stride, D, eps, zero_centered);
    }
  }
  return 0;
}

// Per-head q/k RMSNorm (weights qw/kw of D, or NULL: no norm) then neox RoPE on the first rot
// channels, for N tokens. Query head h of token i is read at qkv + i*row_stride + q_off +
// h*q_head_stride, kv head j at qkv + i*row_stride + k_off + j*D; cos/sin (max_pos, rot)
// float32 tables. Writes q_out (N, H, D) and k_out (N, KVH, D), contiguous.
int pf_qk_norm_rope(int dtype, const void* qkv, int64_t row_stride, int64_t q_off,
                    int64_t q_head_stride, int64_t k_off, const int64_t* positions,
                    const float* cos, const float* sin, int rot, const void* qw, const void* kw,
                    float eps, int zero_centered, void* q_out, void* k_out, int64_t N, int H,
                    int KVH, int D, int nthreads) {
  if (D > kMaxHeadDim || rot > D || rot % 2) return -1;
  if (dtype == 0) {
    qk_rope_all<float>(static_cast<const float*>(qkv), row_stride, q_off, q_head_stride, k_off,
                       positions, cos, sin, rot, static_cast<const float*>(qw),
                       static_cast<const float*>(kw), eps, zero_centered != 0,
                       static_cast<float*>(q_out), static_cast<float*>(k_out), N, H, KVH, D,
                       nthreads);
    return 0;
  }
  if (dtype == 1) {
    qk_rope_all<uint16_t>(static_cast<const uint16_t*>(qkv), row_stride, q_off, q_head_stride,
                          k_off, positions, cos, sin, rot, static_cast<const uint16_t*>(qw),
                          static_cast<const uint16_t*>(kw), eps, zero_centered != 0,
                          static_cast<uint16_t*>(q_out), static_cast<uint16_t*>(k_out), N, H,
                          KVH, D, nthreads);
    return 0;
  }
  return -1;
}

// The GDN output norm over (N, H) rows of D: x row (n, h) at x + n*xs0 + h*xs1, gate likewise
// with gs0/gs1; out (N, H, D) contiguous; weight (D).
int pf_rms_norm_gated(int dtype, const void* x, int64_t xs0, int64_t xs1, const void* gate,
                      int64_t gs0, int64_t gs1, const void* w, void* out, int64_t N, int H, int D,
                      float eps, int nthreads) {
  if (dtype != 0 && dtype != 1) return -1;
  const int64_t rows = N * H;
  const bool par = nthreads > 1 && rows * D >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = i / H, h = i % H;
    if (dtype == 0)
      rms_gated_row<float>(static_cast<const float*>(x) + n * xs0 + h * xs1,
                           static_cast<const float*>(gate) + n * gs0 + h * gs1,
                           static_cast<const float*>(w), static_cast<float*>(out) + i * D, D, eps);
    else
      rms_gated_row<uint16_t>(static_cast<const uint16_t*>(x) + n * xs0 + h * xs1,
                              static_cast<const uint16_t*>(gate) + n * gs0 + h * gs1,
                              static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out) + i * D,
                              D, eps);
  }
  return 0;
}

// out (N, I) = T(T(silu(gate)) * up) with gate = gu[:, :I], up = gu[:, I:2I] (rows stride apart).
int pf_silu_mul(int dtype, const void* gu, int64_t stride, void* out, int64_t N, int I,
                int nthreads) {
  if (dtype == 0) {
    silu_mul_all<float>(static_cast<const float*>(gu), stride, static_cast<float*>(out), N, I,
                        nthreads);
    return 0;
  }
  if (dtype == 1) {
    silu_mul_all<uint16_t>(static_cast<const uint16_t*>(gu), stride, static_cast<uint16_t*>(out),
                           N, I, nthreads);
    return 0;
  }
  return -1;
}

// out (N, H x D) = T(o * T(sigmoid(gate))) (see sigmoid_gate_all); dtype 0 float32, 1 bf16.
int pf_sigmoid_gate(int dtype, const void* o, int64_t os, const void* g, int64_t gs,
                    int64_t ghs, void* out, int64_t outs, int64_t N, int H, int D,
                    int nthreads) {
  if (dtype == 0)
    sigmoid_gate_all<float>(static_cast<const float*>(o), os, static_cast<const float*>(g), gs,
                            ghs, static_cast<float*>(out), outs, N, H, D, nthreads);
  else if (dtype == 1)
    sigmoid_gate_all<uint16_t>(static_cast<const uint16_t*>(o), os,
                               static_cast<const uint16_t*>(g), gs, ghs,
                               static_cast<uint16_t*>(out), outs, N, H, D, nthreads);
  else
    return -1;
  return 0;
}

// out (N, I) = T(relu(x)^2), x rows stride apart (Nemotron-H's relu^2 MLP activation).
int pf_relu2(int dtype, const void* x, int64_t stride, void* out, int64_t N, int I,
             int nthreads) {
  if (dtype == 0)
    relu2_all<float>(static_cast<const float*>(x), stride, static_cast<float*>(out), N, I,
                     nthreads);
  else if (dtype == 1)
    relu2_all<uint16_t>(static_cast<const uint16_t*>(x), stride, static_cast<uint16_t*>(out), N,
                        I, nthreads);
  else
    return -1;
  return 0;
}

// y (M, N) = x (M, K) W^T + bias for bf16 x (rows x_stride apart), W (N, K) contiguous, bias
// (N) or NULL, y rows y_stride apart.
int pf_linear_bf16(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                   int64_t y_stride, int M, int64_t N, int64_t K, int nthreads) {
  if (M < 1) return -1;
#if !defined(__AVX512BF16__) && defined(PF_FMA_GEMV)
  // No bf16 dot product: the AVX2 kernel (converting x once, the weights in registers).
  gemv_fma(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(w),
           static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, M, N, K,
           nthreads);
#else
  gemv_bf16(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(w),
            static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, M, N, K,
            nthreads);
#endif
  return 0;
}

// Which products pf_linear_bf16 / pf_linear_bf16_fma have in this build: bit 0, the
// AVX512-BF16 GEMV (pf_linear_bf16 uses it); bit 1, the AVX2 + FMA kernel.
int pf_gemv_kinds() {
  int kinds = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  kinds |= 1;
#endif
#if defined(PF_FMA_GEMV)
  kinds |= 2;
#endif
  return kinds;
}

// The AVX2 + FMA small-M product (gemv_fma) with pf_linear_bf16's arguments, on any CPU that
// has AVX2 and FMA (pf_linear_bf16 takes it only where there is no AVX512-BF16); -1 where
// it was not compiled in.
int pf_linear_bf16_fma(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                       int64_t y_stride, int M, int64_t N, int64_t K, int nthreads) {
  return fma_entry<uint16_t>(x, x_stride, w, bias, y, y_stride, M, N, K, nthreads);
}

// pf_linear_bf16_fma with float32 outputs (y rows y_stride floats apart): the same sums, not
// rounded to bf16. For an lm_head, whose bf16-rounded logits tie more often than one thinks
// (SmolLM2's top two first tokens of the demo question, 0.05 nat apart, round to one value).
int pf_linear_bf16_fma_f32out(const void* x, int64_t x_stride, const void* w, const void* bias,
                              void* y, int64_t y_stride, int M, int64_t N, int64_t K,
                              int nthreads) {
  return fma_entry<float>(x, x_stride, w, bias, y, y_stride, M, N, K, nthreads);
}

// Each row's greedy token of bf16 logits (M rows of N, ld elements apart) read as float32:
// the first index of the row's maximum, the first NaN winning (numpy's argmax on the float32
// widening: the sampler's rule). An lm_head's GEMV output goes here without a float32 copy.
int pf_argmax_bf16(const void* x, int64_t M, int64_t N, int64_t ld, int64_t* out) {
  if (M < 1 || N < 1 || ld < N) return 1;
  const uint16_t* p = static_cast<const uint16_t*>(x);
  for (int64_t r = 0; r < M; ++r) {
    const uint16_t* row = p + r * ld;
    int64_t best = 0;
    float top = bf16_to_f32(row[0]);
    if (top == top) {
      for (int64_t i = 1; i < N; ++i) {
        const float v = bf16_to_f32(row[i]);
        if (v != v) {  // NaN: the first one is the answer
          best = i;
          break;
        }
        if (v > top) {
          top = v;
          best = i;
        }
      }
    }
    out[r] = best;
  }
  return 0;
}

}  // extern "C"
