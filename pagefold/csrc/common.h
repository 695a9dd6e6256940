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
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The 16-lane helpers below (vload, vstore, vrnd, vexp) need AVX-512 F, BW and VL.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PF_AVX512 1
#endif
// The 8-lane helpers (v8load, v8store, v8rnd, v8exp, v8silu) for CPUs with AVX2 + FMA and no
// AVX-512 (e.g. AMD Zen 2/3): without them the bf16 element-wise loops run scalar there.
#if !defined(PF_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define PF_AVX2 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pf {

// The AMX tile configuration (palette 1) that _tile_loadconfig reads: per tile register its
// rows and bytes per row (gemv_amx.cpp, prefill_amx.cpp).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AMX_TILE__)
// ldtilecfg on cfg. GCC's _tile_loadconfig tells the optimiser it reads 8 bytes of cfg, so
// the stores of the other fields may be dropped as dead (they were in attention_amx.cpp:
// ldtilecfg faulted on a half-written config); the barrier makes every store land first.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

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

// Copies n bytes. With `stream`, the 64-byte lines of a 64-byte aligned dst go out as
// non-temporal stores: for data written now and read much later (prefix-cache checkpoints),
// which then costs no read for ownership and leaves the cache to the step's working set. A
// thread that streamed calls stream_fence() before anyone else may read the bytes.
inline void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, bool stream) {
#if defined(__AVX512F__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i),
                          _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#elif defined(__AVX2__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, n);
}

inline void stream_fence() {
#if defined(__AVX2__) || defined(__AVX512F__)
  _mm_sfence();
#endif
}

// Copies n bytes at byte offset off of a state laid over pages (the page ids `pages`, pb
// bytes each, in raw) to or from buf; `to_pages` picks the direction, `stream` as in
// copy_bytes (writes only). buf NULL with to_pages: the bytes are zeroed.
inline void page_copy(uint8_t* raw, const int64_t* pages, int64_t pb, int64_t off, uint8_t* buf,
                      int64_t n, bool to_pages, bool stream = false) {
  while (n > 0) {
    const int64_t pi = off / pb, po = off % pb;
    const int64_t take = n < pb - po ? n : pb - po;
    uint8_t* p = raw + pages[pi] * pb + po;
    if (!to_pages)
      std::memcpy(buf, p, take);
    else if (buf == nullptr)
      std::memset(p, 0, take);
    else
      copy_bytes(p, buf, take, stream);
    off += take;
    if (buf != nullptr) buf += take;
    n -= take;
  }
}

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 32;   // query heads per kv head
constexpr int kMaxBlock = 256;  // tokens per block

// exp on the whole float range, Cephes' single-precision polynomial (about 1 ulp), written so
// a loop of it vectorises (std::exp does not); above 88.7 (where float overflows) it returns
// +inf, as std::exp does.
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

// exp for x <= 0 (softmax terms). Below -87 it returns 2^-126 instead of a denormal or 0: a
// term that small cannot move a sum that holds exp(0) = 1.
inline float exp_nonpos(float x) { return exp_any(x < -87.0f ? -87.0f : x); }

// Rounds a float to T and back: the value a torch op of dtype T would have stored.
template <typename T> inline float rnd(float v);
template <> inline float rnd<float>(float v) { return v; }
template <> inline float rnd<uint16_t>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

