// The bf16 few-row product on CPUs with AMX: y (M, N) = x (M, K) W^T (+ bias), float32 sums,
// one rounding at the end; M <= 32 in one pass over the weights (the decode and verify GEMV),
// more rows (an MoE expert's run in a prefill step) in a blocked path further down. Called
// through ctypes (see cpu_ops.py).
//
// Why: decode steps (one row per request) and speculative verify steps (1 + k rows) are
// memory bound on the weights, but the AVX512-BF16 dot-product GEMV does 32 multiply-adds per
// instruction per row, so from ~3 rows its compute outgrows the weight stream; oneDNN's GEMM
// has a fixed per-call cost that dwarfs small layers. The AMX tile unit does a 16 x 16 x 32
// block per instruction, so up to 16 rows cost about what one does (17-32 rows: two B tiles,
// each weight tile multiplied with both).
//
// Layout trick: the weight needs no repacking. The tile product computes
// C[i][j] += sum_p A[i][2p] B[p][2j] + A[i][2p+1] B[p][2j+1]; with A = 16 weight rows x 32 k
// (W as stored, one row per tile row) and B = x's 32 k packed as 16 k-pairs x M columns
// (built once per call, a few KiB), C[n][m] is y[m][n]. Each output element depends only on
// its own x row and weight row, accumulated over k in the same order whatever M is: a row's
// bits do not depend on how many rows share the call (a verify step computes what the decode
// steps it replaces would).
//
// Tiles need K a multiple of 32 (every model width we know); other K go to pf_linear_bf16
// (the AVX512-BF16 dot-product GEMV, also independent of M) for every M alike. Weight rows
// past the last multiple of 16 go through a one-row AVX512-BF16 dot product.

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(PF_AVX512)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace pf {
namespace {

constexpr int kTileRows = 16;     // weight rows per tile
constexpr int kTileK = 32;        // k per tile (64 bytes of bf16)
constexpr int kMaxRows = 16;      // x rows (tile columns of B and C)
constexpr int kMaxRowsWide = 32;  // two B tiles: rows 0..15 and 16..M-1
constexpr int kChunkGroups = 16;  // blocked path: 256 rows of x per pass of the weights

// Linux hands out AMX state only to processes that ask (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asking twice is harmless. Called once, from pf_amx_ready.
bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// tmm0: C (16 weight rows x M float32); tmm4: A (16 x 32 bf16 weights); tmm6: B (16 k-pairs
// x M bf16 pairs of x).
void configure(int M) {
  TileConfig cfg;
  cfg.rows[0] = kTileRows;
  cfg.colsb[0] = static_cast<uint16_t>(M * 4);
  cfg.rows[4] = kTileRows;
  cfg.colsb[4] = kTileK * 2;
  cfg.rows[6] = kTileK / 2;
  cfg.colsb[6] = static_cast<uint16_t>(M * 4);
  load_tile_config(cfg);
}

// C (16 weight rows x M, row-major) plus bias, rounded into y's columns n..n+15: column m
// of C is row m of y (gathered 16 at a time; f32_to_bf16's rounding, vectorised).
// ld: C's row stride in floats (default M).
inline void finish(const float* c, int M, const uint16_t* bias, int64_t n, uint16_t* y,
                   int64_t ys, int ld = 0) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(ld > 0 ? ld : M));
  const __m512 b = bias ? vload<uint16_t>(bias + n) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(m)), c, 4);
    vstore<uint16_t>(y + m * ys + n, _mm512_add_ps(v, b));
  }
}

// One 16-row weight tile from n: accumulate over all of K, then round into y. One tile at a
// time, not several side by side: 16 weight rows are 16 streams the hardware prefetchers
// follow, 64 are not (4 tiles side by side: a 1,024 x 3,072 product at 14 GB/s against 27 one
// tile at a time, 2 threads, 300 MB of weights; 3,072 x 1,024 24 against 29). The tile
// unit's latency is far below the weight stream's at any row count up to 32.
void tile1(const uint16_t* xp, const uint16_t* w, int64_t K, int M, const uint16_t* bias,
           int64_t n, uint16_t* y, int64_t ys) {
  _tile_zero(0);
  const uint16_t* w0 = w + n * K;
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, xp + k * M, M * 4);
    _tile_loadd(4, w0 + k, K * 2);
    _tile_dpbf16ps(0, 4, 6);
  }
  alignas(64) float c[kTileRows * kMaxRows];
  _tile_stored(0, c, M * 4);
  finish(c, M, bias, n, y, ys);
}

// 17..32 rows: x's rows 0..15 in B tmm6, rows 16..M-1 in B tmm7; C tmm0 / tmm1 = the weight
// tile (A tmm4) times either half. Every output element is the same tile arithmetic as in
// the narrow kernel, so a row's bits still do not depend on M.
void configure_wide(int M1) {
  TileConfig cfg;
  for (int t : {0, 1, 4, 6, 7}) cfg.rows[t] = kTileRows;
  cfg.colsb[0] = cfg.colsb[6] = kTileRows * 4;
  cfg.colsb[1] = cfg.colsb[7] = static_cast<uint16_t>(M1 * 4);
  cfg.colsb[4] = kTileK * 2;
  load_tile_config(cfg);
}

