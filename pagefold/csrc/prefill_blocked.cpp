// Prefill (and chunked-prefill) attention over the paged bf16 K/V cache, blocked: 32 query
// lanes against blocks of 64 keys, the products on AMX tiles where the CPU has them and on
// AVX512-BF16 dot products (vdpbf16ps) elsewhere. One algorithm, two product units.
//
// Same contract as pf_prefill_attention (prefill.cpp): query token i of a row sits at position
// ctx_len + i and attends the keys at positions [max(kv_start, pos - window + 1), pos] (window
// 0: no window); key position p is read at flat cache slot slots[slot_off + p - kv_start].
//
// Why: prefill.cpp's kernel works one (query, head) row at a time with a few accumulators, so
// its dot products wait on each other and the value sums run in float32 (~100 GFLOP/s on 2
// cores); long prompts spend over half their time here. Blocked, every product is a small
// matrix product with all its operands in registers or L1: the tile unit does a 16 x 16 x 32
// block per instruction; the vector kernel keeps 16 independent 16-lane accumulators live.
//
// Everything is computed transposed, with query "lanes" (row-heads: lane = token * G + head
// of the G query heads sharing a kv head) as the fast index:
//   S^T (64 keys x 32 lanes) = K (keys x D) . Q^T
//   O^T (D x 32 lanes)      += V^T (D x 64 keys) . P^T
// so the softmax statistics of 16 lanes are one vector each and every reduction over keys is
// a vertical max / add of 16-lane vectors (no horizontal reductions). Per call, the K and V
// of each (row, kv head) are first gathered from the pages once into blocks of 64 keys (K as
// rows, V transposed), shared by every query tile of the row. Q^T and P^T are held as bf16
// pairs (32-bit lane l of row p: the lane's dims / keys 2p and 2p + 1): the B operand layout
// of the tile unit and the lane-parallel operand of vdpbf16ps, whose other operand is then a
// broadcast 32-bit word of K (two dims of a key) or of V^T (one dim of two keys).
//
// Numerics: scores exact bf16 products summed in float32 (the two units sum in different
// orders: last bits differ); softmax in float32 in base 2 with a lazily raised maximum (the
// running maximum is only raised when a block's exceeds it by more than 2^8, so most blocks
// skip rescaling; weights stay <= 256, exact in float32); the weights P rounded to bf16 for
// the value product (as SDPA's CPU path does) and the denominator summed from those same
// rounded weights, so the weights of each query sum to one; the output rounded to bf16 once.

#include <algorithm>
#include <climits>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__) && defined(PF_AVX512)
#define PF_PREFILL_BLOCKED 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PF_PREFILL_AMX 1
#endif
#endif

extern "C" {
int pf_amx_ready();  // gemv_amx.cpp
int pf_prefill_attention(const void* q, int64_t q_stride, const void* cache,
                         const int64_t* slots, const int64_t* rows, int R, void* out,
                         int64_t out_stride, int H, int KVH, int D, int window, float scale,
                         int nthreads);  // prefill.cpp
}

