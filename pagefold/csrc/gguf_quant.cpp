// Few-row products with GGUF weights kept quantized (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K as
// pagefold/quantization/gguf_blocks.py decodes them): per output row o and group g of inputs
// w = scale[o, g] * code + min[o, g], so
//   y[r, o] = sum_g scale[o, g] * dot(x[r, g], code[o, g]) + min[o, g] * sum(x[r, g]),
// the codes decoded once per call, the min term from one sum per row and group.
//
// Layout (pagefold/quantization/gguf_kernel.py builds it at load): codes (n, k * bits / 8)
// uint8 row-major, 4-bit codes (groups of 32 only) two to a byte as GGUF lays them out: byte j
// of a group holds its input j in the low nibble and input j + 16 in the high one (a group
// decodes with two masks and no shuffle), 8-bit: one code (5, 6 or 8 significant bits) per byte; scale and min (n, k / group)
// float32, or float16 (``half``: the Q4_0 / Q4_1 / Q8_0 scales are float16 values); x (m, k) float32 contiguous; y (m, ldy) float32, this call writing columns [0, n).
// Work is split over output rows: each output element is one thread's sum in a fixed order,
// so a row's result depends neither on the rows beside it nor on the thread count. Forms:
// AVX-512 for groups of 16 / 32 (every GGUF type), AVX2 + FMA for groups of 8k, scalar.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxRows = 64;

// The widest form the products may take (pf_gguf_limit_isa): 0 any, 1 AVX2, 2 scalar. Tests
// run every form against the reference on a machine that has them all.
int g_isa_limit = 0;

// Codes [0, count) of one group as floats (4-bit codes: count is 32, in GGUF's order).
inline void decode_codes(const uint8_t* src, int bits, int64_t count, float* dst) {
  int64_t i = 0;
  if (bits == 4) {
#if defined(__AVX2__)
    if (g_isa_limit < 2) {
      const __m128i mask = _mm_set1_epi8(0x0F);
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
      _mm256_storeu_ps(dst + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
      _mm256_storeu_ps(dst + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
      _mm256_storeu_ps(dst + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
      return;
    }
#endif
    for (int64_t j = 0; j < 16; ++j) {
      dst[j] = static_cast<float>(src[j] & 0x0F);
      dst[j + 16] = static_cast<float>(src[j] >> 4);
    }
    return;
  }
#if defined(__AVX2__)
  for (; g_isa_limit < 2 && i + 8 <= count; i += 8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  }
#endif
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Codes [16 * half, 16 * half + 16) of one group as 16 floats.
template <int B>
inline __m512 codes16(const uint8_t* src, int half) {
  if constexpr (B == 4) {  // the group's 16 bytes: low nibbles codes 0-15, high 16-31
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if (half) b = _mm_srli_epi16(b, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
  } else {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * half));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
  }
}

// AVX-512 form for the GGUF groups (16 or 32 inputs): the group's codes decoded into one or
// two registers, one product per row and 16 inputs, a vector accumulator per row.
template <int G, int B>
void row_product_512(const float* x, int64_t m, int64_t k, const uint8_t* row,
                     const float* sc, const float* mn, const float* xsum, float* out) {
  const int64_t groups = k / G;
  if (m == 1) {
    // One row (batch-1 decode): two groups at a time into two accumulators, so consecutive
    // groups' FMAs do not wait on each other.
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    float m0 = 0.f, m1 = 0.f;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      const uint8_t* src = row + g * G * B / 8;
      const __m512 u0 = codes16<B>(src, 0);
      const __m512 v0 = codes16<B>(src + G * B / 8, 0);
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(x + g * G), u0);
      __m512 q = _mm512_mul_ps(_mm512_loadu_ps(x + (g + 1) * G), v0);
      if constexpr (G == 32) {
        p = _mm512_fmadd_ps(_mm512_loadu_ps(x + g * G + 16), codes16<B>(src, 1), p);
        q = _mm512_fmadd_ps(_mm512_loadu_ps(x + (g + 1) * G + 16),
                            codes16<B>(src + G * B / 8, 1), q);
      }
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g]), p, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g + 1]), q, a1);
      m0 += mn[g] * xsum[g];
      m1 += mn[g + 1] * xsum[g + 1];
    }
    for (; g < groups; ++g) {
      const uint8_t* src = row + g * G * B / 8;
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(x + g * G), codes16<B>(src, 0));
      if constexpr (G == 32)
        p = _mm512_fmadd_ps(_mm512_loadu_ps(x + g * G + 16), codes16<B>(src, 1), p);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(sc[g]), p, a0);
      m0 += mn[g] * xsum[g];
    }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + (m0 + m1);
    return;
  }
  __m512 acc[kMaxRows];
  float accm[kMaxRows];
  for (int64_t r = 0; r < m; ++r) {
    acc[r] = _mm512_setzero_ps();
    accm[r] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = row + g * G * B / 8;
    const __m512 w0 = codes16<B>(src, 0);
    const __m512 w1 = G == 32 ? codes16<B>(src, 1) : _mm512_setzero_ps();
    const __m512 s = _mm512_set1_ps(sc[g]);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k + g * G;
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(xr), w0);
      if constexpr (G == 32) p = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, p);
      acc[r] = _mm512_fmadd_ps(s, p, acc[r]);
      accm[r] += mn[g] * xsum[r * groups + g];
    }
  }
  for (int64_t r = 0; r < m; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + accm[r];
}
#endif

