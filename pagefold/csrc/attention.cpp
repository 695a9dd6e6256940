// Paged KV cache kernels: decode attention reading K/V blocks in place, and the K/V write.
// Called through ctypes (see cpu_ops.py).
//
// Cache layout (one layer): (num_blocks, block_size, 2, kv_heads, head_dim), K at index 0 and
// V at index 1 of the third axis; token t of block b sits at flat slot b * block_size + t.

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace pf {
namespace {

// Rows of one shared-prefix group attended together (their running states side by side).
constexpr int kMaxShareRows = 32;

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

#if defined(PF_AVX2)
// Lane i = the sum of v[i]'s 8 lanes, for 8 vectors (pairs, then quadruples, within 128-bit
// lanes; then the two halves).
inline __m256 hsum8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                       _mm256_permute2f128_ps(ab, cd, 0x31));
}

// decode_one on 8 lanes for head sizes D = 8 * C (CPUs with AVX2 + FMA and no AVX-512: the
// generic loops above reach ~4-7 GB/s of K/V there), for kv heads [h0, h1) of one row. The
// same online softmax, one update per cache block and head: scores 8 keys at a time (each K
// row converted once for the G query heads, 8 partial dot products summed together by
// hsum8x8), the block's max, exponentials and rescale as whole vectors (exp_nonpos via
// v8exp), then the value sums, keys in order. Float32 sums in another order than the scalar
// loops.
//
// The cache is token-major: a block holds token 0's K of every head, its V, then token 1's.
// A block is read in that order: the scores token by token over all the heads in hand, then
// the value sums token by token over them, so K and V stream through memory as laid out
// (one head walking the whole context alone reads a line or two per token at a stride of
// 2 * KVH * D elements, which the hardware prefetchers do not follow). Each head keeps its
// own state (qf, acc, m, l in `state`: (h1 - h0) * head_floats(G, C) floats, 32-byte aligned)
// and the same sequence of operations on it whatever the grouping, so a head's bits do not
// depend on which heads (or rows) share its item.
inline int64_t head_floats(int G, int C) { return (2LL * G * 8 * C + 2 * G + 7) / 8 * 8; }

constexpr int kAvx2Lanes = 32;  // (head, query) pairs a block pass holds (scores, partials)