#if defined(PF_AVX512)
// Lanes 0..n-1 of 16 (n >= 16: all).
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 elements of T as floats; lanes outside m read as 0 (and their memory is not touched).
template <typename T> inline __m512 vload(const T* p, __mmask16 m = 0xffff);
template <> inline __m512 vload<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <> inline __m512 vload<uint16_t>(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// f32_to_bf16 on 16 lanes (round to nearest even, NaN kept quiet), in integer arithmetic: the
// bf16 bits in the low half of each 32-bit lane.
inline __m512i vbf16_bits_int(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                        _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

// f32_to_bf16 on 16 lanes as 16 packed bf16 values. With AVX512-BF16 the hardware conversion
// (vcvtneps2bf16) computes the same bits (the same round-to-nearest-even carry, NaN quieted
// with the same bit) except that it flushes denormal inputs to signed zero: vectors holding a
// denormal take the integer path. It is one instruction against nine: SiLU x up over 4,096 x
// 3,072 bf16 ran 1.1-1.2x faster with it (AMX Xeon, 2 threads, in turn with the old build).
inline __m256i vbf16_pack(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (!_mm512_fpclass_ps_mask(v, 0x20))  // 0x20: denormal
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return _mm512_cvtepi32_epi16(vbf16_bits_int(v));
}

// vbf16_pack's values in the low half of each 32-bit lane.
inline __m512i vbf16_bits(__m512 v) { return _mm512_cvtepu16_epi32(vbf16_pack(v)); }

// Stores the lanes in m as T (bf16: rounded as store<uint16_t> rounds).
template <typename T> inline void vstore(T* p, __m512 v, __mmask16 m = 0xffff);
template <> inline void vstore<float>(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
template <> inline void vstore<uint16_t>(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, vbf16_pack(v));
}

// rnd on 16 lanes.
template <typename T> inline __m512 vrnd(__m512 v);
template <> inline __m512 vrnd<float>(__m512 v) { return v; }
template <> inline __m512 vrnd<uint16_t>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(vbf16_bits(v), 16));
}

// exp_any on 16 lanes (the same polynomial and clamps; NaN stays NaN).
inline __m512 vexp(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), x);  // NaN: min returns x
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                 _mm512_set1_ps(1.0f));
  const __m512 nc = _mm512_max_ps(_mm512_set1_ps(-127.0f), n);  // 2^-127 -> scale 0
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(nc), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7f), _CMP_GT_OQ);
  return _mm512_mask_mov_ps(out, big, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// x * sigmoid(x) = x / (1 + exp(-x)) on 16 lanes, as the scalar code computes it.
inline __m512 vsilu(__m512 x) {
  const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), x));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

#if defined(__AVX2__)
// The sum of v's 8 lanes in a fixed order: high 128 + low 128, then the pairs, then the last
// two (the AVX2 GEMV, norm and decode attention).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(PF_AVX2)
// 8 elements of T as floats.
template <typename T> inline __m256 v8load(const T* p);
template <> inline __m256 v8load<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 v8load<uint16_t>(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// f32_to_bf16 on 8 lanes (round to nearest even, NaN kept quiet): the bf16 bits in the low
// half of each 32-bit lane.
inline __m256i v8bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  // |u| > inf as signed 32-bit integers: both sides are non-negative.
  const __m256i nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

// Stores 8 lanes as T (bf16: rounded as store<uint16_t> rounds).
template <typename T> inline void v8store(T* p, __m256 v);
template <> inline void v8store<float>(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <> inline void v8store<uint16_t>(uint16_t* p, __m256 v) {
  const __m256i b = v8bf16_bits(v);  // each lane <= 0xffff: the unsigned pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// rnd on 8 lanes.
template <typename T> inline __m256 v8rnd(__m256 v);
template <> inline __m256 v8rnd<float>(__m256 v) { return v; }
template <> inline __m256 v8rnd<uint16_t>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(v8bf16_bits(v), 16));
}

// exp_any on 8 lanes: the same polynomial, clamps and fused multiply-adds as the scalar code
// compiles to (GCC contracts a * b + c there); NaN stays NaN.
inline __m256 v8exp(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), x);  // NaN: min returns x
  const __m256 n = _mm256_round_ps(
      _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
                                 _mm256_set1_ps(1.0f));
  const __m256 nc = _mm256_max_ps(_mm256_set1_ps(-127.0f), n);  // 2^-127 -> scale 0
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(nc), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ);
  return _mm256_blendv_ps(out, _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
}