// One output row: acc[r] = sum over groups of scale * dot + min * xsum.
void row_product(const float* x, int64_t m, int64_t k, const uint8_t* row, int bits,
                 int64_t group, const float* sc, const float* mn, const float* xsum,
                 float* w, float* out) {
  const int64_t groups = k / group;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (g_isa_limit == 0 && group == 32 && bits == 4)
    return row_product_512<32, 4>(x, m, k, row, sc, mn, xsum, out);
  if (g_isa_limit == 0 && group == 32 && bits == 8)
    return row_product_512<32, 8>(x, m, k, row, sc, mn, xsum, out);
  if (g_isa_limit == 0 && group == 16 && bits == 8)
    return row_product_512<16, 8>(x, m, k, row, sc, mn, xsum, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (g_isa_limit <= 1 && group % 8 == 0) {
    // Vector accumulators per row: one horizontal sum per output, not per group.
    __m256 acc[kMaxRows];
    float accm[kMaxRows];
    for (int64_t r = 0; r < m; ++r) {
      acc[r] = _mm256_setzero_ps();
      accm[r] = 0.f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      decode_codes(row + g * group * bits / 8, bits, group, w);
      const __m256 s = _mm256_set1_ps(sc[g]);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + g * group;
        __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xr), _mm256_loadu_ps(w));
        for (int64_t i = 8; i < group; i += 8)
          p = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(w + i), p);
        acc[r] = _mm256_fmadd_ps(s, p, acc[r]);
        accm[r] += mn[g] * xsum[r * groups + g];
      }
    }
    for (int64_t r = 0; r < m; ++r) out[r] = hsum(acc[r]) + accm[r];
    return;
  }
#endif
  for (int64_t r = 0; r < m; ++r) out[r] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    decode_codes(row + g * group * bits / 8, bits, group, w);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k + g * group;
      float d = 0.f;
      for (int64_t i = 0; i < group; ++i) d += xr[i] * w[i];
      out[r] += sc[g] * d + mn[g] * xsum[r * groups + g];
    }
  }
}

// Whether the kernels take this layout: 4-bit codes in groups of 32 or 8-bit codes in groups
// dividing k; float16 scales only where the CPU widens them (F16C).
inline bool layout_ok(int32_t bits, int64_t group, int64_t k, int32_t half) {
#if !defined(__F16C__)
  if (half) return false;
#endif
  return (bits == 4 || bits == 8) && k >= 1 && group >= 1 && k % group == 0 &&
         (bits != 4 || group == 32);
}