template <typename T, int C>
void decode_row_avx2(const T* q, const T* cache, const int64_t* table, int64_t seq_len,
                     int64_t kv_start, T* out, int G, int KVH, int bs, int h0, int h1,
                     float scale, float* state) {
  constexpr int D = 8 * C;
  const int64_t hf = head_floats(G, C);
  alignas(32) float s[kAvx2Lanes][kMaxBlock + 8];
  alignas(32) __m256 part[kAvx2Lanes][8];
  for (int kvh = h0; kvh < h1; ++kvh) {
    float* qf = state + (kvh - h0) * hf;
    float* acc = qf + G * D;
    float* m = acc + G * D;
    float* l = m + G;
    for (int g = 0; g < G; ++g) {
      const T* qg = q + static_cast<int64_t>(kvh * G + g) * D;
      for (int d = 0; d < D; ++d) {
        qf[g * D + d] = load<T>(qg, d) * scale;
        acc[g * D + d] = 0.f;
      }
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
  }
  const int64_t tok_stride = 2LL * KVH * D;
  const int64_t block_stride = bs * tok_stride;
  const int64_t v_off = static_cast<int64_t>(KVH) * D;
  const int64_t first_blk = kv_start / bs;
  const int64_t last_blk = (seq_len - 1) / bs;
  const __m256 floor87 = _mm256_set1_ps(-87.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Heads per pass: their (head, query) pairs fit the score and partial buffers (G <= 32).
  const int hp = kAvx2Lanes / G;
  for (int64_t jb = first_blk; jb <= last_blk; ++jb) {
    const int t0 = jb == first_blk ? static_cast<int>(kv_start - jb * bs) : 0;
    const int t1 = jb == last_blk ? static_cast<int>(seq_len - jb * bs) : bs;
    const int n = t1 - t0;
    const T* blk = cache + table[jb] * block_stride;
    if (jb < last_blk) {  // the next block's rows of these heads, while this one computes
      const char* nb = reinterpret_cast<const char*>(cache + table[jb + 1] * block_stride);
      const int nt = jb + 1 == last_blk ? static_cast<int>(seq_len - (jb + 1) * bs) : bs;
      const int64_t lo = static_cast<int64_t>(h0) * D * sizeof(T);
      const int64_t hi = static_cast<int64_t>(h1) * D * sizeof(T);
      for (int t = 0; t < nt; ++t)
        for (int64_t off = lo; off < hi; off += 64) {
          const char* r = nb + t * tok_stride * sizeof(T) + off;
          _mm_prefetch(r, _MM_HINT_T0);
          _mm_prefetch(r + v_off * sizeof(T), _MM_HINT_T0);
        }
    }
    for (int ha = h0; ha < h1; ha += hp) {
      const int hb = ha + hp < h1 ? ha + hp : h1;
      for (int j0 = 0; j0 < n; j0 += 8) {  // scores of keys t0 + j0 .. + 7
        for (int j = 0; j < 8; ++j) {
          if (j0 + j >= n) {
            for (int i = 0; i < (hb - ha) * G; ++i) part[i][j] = _mm256_setzero_ps();
            continue;
          }
          const T* krow = blk + (t0 + j0 + j) * tok_stride;
          for (int kvh = ha; kvh < hb; ++kvh) {
            const T* k = krow + static_cast<int64_t>(kvh) * D;
            const float* qf = state + (kvh - h0) * hf;
            __m256 kc[C];
            for (int c = 0; c < C; ++c) kc[c] = v8load<T>(k + 8 * c);
            for (int g = 0; g < G; ++g) {
              const float* qg = qf + g * D;
              __m256 a = _mm256_mul_ps(_mm256_load_ps(qg), kc[0]);
              for (int c = 1; c < C; ++c)
                a = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c), kc[c], a);
              part[(kvh - ha) * G + g][j] = a;
            }
          }
        }
        for (int i = 0; i < (hb - ha) * G; ++i) _mm256_storeu_ps(s[i] + j0, hsum8x8(part[i]));
      }
      for (int kvh = ha; kvh < hb; ++kvh) {  // softmax update of each (head, query)
        float* acc = state + (kvh - h0) * hf + G * D;
        float* m = acc + G * D;
        float* l = m + G;
        for (int g = 0; g < G; ++g) {
          float* sg = s[(kvh - ha) * G + g];
          float bmax = m[g];
          for (int j = 0; j < n; ++j) bmax = sg[j] > bmax ? sg[j] : bmax;
          const float alpha = exp_nonpos(m[g] - bmax);
          m[g] = bmax;
          const __m256 vmax = _mm256_set1_ps(bmax);
          __m256 sum = _mm256_setzero_ps();
          for (int j0 = 0; j0 < n; j0 += 8) {
            const __m256 live = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j0), lane));  // keys past n: 0
            const __m256 p = _mm256_and_ps(
                live,
                v8exp(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + j0), vmax), floor87)));
            _mm256_storeu_ps(sg + j0, p);
            sum = _mm256_add_ps(sum, p);
          }
          l[g] = l[g] * alpha + hsum8(sum);
          const __m256 va = _mm256_set1_ps(alpha);
          float* ag = acc + g * D;
          for (int c = 0; c < C; ++c)
            _mm256_store_ps(ag + 8 * c, _mm256_mul_ps(_mm256_load_ps(ag + 8 * c), va));
        }
      }
      // The value sums, keys in order, 8 at a time: each (head, query) adds the 8 keys' rows
      // with its accumulators in registers, then the next head reads the same tokens' lines.
      for (int j0 = 0; j0 < n; j0 += 8) {
        const int j1 = j0 + 8 < n ? j0 + 8 : n;
        for (int kvh = ha; kvh < hb; ++kvh) {
          const T* v0 = blk + t0 * tok_stride + v_off + static_cast<int64_t>(kvh) * D;
          float* acc = state + (kvh - h0) * hf + G * D;
          for (int g = 0; g < G; ++g) {
            const float* sg = s[(kvh - ha) * G + g];
            float* ag = acc + g * D;
            __m256 a[C];
            for (int c = 0; c < C; ++c) a[c] = _mm256_load_ps(ag + 8 * c);
            for (int j = j0; j < j1; ++j) {
              const T* v = v0 + j * tok_stride;
              const __m256 pb = _mm256_set1_ps(sg[j]);
              for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(pb, v8load<T>(v + 8 * c), a[c]);
            }
            for (int c = 0; c < C; ++c) _mm256_store_ps(ag + 8 * c, a[c]);
          }
        }
      }
    }
  }
  for (int kvh = h0; kvh < h1; ++kvh) {
    const float* acc = state + (kvh - h0) * hf + G * D;
    const float* l = acc + G * D + G;
    for (int g = 0; g < G; ++g) {
      const __m256 inv = _mm256_set1_ps(1.f / l[g]);
      T* o = out + static_cast<int64_t>(kvh * G + g) * D;
      for (int c = 0; c < C; ++c)
        v8store<T>(o + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc + g * D + 8 * c), inv));
    }
  }
}
#endif

