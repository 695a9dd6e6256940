// Activations quantized to int8 per row and group of 32 inputs, as the int8-activation GGUF
// products take them (qgemv_q8.cpp, qgemm_amx.cpp), so both kernels see the same integers:
//   d = amax / 127, q[i] = round(x[i] * (127 / amax)) (0 where amax is 0), rounded to nearest
//   even,
// and per weight group of `wg` inputs (32, or 16: two halves of the group) the sum of its q.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pf {

// One group of 32 inputs xs into qs; sums[0] (and sums[1] for wg 16) the weight groups' sums
// of q. Returns d. The AVX-512 form computes the same values (max and integer sums are exact
// in any order; the product and the rounding are the scalar form's, element by element).
inline float q8_group(const float* xs, int8_t* qs, int64_t wg, int32_t sums[2]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 x0 = _mm512_loadu_ps(xs), x1 = _mm512_loadu_ps(xs + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float id = amax > 0.f ? 127.0f / amax : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, vid), kRound));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, vid), kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16), _mm512_cvtepi32_epi8(q1));
  const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
  if (wg == 16) {
    sums[0] = s0, sums[1] = s1;
  } else {
    sums[0] = s0 + s1, sums[1] = 0;
  }
  return amax / 127.0f;
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xs[i]));
  const float id = amax > 0.f ? 127.0f / amax : 0.f;
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    qs[i] = static_cast<int8_t>(std::nearbyint(xs[i] * id));
    sums[wg == 16 && i >= 16] += qs[i];
  }
  return amax / 127.0f;
#endif
}

}  // namespace pf
