// Decode attention's scores on AMX tiles (attention.cpp's bf16 path for grouped query heads).
//
// With G query heads per kv head, the AVX-512 scores cost G * D / 16 multiply-adds a key plus
// a horizontal sum per 16 keys and head: at G = 8 and D = 128 decode attention ran at about
// half the copy rate (compute-bound; 6.6 GB/s a core on the AMX Xeon). The tile product does
// a 16-key sub-block for all G heads in D / 32 instructions: C (16 keys x G heads, float32) =
// A (16 K rows x 32 dims, loaded straight from the paged cache at the token stride) . B (the
// G query rows packed as 16 dimension pairs x G, once per row and head). The cache is never
// repacked. Float32 sums of exact bf16 products, in the tile's order: other last bits than
// the AVX-512 scores (q * scale there, the scale here applied to the sum), the same for every
// row of a call, so a row's result does not depend on its batch.

#include "common.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PF_AVX512)
#include <immintrin.h>

namespace pf {

// tmm0: C (16 keys x G float32); tmm1: A (16 keys x 32 bf16); tmm2: B (16 pairs x G).
bool decode_amx_begin(int G, int D) {
  if (G < 1 || G > 16 || D % 32 != 0 || !pf_amx_ready()) return false;
  TileConfig cfg;
  cfg.rows[0] = 16;
  cfg.colsb[0] = static_cast<uint16_t>(4 * G);
  cfg.rows[1] = 16;
  cfg.colsb[1] = 64;
  cfg.rows[2] = 16;
  cfg.colsb[2] = static_cast<uint16_t>(4 * G);
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

}  // namespace pf

#else  // no AMX in this build: the AVX-512 scores are used

namespace pf {
bool decode_amx_begin(int, int) { return false; }
void decode_amx_end() {}
void decode_amx_pack_q(const uint16_t*, int, int, uint16_t*) {}
void decode_amx_scores(const uint16_t*, int64_t, const uint16_t*, int, int, float*) {}
}  // namespace pf

#endif