// One 16-row weight tile from n, all M = 16 + M1 rows.
void tile1_wide(const uint16_t* xp0, const uint16_t* xp1, const uint16_t* w, int64_t K, int M1,
                const uint16_t* bias, int64_t n, uint16_t* y, int64_t ys) {
  _tile_zero(0);
  _tile_zero(1);
  const uint16_t* w0 = w + n * K;
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, xp0 + k * kTileRows, kTileRows * 4);
    _tile_loadd(7, xp1 + k * M1, M1 * 4);
    _tile_loadd(4, w0 + k, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  alignas(64) float c[2][kTileRows * kMaxRows];
  _tile_stored(0, c[0], kTileRows * 4);
  _tile_stored(1, c[1], M1 * 4);
  finish(c[0], kTileRows, bias, n, y, ys);
  finish(c[1], M1, bias, n, y + kTileRows * ys, ys);
}

// B tiles of M rows of x: for each 32-k chunk, 16 rows of M (x[m][k + 2p], x[m][k + 2p + 1])
// pairs.
std::vector<uint16_t> pack_x(const uint16_t* x, int64_t xs, int M, int64_t K) {
  std::vector<uint16_t> xp(static_cast<size_t>(K) * M);
  for (int64_t k = 0; k < K; k += 2)
    for (int m = 0; m < M; ++m) {
      const int64_t at = (k / kTileK) * kTileK * M + ((k % kTileK) / 2) * 2 * M + 2 * m;
      xp[at] = x[m * xs + k];
      xp[at + 1] = x[m * xs + k + 1];
    }
  return xp;
}

// More than 32 rows (an MoE expert's run in a prefill step): x packed in 16-row groups (the
// last zero-padded), two weight tiles x two groups per pass over K (C tmm0-3, A tmm4-5, B
// tmm6-7). A pair of weight tiles (32 x K) is read from memory once and multiplied with every
// group while it sits in this core's cache; calling the 32-row kernel per piece read the whole
// weight once per piece. Every output element is the narrow kernels' arithmetic (C zeroed,
// one tile product per 32 k ascending, finish), so a row's bits still do not depend on M.
void configure_block() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;  // B: 16 k-pairs; A and C: 16 weight rows
    cfg.colsb[t] = kTileRows * 4;
  }
  cfg.colsb[4] = cfg.colsb[5] = kTileK * 2;
  load_tile_config(cfg);
}

// Group g of x (rows 16g .. 16g + 15, zeros past M) as pack_x lays out 16 rows: a (k-pair,
// row) dword per 32-bit slot. Groups are independent (threads split them).
void pack_group(const uint16_t* x, int64_t xs, int M, int64_t K, int g, uint16_t* dst) {
  for (int m = 0; m < kTileRows; ++m) {
    const int row = g * kTileRows + m;
    uint32_t* d = reinterpret_cast<uint32_t*>(dst) + m;
    if (row >= M) {
      for (int64_t p = 0; p < K / 2; ++p) d[p * kTileRows] = 0;
      continue;
    }
    const uint16_t* src = x + row * xs;
    for (int64_t p = 0; p < K / 2; ++p) {  // k-pair p of chunk p / 16 lands at row p % 16
      uint32_t v;
      std::memcpy(&v, src + 2 * p, sizeof(v));
      d[p * kTileRows] = v;
    }
  }
}

// Weight tiles n0 (and n0 + 16 when two) times groups g0, g0 + 1 of the packed x; rows past M
// are not written.
void block_2x2(const uint16_t* xp, const uint16_t* w, int64_t K, int M, const uint16_t* bias,
               int64_t n0, bool two, int g0, uint16_t* y, int64_t ys) {
  const int64_t gstride = kTileRows * K;  // packed elements a group
  const uint16_t* b0 = xp + g0 * gstride;
  const uint16_t* b1 = b0 + gstride;
  const uint16_t* a0 = w + n0 * K;
  const uint16_t* a1 = a0 + kTileRows * K;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, b0 + k * kTileRows, kTileRows * 4);
    _tile_loadd(7, b1 + k * kTileRows, kTileRows * 4);
    _tile_loadd(4, a0 + k, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + k, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kTileRows * kTileRows];
  _tile_stored(0, c[0], kTileRows * 4);
  _tile_stored(1, c[1], kTileRows * 4);
  if (two) {
    _tile_stored(2, c[2], kTileRows * 4);
    _tile_stored(3, c[3], kTileRows * 4);
  }
  for (int t = 0; t < (two ? 4 : 2); ++t) {
    const int g = g0 + (t & 1);
    const int rows = std::min(kTileRows, M - g * kTileRows);
    if (rows <= 0) continue;
    finish(c[t], rows, bias, n0 + (t >> 1) * kTileRows, y + g * kTileRows * ys, ys, kTileRows);
  }
}