// Keys per softmax update: the scores of up to kTile keys (whole 16-key sub-blocks, from one
// or more cache blocks) are computed first, then one max, one rescale of the running sums and
// one pass of exponentials per head for all of them, then the value sums. Tiles start at
// fixed key positions ((kv_start / 16) * 16 + i * kTile), whatever else the step holds, so a
// row's result does not depend on the batch it is in.
// 32 keys: a kv head's K and V rows are 2 * KVH * D elements apart (the cache is token-major),
// and the heads of a row take each tile in turn, so a short tile keeps the lines all of a
// row's heads read close together in time, where the hardware prefetchers follow them. With
// 128-key tiles, 12 kv heads of 64 (an MHA model) decoded at 5 GB/s a core, waiting on each
// line; 32-key tiles gave 1.6x at batch 32 and 1.1-1.2x at batch 1-4 on 3,000 keys, and
// 1.0-1.2x on GQA shapes (head dims 64 and 128, 2-8 kv heads; AVX512 host).
constexpr int kTile = 32;
constexpr int kSub = kTile / 16;

// The tile unit takes decode attention's scores and value sums from this many query heads
// per kv head (attention_amx.cpp). Measured on the AMX Xeon, 2 threads, 8 rows x 1,000 keys:
// at 2 heads of 64 the tiles were 6% slower than the AVX-512 loops (a tile product of 2 rows
// and the V repack cost more than they save), at 2 of 128 2-4% faster, at 3 heads 5-12% and at
// 8 heads of 128 1.5x faster. pf_decode_attention_amx turns them off (tests pin both paths,
// benchmarks compare them).
constexpr int kAmxMinGroup = 3;
std::atomic<int> g_decode_amx{1};
std::atomic<int64_t> g_decode_amx_calls{0};  // calls that took the AMX tiles (tests read it)

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


// Running attention of one (decode row, kv head) over the keys seen so far, for its G query
// heads: scaled queries qf (G, D), unnormalised sums acc (G, D), running max m and sum l (G).
// With AMX tiles (decode_amx_*), qf holds the G query rows packed as the tile product's B
// operand (bf16, unscaled) and the scale applies to the sums.
struct RowState {
  float* qf;
  float* acc;
  float* m;
  float* l;
  float scale;
};

// Where one kv head's keys and values live: the layer's cache, its geometry, the head.
template <typename T>
struct KvView {
  const T* cache;
  int64_t tok_stride, block_stride, k_off, v_off;
  int bs;
  const T* row(const int64_t* table, int64_t pos) const {  // key pos's K row of this head
    return cache + table[pos / bs] * block_stride + (pos % bs) * tok_stride + k_off;
  }
};

// A K, V or query row of D as C = D / 16 float vectors. float: in order. bf16: "split" -- each
// 32 elements (one 64-byte load) give the even-indexed ones (shifted up: a bf16 is the top
// half of its float) and the odd-indexed ones (masked), so vector 2k holds elements 32k, 32k +
// 2, ... and vector 2k + 1 elements 32k + 1, 32k + 3, .... Widening 16 bf16 to 16 floats in
// order takes a cross-lane shuffle (vpmovzxwd), and shuffles share one port with the
// broadcasts and horizontal sums; a shift and a bitwise AND do not (3-8% faster decode on
// the AMX Xeon, MHA and GQA shapes). Dot products do not care about the order of the elements
// as long as the query is split alike; the value sums stay split until the output is
// written.
template <typename T, int D>
inline void load_row(const T* p, __m512* v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int k = 0; k < D / 32; ++k) {
      const __m512i w = _mm512_loadu_si512(p + 32 * k);
      v[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      v[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
    }
  } else {
    for (int c = 0; c < D / 16; ++c) v[c] = vload<T>(p + 16 * c);
  }
}