namespace pf {
namespace {

#if defined(PF_PREFILL_BLOCKED)

constexpr int kLanes = 32;  // query row-heads per item: two 16-lane halves
// Keys per block: the softmax step and the depth of one P^T . V product. 64 keys = two tile
// depths, so the value product loads and stores each O^T tile once per 64 keys (at 32 it did
// so per 32: 16/2 x 128 over 2,048 fresh tokens 1.09-1.17x slower, AMX Xeon, 2 threads; the
// head-dim-64 cases within noise).
constexpr int kKeys = 64;
constexpr int kDepth = 32;  // bf16 products of one tile instruction: keys of a score tile
constexpr float kLazy = 8.0f;  // base-2 headroom before the running maximum is raised
constexpr int kMinLanes = 8;   // fewer query row-heads in a row: prefill.cpp's row kernel

struct RowDesc {
  int64_t tok_start, q_len, ctx_len, kv_start, slot_off;
  int64_t first, last;  // the keys any query of the row reads
  int64_t nb;           // blocks of kKeys keys from first
  int64_t pack_off;     // this row's packed blocks (kv head 0) in the pack buffer
};

// 2^x for x <= ~kLazy + 1 (the scores minus the running maximum, base 2); below -126 it returns
// 2^-126 (callers zero masked keys themselves). 2^x = 2^n 2^f, n = round(x), |f| <= 1/2, 2^f
// by a degree-5 polynomial fitted for relative error (at most 2.4e-7 in float32: below the
// bf16 rounding the weights get by four orders of magnitude).
inline __m512 vexp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.327644451521337e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67553723603487e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713464617729e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
}

// Two float vectors as bf16 pairs: 32-bit lane i holds (bf16(a[i]), bf16(b[i])), a in the low
// half. The hardware rounding is round-to-nearest-even, as f32_to_bf16; the weights are finite
// and at least 2^-126 (or zero), so no NaN or denormal case differs.
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  // cvtne2ps puts b's 16 values in elements 16..31 and a's in 0..15: interleave them.
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Gathers block b of (row, kv head) from the pages: K as kKeys rows of D, V transposed as D
// rows of kKeys keys; keys past the row's last are zeros (masked scores; zero values keep 0 * V
// finite).
void pack_block(const uint16_t* cache, const int64_t* slots, const RowDesc& row, int kvh,
                int KVH, int D, int64_t b, uint16_t* kb, uint16_t* vb) {
  const int64_t tok_stride = 2LL * KVH * D;
  const uint16_t* vrow[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    const int64_t pos = row.first + b * kKeys + j;
    if (pos > row.last) {
      std::memset(kb + j * D, 0, sizeof(uint16_t) * D);
      vrow[j] = nullptr;
      continue;
    }
    const uint16_t* kp = cache + slots[row.slot_off + pos - row.kv_start] * tok_stride +
                         static_cast<int64_t>(kvh) * D;
    std::memcpy(kb + j * D, kp, sizeof(uint16_t) * D);
    vrow[j] = kp + static_cast<int64_t>(KVH) * D;
  }
  // V^T, 16 dims at a time: w[kk] holds (v[2kk][d], v[2kk+1][d]) for the 16 dims; V^T row d is
  // then w[0..kKeys / 2 - 1][d], gathered 16 words at a time.
  alignas(64) uint32_t w[kKeys / 2][16];
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int d0 = 0; d0 < D; d0 += 16) {
    for (int kk = 0; kk < kKeys / 2; ++kk) {
      const uint16_t* a = vrow[2 * kk];
      const uint16_t* c = vrow[2 * kk + 1];
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(a + d0)))
                           : _mm512_setzero_si512();
      const __m512i hi = c ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(c + d0)))
                           : _mm512_setzero_si512();
      _mm512_store_si512(w[kk], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (int d = 0; d < 16; ++d)
      for (int g = 0; g < kKeys / 32; ++g)
        _mm512_storeu_si512(vb + (d0 + d) * kKeys + 32 * g,
                            _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(d)),
                                                   w[16 * g], 4));
  }
}

// The vector product unit: AVX512-BF16 dot products. Each pass keeps 16 accumulators live (8
// keys or 8 dims x the two 16-lane halves), so 16 independent vdpbf16ps chains hide the
// instruction's latency; per pass only the lane-parallel operand rows are loaded as vectors,
// the other operand is a broadcast 32-bit word.
struct VecProducts {
  static void begin() {}
  static void end() {}

