// Few-row products with GGUF-layout weights (gguf_quant.cpp's layout: unsigned codes, per
// output row and group of 32 or 16 inputs a scale and a min) on int8 activations, as
// llama.cpp multiplies its quantized weights by Q8 activations: integer dot products (AVX-512
// VNNI vpdpbusd; AVX2 vpmaddubsw for codes of at most 6 bits), one float scale per group.
// `bits`: 4 (codes two to a byte, GGUF's order per 32 inputs: Q4_0, Q4_1, Q4_K), or 5..8 (one
// code a byte, every code below 2^bits: Q5_K 5, Q6_K 6, Q8_0 8). Weight groups of 16 (Q6_K)
// split each activation group in two halves, each with its own weight scale and min.
//
// The activations are quantized per row r and group g of 32 inputs:
//   d[r, g] = amax / 127, q[r, g, i] = round(x[r, g, i] * (127 / amax)) (0 where amax is 0),
// rounded to nearest even, and the product is exactly the float product of those rounded
// activations with the decoded weights (w = scale * code + min), over the weight groups h
// (h within activation group g(h)):
//   y[r, o] = sum_h scale[o, h] * d[r, g(h)] * dot(q[r, h], code[o, h])
//             + min[o, h] * d[r, g(h)] * sum(q[r, h]),
// the integer sums exact, so it differs from x @ w.T only by the activations' rounding (at
// most d / 2 per input: about 0.4% of the group's largest input). That is not the float32
// product the exactness tests hold the models to: pagefold/quantization/gguf_kernel.py takes
// this form only for bf16 activations (where the module path and the native decode driver
// both take it, so they agree bit for bit), never for float32.
//
// Work is split over output rows; each output element is one thread's sum in a fixed order,
// the same whichever rows are beside it (blocks of rows run the same per-row instructions).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "q8_act.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kG = 32;        // the activations' group (and the weight groups' largest)
constexpr int64_t kMaxRows = 64;  // as pf_qgemv_affine
constexpr int kBlock = 4;         // rows per pass over a weight row

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PF_Q8_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PF_Q8_AVX2 1
#endif

// The widest form pf_qgemv_affine_q8 may take (0: any, 1: AVX2 at most); tests run both.
int g_limit = 0;

// The activations, quantized: q (m, kpad) int8 with zeros past k (kpad: a whole number of
// group pairs), per row and group pair the VNNI form's lane scales (d[g] in lanes 0-7,
// d[g + 1] in 8-15), and per row and weight group h (`wg` inputs: 32 or 16) d[g(h)] * sum(q
// over h) (the min term's factor; `hpad` of them a row).
struct Activations {
  int64_t groups, gpad, kpad, hpad;
  std::vector<int8_t> q;
  std::vector<float> d, lanes, dsum;

  Activations(const float* x, int64_t m, int64_t k, int64_t wg)
      : groups(k / kG), gpad((k / kG + 1) / 2 * 2), kpad(gpad * kG), hpad(gpad * (kG / wg)),
        q(static_cast<size_t>(m * kpad), 0), d(static_cast<size_t>(m * gpad), 0.f),
        lanes(static_cast<size_t>(m * gpad * 8), 0.f),
        dsum(static_cast<size_t>(m * hpad), 0.f) {
    const int64_t per = kG / wg;  // weight groups per activation group
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum[2];
        const float dg = pf::q8_group(x + r * k + g * kG, q.data() + r * kpad + g * kG, wg, sum);
        d[r * gpad + g] = dg;
        for (int64_t h = 0; h < per; ++h)
          dsum[r * hpad + g * per + h] = dg * static_cast<float>(sum[h]);
        std::fill_n(lanes.data() + (r * gpad + g) * 8, 8, dg);
      }
  }
};

#if defined(PF_Q8_AVX2)
// A row's scale or min i as a float (stored float16 when `half`).
inline float param(const void* p, int32_t half, int64_t i) {
  return half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
#endif

#if defined(PF_Q8_VNNI)
// Two groups' codes as 64 bytes in input order (the second group zero when `one`).
template <int B>
inline __m512i codes64(const uint8_t* src, bool one) {
  if constexpr (B == 4) {  // 16 bytes a group: low nibbles inputs 0-15, high 16-31
    const __m256i b = one ? _mm256_maskz_loadu_epi8(0xFFFFu, src)
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m512i z = _mm512_castsi256_si512(b);
    const __m512i lanes = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));  // g g g+1 g+1
    const long long s4 = 0x0004000400040004LL;  // 16-bit counts: lanes 1 and 3 high nibbles
    const __m512i v = _mm512_srlv_epi16(lanes, _mm512_set_epi64(s4, s4, 0, 0, s4, s4, 0, 0));
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
  } else {
    return one ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
  }
}