// Element d of a row held as load_row leaves it (vectors stored in order, 16 floats each).
template <typename T>
inline int split_index(int d) {
  if constexpr (std::is_same_v<T, uint16_t>) return (d / 32) * 32 + (d % 2) * 16 + (d % 32) / 2;
  return d;
}

// acc[g] += sum over the tile's keys of ps[g][key] * V[key], for heads g0 .. g0 + GC - 1:
// the GC heads' sums in registers (GC * D / 16 <= 16 vectors), each V row converted once per
// group of heads. Keys in order within the tile.
template <typename T, int D, int GC>
inline void pv_tile(const T* const* vb, const int* lo, const int* hi, int nsub,
                    int64_t tok_stride, int g0, const float (*ps)[kTile], float* acc) {
  constexpr int C = D / 16;
  __m512 a[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_load_ps(acc + (g0 + g) * D + 16 * c);
  for (int j = 0; j < nsub; ++j) {
    for (int t = lo[j]; t < hi[j]; ++t) {
      __m512 vc[C];
      load_row<T, D>(vb[j] + t * tok_stride, vc);
      for (int g = 0; g < GC; ++g) {
        const __m512 pb = _mm512_set1_ps(ps[g0 + g][16 * j + t]);
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pb, vc[c], a[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) _mm512_store_ps(acc + (g0 + g) * D + 16 * c, a[g][c]);
}

// One tile, keys [p0, p0 + kTile) clipped to [kv_start, seq_len), into st. ``prefetch``: also
// start loading the next tile's rows of this head.
template <typename T, int D, bool AMX>
void attend_tile(const RowState& st, int G, const KvView<T>& kv, const int64_t* table,
                 int64_t p0, int64_t kv_start, int64_t seq_len, bool prefetch) {
  constexpr int C = D / 16;
  constexpr int HG = 16 / C;  // heads whose value sums fit the registers together
  alignas(64) float sc[kMaxGroup][kTile];
  __m512 part[kMaxGroup][16];
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const T* kb[kSub];
  const T* vb[kSub];
  int lo[kSub], hi[kSub];
  __mmask16 mk[kSub];
  const int64_t v_rel = kv.v_off - kv.k_off;
  int nsub = 0;
  for (int64_t sb = p0; sb < seq_len && sb < p0 + kTile; sb += 16, ++nsub) {
    kb[nsub] = kv.row(table, sb);
    vb[nsub] = kb[nsub] + v_rel;
    lo[nsub] = kv_start > sb ? static_cast<int>(kv_start - sb) : 0;
    hi[nsub] = seq_len < sb + 16 ? static_cast<int>(seq_len - sb) : 16;
    mk[nsub] = static_cast<__mmask16>(((1u << hi[nsub]) - 1u) & ~((1u << lo[nsub]) - 1u));
  }
  if (prefetch) {
    for (int64_t sb = p0 + kTile; sb < seq_len && sb < p0 + 2 * kTile; sb += 16) {
      const char* r = reinterpret_cast<const char*>(kv.row(table, sb));
      for (int t = 0; t < 16 && sb + t < seq_len; ++t)
        for (int64_t off = 0; off < static_cast<int64_t>(D * sizeof(T)); off += 64) {
          _mm_prefetch(r + t * kv.tok_stride * sizeof(T) + off, _MM_HINT_T0);
          _mm_prefetch(r + (t * kv.tok_stride + v_rel) * sizeof(T) + off, _MM_HINT_T0);
        }
    }
  }
  if constexpr (AMX) {
    // Scores of a 16-key sub-block for all G heads in one tile product (attention_amx.cpp),
    // then per head the 16 keys' sums gathered from the product's rows, scaled.
    alignas(64) float cb[16 * kMaxGroup];
    const __m512i tix = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(G));
    const __m512 vs = _mm512_set1_ps(st.scale);
    for (int j = 0; j < nsub; ++j) {
      decode_amx_scores(reinterpret_cast<const uint16_t*>(kb[j]), kv.tok_stride,
                        reinterpret_cast<const uint16_t*>(st.qf), G, D, cb);
      for (int g = 0; g < G; ++g) {
        const __m512 sg = _mm512_mul_ps(
            _mm512_i32gather_ps(_mm512_add_epi32(tix, _mm512_set1_epi32(g)), cb, 4), vs);
        _mm512_store_ps(sc[g] + 16 * j, _mm512_mask_mov_ps(ninf, mk[j], sg));
      }
    }
  } else {
    // Scores: per key and head a 16-lane partial dot product (each key converted once, used by
    // the G heads); a sub-block's 16 partials of a head are summed together (hsum16).
    for (int j = 0; j < nsub; ++j) {
      for (int t = 0; t < 16; ++t) {
        if (t < lo[j] || t >= hi[j]) {
          for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
          continue;
        }
        __m512 kc[C];
        load_row<T, D>(kb[j] + t * kv.tok_stride, kc);
        for (int g = 0; g < G; ++g) {
          const float* qg = st.qf + g * D;
          __m512 a = _mm512_mul_ps(_mm512_load_ps(qg), kc[0]);
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c), kc[c], a);
          part[g][t] = a;
        }
      }
      for (int g = 0; g < G; ++g)
        _mm512_store_ps(sc[g] + 16 * j, _mm512_mask_mov_ps(ninf, mk[j], hsum16(part[g])));
    }
  }
  // One softmax update per head for the whole tile.
  for (int g = 0; g < G; ++g) {
    __m512 vmax = _mm512_load_ps(sc[g]);
    for (int j = 1; j < nsub; ++j) vmax = _mm512_max_ps(vmax, _mm512_load_ps(sc[g] + 16 * j));
    const float smax = _mm512_reduce_max_ps(vmax);
    const float mnew = smax > st.m[g] ? smax : st.m[g];
    // Once the first tiles are in, the running maximum rarely moves: alpha is then 1 and the
    // rescale of the sums is skipped (the same bits: x * 1 = x). exp(-inf) = 0 on the first keys.
    const bool same = st.m[g] == mnew;
    const float alpha = same ? 1.0f : std::exp(st.m[g] - mnew);
    st.m[g] = mnew;
    const __m512 vm = _mm512_set1_ps(mnew);
    __m512 vsum = _mm512_setzero_ps();
    for (int j = 0; j < nsub; ++j) {
      __m512 p = _mm512_maskz_mov_ps(
          mk[j], exp16_nonpos(_mm512_sub_ps(_mm512_load_ps(sc[g] + 16 * j), vm)));
      // The tile product takes P as bf16: the sum uses the same rounded terms.
      if constexpr (AMX) p = vrnd<uint16_t>(p);
      _mm512_store_ps(sc[g] + 16 * j, p);
      vsum = _mm512_add_ps(vsum, p);
    }
    if constexpr (AMX)
      for (int j = nsub; j < kSub; ++j) _mm512_store_ps(sc[g] + 16 * j, _mm512_setzero_ps());
    st.l[g] = st.l[g] * alpha + _mm512_reduce_add_ps(vsum);
    if (same) continue;
    const __m512 va = _mm512_set1_ps(alpha);
    float* ag = st.acc + g * D;
    for (int c = 0; c < C; ++c)
      _mm512_store_ps(ag + 16 * c, _mm512_mul_ps(_mm512_load_ps(ag + 16 * c), va));
  }
  if constexpr (AMX) {  // value sums on the tile unit, all heads at once
    const uint16_t* vr[kTile];
    for (int j = 0; j < kSub; ++j)
      for (int t = 0; t < 16; ++t)
        vr[16 * j + t] = j < nsub && t >= lo[j] && t < hi[j]
                             ? reinterpret_cast<const uint16_t*>(vb[j] + t * kv.tok_stride)
                             : nullptr;
    decode_amx_pv(vr, sc[0], G, D, st.acc);
    return;
  }
  for (int g0 = 0; g0 < G; g0 += HG) {  // value sums, HG heads at a time
    switch (G - g0 < HG ? G - g0 : HG) {
      case 1: pv_tile<T, D, 1>(vb, lo, hi, nsub, kv.tok_stride, g0, sc, st.acc); break;
      case 2: pv_tile<T, D, 2>(vb, lo, hi, nsub, kv.tok_stride, g0, sc, st.acc); break;
      case 3: pv_tile<T, D, 3>(vb, lo, hi, nsub, kv.tok_stride, g0, sc, st.acc); break;
      default: pv_tile<T, D, 4>(vb, lo, hi, nsub, kv.tok_stride, g0, sc, st.acc); break;
    }
  }
}

// Rows idx[0 .. R) of the step for kv heads [h0, h1). Keys [0, shared) are in the same blocks
// for all R rows (a shared prompt prefix; a multiple of kTile, 0 when none): each of those
// tiles is read once and attended by every row while it is in cache, then each row goes on
// alone; the heads of a row take each tile in turn (a tile's rows of all heads are near each
// other in the token-major cache). Each (row, head) sees the same tiles in the same order as
// alone: the same bits.
template <typename T, int D, bool AMX>
void decode_rows_avx512(const T* q, int64_t q_stride, const int64_t* rows, const int* idx, int R,
                        int h0, int h1, const T* cache, int KVH, int bs, const int64_t* tables,
                        int64_t table_stride, const int64_t* seq_lens, const int64_t* kv_starts,
                        T* out, int64_t out_stride, int G, float scale, int64_t shared,
                        float* scratch) {
  constexpr int C = D / 16;
  const __m512 vscale = _mm512_set1_ps(scale);
  const int nh = h1 - h0;
  std::vector<RowState> st(static_cast<size_t>(R) * nh);
  std::vector<KvView<T>> kv(nh);
  const int64_t tok_stride = 2LL * KVH * D;
  for (int h = 0; h < nh; ++h)
    kv[h] = KvView<T>{cache, tok_stride, bs * tok_stride, static_cast<int64_t>(h0 + h) * D,
                      static_cast<int64_t>(KVH + h0 + h) * D, bs};
  for (int r = 0; r < R; ++r) {
    const int64_t row = rows ? rows[idx[r]] : idx[r];
    for (int h = 0; h < nh; ++h) {
      RowState& s = st[r * nh + h];
      float* base = scratch + static_cast<int64_t>(r * nh + h) * (2 * G * D + 2 * kMaxGroup);
      s = RowState{base, base + G * D, base + 2 * G * D, base + 2 * G * D + kMaxGroup, scale};
      const T* qb = q + row * q_stride + static_cast<int64_t>(h0 + h) * G * D;
      if constexpr (AMX)
        decode_amx_pack_q(reinterpret_cast<const uint16_t*>(qb), G, D,
                          reinterpret_cast<uint16_t*>(s.qf));
      for (int g = 0; g < G; ++g) {
        __m512 qc[C];
        if constexpr (!AMX) load_row<T, D>(qb + g * D, qc);  // split like the keys (load_row)
        for (int c = 0; c < C; ++c) {
          if constexpr (!AMX) _mm512_store_ps(s.qf + g * D + 16 * c, _mm512_mul_ps(qc[c], vscale));
          _mm512_store_ps(s.acc + g * D + 16 * c, _mm512_setzero_ps());
        }
        s.m[g] = -std::numeric_limits<float>::infinity();
        s.l[g] = 0.f;
      }
    }
  }
  const int64_t* t0 = tables + static_cast<int64_t>(idx[0]) * table_stride;
  for (int64_t p0 = 0; p0 < shared; p0 += kTile)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < nh; ++h)
        attend_tile<T, D, AMX>(st[r * nh + h], G, kv[h], t0, p0, 0, seq_lens[idx[r]], r == 0);
  for (int r = 0; r < R; ++r) {
    const int b = idx[r];
    const int64_t start = kv_starts ? kv_starts[b] : 0;
    const int64_t* tb = tables + static_cast<int64_t>(b) * table_stride;
    for (int64_t p0 = shared > 0 ? shared : (start / 16) * 16; p0 < seq_lens[b]; p0 += kTile)
      for (int h = 0; h < nh; ++h)
        attend_tile<T, D, AMX>(st[r * nh + h], G, kv[h], tb, p0, start, seq_lens[b], true);
    const int64_t row = rows ? rows[b] : b;
    for (int h = 0; h < nh; ++h) {
      const RowState& s = st[r * nh + h];
      for (int g = 0; g < G; ++g) {
        const float inv = 1.f / s.l[g];
        T* o = out + row * out_stride + static_cast<int64_t>((h0 + h) * G + g) * D;
        // The AVX-512 value sums are held split (load_row); the tile unit's in order.
        for (int d = 0; d < D; ++d)
          store<T>(o, d, s.acc[g * D + (AMX ? d : split_index<T>(d))] * inv);
      }
    }
  }
}
#endif

