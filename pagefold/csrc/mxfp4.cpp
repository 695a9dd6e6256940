// Few-row products with MXFP4 weights (gpt-oss's experts, pagefold/quantization/mxfp4.py's
// layout): an (n, k) matrix as blocks (n, k / 32, 16) uint8, two E2M1 codes a byte (the even
// input in the low nibble), and scales (n, k / 32) uint8, E8M0: 2^(s - 127).
//
// Per output row the weights are decoded once into a float32 row buffer, exactly (an E2M1
// value times a power of two, 2^-127 included, is a float32), each block's low nibbles
// (the even inputs) then its high nibbles (the odd inputs); the activations are laid out in
// the same order once per call, so each product is a plain float32 dot product:
//   y[r, o] = sum_i w[o, i] * x[r, i],
// accumulated per lane over the inputs in a fixed order and then summed across lanes, the
// same whichever rows are beside it (every row runs the same instructions). It differs from
// the torch reference (decode, F.linear) only in the summation order of float32 sums.
//
// Decoding a code: the value of its magnitude bits (0, 0.5, 1, 1.5, 2, 3, 4, 6) by a table
// lookup in a register (AVX2 vpermps on the low three bits; AVX-512 vpermps over all 16 codes,
// the sign included), the sign moved from bit 3 to bit 31.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlk = 32;      // inputs per block (one scale)
constexpr int64_t kMaxRows = 64;  // rows one call takes
constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                             -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The widest form pf_qgemv_mxfp4 may take (0: any, 1: AVX2 at most, 2: scalar); tests run each.
int g_limit = 0;

// 2^(s - 127) as a float32 (s = 0: the subnormal 2^-127; 255, NaN, is refused on load).
inline float e8m0(uint8_t s) {
  const uint32_t bits = s == 0 ? (1u << 22) : static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Row o's weights decoded into w (k floats, per block: even inputs, then odd inputs).
void decode_scalar(const uint8_t* blocks, const uint8_t* scales, int64_t k, float* w) {
  for (int64_t g = 0; g < k / kBlk; ++g) {
    const float s = e8m0(scales[g]);
    const uint8_t* b = blocks + g * 16;
    for (int j = 0; j < 16; ++j) {
      w[g * kBlk + j] = kE2M1[b[j] & 15] * s;
      w[g * kBlk + 16 + j] = kE2M1[b[j] >> 4] * s;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight codes (int32 lanes, values 0-15) -> their E2M1 values.
inline __m256 e2m1_8(__m256i code, __m256 mag) {
  const __m256 v = _mm256_permutevar8x32_ps(mag, code);  // the low three bits index
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28),
                                        _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

void decode_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t k, float* w) {
  const __m256 mag = _mm256_loadu_ps(kE2M1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < k / kBlk; ++g) {
    const __m256 s = _mm256_set1_ps(e8m0(scales[g]));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + g * 16));
    const __m128i lo = _mm_and_si128(b, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    float* dst = w + g * kBlk;
    _mm256_storeu_ps(dst, _mm256_mul_ps(e2m1_8(_mm256_cvtepu8_epi32(lo), mag), s));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(
        e2m1_8(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), mag), s));
    _mm256_storeu_ps(dst + 16, _mm256_mul_ps(e2m1_8(_mm256_cvtepu8_epi32(hi), mag), s));
    _mm256_storeu_ps(dst + 24, _mm256_mul_ps(
        e2m1_8(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), mag), s));
  }
}

inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// out[r] = dot(w, x[r]) for rows [r0, r0 + R); k a multiple of 32.
template <int R>
void dots_avx2(const float* w, const float* x, int64_t k, int64_t r0, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 wv = _mm256_loadu_ps(w + i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (r0 + r) * k + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r0 + r] = hsum8(acc[r]);
}
#endif

#if defined(PF_AVX512)
void decode_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t k, float* w) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);  // 16 codes, the sign included
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < k / kBlk; ++g) {
    const __m512 s = _mm512_set1_ps(e8m0(scales[g]));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + g * 16));
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, low4));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
    _mm512_storeu_ps(w + g * kBlk, _mm512_mul_ps(_mm512_permutexvar_ps(lo, lut), s));
    _mm512_storeu_ps(w + g * kBlk + 16, _mm512_mul_ps(_mm512_permutexvar_ps(hi, lut), s));
  }
}

template <int R>
void dots_avx512(const float* w, const float* x, int64_t k, int64_t r0, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 wv = _mm512_loadu_ps(w + i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (r0 + r) * k + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r0 + r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <int R>
void dots_scalar(const float* w, const float* x, int64_t k, int64_t r0, float* out) {
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t i = 0; i < k; ++i) acc += w[i] * x[(r0 + r) * k + i];
    out[r0 + r] = acc;
  }
}

using DecodeFn = void (*)(const uint8_t*, const uint8_t*, int64_t, float*);
using DotsFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
constexpr int kRowBlock = 4;  // activation rows per pass over a decoded weight row

struct Form {
  DecodeFn decode;
  DotsFn dots[kRowBlock + 1];
};

Form pick() {
#if defined(PF_AVX512)
  if (g_limit == 0)
    return {decode_avx512, {nullptr, dots_avx512<1>, dots_avx512<2>, dots_avx512<3>,
                            dots_avx512<4>}};
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (g_limit <= 1)
    return {decode_avx2, {nullptr, dots_avx2<1>, dots_avx2<2>, dots_avx2<3>, dots_avx2<4>}};
#endif
  return {decode_scalar, {nullptr, dots_scalar<1>, dots_scalar<2>, dots_scalar<3>,
                          dots_scalar<4>}};
}

}  // namespace

extern "C" {

// Limit the forms of pf_qgemv_mxfp4 (0: any, 1: AVX2 at most, 2: scalar); returns the old one.
int pf_mxfp4_limit_isa(int32_t limit) {
  const int old = g_limit;
  g_limit = limit;
  return old;
}

// y (m, ldy) float32 = x (m, k) float32 times the MXFP4 matrix (n, k), transposed. 0 on
// success; 1 when the arguments are outside what it takes (m not in 1..64, k not a positive
// multiple of 32, n < 1, ldy < n): nothing written.
int pf_qgemv_mxfp4(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* blocks,
                   const uint8_t* scales, float* y, int64_t ldy, int32_t nthreads) {
  if (m < 1 || m > kMaxRows || k < kBlk || k % kBlk || n < 1 || ldy < n) return 1;
  const Form form = pick();
  // The activations in the decoded rows' order: per block the even inputs, then the odd.
  std::vector<float> xp(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / kBlk; ++g)
      for (int j = 0; j < 16; ++j) {
        xp[r * k + g * kBlk + j] = x[r * k + g * kBlk + 2 * j];
        xp[r * k + g * kBlk + 16 + j] = x[r * k + g * kBlk + 2 * j + 1];
      }
  const int64_t groups = k / kBlk;
  const bool par = n >= 16 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<float> w(static_cast<size_t>(k));
    float out[kMaxRows];
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      form.decode(blocks + o * groups * 16, scales + o * groups, k, w.data());
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rb = std::min<int64_t>(kRowBlock, m - r0);
        form.dots[rb](w.data(), xp.data(), k, r0, out);
      }
      for (int64_t r = 0; r < m; ++r) y[r * ldy + o] = out[r];
    }
  }
  return 0;
}

}  // extern "C"