// Weight rows past the last whole tile: one row at a time (per-row arithmetic, so still
// independent of M).
void tail_rows(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K, int M,
               const uint16_t* bias, int64_t n0, int64_t n1, uint16_t* y, int64_t ys) {
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kTileK)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k),
                               (__m512bh)_mm512_loadu_si512(x + m * xs + k));
      float v = _mm512_reduce_add_ps(acc);
      if (bias) v += bf16_to_f32(bias[n]);
      y[m * ys + n] = f32_to_bf16(v);
    }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

int pf_linear_bf16(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                   int64_t y_stride, int M, int64_t N, int64_t K, int nthreads);  // layers.cpp

// 1 when this build has the AMX product and the OS granted this process the tile state.
int pf_amx_ready() {
  static const int ready = request_amx() ? 1 : 0;
  return ready;
}

// pf_linear_bf16's arguments; -1 (nothing written) for M < 1 or without AMX. Up to 32 rows
// one pass over the weights per call (the decode and verify GEMV); more rows in the blocked
// path (same bits per row).
int pf_linear_bf16_amx(const void* xv, int64_t xs, const void* wv, const void* biasv, void* yv,
                       int64_t ys, int M, int64_t N, int64_t K, int nthreads) {
  if (M < 1 || K <= 0 || !pf_amx_ready()) return -1;
  if (M > kMaxRowsWide && K % kTileK == 0) {
    const auto* x = static_cast<const uint16_t*>(xv);
    const auto* w = static_cast<const uint16_t*>(wv);
    const auto* bias = static_cast<const uint16_t*>(biasv);
    auto* y = static_cast<uint16_t*>(yv);
    const int G = (M + kTileRows - 1) / kTileRows;
    const int G2 = G + (G & 1);  // groups go in pairs: a zero group pads an odd count
    std::vector<uint16_t> xp(static_cast<size_t>(G2) * kTileRows * K);
    const int64_t tiles = N / kTileRows, units = (tiles + 1) / 2;
    const bool par = nthreads > 1 && N * K >= (1 << 16);
#pragma omp parallel num_threads(nthreads) if (par)
    {
#pragma omp for schedule(static)
      for (int g = 0; g < G2; ++g) pack_group(x, xs, M, K, g, xp.data() + g * kTileRows * K);
      configure_block();
      // Rows in chunks of kChunkGroups groups: a chunk's packed x stays in cache while every
      // weight tile pair passes over it (the weights are read once per chunk).
      for (int c0 = 0; c0 < G2; c0 += kChunkGroups) {
        const int c1 = std::min(G2, c0 + kChunkGroups);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u)
          for (int g0 = c0; g0 < c1; g0 += 2)
            block_2x2(xp.data(), w, K, M, bias, 2 * u * kTileRows, 2 * u + 1 < tiles, g0, y,
                      ys);
      }
      _tile_release();
    }
    tail_rows(x, xs, w, K, M, bias, tiles * kTileRows, N, y, ys);
    return 0;
  }
  if (M > kMaxRowsWide) return pf_linear_bf16(xv, xs, wv, biasv, yv, ys, M, N, K, nthreads);
  // Every weight with whole 32-k tiles takes the tiles, small ones too: at one row they cost
  // about what the dot-product GEMV does (192 x 576: 6.5 us against 5.5), at 4 and 32 rows
  // 2-3x and 6-7x less (the dot product's work grows with M, the tiles' hardly), and one path
  // per weight for every M keeps a row's bits independent of M.
  if (K % kTileK != 0)
    return pf_linear_bf16(xv, xs, wv, biasv, yv, ys, M, N, K, nthreads);
  const auto* x = static_cast<const uint16_t*>(xv);
  const auto* w = static_cast<const uint16_t*>(wv);
  const auto* bias = static_cast<const uint16_t*>(biasv);
  auto* y = static_cast<uint16_t*>(yv);
  const bool wide = M > kMaxRows;
  const int M1 = M - kMaxRows;  // rows in the second B tile (wide)
  const std::vector<uint16_t> xp0 = pack_x(x, xs, wide ? kMaxRows : M, K);
  const std::vector<uint16_t> xp1 = wide ? pack_x(x + kMaxRows * xs, xs, M1, K)
                                         : std::vector<uint16_t>();
  const int64_t tiles = N / kTileRows;
  const bool par = nthreads > 1 && N * K >= (1 << 18);
#pragma omp parallel num_threads(nthreads) if (par)
  {
    if (wide)
      configure_wide(M1);
    else
      configure(M);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < tiles; ++u) {
      if (wide)
        tile1_wide(xp0.data(), xp1.data(), w, K, M1, bias, u * kTileRows, y, ys);
      else
        tile1(xp0.data(), w, K, M, bias, u * kTileRows, y, ys);
    }
    _tile_release();
  }
  tail_rows(x, xs, w, K, M, bias, tiles * kTileRows, N, y, ys);
  return 0;
}

}  // extern "C"

#else  // no AMX in this build

extern "C" {
int pf_amx_ready() { return 0; }
int pf_linear_bf16_amx(const void*, int64_t, const void*, const void*, void*, int64_t, int,
                       int64_t, int64_t, int) {
  return -1;
}
}  // extern "C"

#endif