// Work items of a decode step: rows order[first .. first + count) for kv heads [h0, h1),
// with their shared leading keys.
struct Item {
  int first, count, h0, h1;
  int64_t shared;
};

#if defined(PF_AVX512)
// decode_rows_avx512 for head size D (64, 128 or 256) and one work item.
template <typename T, bool AMX>
void rows_avx512(int D, const T* q, int64_t q_stride, const int64_t* rows, const int* idx,
                 const Item& it, const T* cache, int KVH, int bs, const int64_t* tables,
                 int64_t table_stride, const int64_t* seq_lens, const int64_t* kv_starts, T* out,
                 int64_t out_stride, int G, float scale, float* scratch) {
  auto run = [&](auto d) {
    decode_rows_avx512<T, decltype(d)::value, AMX>(
        q, q_stride, rows, idx, it.count, it.h0, it.h1, cache, KVH, bs, tables, table_stride,
        seq_lens, kv_starts, out, out_stride, G, scale, it.shared, scratch);
  };
  if (D == 64)
    run(std::integral_constant<int, 64>());
  else if (D == 128)
    run(std::integral_constant<int, 128>());
  else
    run(std::integral_constant<int, 256>());
}
#endif

// Rows with the same first block are grouped (up to kMaxShareRows, and split so that every
// thread has work), with the leading keys in blocks common to all of them, whole tiles only,
// as their shared part; other rows are items of one. Sliding windows (kv_starts) never group.
// Each piece of rows covers all kv heads when there are pieces enough for the threads, else
// the heads are split among items.
inline void plan_items(const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
                       const int64_t* kv_starts, int B, int KVH, int bs, int nthreads,
                       std::vector<int>& order, std::vector<Item>& items) {
  order.resize(B);
  for (int b = 0; b < B; ++b) order[b] = b;
  items.clear();
  if (kv_starts == nullptr && B > 1)
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return tables[x * table_stride] < tables[y * table_stride];
    });
  struct Piece {
    int first, count;
    int64_t shared;
  };
  std::vector<Piece> pieces;
  for (int i = 0; i < B;) {
    int j = i + 1;
    int64_t shared = 0;
    if (kv_starts == nullptr) {
      const int64_t* ti = tables + order[i] * table_stride;
      int64_t lim = seq_lens[order[i]];
      while (j < B && tables[order[j] * table_stride] == ti[0]) ++j;
      for (int r = i + 1; r < j; ++r) lim = std::min(lim, seq_lens[order[r]]);
      shared = (lim / kTile) * kTile;
      for (int r = i + 1; r < j && shared > 0; ++r) {
        const int64_t* tr = tables + order[r] * table_stride;
        int64_t blk = 0;
        const int64_t nblk = (shared + bs - 1) / bs;
        while (blk < nblk && tr[blk] == ti[blk]) ++blk;
        shared = std::min(shared, (blk * bs / kTile) * kTile);
      }
      if (shared == 0) j = i + 1;
    }
    const int n = j - i;
    // Enough pieces for the threads; each piece re-reads the shared keys once.
    int np = std::max(n > 1 ? (nthreads + KVH - 1) / KVH : 1,
                      (n + kMaxShareRows - 1) / kMaxShareRows);
    np = std::min(np, n);
    for (int k = 0; k < np; ++k) {
      const int a = i + static_cast<int>(static_cast<int64_t>(n) * k / np);
      const int e = i + static_cast<int>(static_cast<int64_t>(n) * (k + 1) / np);
      pieces.push_back(Piece{a, e - a, e - a > 1 ? shared : 0});
    }
    i = j;
  }
  const int np = static_cast<int>(pieces.size());
  const int splits = std::min(KVH, std::max(1, (2 * nthreads + np - 1) / np));
  for (const Piece& p : pieces)
    for (int k = 0; k < splits; ++k)
      items.push_back(Item{p.first, p.count, KVH * k / splits, KVH * (k + 1) / splits,
                           p.shared});
}