  // S^T (kKeys keys x 32 lanes, rows kLanes floats apart) of one K block (kKeys rows of D).
  static void scores(const uint32_t* qt, const uint16_t* kb, int D, float* dst) {
    constexpr int J = 8;
    for (int j0 = 0; j0 < kKeys; j0 += J) {
      __m512 a[J][2];
      for (int j = 0; j < J; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
      const uint16_t* k0 = kb + j0 * D;
      for (int p = 0; p < D / 2; ++p) {
        const __m512bh q0 = (__m512bh)_mm512_load_si512(qt + p * kLanes);
        const __m512bh q1 = (__m512bh)_mm512_load_si512(qt + p * kLanes + 16);
        for (int j = 0; j < J; ++j) {
          int32_t w;  // dims 2p, 2p + 1 of key j0 + j
          std::memcpy(&w, k0 + j * D + 2 * p, sizeof(w));
          const __m512bh kj = (__m512bh)_mm512_set1_epi32(w);
          a[j][0] = _mm512_dpbf16_ps(a[j][0], kj, q0);
          a[j][1] = _mm512_dpbf16_ps(a[j][1], kj, q1);
        }
      }
      for (int j = 0; j < J; ++j) {
        _mm512_store_ps(dst + (j0 + j) * kLanes, a[j][0]);
        _mm512_store_ps(dst + (j0 + j) * kLanes + 16, a[j][1]);
      }
    }
  }

  // O^T (D x 32 lanes) += V^T (D rows of kKeys keys) . P^T (kKeys / 2 key pairs x 32 lanes).
  static void values(const uint32_t* pb, const uint16_t* vb, int D, float* ot) {
    constexpr int E = 8;
    for (int d0 = 0; d0 < D; d0 += E) {
      float* ob = ot + d0 * kLanes;
      __m512 o[E][2];
      for (int e = 0; e < E; ++e) {
        o[e][0] = _mm512_load_ps(ob + e * kLanes);
        o[e][1] = _mm512_load_ps(ob + e * kLanes + 16);
      }
      const uint16_t* v0 = vb + d0 * kKeys;
      for (int kk = 0; kk < kKeys / 2; ++kk) {
        const __m512bh p0 = (__m512bh)_mm512_load_si512(pb + kk * kLanes);
        const __m512bh p1 = (__m512bh)_mm512_load_si512(pb + kk * kLanes + 16);
        for (int e = 0; e < E; ++e) {
          int32_t w;  // dim d0 + e of keys 2kk, 2kk + 1
          std::memcpy(&w, v0 + e * kKeys + 2 * kk, sizeof(w));
          const __m512bh v = (__m512bh)_mm512_set1_epi32(w);
          o[e][0] = _mm512_dpbf16_ps(o[e][0], v, p0);
          o[e][1] = _mm512_dpbf16_ps(o[e][1], v, p1);
        }
      }
      for (int e = 0; e < E; ++e) {
        _mm512_store_ps(ob + e * kLanes, o[e][0]);
        _mm512_store_ps(ob + e * kLanes + 16, o[e][1]);
      }
    }
  }
};

#if defined(PF_PREFILL_AMX)
// The tile product unit; every tile is 16 rows of 64 bytes. S phase, per 32 keys of the block:
// tmm0..3 S^T (keys 0-15 / 16-31 x lanes 0-15 / 16-31: tmm0 = keys 0-15 lanes 0-15, tmm1 =
// keys 0-15 lanes 16-31, tmm2 / tmm3 the same for keys 16-31); tmm4 / tmm5 K rows 0-15 / 16-31
// (32 dims); tmm6 / tmm7 Q^T of either lane half (16 dim pairs x 16 lanes). PV phase: the
// block's P^T stays in tmm2..5 (key pairs 0-15 / 16-31 x lane half: tmm2 / tmm3 keys 0-31 of
// either half, tmm4 / tmm5 keys 32-63); per 16 dims, O^T of either lane half in tmm0 / tmm1
// takes both 32-key depths (V^T of keys 0-31 in tmm6, of keys 32-63 in tmm7) between one load
// and one store. The caller issues the scores of block b + 1 before the softmax of b and the
// value product of b - 1 after it. Measured on the AMX Xeon (16/2 x 128, 2,048 fresh tokens),
// the tile and vector work mostly add up rather than overlap (tiles alone 7.8 ms, softmax
// alone 4.7, both 10.9), and spreading the tile work in units of 4 products through the
// softmax loop made it slower (12 ms): the time to win is in the softmax's vector work.
static_assert(kKeys == 2 * kDepth, "the PV phase holds two tile depths of P^T");
struct TileProducts {
  static void begin() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    load_tile_config(cfg);
  }
  static void end() { _tile_release(); }

  static void scores(const uint32_t* qt, const uint16_t* kb, int D, float* dst) {
    constexpr int L = kLanes;
    for (int k0 = 0; k0 < kKeys; k0 += kDepth) {
      const uint16_t* kh = kb + k0 * D;
      float* dh = dst + k0 * L;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(6, qt + c * 16 * L, L * 4);
        _tile_loadd(7, qt + c * 16 * L + 16, L * 4);
        _tile_loadd(4, kh + c * 32, D * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, kh + 16 * D + c * 32, D * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, dh, L * 4);
      _tile_stored(1, dh + 16, L * 4);
      _tile_stored(2, dh + 16 * L, L * 4);
      _tile_stored(3, dh + 16 * L + 16, L * 4);
    }
  }

