// Few-row products with integer or FP8 weights in groups (GPTQ, AWQ, compressed-tensors int,
// int8 / int4 / fp8 quantized on load, FP8 checkpoints): y[r, o] = sum_g scale[o, g] * (dot(x[r, g], code[o, g]) -
// zero[o, g] * sum(x[r, g])), which is x @ (scale * (code - zero)).T with the codes decoded
// once per call and the zero term from one sum per row and group.
//
// Layout (pagefold/quantization/int_kernel.py builds it at load): codes (n, k * bits / 8)
// uint8, row-major, 4-bit codes two to a byte (input 2j in the low nibble, 2j + 1 in the high
// one), or float8_e4m3fn bytes (fp8, zeros 0); scale and zero (n, k / group) float32; x (m, k) float32 contiguous; y (m, ldy) float32,
// this call writing columns [0, n). Work is split over output rows: each output element is one
// thread's sum in a fixed order, so a row's result does not depend on the rows beside it or on
// the thread count.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxRows = 64;

// float8_e4m3fn byte -> float: the exponent and mantissa bits moved to float32's positions
// are a float 2^-120 times the value (subnormals included), so one product by 2^120 and the
// sign bit finish it. (0x7f / 0xff, the format's NaN, do not occur in weights.)
inline float fp8_to_f32(uint8_t b) {
  uint32_t em = static_cast<uint32_t>(b & 0x7f) << 20;
  float f;
  std::memcpy(&f, &em, sizeof(f));
  f *= std::ldexp(1.0f, 120);
  return (b & 0x80) ? -f : f;
}

// Codes [0, count) of one group (starting at an even input) as floats.
inline void decode(const uint8_t* src, int bits, bool fp8, int64_t count, float* dst) {
  int64_t i = 0;
  if (fp8) {
#if defined(__AVX2__)
    const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80);
    const __m256 two120 = _mm256_castsi256_ps(_mm256_set1_epi32(0x7B800000));  // 2^120
    for (; i + 8 <= count; i += 8) {
      __m256i v = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      __m256 f = _mm256_mul_ps(
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, m7f), 20)), two120);
      __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, m80), 24);
      _mm256_storeu_ps(dst + i, _mm256_or_ps(f, _mm256_castsi256_ps(sign)));
    }
#endif
    for (; i < count; ++i) dst[i] = fp8_to_f32(src[i]);
    return;
  }
  if (bits == 4) {
#if defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (; i + 16 <= count; i += 16) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i / 2));
      __m128i lo = _mm_and_si128(b, mask);
      __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      __m128i v = _mm_unpacklo_epi8(lo, hi);  // 16 codes in input order
      _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
      _mm256_storeu_ps(dst + i + 8,
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
    }
#endif
    for (; i < count; ++i) {
      uint8_t b = src[i / 2];
      dst[i] = static_cast<float>((i & 1) ? (b >> 4) : (b & 0x0F));
    }
    return;
  }
#if defined(__AVX2__)
  for (; i + 8 <= count; i += 8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  }
#endif
  for (; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t count) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= count; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < count; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

extern "C" {

// 0 on success; 1 when the arguments are outside what the kernel takes (nothing written).
int pf_qgemv_int(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                 int32_t bits, int32_t fp8, int64_t group, const float* scale,
                 const float* zero, float* y, int64_t ldy, int32_t nthreads) {
  if ((bits != 4 && bits != 8) || (fp8 && bits != 8) || m < 1 || m > kMaxRows || k < 1 || n < 1 || group < 1 ||
      k % group || (bits == 4 && (group % 2 || k % 2)) || ldy < n)
    return 1;
  const int64_t groups = k / group;
  const int64_t row_bytes = k * bits / 8;
  const std::vector<float> xsum = pf::group_sums(x, m, k, group);
  const bool par = n >= 64 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    std::vector<float> w(group);
    float acc[kMaxRows];
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const uint8_t* row = codes + o * row_bytes;
      const float* sc = scale + o * groups;
      const float* zp = zero + o * groups;
      std::fill(acc, acc + m, 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        decode(row + g * group * bits / 8, bits, fp8 != 0, group, w.data());
        for (int64_t r = 0; r < m; ++r) {
          float d = dot(x + r * k + g * group, w.data(), group);
          acc[r] += sc[g] * (d - zp[g] * xsum[r * groups + g]);
        }
      }
      for (int64_t r = 0; r < m; ++r) y[r * ldy + o] = acc[r];
    }
  }
  return 0;
}

}  // extern "C"