template <typename T>
void decode_all(const T* q, int64_t q_stride, const int64_t* rows, const T* cache,
                const int64_t* tables,
                int64_t table_stride, const int64_t* seq_lens, const int64_t* kv_starts, T* out,
                int64_t out_stride, int B, int H, int KVH, int D, int bs, float scale,
                int nthreads) {
  const int G = H / KVH;
#if defined(PF_AVX512)
  if (bs % 16 == 0 && (D == 64 || D == 128 || D == 256)) {
    // AMX tiles for bf16 caches with grouped query heads (every row of the call alike).
    const bool amx = std::is_same_v<T, uint16_t> && g_decode_amx.load() != 0 &&
                     G >= kAmxMinGroup && G <= 16 && G <= kMaxGroup && pf_amx_ready() != 0;
    if (amx) g_decode_amx_calls.fetch_add(1, std::memory_order_relaxed);
    std::vector<int> order;
    std::vector<Item> items;
    plan_items(tables, table_stride, seq_lens, kv_starts, B, KVH, bs, nthreads, order, items);
    int most = 1;  // the largest item's (rows x heads): its states' scratch
    for (const Item& it : items) most = std::max(most, it.count * (it.h1 - it.h0));
    const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n > 1)
    {
      std::vector<float> buf(static_cast<size_t>(most) * (2 * G * D + 2 * kMaxGroup) + 16);
      float* scratch = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~static_cast<uintptr_t>(63));
      if (amx) decode_amx_begin(G, D);  // this thread's tiles (amx checked shape and grant)
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) {
        const Item& it = items[i];
        const int* idx = order.data() + it.first;
        if (amx)
          rows_avx512<T, true>(D, q, q_stride, rows, idx, it, cache, KVH, bs, tables,
                               table_stride, seq_lens, kv_starts, out, out_stride, G, scale,
                               scratch);
        else
          rows_avx512<T, false>(D, q, q_stride, rows, idx, it, cache, KVH, bs, tables,
                                table_stride, seq_lens, kv_starts, out, out_stride, G, scale,
                                scratch);
      }
      if (amx) decode_amx_end();
    }
    return;
  }