  static void values(const uint32_t* pb, const uint16_t* vb, int D, float* ot) {
    constexpr int L = kLanes;
    _tile_loadd(2, pb, L * 4);
    _tile_loadd(3, pb + 16, L * 4);
    _tile_loadd(4, pb + 16 * L, L * 4);
    _tile_loadd(5, pb + 16 * L + 16, L * 4);
    for (int c = 0; c < D / 16; ++c) {
      float* o = ot + c * 16 * L;
      const uint16_t* v = vb + c * 16 * kKeys;
      _tile_loadd(0, o, L * 4);
      _tile_loadd(1, o + 16, L * 4);
      _tile_loadd(6, v, kKeys * 2);
      _tile_dpbf16ps(0, 6, 2);
      _tile_dpbf16ps(1, 6, 3);
      _tile_loadd(7, v + kDepth, kKeys * 2);
      _tile_dpbf16ps(0, 7, 4);
      _tile_dpbf16ps(1, 7, 5);
      _tile_stored(0, o, L * 4);
      _tile_stored(1, o + 16, L * 4);
    }
  }
};
#endif  // PF_PREFILL_AMX

// One item: lanes [lane0, lane0 + 32) of (row, kv head) over all the keys they see.
template <class Products>
void attend_item(const uint16_t* q, int64_t q_stride, const RowDesc& row, int kvh, int64_t lane0,
                 const uint16_t* pack, uint16_t* out, int64_t out_stride, int G, int D,
                 int window, float scale) {
  constexpr int L = kLanes, H2 = kLanes / 16;  // lanes, 16-lane halves
  const int64_t nrh = row.q_len * G;
  const int nl = static_cast<int>(std::min<int64_t>(L, nrh - lane0));
  alignas(64) uint32_t qt[kMaxHeadDim / 2 * L];  // Q^T: dim pair x lane
  alignas(64) float ot[kMaxHeadDim * L];         // O^T: dim x lane
  alignas(64) float st[2][kKeys * L];            // S^T: key x lane, two blocks
  alignas(64) uint32_t pt[2][kKeys / 2 * L];     // P^T: key pair x lane (bf16 pairs)
  alignas(64) int32_t posv[L], lov[L];
  auto lo_of = [&](int64_t pos) {
    const int64_t w = window > 0 ? pos - window + 1 : 0;
    return w > row.kv_start ? w : row.kv_start;
  };
  alignas(64) int32_t qoff[L];  // each lane's query row, in 32-bit words from q
  for (int l = 0; l < L; ++l) {
    const int64_t rh = lane0 + std::min(l, nl - 1);  // padded lanes repeat the last one
    const int64_t tok = rh / G;
    const int head = kvh * G + static_cast<int>(rh % G);
    posv[l] = static_cast<int32_t>(row.ctx_len + tok);
    lov[l] = static_cast<int32_t>(lo_of(row.ctx_len + tok));
    qoff[l] = static_cast<int32_t>(((row.tok_start + tok) * q_stride + head * D) / 2);
  }
  // Q^T: row p holds dim pair p of every lane (padded lanes zero), gathered 16 lanes at a time.
  for (int h = 0; h < L / 16; ++h) {
    const __m512i off = _mm512_load_si512(qoff + 16 * h);
    const __mmask16 live = lanes(nl - 16 * h > 0 ? nl - 16 * h : 0);
    for (int p = 0; p < D / 2; ++p)
      _mm512_store_si512(qt + p * L + 16 * h,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                     _mm512_add_epi32(off, _mm512_set1_epi32(p)),
                                                     q, 4));
  }
  std::memset(ot, 0, sizeof(float) * D * L);
  __m512i vpos[H2], vlo[H2];
  __m512 m2[H2], lsum[H2];
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int h = 0; h < H2; ++h) {
    vpos[h] = _mm512_load_si512(posv + 16 * h);
    vlo[h] = _mm512_load_si512(lov + 16 * h);
    m2[h] = ninf;
    lsum[h] = _mm512_setzero_ps();
  }
  const int64_t minpos = posv[0], maxpos = posv[L - 1];
  const int64_t lo_min = lov[0], lo_max = lov[L - 1];
  const __m512 vc2 = _mm512_set1_ps(scale * 1.44269504088896341f);  // to base-2 exponents
  const int64_t blk_stride = 2LL * kKeys * D;  // K block then V^T block
  const uint16_t* kv_base = pack + row.pack_off + kvh * row.nb * blk_stride;
  // The scores of block b + 1 are computed before the softmax of b and the value product of
  // b - 1 after it (see TileProducts).
  auto scores = [&](int64_t b, float* dst) {
    Products::scores(qt, kv_base + b * blk_stride, D, dst);
  };
  auto values = [&](int64_t b, const uint32_t* pb) {
    Products::values(pb, kv_base + b * blk_stride + kKeys * D, D, ot);
  };
  const int64_t b0 = (lo_min - row.first) / kKeys, b1 = (maxpos - row.first) / kKeys;
  int64_t pending = -1;  // the block whose value product is still to do
  scores(b0, st[0]);
  for (int64_t b = b0; b <= b1; ++b) {
    const int slot = static_cast<int>((b - b0) & 1);
    const float* sb = st[slot];
    if (b < b1) scores(b + 1, st[slot ^ 1]);
    const int64_t j0 = row.first + b * kKeys;
    // Every lane sees every key of the block: the last key at or before the first query and
    // the first key at or after the last query's window start.
    const bool full = j0 + kKeys - 1 <= minpos && j0 >= lo_max;
    __mmask16 vis[kKeys][H2];  // masked blocks: the keys each lane sees
    __m512 mx[H2];
    __mmask16 up[H2];
    for (int h = 0; h < H2; ++h) {
      mx[h] = ninf;
      for (int j = 0; j < kKeys; ++j) {
        __m512 sv = _mm512_load_ps(sb + j * L + 16 * h);
        if (!full) {  // masked keys take no part in the maximum
          const __m512i vj = _mm512_set1_epi32(static_cast<int32_t>(j0 + j));
          vis[j][h] = _mm512_cmpge_epi32_mask(vpos[h], vj) & _mm512_cmple_epi32_mask(vlo[h], vj);
          sv = _mm512_mask_mov_ps(ninf, vis[j][h], sv);
        }
        mx[h] = _mm512_max_ps(mx[h], sv);
      }
      // Raise the running maximum where this block's exceeds it by more than kLazy.
      mx[h] = _mm512_mul_ps(mx[h], vc2);
      up[h] = _mm512_cmp_ps_mask(mx[h], _mm512_add_ps(m2[h], _mm512_set1_ps(kLazy)),
                                 _CMP_GT_OQ);
    }
    for (int h = 0; h < H2; ++h) {
      if (!up[h]) continue;
      if (pending >= 0) {  // its weights are on the old maximum: add them before rescaling
        values(pending, pt[(pending - b0) & 1]);
        pending = -1;
      }
      const __m512 m2new = _mm512_mask_mov_ps(m2[h], up[h], mx[h]);
      const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), up[h],
                                              vexp2(_mm512_sub_ps(m2[h], m2new)));
      lsum[h] = _mm512_mul_ps(lsum[h], alpha);
      for (int d = 0; d < D; ++d) {
        float* o = ot + d * L + 16 * h;
        _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), alpha));
      }
      m2[h] = m2new;
    }
    // Masked keys weigh exactly 0 (a lane that has seen no key yet has m2 = -inf and sees
    // none in this block either: all its weights here are masked).
    uint32_t* pb = pt[slot];
    for (int h = 0; h < H2; ++h)
      for (int kk = 0; kk < kKeys / 2; ++kk) {
        const float* s0 = sb + 2 * kk * L + 16 * h;
        __m512 p0 = vexp2(_mm512_fmsub_ps(_mm512_load_ps(s0), vc2, m2[h]));
        __m512 p1 = vexp2(_mm512_fmsub_ps(_mm512_load_ps(s0 + L), vc2, m2[h]));
        if (!full) {
          p0 = _mm512_maskz_mov_ps(vis[2 * kk][h], p0);
          p1 = _mm512_maskz_mov_ps(vis[2 * kk + 1][h], p1);
        }
        _mm512_store_si512(pb + kk * L + 16 * h, bf16_pairs(p0, p1));
        lsum[h] = _mm512_add_ps(lsum[h], _mm512_add_ps(p0, p1));
      }
    if (pending >= 0) values(pending, pt[(pending - b0) & 1]);
    pending = b;
  }
  values(pending, pt[(pending - b0) & 1]);
  // Each live lane's row of O = O^T column / its weight sum, rounded to bf16 once.
  alignas(64) float inv[L];
  for (int h = 0; h < H2; ++h)
    _mm512_store_ps(inv + 16 * h, _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[h]));
  const __m512i col = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(L));
  for (int l = 0; l < nl; ++l) {
    const int64_t rh = lane0 + l;
    uint16_t* o = out + (row.tok_start + rh / G) * out_stride +
                  static_cast<int64_t>(kvh * G + rh % G) * D;
    const __m512 il = _mm512_set1_ps(inv[l]);
    for (int d0 = 0; d0 < D; d0 += 16)
      vstore<uint16_t>(o + d0, _mm512_mul_ps(_mm512_i32gather_ps(col, ot + d0 * L + l, 4), il));
  }
}