// x * sigmoid(x) = x / (1 + exp(-x)) on 8 lanes, as the scalar code computes it.
inline __m256 v8silu(__m256 x) {
  const __m256 e = v8exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

#endif

// RMSNorm of one row of D, by mode: 0 out = w * T(x / rms(x)) (pagefold.layers.norm);
// 1 (zero-centred, the weight an offset from 1) T(x / rms(x) * (1 + w)); 2 (the weight
// multiply in float32, Nemotron-H) T(x / rms(x) * w). With res: x + res is rounded to T,
// written back to res, and normalised.
template <typename T>
void rms_row(const T* x, T* res, const T* w, T* out, int D, float eps, int mode) {
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
  if (mode == 1) {
#pragma omp simd
    for (int d = 0; d < D; ++d) store<T>(out, d, load<T>(src, d) * r * (1.0f + load<T>(w, d)));
  } else if (mode == 2) {
#pragma omp simd
    for (int d = 0; d < D; ++d) store<T>(out, d, load<T>(src, d) * r * load<T>(w, d));
  } else {
#pragma omp simd
    for (int d = 0; d < D; ++d) store<T>(out, d, load<T>(w, d) * rnd<T>(load<T>(src, d) * r));
  }
}

#if defined(PF_AVX512)
// rms_row for bf16 on 16 lanes (the compiler leaves the generic loops scalar, ~2.5 cycles an
// element): the same roundings at the same points; the float sum of squares in another order.
template <>
inline void rms_row<uint16_t>(const uint16_t* x, uint16_t* res, const uint16_t* w,
                              uint16_t* out, int D, float eps, int mode) {
  __m512 ss = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    __m512 v = vload<uint16_t>(x + d, m);
    if (res) {
      v = vrnd<uint16_t>(_mm512_add_ps(v, vload<uint16_t>(res + d, m)));
      vstore<uint16_t>(res + d, v, m);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
  const __m512 vr = _mm512_set1_ps(r), one = _mm512_set1_ps(1.0f);
  const uint16_t* src = res ? res : x;
  for (int d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    const __m512 v = _mm512_mul_ps(vload<uint16_t>(src + d, m), vr);
    const __m512 wv = vload<uint16_t>(w + d, m);
    vstore<uint16_t>(out + d, mode == 1   ? _mm512_mul_ps(v, _mm512_add_ps(one, wv))
                              : mode == 2 ? _mm512_mul_ps(v, wv)
                                          : _mm512_mul_ps(wv, vrnd<uint16_t>(v)), m);
  }
}
#endif

#if defined(PF_AVX2)
// rms_row for bf16 on 8 lanes, a scalar tail: the same roundings at the same points; the float
// sum of squares in another order.
template <>
inline void rms_row<uint16_t>(const uint16_t* x, uint16_t* res, const uint16_t* w,
                              uint16_t* out, int D, float eps, int mode) {
  const int main = D / 8 * 8;
  __m256 ss = _mm256_setzero_ps();
  for (int d = 0; d < main; d += 8) {
    __m256 v = v8load<uint16_t>(x + d);
    if (res) {
      v = v8rnd<uint16_t>(_mm256_add_ps(v, v8load<uint16_t>(res + d)));
      v8store<uint16_t>(res + d, v);
    }
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  float sst = hsum8(ss);
  for (int d = main; d < D; ++d) {
    float v = load<uint16_t>(x, d);
    if (res) {
      v = rnd<uint16_t>(v + load<uint16_t>(res, d));
      store<uint16_t>(res, d, v);
    }
    sst += v * v;
  }
  const float r = 1.0f / std::sqrt(sst / static_cast<float>(D) + eps);
  const __m256 vr = _mm256_set1_ps(r), one = _mm256_set1_ps(1.0f);
  const uint16_t* src = res ? res : x;
  for (int d = 0; d < main; d += 8) {
    const __m256 v = _mm256_mul_ps(v8load<uint16_t>(src + d), vr);
    const __m256 wv = v8load<uint16_t>(w + d);
    v8store<uint16_t>(out + d, mode == 1   ? _mm256_mul_ps(v, _mm256_add_ps(one, wv))
                               : mode == 2 ? _mm256_mul_ps(v, wv)
                                           : _mm256_mul_ps(wv, v8rnd<uint16_t>(v)));
  }
  for (int d = main; d < D; ++d) {
    const float v = load<uint16_t>(src, d) * r, wd = load<uint16_t>(w, d);
    store<uint16_t>(out, d, mode == 1 ? v * (1.0f + wd) : mode == 2 ? v * wd
                                                                    : wd * rnd<uint16_t>(v));
  }
}
#endif

// Per row of x (m x k, float32) and group of `group` inputs, the sum of its inputs (m x
// k / group): the term a weight's per-group zero or min multiplies in the quantized GEMVs
// (quant.cpp, gguf_quant.cpp), taken once per call instead of once per output row.
inline std::vector<float> group_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> out(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += x[r * k + g * group + i];
      out[r * groups + g] = s;
    }
  return out;
}

}  // namespace pf