#endif
#if defined(PF_AVX2)
  if (D == 32 || D == 64 || D == 128 || D == 256) {
    // Items: a row with all its kv heads; with fewer rows than threads, each row's heads in
    // ranges, so every thread has work (a batch-1 step on one thread otherwise).
    const int splits = B >= nthreads ? 1 : std::min(KVH, (nthreads + B - 1) / B);
    const int64_t n = static_cast<int64_t>(B) * splits;
    const int64_t hf = head_floats(G, D / 8);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n > 1)
    {
      std::vector<float> buf(static_cast<size_t>((KVH + splits - 1) / splits + 1) * hf + 8);
      float* state = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~static_cast<uintptr_t>(31));
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n; ++it) {
        const int b = static_cast<int>(it / splits), k = static_cast<int>(it % splits);
        const int h0 = KVH * k / splits, h1 = KVH * (k + 1) / splits;
        const int64_t r = rows ? rows[b] : b;
        const T* qb = q + r * q_stride;
        const int64_t* tb = tables + b * table_stride;
        const int64_t start = kv_starts ? kv_starts[b] : 0;
        T* ob = out + r * out_stride;
        if (D == 32)
          decode_row_avx2<T, 4>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, h0, h1,
                                scale, state);
        else if (D == 64)
          decode_row_avx2<T, 8>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, h0, h1,
                                scale, state);
        else if (D == 128)
          decode_row_avx2<T, 16>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, h0, h1,
                                 scale, state);
        else
          decode_row_avx2<T, 32>(qb, cache, tb, seq_lens[b], start, ob, G, KVH, bs, h0, h1,
                                 scale, state);
      }
    }
    return;
  }
#endif
  const int64_t items = static_cast<int64_t>(B) * KVH;
  // One chunk = one row's kv heads, so a thread reads a row's blocks while they are hot; with
  // fewer rows than threads, single heads (else one thread would take all of a batch-1 step).
  const int chunk = B >= nthreads ? KVH : 1;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(nthreads) \
    if (nthreads > 1 && items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int b = static_cast<int>(it / KVH);
    const int kvh = static_cast<int>(it % KVH);
    const int64_t r = rows ? rows[b] : b;
    const T* qb = q + r * q_stride;
    const int64_t* tb = tables + b * table_stride;
    const int64_t start = kv_starts ? kv_starts[b] : 0;
    T* ob = out + r * out_stride;
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

// AMX tiles in decode attention on (1, the default) or off (0); returns the previous setting.
int pf_decode_attention_amx(int on) { return g_decode_amx.exchange(on != 0 ? 1 : 0); }

// How many decode attention calls took the AMX tiles so far.
int64_t pf_decode_attention_amx_calls() { return g_decode_amx_calls.load(); }

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