// Rows [r0, r0 + R) of one output row o: scale/min rows sc, mn (float16 when half), weight
// groups of W inputs (32 or 16). Two accumulators per row (even and odd group pairs), so
// consecutive pairs' FMAs do not wait on each other; every row runs the same instructions
// whatever R is.
template <int B, int W, int R>
void rows_vnni(const Activations& a, int64_t r0, const uint8_t* row, const void* sc,
               const void* mn, int32_t half, float* out) {
  constexpr int64_t P = kG / W;  // weight groups per activation group
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t groups = a.groups, wgroups = groups * P;
  __m512 sc16 = _mm512_setzero_ps();  // the scales of weight groups [h & ~15, +16)
  // The dot product's lane i sums inputs [4 i, 4 i + 4) of the pair: its weight group.
  const __m512i lane_group =
      P == 1 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
             : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t g = 0; g < groups; g += 2) {
    const int j = static_cast<int>((g >> 1) & 1);
    const bool one = g + 1 == groups;
    const int64_t h = g * P;  // the pair's first weight group (a multiple of 2 P)
    if ((h & 15) == 0) {
      const int64_t left = wgroups - h;
      const __mmask16 mk = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      sc16 = half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                        mk, static_cast<const uint16_t*>(sc) + h))
                  : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(sc) + h);
    }
    const __m512i w = codes64<B>(row + g * kG * B / 8, one);
    // each lane: its weight group's scale (0 past the last group)
    const __m512i pick = _mm512_add_epi32(lane_group, _mm512_set1_epi32(static_cast<int>(h & 15)));
    const __m512 sv = _mm512_permutexvar_ps(pick, sc16);
    for (int r = 0; r < R; ++r) {
      const int64_t rr = r0 + r;
      const __m512i xq = _mm512_loadu_si512(a.q.data() + rr * a.kpad + g * kG);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
      const __m512 dv = _mm512_loadu_ps(a.lanes.data() + (rr * a.gpad + g) * 8);
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, dv), acc[r][j]);
    }
  }
  // The min term: sum_h min[h] * d[g(h)] * sum(q[h]), 16 weight groups a step.
  for (int64_t g = 0; g < wgroups; g += 16) {
    const __mmask16 mk =
        wgroups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (wgroups - g)) - 1);
    const __m512 mv = half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                                 mk, static_cast<const uint16_t*>(mn) + g))
                           : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(mn) + g);
    for (int r = 0; r < R; ++r)
      acc[r][1] = _mm512_fmadd_ps(
          mv, _mm512_maskz_loadu_ps(mk, a.dsum.data() + (r0 + r) * a.hpad + g), acc[r][1]);
  }
  for (int r = 0; r < R; ++r)
    out[r0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

#if defined(PF_Q8_AVX2)
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Codes of at most 6 bits (B = 4: two to a byte; B = 8: one to a byte, below 64): code times
// q pairs fit vpmaddubsw's int16 sums (2 * 63 * 127 < 2^15; 8-bit codes would overflow). One
// activation group a step, then int32 sums of pairs; weight groups of W inputs (32 or 16:
// lanes 0-3 the first half's, 4-7 the second's).
template <int B, int W, int R>
void rows_avx2(const Activations& a, int64_t r0, const uint8_t* row, const void* sc,
               const void* mn, int32_t half, float* out) {
  constexpr int64_t P = kG / W;
  __m256 acc[R];
  float accm[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    accm[r] = 0.f;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256i w;
    if constexpr (B == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kG / 2));
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kG));
    }
    const __m256 s = P == 1 ? _mm256_set1_ps(param(sc, half, g))
                            : _mm256_set_m128(_mm_set1_ps(param(sc, half, 2 * g + 1)),
                                              _mm_set1_ps(param(sc, half, 2 * g)));
    float m[P];
    for (int64_t h = 0; h < P; ++h) m[h] = param(mn, half, g * P + h);
    for (int r = 0; r < R; ++r) {
      const int64_t rr = r0 + r;
      const __m256i xq =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + rr * a.kpad + g * kG));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
      const __m256 dv = _mm256_set1_ps(a.d[rr * a.gpad + g]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, dv), acc[r]);
      for (int64_t h = 0; h < P; ++h) accm[r] += m[h] * a.dsum[rr * a.hpad + g * P + h];
    }
  }
  for (int r = 0; r < R; ++r) out[r0 + r] = hsum8(acc[r]) + accm[r];
}
#endif

