// Prefill (and chunked-prefill) attention over the paged bf16 K/V cache, with AVX-512 BF16.
//
// One work item = (prefill row, kv head, tile of up to 16 query tokens); the G query heads
// that share the kv head are processed together. Keys are visited in tiles of 16: a tile's
// K is transposed once into pairs (lane j of vector p holds key j's channels 2p and 2p+1), so
// one vdpbf16ps per channel pair gives 16 scores of one query at once, for every query row
// and head of the item; its V is widened to float32 once. Scores: exact bf16 products summed
// in float32; online softmax in float32; the value sums in float32; the output rounded to
// bf16 once (SDPA's CPU path also rounds P to bf16 for its value product; this does not).
//
// Query token i of a row sits at position ctx_len + i and attends the keys at positions
// [max(kv_start, pos - window + 1), pos] (window 0: no window); key position p is read at
// flat cache slot slots[slot_off + p - kv_start] (K at index 0 of the slot, V at index 1).

#include <type_traits>
#include <vector>

#include "common.h"

namespace pf {
namespace {

constexpr int kTile = 16;

#if defined(PF_AVX512) && defined(__AVX512BF16__)
#define PF_PREFILL 1

struct RowDesc {
  int64_t tok_start, q_len, ctx_len, kv_start, slot_off;
};

// CM: 16-lane chunks of a head (D <= 16 * CM; chunks past D are masked off).
template <int CM>
void prefill_item(const uint16_t* q, int64_t q_stride, const uint16_t* cache,
                  const int64_t* slots, const RowDesc& row, int64_t i0, int kvh, uint16_t* out,
                  int64_t out_stride, int H, int KVH, int D, int window, float scale,
                  float* acc /* kTile * G * D */, uint32_t* kt /* D/2 * 16 */,
                  float* vf /* 16 * D */, uint32_t* qp /* kTile * G * D/2 */) {
  const int G = H / KVH, P = D / 2;
  const int64_t i1 = i0 + kTile < row.q_len ? i0 + kTile : row.q_len;
  const int nq = static_cast<int>(i1 - i0), nrh = nq * G;
  __mmask16 cm[CM];
  for (int c = 0; c < CM; ++c) cm[c] = D > 16 * c ? lanes(D - 16 * c) : 0;
  float m[kTile * kMaxGroup], l[kTile * kMaxGroup];
  alignas(64) float sc[kTile * kMaxGroup][kTile];
  for (int r = 0; r < nrh; ++r) {  // row-head r = (query qi, head g) = qi * G + g
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    std::memcpy(qp + static_cast<int64_t>(r) * P,
                q + (row.tok_start + i0 + r / G) * q_stride +
                    static_cast<int64_t>(kvh * G + r % G) * D,
                2 * P * sizeof(uint16_t));
  }
  for (int64_t e = 0; e < static_cast<int64_t>(nrh) * D; ++e) acc[e] = 0.f;
  auto lo_of = [&](int64_t pos) {
    const int64_t w = window > 0 ? pos - window + 1 : 0;
    return w > row.kv_start ? w : row.kv_start;
  };
  const int64_t first = lo_of(row.ctx_len + i0), last = row.ctx_len + i1 - 1;
  const int64_t tok_stride = 2LL * KVH * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = first; j0 <= last; j0 += kTile) {
    const int nk = static_cast<int>(last - j0 + 1 < kTile ? last - j0 + 1 : kTile);
    for (int j = 0; j < kTile; ++j) {
      if (j < nk) {
        const uint16_t* kp = cache + slots[row.slot_off + j0 + j - row.kv_start] * tok_stride +
                             static_cast<int64_t>(kvh) * D;
        for (int p = 0; p < P; ++p) std::memcpy(&kt[p * kTile + j], kp + 2 * p, 4);
        const uint16_t* vp = kp + static_cast<int64_t>(KVH) * D;
        for (int c = 0; c < CM; ++c)
          _mm512_mask_storeu_ps(vf + j * D + 16 * c, cm[c], vload<uint16_t>(vp + 16 * c, cm[c]));
      } else {  // past the last key: zeros (their scores are masked, their values unused)
        for (int p = 0; p < P; ++p) kt[p * kTile + j] = 0;
        for (int d = 0; d < D; ++d) vf[j * D + d] = 0.f;
      }
    }
    // Scores of 4 row-heads at a time: each K pair vector is loaded once for the 4, and the
    // 4 dot-product chains run in parallel.
    for (int r0 = 0; r0 < nrh; r0 += 4) {
      const int nr = nrh - r0 < 4 ? nrh - r0 : 4;
      __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      const uint32_t* q0 = qp + static_cast<int64_t>(r0) * P;
      for (int p = 0; p < P; ++p) {
        const __m512bh k = (__m512bh)_mm512_load_si512(kt + p * kTile);
        for (int x = 0; x < 4; ++x)
          if (x < nr)
            s[x] = _mm512_dpbf16_ps(
                s[x], k, (__m512bh)_mm512_set1_epi32(static_cast<int>(q0[x * P + p])));
      }
      for (int x = 0; x < nr; ++x) _mm512_store_ps(sc[r0 + x], _mm512_mul_ps(s[x], vscale));
    }
    for (int r = 0; r < nrh; ++r) {
      const int64_t pos = row.ctx_len + i0 + r / G;
      const int64_t lo = lo_of(pos);
      if (j0 > pos || j0 + nk <= lo) continue;  // no key of this tile is visible
      // Lane j is visible when lo <= j0 + j <= pos (and j < nk).
      const int a = lo > j0 ? static_cast<int>(lo - j0) : 0;
      const int b = pos - j0 + 1 < nk ? static_cast<int>(pos - j0 + 1) : nk;
      const __mmask16 vis = static_cast<__mmask16>(lanes(b) & ~lanes(a));
      const __m512 sv = _mm512_load_ps(sc[r]);
      const float smax = _mm512_mask_reduce_max_ps(vis, sv);
      const float mnew = smax > m[r] ? smax : m[r];
      const float alpha = std::exp(m[r] - mnew);  // 0 on the first visible keys
      m[r] = mnew;
      const __m512 pr = _mm512_maskz_mov_ps(vis, vexp(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(pr);
      alignas(64) float pv[kTile];
      _mm512_store_ps(pv, pr);
      float* ar = acc + static_cast<int64_t>(r) * D;
      const __m512 va = _mm512_set1_ps(alpha);
      __m512 o[CM];
      for (int c = 0; c < CM; ++c) o[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(cm[c], ar + 16 * c), va);
      for (int j = a; j < b; ++j) {
        const __m512 pj = _mm512_set1_ps(pv[j]);
        for (int c = 0; c < CM; ++c)
          o[c] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(cm[c], vf + j * D + 16 * c), o[c]);
      }
      for (int c = 0; c < CM; ++c) _mm512_mask_storeu_ps(ar + 16 * c, cm[c], o[c]);
    }
  }
  for (int r = 0; r < nrh; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    uint16_t* o = out + (row.tok_start + i0 + r / G) * out_stride +
                  static_cast<int64_t>(kvh * G + r % G) * D;
    for (int c = 0; c < CM; ++c)
      vstore<uint16_t>(o + 16 * c,
                       _mm512_mul_ps(_mm512_maskz_loadu_ps(cm[c], acc + r * D + 16 * c), inv),
                       cm[c]);
  }
}
#endif

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// q (T, H, D) bf16, token rows q_stride apart, heads contiguous; out likewise (out_stride).
// rows (R, 5) int64: tok_start, q_len, ctx_len, kv_start, slot_off (see the top of the file);
// cache (num_blocks, block_size, 2, KVH, D) bf16. Every key a query attends must already be
// in the cache. Returns 0, or -1 when this build or these shapes are not handled.
int pf_prefill_attention(const void* q, int64_t q_stride, const void* cache,
                         const int64_t* slots, const int64_t* rows, int R, void* out,
                         int64_t out_stride, int H, int KVH, int D, int window, float scale,
                         int nthreads) {
#if defined(PF_PREFILL)
  if (D % 2 || D > kMaxHeadDim || H % KVH || H / KVH > kMaxGroup) return -1;
  const int G = H / KVH;
  std::vector<int64_t> item_row, item_tile;  // (row, first query) per item, kv head inner
  for (int r = 0; r < R; ++r)
    for (int64_t i0 = 0; i0 < rows[r * 5 + 1]; i0 += kTile) {
      item_row.push_back(r);
      item_tile.push_back(i0);
    }
  const int64_t items = static_cast<int64_t>(item_row.size()) * KVH;
  const auto* qh = static_cast<const uint16_t*>(q);
  const auto* ch = static_cast<const uint16_t*>(cache);
  auto* oh = static_cast<uint16_t*>(out);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
  {
    std::vector<float> acc(static_cast<size_t>(kTile) * G * D);
    std::vector<float> vf(static_cast<size_t>(kTile) * D);
    std::vector<uint32_t> qp(static_cast<size_t>(kTile) * G * (D / 2));
    alignas(64) uint32_t kt[kMaxHeadDim / 2 * kTile];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t k = it / KVH;
      const int64_t* rd = rows + item_row[k] * 5;
      const RowDesc row{rd[0], rd[1], rd[2], rd[3], rd[4]};
      const int kvh = static_cast<int>(it % KVH);
      auto run = [&](auto cm) {
        prefill_item<decltype(cm)::value>(qh, q_stride, ch, slots, row, item_tile[k], kvh, oh,
                                          out_stride, H, KVH, D, window, scale, acc.data(), kt,
                                          vf.data(), qp.data());
      };
      if (D <= 32)
        run(std::integral_constant<int, 2>{});
      else if (D <= 64)
        run(std::integral_constant<int, 4>{});
      else if (D <= 128)
        run(std::integral_constant<int, 8>{});
      else
        run(std::integral_constant<int, 16>{});
    }
  }
  return 0;
#else
  (void)q, (void)q_stride, (void)cache, (void)slots, (void)rows, (void)R, (void)out,
      (void)out_stride, (void)H, (void)KVH, (void)D, (void)window, (void)scale, (void)nthreads;
  return -1;
#endif
}

}  // extern "C"