// The shared driver: validates, sends rows of few lanes to prefill.cpp's kernel, packs the
// K/V blocks (threads split the blocks), then runs the items (threads take them dynamically).
// Items go kv head by kv head, each head's tiles of a row from the longest down: the threads
// work on one head's packed K/V at a time, which stays in their L2 (a head of 3,000 keys of 64
// is 0.8 MB; all 12 heads of an MHA row are 9 MB). Head-minor order (every item a new head)
// streamed the K/V from memory for each item: 1.15-1.37x slower on 12 heads x 3,100 tokens
// (AMX Xeon, 2 threads).
// -1 (nothing written) for shapes it does not take.
template <class Products>
int prefill_blocked(const void* q, int64_t q_stride, const void* cache, const int64_t* slots,
                    const int64_t* rows, int R, void* out, int64_t out_stride, int H, int KVH,
                    int D, int window, float scale, int nthreads) {
  if (D % 32 || D > kMaxHeadDim || H % KVH || R <= 0) return -1;
  const int G = H / KVH;
  // Query rows are gathered by 32-bit word offsets (int32) and positions compared as int32.
  for (int i = 0; i < R; ++i) {
    const int64_t* rd = rows + i * 5;
    if ((rd[0] + rd[1]) * q_stride / 2 > INT32_MAX || rd[2] + rd[1] > INT32_MAX) return -1;
  }
  // Rows of fewer than kMinLanes query row-heads (a few tokens of a one-head group) would fill
  // a fraction of the 32 lanes after gathering all their keys: prefill.cpp's row kernel takes
  // them (measured on AMX: 1-4 tokens x 1 head over 1,000 keys in 0.66-0.93x the tiles' time;
  // the same threshold for the vector unit, whose small rows waste lanes alike).
  std::vector<int64_t> small;
  std::vector<RowDesc> desc;
  desc.reserve(R);
  int64_t pack_elems = 0;
  std::vector<int64_t> item_row, item_lane, blk_row, blk_idx;
  for (int i = 0; i < R; ++i) {
    const int64_t* rd = rows + i * 5;
    if (rd[1] * G < kMinLanes) {
      small.insert(small.end(), rd, rd + 5);
      continue;
    }
    const int r = static_cast<int>(desc.size());
    desc.emplace_back();
    RowDesc& d = desc.back();
    d = {rd[0], rd[1], rd[2], rd[3], rd[4], 0, 0, 0, 0};
    const int64_t w = window > 0 ? d.ctx_len - window + 1 : 0;
    d.first = w > d.kv_start ? w : d.kv_start;
    d.last = d.ctx_len + d.q_len - 1;
    d.nb = (d.last - d.first) / kKeys + 1;
    d.pack_off = pack_elems;
    pack_elems += static_cast<int64_t>(KVH) * d.nb * 2 * kKeys * D;
    for (int64_t b = 0; b < d.nb; ++b) {
      blk_row.push_back(r);
      blk_idx.push_back(b);
    }
    // The tiles of a row from the last (the most keys) down, for the dynamic schedule (the
    // shortest items of the last kv head end it).
    for (int64_t l0 = (d.q_len * G - 1) / kLanes * kLanes; l0 >= 0; l0 -= kLanes) {
      item_row.push_back(r);
      item_lane.push_back(l0);
    }
  }
  // The pack buffer is reused across calls (one per calling thread): every layer of a prefill
  // step needs the same size, and fresh multi-MiB allocations would fault their pages in anew.
  if (!small.empty() &&
      pf_prefill_attention(q, q_stride, cache, slots, small.data(),
                           static_cast<int>(small.size() / 5), out, out_stride, H, KVH, D,
                           window, scale, nthreads) != 0)
    return -1;
  if (desc.empty()) return 0;
  static thread_local std::vector<uint16_t> pack;
  if (static_cast<int64_t>(pack.size()) < pack_elems) pack.resize(pack_elems);
  uint16_t* pk = pack.data();
  const auto* qh = static_cast<const uint16_t*>(q);
  const auto* ch = static_cast<const uint16_t*>(cache);
  auto* oh = static_cast<uint16_t*>(out);
  const int64_t nblk = static_cast<int64_t>(blk_row.size()) * KVH;
  const int64_t nk = static_cast<int64_t>(item_row.size());  // items of one kv head
  const int64_t items = nk * KVH;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < nblk; ++u) {
      const RowDesc& d = desc[blk_row[u / KVH]];
      const int kvh = static_cast<int>(u % KVH);
      const int64_t b = blk_idx[u / KVH];
      uint16_t* kb = pk + d.pack_off + (kvh * d.nb + b) * 2 * kKeys * D;
      pack_block(ch, slots, d, kvh, KVH, D, b, kb, kb + kKeys * D);
    }
    Products::begin();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t k = it % nk;
      attend_item<Products>(qh, q_stride, desc[item_row[k]], static_cast<int>(it / nk),
                            item_lane[k], pk, oh, out_stride, G, D, window, scale);
    }
    Products::end();
  }
  return 0;
}

