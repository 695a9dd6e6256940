// Decode attention on AMX tiles (attention.cpp's bf16 path for grouped query heads).
//
// With G query heads per kv head, the AVX-512 loops cost G * D / 16 multiply-adds a key for
// the scores (plus a horizontal sum per 16 keys and head) and as many again for the value
// sums: at G = 8 and D = 128 decode attention ran at about half the copy rate (compute-bound;
// 6.6 GB/s a core on the AMX Xeon). Here both products go to the tile unit:
// - scores: C (16 keys x G heads, float32) = A (16 K rows x 32 dims, loaded straight from the
//   paged cache at the token stride) . B (the G query rows packed as 16 dimension pairs x G,
//   once per row and head), D / 32 products a 16-key sub-block; the cache is never repacked.
//   Float32 sums of exact bf16 products; the scale applies to the sum (the AVX-512 loops
//   scale the query first).
// - value sums: the running sums (G x D float32) += P (G x 32 keys, rounded to bf16, as
//   flash attention does on GPUs) . V (32 rows repacked per tile into pairs of keys per
//   dimension: an unpack and a permute a 64-byte row), D / 16 products a 32-key tile through
//   the C tile; masked keys' rows are zeros (their cache slots may hold anything).
// The same path for every row of a call, so a row's result does not depend on its batch.

#include "common.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PF_AVX512)
#include <immintrin.h>

namespace pf {

// Scores: tmm0 C (16 keys x G float32), tmm1 A (16 keys x 32 bf16), tmm2 B (16 pairs x G).
// Value sums: tmm3 A (G heads x 32 keys of P, bf16), tmm4 B (16 key pairs x 16 dims), tmm5 C
// (G heads x 16 dims float32, loaded from and stored to the running sums).
bool decode_amx_begin(int G, int D) {
  if (G < 1 || G > 16 || D % 32 != 0 || !pf_amx_ready()) return false;
  TileConfig cfg;
  cfg.rows[0] = 16;
  cfg.colsb[0] = static_cast<uint16_t>(4 * G);
  cfg.rows[1] = 16;
  cfg.colsb[1] = 64;
  cfg.rows[2] = 16;
  cfg.colsb[2] = static_cast<uint16_t>(4 * G);
  cfg.rows[3] = static_cast<uint8_t>(G);
  cfg.colsb[3] = 64;
  cfg.rows[4] = 16;
  cfg.colsb[4] = 64;
  cfg.rows[5] = static_cast<uint8_t>(G);
  cfg.colsb[5] = 64;
  load_tile_config(cfg);
  return true;
}

void decode_amx_end() { _tile_release(); }

// qv[(c * 16 + i) * 2G + 2g + e] = q[g * D + 32c + 2i + e]: chunk c's B tile, row i holding
// dimension pair (32c + 2i, 32c + 2i + 1) of each head.
void decode_amx_pack_q(const uint16_t* q, int G, int D, uint16_t* qv) {
  for (int c = 0; c < D / 32; ++c)
    for (int i = 0; i < 16; ++i)
      for (int g = 0; g < G; ++g)
        for (int e = 0; e < 2; ++e)
          qv[(c * 16 + i) * 2 * G + 2 * g + e] = q[g * D + 32 * c + 2 * i + e];
}

// c[t * G + g] = K row t . q_g (t < 16) for the rows at k, k + stride, ... (elements).
void decode_amx_scores(const uint16_t* k, int64_t stride, const uint16_t* qv, int G, int D,
                       float* c) {
  _tile_zero(0);
  for (int ch = 0; ch < D / 32; ++ch) {
    _tile_loadd(1, k + 32 * ch, stride * 2);
    _tile_loadd(2, qv + ch * 16 * 2 * G, 4 * G);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, c, 4 * G);
}

// acc (G x D float32, row-major) += P (G x 32 keys: p[g * 32 + key], values already bf16)
// . V (the 32 rows at v[key], nullptr where a key is masked: read as zeros). V is repacked
// per tile into the B operand (pairs of keys interleaved per dimension: unpack + permute), P
// rounded to bf16 exactly (the caller rounded it), one product per 16 dimensions accumulating
// into acc through the C tile.
void decode_amx_pv(const uint16_t* const* v, const float* p, int G, int D, float* acc) {
  alignas(64) uint16_t pb[16 * 32];
  alignas(64) uint16_t vp[16 * 16 * 32];  // (D / 16) B tiles of 16 rows x 32 bf16, D <= 256
  for (int g = 0; g < G; ++g) {
    const __m512 lo = _mm512_loadu_ps(p + g * 32), hi = _mm512_loadu_ps(p + g * 32 + 16);
    _mm512_store_si512(pb + g * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  const __m512i i0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i i1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int i = 0; i < 16; ++i) {
    const uint16_t* a = v[2 * i];
    const uint16_t* b = v[2 * i + 1];
    for (int k = 0; k < D / 32; ++k) {
      const __m512i va = a ? _mm512_loadu_si512(a + 32 * k) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + 32 * k) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
      _mm512_store_si512(vp + ((2 * k) * 16 + i) * 32, _mm512_permutex2var_epi64(lo, i0, hi));
      _mm512_store_si512(vp + ((2 * k + 1) * 16 + i) * 32, _mm512_permutex2var_epi64(lo, i1, hi));
    }
  }
  _tile_loadd(3, pb, 64);
  for (int n = 0; n < D / 16; ++n) {
    _tile_loadd(5, acc + 16 * n, D * 4);
    _tile_loadd(4, vp + n * 16 * 32, 64);
    _tile_dpbf16ps(5, 3, 4);
    _tile_stored(5, acc + 16 * n, D * 4);
  }
}

}  // namespace pf

#else  // no AMX in this build: the AVX-512 scores are used

namespace pf {
bool decode_amx_begin(int, int) { return false; }
void decode_amx_end() {}
void decode_amx_pack_q(const uint16_t*, int, int, uint16_t*) {}
void decode_amx_scores(const uint16_t*, int64_t, const uint16_t*, int, int, float*) {}
void decode_amx_pv(const uint16_t* const*, const float*, int, int, float*) {}
}  // namespace pf

#endif