using RowsFn = void (*)(const Activations&, int64_t, const uint8_t*, const void*, const void*,
                        int32_t, float*);

template <template <int, int, int> class F, int B, int W>
void fill(RowsFn (&fn)[kBlock + 1]) {
  fn[1] = F<B, W, 1>::fn, fn[2] = F<B, W, 2>::fn, fn[3] = F<B, W, 3>::fn;
  fn[4] = F<B, W, 4>::fn;
}

#if defined(PF_Q8_VNNI)
template <int B, int W, int R>
struct Vnni {
  static constexpr RowsFn fn = rows_vnni<B, W, R>;
};
#endif
#if defined(PF_Q8_AVX2)
template <int B, int W, int R>
struct Avx2 {
  static constexpr RowsFn fn = rows_avx2<B, W, R>;
};
#endif

// The row-block functions of the form this call takes, for blocks of 1..kBlock rows; false
// when no compiled form takes (bits, group, limit).
bool forms(int32_t bits, int64_t group, RowsFn (&fn)[kBlock + 1]) {
  if ((group != 32 && group != 16) || bits < 4 || bits > 8) return false;
  const bool g32 = group == 32;
#if defined(PF_Q8_VNNI)
  if (g_limit == 0) {
    if (bits == 4) g32 ? fill<Vnni, 4, 32>(fn) : fill<Vnni, 4, 16>(fn);
    else g32 ? fill<Vnni, 8, 32>(fn) : fill<Vnni, 8, 16>(fn);
    return true;
  }
#endif
#if defined(PF_Q8_AVX2)
  if (g_limit <= 1 && bits <= 6) {
    if (bits == 4) g32 ? fill<Avx2, 4, 32>(fn) : fill<Avx2, 4, 16>(fn);
    else g32 ? fill<Avx2, 8, 32>(fn) : fill<Avx2, 8, 16>(fn);
    return true;
  }
#endif
  (void)g32;
  return false;
}

}  // namespace

extern "C" {

// Limit the forms of pf_qgemv_affine_q8 (0: any, 1: AVX2 at most); returns the old limit.
int pf_qgemv_q8_limit_isa(int32_t limit) {
  const int old = g_limit;
  g_limit = limit;
  return old;
}

// Whether a compiled form takes `bits`-bit codes in weight groups of `group` (32 or 16)
// under the current limit.
int pf_qgemv_q8_takes(int32_t bits, int64_t group) {
  RowsFn fn[kBlock + 1];
  return forms(bits, group, fn) ? 1 : 0;
}

// pf_qgemv_affine's arguments and layout (x float32 (m, k), codes, scale / min float32 or
// float16, y float32 (m, ldy)), on int8 activations as above (`bits` as above: 4, or 5..8
// for one code a byte). 0 on success; 1 when the arguments are outside what a compiled form
// takes (group not 32 / 16, k not whole groups of 32, no form for the bits here): nothing
// written.
int pf_qgemv_affine_q8(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                       int32_t bits, int64_t group, const void* scale, const void* mins,
                       int32_t half, float* y, int64_t ldy, int32_t nthreads) {
  RowsFn fn[kBlock + 1];
  if (m < 1 || m > kMaxRows || k < kG || k % kG || n < 1 || ldy < n || !forms(bits, group, fn))
    return 1;
  const Activations a(x, m, k, group);
  const int64_t groups = k / group, row_bytes = bits == 4 ? k / 2 : k;
  const bool par = n >= 64 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    float out[kMaxRows];
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const int64_t p = o * groups;
      const void* sc = half ? static_cast<const void*>(static_cast<const uint16_t*>(scale) + p)
                            : static_cast<const void*>(static_cast<const float*>(scale) + p);
      const void* mn = half ? static_cast<const void*>(static_cast<const uint16_t*>(mins) + p)
                            : static_cast<const void*>(static_cast<const float*>(mins) + p);
      for (int64_t r0 = 0; r0 < m; r0 += kBlock) {
        const int64_t rb = std::min<int64_t>(kBlock, m - r0);
        fn[rb](a, r0, codes + o * row_bytes, sc, mn, half, out);
      }
      for (int64_t r = 0; r < m; ++r) y[r * ldy + o] = out[r];
    }
  }
  return 0;
}

}  // extern "C"
