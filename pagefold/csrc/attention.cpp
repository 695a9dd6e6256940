// Paged KV cache kernels: decode attention reading K/V blocks in place, and the K/V write.
// Called through ctypes (see cpu_ops.py).
//
// Cache layout (one layer): (num_blocks, block_size, 2, kv_heads, head_dim), K at index 0 and
// V at index 1 of the third axis; token t of block b sits at flat slot b * block_size + t.

#include "common.h"

namespace pf {
namespace {

// One (decode row, kv head): the G query heads that share the kv head read each K/V row once.
// Online softmax over the row's keys [kv_start, seq_len), block by block. DC is the head
// size when known at compile time (0: the runtime D), so the common sizes get unrolled loops.
template <typename T, int DC>
void decode_one(const T* q, const T* cache, const int64_t* table, int64_t seq_len,
                int64_t kv_start, T* out, int G, int KVH, int Drt, int bs, int kvh, float scale) {
  const int D = DC > 0 ? DC : Drt;
  alignas(64) float qf[kMaxGroup][kMaxHeadDim];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  alignas(64) float s[kMaxGroup][kMaxBlock];
  alignas(64) float kv[kMaxBlock][kMaxHeadDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int g = 0; g < G; ++g) {
    const T* qg = q + static_cast<int64_t>(kvh * G + g) * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      qf[g][d] = load<T>(qg, d) * scale;
      acc[g][d] = 0.f;
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t tok_stride = 2LL * KVH * D;  // one token's K and V
  const int64_t block_stride = bs * tok_stride;
  const int64_t first_blk = kv_start / bs;
  const int64_t last_blk = (seq_len - 1) / bs;
  for (int64_t jb = first_blk; jb <= last_blk; ++jb) {
    const T* blk = cache + table[jb] * block_stride;
    const int t0 = jb == first_blk ? static_cast<int>(kv_start - jb * bs) : 0;
    const int t1 = jb == last_blk ? static_cast<int>(seq_len - jb * bs) : bs;
    // Scores of this block's keys, then one rescale of the running sums per block.
    for (int t = t0; t < t1; ++t) {
      const T* k = blk + t * tok_stride + static_cast<int64_t>(kvh) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) kv[t][d] = load<T>(k, d);
    }
    for (int g = 0; g < G; ++g) {
      float bmax = m[g];
      for (int t = t0; t < t1; ++t) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qf[g][d] * kv[t][d];
        s[g][t] = dot;
        bmax = dot > bmax ? dot : bmax;
      }
      const float alpha = exp_nonpos(m[g] - bmax);  // m = -inf on the first block: ~0
      m[g] = bmax;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = t0; t < t1; ++t) {
        const float p = exp_nonpos(s[g][t] - bmax);
        s[g][t] = p;
        sum += p;
      }
      l[g] = l[g] * alpha + sum;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= alpha;
    }
    for (int t = t0; t < t1; ++t) {
      const T* v = blk + t * tok_stride + static_cast<int64_t>(KVH + kvh) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) kv[t][d] = load<T>(v, d);
    }
    for (int g = 0; g < G; ++g) {
      for (int t = t0; t < t1; ++t) {
        const float p = s[g][t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * kv[t][d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    T* o = out + static_cast<int64_t>(kvh * G + g) * D;
    for (int d = 0; d < D; ++d) store<T>(o, d, acc[g][d] * inv);
  }
}

#if defined(PF_AVX512)
// The same computation with AVX-512 intrinsics, 16 keys at a time: head sizes that are a
// multiple of 16 and blocks that are (the defaults). Scores are 16 horizontal sums per
// sub-block; the softmax terms, the rescale and the value sums are whole-vector operations.
// exp_nonpos on 16 lanes: common.h's vexp after the same clamp (bit for bit the scalar's).
inline __m512 exp16_nonpos(__m512 x) { return vexp(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

// Lane i = the sum of v[i]'s 16 lanes, for 16 vectors: pairs, then quadruples, interleaved
// within 128-bit lanes, then the four 128-bit lanes of each quadruple summed across.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's sums of v[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Blocks read ahead. 32 rows of 290 keys, one thread: 2 is 10% slower than 4, 8 no faster.
constexpr int64_t kPrefetch = 4;

// acc[g] += sum over keys t in [lo, hi) of ps[g][t - sb] * V[t], for GC heads, keys in order:
// each head's sums in registers (GC * D / 16 <= 16 vectors), so the GC * D / 16 FMA chains
// run side by side and each V row is converted once and used by every head. The same
// products added in the same order as the one-head-at-a-time loop: the same bits.
template <typename T, int D, int GC>
inline void pv_regs(const T* vbase, int64_t tok_stride, int lo, int hi, int sb,
                    const float (*ps)[16], float (*acc)[D]) {
  constexpr int C = D / 16;
  __m512 a[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_load_ps(acc[g] + 16 * c);
  for (int t = lo; t < hi; ++t) {
    const T* v = vbase + t * tok_stride;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = vload<T>(v + 16 * c);
    for (int g = 0; g < GC; ++g) {
      const __m512 pb = _mm512_set1_ps(ps[g][t - sb]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pb, vc[c], a[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) _mm512_store_ps(acc[g] + 16 * c, a[g][c]);
}

template <typename T, int D>
void decode_one_avx512(const T* q, const T* cache, const int64_t* table, int64_t seq_len,
                       int64_t kv_start, T* out, int G, int KVH, int bs, int kvh, float scale) {
  constexpr int C = D / 16;
  alignas(64) float qf[kMaxGroup][D];
  alignas(64) float acc[kMaxGroup][D];
  alignas(64) float ps[kMaxGroup][16];
  alignas(64) float vt[16][D];
  alignas(64) float sc[kMaxGroup][16];
  __m512 part[kMaxGroup][16];
  float m[kMaxGroup], l[kMaxGroup];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    const T* qg = q + static_cast<int64_t>(kvh * G + g) * D;
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(qf[g] + 16 * c, _mm512_mul_ps(vload<T>(qg + 16 * c), vscale));
      _mm512_store_ps(acc[g] + 16 * c, _mm512_setzero_ps());
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t tok_stride = 2LL * KVH * D;
  const int64_t block_stride = bs * tok_stride;
  const int64_t first_blk = kv_start / bs;
  const int64_t last_blk = (seq_len - 1) / bs;
  for (int64_t jb = first_blk; jb <= last_blk; ++jb) {
    const T* blk = cache + table[jb] * block_stride;
    if (kvh == 0) {  // blocks ahead, all heads, while this one computes
      for (int64_t ahead = jb == first_blk ? 1 : kPrefetch; ahead <= kPrefetch; ++ahead) {
        if (jb + ahead > last_blk) break;
        const char* nb = reinterpret_cast<const char*>(cache + table[jb + ahead] * block_stride);
        for (int64_t off = 0; off < static_cast<int64_t>(block_stride * sizeof(T)); off += 64)
          _mm_prefetch(nb + off, _MM_HINT_T0);
      }
    }
    const int t0 = jb == first_blk ? static_cast<int>(kv_start - jb * bs) : 0;
    const int t1 = jb == last_blk ? static_cast<int>(seq_len - jb * bs) : bs;
    for (int sb = (t0 / 16) * 16; sb < t1; sb += 16) {
      const int lo = t0 > sb ? t0 : sb;
      const int hi = t1 < sb + 16 ? t1 : sb + 16;
      const __mmask16 mask = static_cast<__mmask16>(
          ((1u << (hi - sb)) - 1u) & ~((1u << (lo - sb)) - 1u));
      // Per key and head a 16-lane partial dot product; the 16 keys' partials of a head are
      // then summed together (hsum16), not one horizontal reduction per key.
      for (int t = lo; t < hi; ++t) {  // each key converted once, used by the G heads
        const T* k = blk + t * tok_stride + static_cast<int64_t>(kvh) * D;
        __m512 kc[C];
        for (int c = 0; c < C; ++c) kc[c] = vload<T>(k + 16 * c);
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_mul_ps(_mm512_load_ps(qf[g]), kc[0]);
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(_mm512_load_ps(qf[g] + 16 * c), kc[c], a);
          part[g][t - sb] = a;
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int t = sb; t < lo; ++t) part[g][t - sb] = _mm512_setzero_ps();
        for (int t = hi; t < sb + 16; ++t) part[g][t - sb] = _mm512_setzero_ps();
        _mm512_store_ps(sc[g], hsum16(part[g]));
      }
      for (int g = 0; g < G; ++g) {
        const __m512 sv = _mm512_mask_load_ps(
            _mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, sc[g]);
        const float smax = _mm512_mask_reduce_max_ps(mask, sv);
        const float mnew = smax > m[g] ? smax : m[g];
        const float alpha = std::exp(m[g] - mnew);  // exp(-inf) = 0 on the first keys
        m[g] = mnew;
        const __m512 p = _mm512_maskz_mov_ps(mask, exp16_nonpos(
            _mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(p);
        _mm512_store_ps(ps[g], p);
        const __m512 va = _mm512_set1_ps(alpha);
        for (int c = 0; c < C; ++c)
          _mm512_store_ps(acc[g] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * c), va));
      }
      const T* vbase = blk + static_cast<int64_t>(KVH + kvh) * D;
      if (G * C <= 16) {  // all G heads' sums in registers: each V row read once, as loaded
        switch (G) {
          case 1: pv_regs<T, D, 1>(vbase, tok_stride, lo, hi, sb, ps, acc); continue;
          case 2: pv_regs<T, D, 2>(vbase, tok_stride, lo, hi, sb, ps, acc); continue;
          case 3: pv_regs<T, D, 3>(vbase, tok_stride, lo, hi, sb, ps, acc); continue;
          case 4: pv_regs<T, D, 4>(vbase, tok_stride, lo, hi, sb, ps, acc); continue;
          default: break;
        }
      }
      for (int t = lo; t < hi; ++t) {
        const T* v = vbase + t * tok_stride;
        for (int c = 0; c < C; ++c) _mm512_store_ps(vt[t - sb] + 16 * c, vload<T>(v + 16 * c));
      }
      for (int g = 0; g < G; ++g) {
        __m512 a[C];
        for (int c = 0; c < C; ++c) a[c] = _mm512_load_ps(acc[g] + 16 * c);
        for (int t = lo; t < hi; ++t) {
          const __m512 pb = _mm512_set1_ps(ps[g][t - sb]);
          for (int c = 0; c < C; ++c)
            a[c] = _mm512_fmadd_ps(pb, _mm512_load_ps(vt[t - sb] + 16 * c), a[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc[g] + 16 * c, a[c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    T* o = out + static_cast<int64_t>(kvh * G + g) * D;
    for (int d = 0; d < D; ++d) store<T>(o, d, acc[g][d] * inv);
  }
}
#endif

template <typename T>
void decode_all(const T* q, int64_t q_stride, const int64_t* rows, const T* cache,
                const int64_t* tables,
                int64_t table_stride, const int64_t* seq_lens, const int64_t* kv_starts, T* out,
                int64_t out_stride, int B, int H, int KVH, int D, int bs, float scale,
                int nthreads) {
  const int G = H / KVH;
  const int64_t items = static_cast<int64_t>(B) * KVH;
  // One chunk = one row's kv heads, so a thread reads a row's blocks while they are hot.
#pragma omp parallel for schedule(dynamic, KVH) num_threads(nthreads) if (nthreads > 1 && items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int b = static_cast<int>(it / KVH);
    const int kvh = static_cast<int>(it % KVH);
    const int64_t r = rows ? rows[b] : b;
    const T* qb = q + r * q_stride;
    const int64_t* tb = tables + b * table_stride;
    const int64_t start = kv_starts ? kv_starts[b] : 0;
    T* ob = out + r * out_stride;
#if defined(PF_AVX512)
    if (bs % 16 == 0 && (D == 64 || D == 128 || D == 256)) {
      if (D == 64)
        decode_one_avx512<T, 64>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, kvh, scale);
      else if (D == 128)
        decode_one_avx512<T, 128>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, kvh, scale);
      else
        decode_one_avx512<T, 256>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, kvh, scale);
      continue;
    }
#endif
    switch (D) {
      case 64:
        decode_one<T, 64>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, D, bs, kvh, scale);
        break;
      case 128:
        decode_one<T, 128>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, D, bs, kvh, scale);
        break;
      case 256:
        decode_one<T, 256>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, D, bs, kvh, scale);
        break;
      default:
        decode_one<T, 0>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, D, bs, kvh, scale);
    }
  }
}

template <typename T>
void write_kv_all(const T* k, const T* v, int64_t k_stride, int64_t v_stride,
                  const int64_t* slots, T* cache, int N, int KVH, int D) {
  const int64_t row = static_cast<int64_t>(KVH) * D;
  for (int i = 0; i < N; ++i) {
    T* dst = cache + slots[i] * 2 * row;
    std::memcpy(dst, k + i * k_stride, row * sizeof(T));
    std::memcpy(dst + row, v + i * v_stride, row * sizeof(T));
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// Limits the Python side checks before calling (larger shapes take the torch path).
int pf_max_head_dim() { return kMaxHeadDim; }
int pf_max_group() { return kMaxGroup; }
int pf_max_block() { return kMaxBlock; }

// q (T, H, D) rows q_stride apart (elements), heads contiguous; out the same with out_stride.
// Decode row b reads q row rows[b] and writes out row rows[b] (rows NULL: row b).
// tables (B, table_stride) block ids; seq_lens (B,) keys per row, the new token included;
// kv_starts (B,) first key position (sliding window) or NULL for 0. Returns 0, or -1 for an
// unsupported dtype.
int pf_decode_attention(int dtype, const void* q, int64_t q_stride, const int64_t* rows,
                        const void* cache,
                        const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
                        const int64_t* kv_starts, void* out, int64_t out_stride, int B, int H,
                        int KVH, int D, int bs, float scale, int nthreads) {
  if (dtype == 0) {
    decode_all<float>(static_cast<const float*>(q), q_stride, rows,
                      static_cast<const float*>(cache),
                      tables, table_stride, seq_lens, kv_starts, static_cast<float*>(out),
                      out_stride, B, H, KVH, D, bs, scale, nthreads);
    return 0;
  }
  if (dtype == 1) {
    decode_all<uint16_t>(static_cast<const uint16_t*>(q), q_stride, rows,
                         static_cast<const uint16_t*>(cache), tables, table_stride, seq_lens,
                         kv_starts, static_cast<uint16_t*>(out), out_stride, B, H, KVH, D, bs,
                         scale, nthreads);
    return 0;
  }
  return -1;
}

// k, v (N, KVH, D) rows k_stride / v_stride apart (heads contiguous), in the cache's dtype;
// token i goes to flat slot slots[i].
int pf_write_kv(int dtype, const void* k, const void* v, int64_t k_stride, int64_t v_stride,
                const int64_t* slots, void* cache, int N, int KVH, int D) {
  if (dtype == 0) {
    write_kv_all<float>(static_cast<const float*>(k), static_cast<const float*>(v), k_stride,
                        v_stride, slots, static_cast<float*>(cache), N, KVH, D);
    return 0;
  }
  if (dtype == 1) {
    write_kv_all<uint16_t>(static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                           k_stride, v_stride, slots, static_cast<uint16_t*>(cache), N, KVH, D);
    return 0;
  }
  return -1;
}

}  // extern "C"