// Row o's scales and mins as float32: the tensors' own row, or (float16 tensors, exact for
// Q4_0 / Q4_1 / Q8_0) widened into sc_buf / mn_buf (groups floats each).
inline void row_scales(const void* scale, const void* mins, int32_t half, int64_t o,
                       int64_t groups, float* sc_buf, float* mn_buf, const float** sc,
                       const float** mn) {
  *sc = static_cast<const float*>(scale) + o * groups;
  *mn = static_cast<const float*>(mins) + o * groups;
#if defined(__F16C__)
  if (half) {
    const uint16_t* hs = static_cast<const uint16_t*>(scale) + o * groups;
    const uint16_t* hm = static_cast<const uint16_t*>(mins) + o * groups;
    for (int64_t g = 0; g < groups; ++g) {
      sc_buf[g] = _cvtsh_ss(hs[g]);
      mn_buf[g] = _cvtsh_ss(hm[g]);
    }
    *sc = sc_buf;
    *mn = mn_buf;
  }
#endif
}

}  // namespace

extern "C" {

// Limit the forms of pf_qgemv_affine (0: any, 1: AVX2 at most, 2: scalar); returns the old.
int pf_gguf_limit_isa(int32_t limit) {
  int old = g_isa_limit;
  g_isa_limit = limit;
  return old;
}

// 0 on success; 1 when the arguments are outside what the kernel takes (nothing written).
int pf_qgemv_affine(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                    int32_t bits, int64_t group, const void* scale, const void* mins,
                    int32_t half, float* y, int64_t ldy, int32_t nthreads) {
  if (!layout_ok(bits, group, k, half) || m < 1 || m > kMaxRows || n < 1 || ldy < n) return 1;
  const int64_t groups = k / group;
  const int64_t row_bytes = k * bits / 8;
  const std::vector<float> xsum = pf::group_sums(x, m, k, group);
  const bool par = n >= 64 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<float> w(group), sc_row(half ? groups : 0), mn_row(half ? groups : 0);
    float out[kMaxRows];
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const float *sc, *mn;
      row_scales(scale, mins, half, o, groups, sc_row.data(), mn_row.data(), &sc, &mn);
      row_product(x, m, k, codes + o * row_bytes, bits, group, sc, mn, xsum.data(), w.data(),
                  out);
      for (int64_t r = 0; r < m; ++r) y[r * ldy + o] = out[r];
    }
  }
  return 0;
}

// Rows [0, n) of an affine weight decoded to bf16 into out (n rows, stride ldo): each weight
// bf16(scale * code + min), the product and the sum each rounded to float32 (never fused) and
// the result rounded to nearest even: the bits of gguf_kernel.py's torch decode
// (codes.float() * scale.float() + min.float(), then .to(torch.bfloat16)). Products above the
// few-row kernels' rows decode a tile here and run oneDNN's GEMM on it. 0 on success; 1 when
// the arguments are outside what it takes (nothing written).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
int pf_affine_decode_bf16(const uint8_t* codes, int32_t bits, int64_t group, const void* scale,
                          const void* mins, int32_t half, int64_t n, int64_t k, uint16_t* out,
                          int64_t ldo, int32_t nthreads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  if (!layout_ok(bits, group, k, half) || n < 1 || ldo < k) return 1;
  const int64_t groups = k / group;
  const int64_t row_bytes = k * bits / 8;
  const bool par = n >= 16 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<float> w(group), sc_row(half ? groups : 0), mn_row(half ? groups : 0);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const uint8_t* src = codes + o * row_bytes;
      uint16_t* dst = out + o * ldo;
      const float *sc, *mn;
      row_scales(scale, mins, half, o, groups, sc_row.data(), mn_row.data(), &sc, &mn);
      for (int64_t g = 0; g < groups; ++g) {
        decode_codes(src + g * group * bits / 8, bits, group, w.data());
        for (int64_t j = 0; j < group; ++j) {
          const float p = w[j] * sc[g];
          dst[g * group + j] = pf::f32_to_bf16(p + mn[g]);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