#endif  // PF_PREFILL_BLOCKED

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// pf_prefill_attention's arguments and result (prefill.cpp), on AMX tiles; -1 (nothing
// written) without AMX (in the build or granted by the OS) or for head dims that are not a
// multiple of 32 (up to kMaxHeadDim).
int pf_prefill_attention_amx(const void* q, int64_t q_stride, const void* cache,
                             const int64_t* slots, const int64_t* rows, int R, void* out,
                             int64_t out_stride, int H, int KVH, int D, int window, float scale,
                             int nthreads) {
#if defined(PF_PREFILL_AMX)
  if (!pf_amx_ready()) return -1;
  return prefill_blocked<TileProducts>(q, q_stride, cache, slots, rows, R, out, out_stride, H,
                                       KVH, D, window, scale, nthreads);
#else
  (void)q, (void)q_stride, (void)cache, (void)slots, (void)rows, (void)R, (void)out,
      (void)out_stride, (void)H, (void)KVH, (void)D, (void)window, (void)scale, (void)nthreads;
  return -1;
#endif
}

// The same with AVX512-BF16 dot products (any CPU with AVX512-BF16); -1 without them or for
// head dims that are not a multiple of 32.
int pf_prefill_attention_blocked(const void* q, int64_t q_stride, const void* cache,
                                 const int64_t* slots, const int64_t* rows, int R, void* out,
                                 int64_t out_stride, int H, int KVH, int D, int window,
                                 float scale, int nthreads) {
#if defined(PF_PREFILL_BLOCKED)
  return prefill_blocked<VecProducts>(q, q_stride, cache, slots, rows, R, out, out_stride, H,
                                      KVH, D, window, scale, nthreads);
#else
  (void)q, (void)q_stride, (void)cache, (void)slots, (void)rows, (void)R, (void)out,
      (void)out_stride, (void)H, (void)KVH, (void)D, (void)window, (void)scale, (void)nthreads;
  return -1;
#endif
}

// 1 where pf_prefill_attention_blocked is compiled in (AVX512-BF16), else 0.
int pf_prefill_blocked_ready() {
#if defined(PF_PREFILL_BLOCKED)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
