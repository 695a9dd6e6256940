// Shared helpers of pagefold's CPU kernels (attention.cpp, layers.cpp): element types,
// bf16 rounding, vectorisable exp, one RMSNorm row.
//
// Element types: 0 = float32, 1 = bfloat16 (stored as uint16; converted by bit shifts, rounded
// to nearest even on the way back, as torch does). Every reduction accumulates in float32.
//
// Threads: the caller passes how many (torch.get_num_threads()); the OpenMP runtime is the one
// torch already loaded (same soname), so no second thread pool competes with torch's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pf {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// Row to float: the compiler vectorises this (bf16 -> f32 is a widening shift).
template <typename T> inline void to_float(const T* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = load<T>(src, i);
}

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 32;   // query heads per kv head
constexpr int kMaxBlock = 256;  // tokens per block

// exp for x <= 0 (softmax terms), Cephes' single-precision polynomial (about 1 ulp), written
// so a loop of it vectorises (std::exp does not). Below -87 it returns 2^-126 instead of a
// denormal or 0: a term that small cannot move a sum that holds exp(0) = 1.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// exp on the whole float range, vectorisable: exp_nonpos's polynomial after a clamp; above
// 88.7 (where float overflows) it returns +inf, as std::exp does.
inline float exp_any(float x) {
  const float xc = x > 88.0f ? 88.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = static_cast<int32_t>(n < -126.0f ? -127.0f : n) + 127;  // 0: y * 0
  const int32_t bits = e << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x > 88.7f ? std::numeric_limits<float>::infinity() : y * scale;
}

// Rounds a float to T and back: the value a torch op of dtype T would have stored.
template <typename T> inline float rnd(float v);
template <> inline float rnd<float>(float v) { return v; }
template <> inline float rnd<uint16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// RMSNorm of one row of D: out = w * T(x / rms(x)), or T(x / rms(x) * (1 + w)) when
// zero-centred (the weight stored as an offset from 1), as pagefold.layers.norm computes it.
// With res: x + res is rounded to T, written back to res, and normalised.
template <typename T>
void rms_row(const T* x, T* res, const T* w, T* out, int D, float eps, bool zc) {
  float ss = 0.f;
  if (res) {
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; ++d) {
      const float v = rnd<T>(load<T>(x, d) + load<T>(res, d));
      store<T>(res, d, v);
      ss += v * v;
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < D; ++d) {
      const float v = load<T>(x, d);
      ss += v * v;
    }
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  const T* src = res ? res : x;
  if (zc) {
#pragma omp simd
    for (int d = 0; d < D; ++d) store<T>(out, d, load<T>(src, d) * r * (1.0f + load<T>(w, d)));
  } else {
#pragma omp simd
    for (int d = 0; d < D; ++d) store<T>(out, d, load<T>(w, d) * rnd<T>(load<T>(src, d) * r));
  }
}

}  // namespace pf
