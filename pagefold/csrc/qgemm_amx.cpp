// Many-row products with GGUF-layout weights (gguf_quant.cpp's layout, unchanged: unsigned
// codes row-major, per output row and weight group of 32 or 16 inputs a scale and a min) on
// int8 activations, on the AMX tile unit (TDPBUSD: unsigned weight codes times signed
// activations, int32 sums).
//
// Why: from a few rows on, the int8-activation GEMV (qgemv_q8.cpp) is compute-bound (a
// vpdpbusd and a float rescale per 64 products a row), while one tile instruction multiplies
// 16 weight rows by 16 activation rows over a whole weight group (at 32 rows 3-5x the GEMV's
// speed in isolation on a Sapphire Rapids Xeon, one thread).
//
// The activations are quantized per row and group of 32 as qgemv_q8.cpp quantizes them
// (q8_act.h: the same integers q and scales d), and each output is, per weight group h in
// order (h within activation group g(h)), with the integer dot product exact in int32:
//   acc = fma(float(dot(q[r, h], code[o, h])), scale[o, h] * d[r, g(h)], acc)
//   acc = fma(min[o, h], d[r, g(h)] * sum(q[r, h]), acc)
// from acc = 0: float32 rounding of the same function qgemv_q8.cpp computes (its sums run in
// another order, so the two agree to float32 rounding, not bitwise). Each output element is
// one thread's chain in that fixed order, whichever rows share the call: a row's bits do not
// depend on the rows beside it, nor on the thread count.
//
// Rows below `g_from` (pf_qgemm_q8_from; 16) take qgemv_q8.cpp's form instead, so the bits of
// a call depend on whether it has at least `g_from` rows, as a product above a GEMV's rows
// takes another path. Why 16, not the 4 rows where the tile form starts to win (at 1-2 rows
// the VNNI GEMV was 1.2-2.2x the tile form's speed, at 4 rows 0.7-0.9x, at 8 rows 0.5x, same
// Xeon): a speculative verify step's rows (1 + k a request) must keep the bits of a decode
// step's one row, so that greedy tokens and logprobs with speculation on equal those with it
// off (tests/spec_decode/test_bf16_verify.py); below 16 rows they do, as the bf16 GEMVs keep
// one form up to their 32 rows. Batches of 16 and more (where the tiles are 3-5x) keep them.
//
// Layout in the tile unit: A (16 weight rows x one weight group of codes, the codes as
// stored: 8-bit codes straight from the weight, 4-bit codes unpacked per 16-row strip into a
// buffer of bytes), B (the group's activations of 16 rows, 4 inputs a row per 4 bytes: packed
// once per call), C (16 weight rows x 16 activation rows, int32), then the float rescale above
// with one vector of 16 activation rows per weight row.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "q8_act.h"

extern "C" int pf_amx_ready();  // gemv_amx.cpp

namespace {

constexpr int64_t kMaxRows = 64;  // as pf_qgemv_affine_q8
int g_from = 16;                  // the least rows this form takes (below: qgemv_q8.cpp's)

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(PF_AVX512)
#define PF_QGEMM_AMX 1

constexpr int kT = 16;  // weight rows per strip (A / C tile rows), activation rows per half

// tmm0 / tmm1: C (16 x 16 int32); tmm4 / tmm5: A (16 weight rows x W codes); tmm6 / tmm7: B
// (W / 4 rows of 16 x 4 activations): even and odd groups.
void configure(int64_t W) {
  pf::TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = kT, cfg.colsb[t] = kT * 4;
  for (int t : {4, 5}) cfg.rows[t] = kT, cfg.colsb[t] = static_cast<uint16_t>(W);
  for (int t : {6, 7}) cfg.rows[t] = static_cast<uint8_t>(W / 4), cfg.colsb[t] = kT * 4;
  load_tile_config(cfg);
}

// One row's 4-bit codes (GGUF order per group of 32: byte j holds input j low, j + 16 high)
// as k bytes in input order.
void unpack4(const uint8_t* src, int64_t k, uint8_t* dst) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  // 16-byte quarters: [lo0 hi0 lo1 hi1] and [lo2 hi2 lo3 hi3] of the lo / hi nibbles
  const __m512i i0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i i1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t bytes = k / 2;
  for (int64_t b = 0; b < bytes; b += 64) {
    const int64_t left = std::min<int64_t>(64, bytes - b);
    const __mmask64 lm = left == 64 ? ~0ull : (1ull << left) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(lm, src + b);
    const __m512i lo = _mm512_and_si512(v, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    const int64_t out = 2 * left;  // bytes written: 32, 64, 96 or 128
    const __mmask64 m0 = out >= 64 ? ~0ull : (1ull << out) - 1;
    _mm512_mask_storeu_epi8(dst + 2 * b, m0, _mm512_permutex2var_epi64(lo, i0, hi));
    if (out > 64) {
      const __mmask64 m1 = out == 128 ? ~0ull : (1ull << (out - 64)) - 1;
      _mm512_mask_storeu_epi8(dst + 2 * b + 64, m1, _mm512_permutex2var_epi64(lo, i1, hi));
    }
  }
}

// The permutations of transpose16's stages (block sizes 8, 4, 2, 1): lane l of the first
// row of a pair takes (l & s ? the second row's l - s : its own l), of the second (l & s ?
// the second's l : the first's l + s).
struct Swaps {
  alignas(64) int32_t lo[4][16], hi[4][16];
  constexpr Swaps() : lo(), hi() {
    for (int t = 0, s = 8; t < 4; ++t, s /= 2)
      for (int l = 0; l < 16; ++l) {
        lo[t][l] = (l & s) ? 16 + l - s : l;
        hi[t][l] = (l & s) ? 16 + l : l + s;
      }
  }
};
constexpr Swaps kSwaps;

// r (16 x 16 floats) transposed in place: the off-diagonal blocks of 8, 4, 2 and 1 swapped.
// The loops are unrolled (here and in rescale) so that the caller's accumulators stay in
// registers: an array indexed by a loop variable lives on the stack, and every group's
// rescale then loaded and stored all 16 (10% of a 32-row product's time).
inline void transpose16(__m512 (&r)[kT]) {
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    const int s = 8 >> t;
    const __m512i il = _mm512_load_si512(kSwaps.lo[t]), ih = _mm512_load_si512(kSwaps.hi[t]);
#pragma GCC unroll 16
    for (int j = 0; j < kT; ++j) {
      if (j & s) continue;
      const __m512 a = r[j], c = r[j + s];
      r[j] = _mm512_permutex2var_ps(a, il, c);
      r[j + s] = _mm512_permutex2var_ps(a, ih, c);
    }
  }
}

// The rows' int8 activations in B-tile order: per half of 16 rows and weight group h, W / 4
// tile rows of 64 bytes (row r's inputs 4j..4j+3 at bytes 4r..4r+3); per half and h the 16
// rows' d[r, g(h)] and d[r, g(h)] * sum(q[r, h]) (zero past the last row). Over a half, tile
// row j of group h is 4-byte word h * W / 4 + j of every row: the half's B tiles are the
// transpose of its rows' (16 x k / 4) words, moved 16 x 16 words at a time.
//
// Filled in two passes that the call's threads share (a serial fill was ~15% of a 2-thread
// 576 x 576 product at 32 rows): `quantize` per padded row (rows(), any order), then
// `transpose` per block of 16 words of a half (blocks(), any order, after every row).
struct Packed {
  int64_t m, k, W, H, halves;
  std::vector<int8_t> q, b;
  std::vector<float> rd, rds;  // per padded row and group h: d and d * sum (row-major)
  std::vector<float> d, dsum;  // the same per half and h, 16 rows a group (the tile order)

  Packed(int64_t rows, int64_t cols, int64_t wg)
      : m(rows), k(cols), W(wg), H(cols / wg), halves((rows + kT - 1) / kT),
        q(static_cast<size_t>(halves * kT * cols)),
        b(static_cast<size_t>(halves * cols * kT)),
        rd(static_cast<size_t>(halves * kT * H), 0.f), rds(rd.size(), 0.f),
        d(rd.size(), 0.f), dsum(rd.size(), 0.f) {}

  int64_t rows() const { return halves * kT; }
  int64_t blocks() const { return halves * ((k / 4 + kT - 1) / kT); }

  // Padded row `row` of x (zero codes, scales and sums past the m real rows). Each row
  // writes only its own lines (rd / rds row-major): the threads share no cache line.
  void quantize(const float* x, int64_t row) {
    int8_t* qr = q.data() + row * k;
    if (row >= m) {
      std::memset(qr, 0, static_cast<size_t>(k));
      return;
    }
    const int64_t per = 32 / W;
    const float* xr = x + row * k;
    for (int64_t g = 0; g < k / 32; ++g) {
      int32_t sum[2];
      const float dg = pf::q8_group(xr + g * 32, qr + g * 32, W, sum);
      for (int64_t p = 0; p < per; ++p) {
        rd[row * H + g * per + p] = dg;
        rds[row * H + g * per + p] = dg * static_cast<float>(sum[p]);
      }
    }
  }

  // Block `t` of the B tiles: words w0..w0 + 15 of half t / (blocks a half), and the d / dsum
  // of the groups those words hold.
  void transpose(int64_t t) {
    const int64_t words = k / 4, per_half = (words + kT - 1) / kT;
    const int64_t half = t / per_half, w0 = (t % per_half) * kT;
    const int64_t wn = std::min<int64_t>(kT, words - w0);  // k is a multiple of 32: 8 or 16
    const __mmask16 mk = static_cast<__mmask16>((1u << wn) - 1);
    const int8_t* qh = q.data() + half * kT * k;
    int8_t* bh = b.data() + half * words * 64;
    __m512 r[kT];
#pragma GCC unroll 16
    for (int i = 0; i < kT; ++i)
      r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mk, qh + i * k + w0 * 4));
    transpose16(r);
    for (int64_t j = 0; j < wn; ++j) _mm512_storeu_ps(bh + (w0 + j) * 64, r[j]);
    for (int64_t h = w0 * 4 / W; h < (w0 + wn) * 4 / W; ++h)
      for (int i = 0; i < kT; ++i) {
        d[(half * H + h) * kT + i] = rd[(half * kT + i) * H + h];
        dsum[(half * H + h) * kT + i] = rds[(half * kT + i) * H + h];
      }
  }
};

// A strip's float32 scales (or mins) in chunks of kChunk groups: weight row i's group h at
// (h / kChunk) * kT * kChunk + i * kChunk + h % kChunk. Row i's value of group h sits a
// constant i * kChunk floats from row 0's, so the rescale's 16 broadcasts share one address
// register (a runtime row stride took one register a row and spilled the accumulators), and
// filling it is a widening copy, no transpose.
constexpr int64_t kChunk = 64;

inline int64_t chunk_at(int64_t h) { return (h / kChunk) * kT * kChunk + h % kChunk; }

// acc[i] (16 activation rows of weight row i) += group h's C tile (c: 16 x 16 int32), rescaled
// (sc / mn: row 0's scale and min of group h, row i's i * kChunk further).
inline void rescale(const int32_t* c, const float* sc, const float* mn, int64_t h,
                    const float* dv, const float* dsv, __m512 (&acc)[kT]) {
  const __m512 d = _mm512_loadu_ps(dv + h * kT);
  const __m512 ds = _mm512_loadu_ps(dsv + h * kT);
#pragma GCC unroll 16
  for (int i = 0; i < kT; ++i) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * kT));
    acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(sc[i * kChunk])), acc[i]);
    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(mn[i * kChunk]), ds, acc[i]);
  }
}

// Rows [16 half, +16) of y's columns o0..o0 + valid - 1 from acc (weight row i, activation
// row r at acc[i][r]; clobbered).
inline void put(__m512 (&acc)[kT], int64_t half, int64_t m, int64_t o0, int valid, float* y,
                int64_t ldy) {
  transpose16(acc);
  const int64_t rows = std::min<int64_t>(kT, m - half * kT);
  const __mmask16 mk = static_cast<__mmask16>((1u << valid) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < kT; ++r)
    if (r < rows) _mm512_mask_storeu_ps(y + (half * kT + r) * ldy + o0, mk, acc[r]);
}

// One strip of 16 weight rows (A: codes of row i at a + i * lda; sc / mn: float32 scales and
// mins in chunk_at order; `valid` rows of the strip are real) times every
// activation row, 16 rows (a half) at a time: y's columns o0..o0 + valid - 1. `next`
// (`next_bytes`; null: none) is the next strip's codes as stored, prefetched a few lines a
// group while this strip computes: a model step's weights stream from memory, and a strip's
// codes are otherwise first read by its unpacking (4-bit) or tile loads (8-bit), which then
// wait on memory (with it, a SmolLM2 step's products on 32 rows took 20% less time).
//
// The tile unit runs its instructions in order, so each group's tiles go in one of two sets
// (even groups tmm4 A / tmm6 B / tmm0 C, odd ones tmm5 / tmm7 / tmm1): two groups' products
// are in flight, h + 2 issued as soon as h's C is stored (its set free again), so the vector
// units rescale group h while the tile unit works on h + 1 and h + 2 (one group ahead, h + 1
// issued just before h's store, measured 3% slower on a SmolLM2 pass at 32 rows).
void strip(const Packed& p, const uint8_t* a, int64_t lda, const float* sc,
           const float* mn, int64_t o0, int valid, float* y, int64_t ldy,
           const uint8_t* next, int64_t next_bytes) {
  const int64_t W = p.W, H = p.H;
  // the next strip's codes, fetched while this one computes: lines spread over the groups
  const int64_t lines = (next_bytes + 63) / 64, per = (lines + H - 1) / H;
  int64_t line = 0;
  alignas(64) int32_t c[2][kT * kT];
  for (int64_t half = 0; half < p.halves; ++half) {
    const int8_t* b = p.b.data() + half * H * W * kT;
    const float* dv = p.d.data() + half * H * kT;
    const float* dsv = p.dsum.data() + half * H * kT;
    __m512 acc[kT];
#pragma GCC unroll 16
    for (int i = 0; i < kT; ++i) acc[i] = _mm512_setzero_ps();
    const auto issue = [&](int64_t h) {
      if ((h & 1) == 0) {
        _tile_loadd(4, a + h * W, lda);
        _tile_loadd(6, b + h * W * kT, 64);
        _tile_zero(0);
        _tile_dpbusd(0, 4, 6);
      } else {
        _tile_loadd(5, a + h * W, lda);
        _tile_loadd(7, b + h * W * kT, 64);
        _tile_zero(1);
        _tile_dpbusd(1, 5, 7);
      }
    };
    issue(0);
    if (H > 1) issue(1);
    for (int64_t h = 0; h < H; ++h) {
      if (half == 0 && next)
        for (int64_t e = 0; e < per && line < lines; ++e, ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + line * 64), _MM_HINT_T0);
      if ((h & 1) == 0)
        _tile_stored(0, c[0], 64);
      else
        _tile_stored(1, c[1], 64);
      if (h + 2 < H) issue(h + 2);
      rescale(c[h & 1], sc + chunk_at(h), mn + chunk_at(h), h, dv, dsv, acc);
    }
    put(acc, half, p.m, o0, valid, y, ldy);
  }
}

// Whether the tile form takes `bits`-bit codes in weight groups of `group`.
bool takes(int32_t bits, int64_t group) {
  return pf_amx_ready() && ((bits == 4 && group == 32) || (bits >= 5 && bits <= 8 &&
                                                           (group == 32 || group == 16)));
}
#else
bool takes(int32_t, int64_t) { return false; }
#endif

}  // namespace

extern "C" {

// Set the least rows the tile form takes (fewer: qgemv_q8.cpp's form); returns the old value.
// Tests set 1 to check the tile form at every row count.
int pf_qgemm_q8_from(int32_t rows) {
  const int old = g_from;
  g_from = std::max(1, rows);
  return old;
}

// Whether this build and CPU run the tile form for `bits`-bit codes in groups of `group`.
int pf_qgemm_q8_takes(int32_t bits, int64_t group) { return takes(bits, group) ? 1 : 0; }

// pf_qgemv_affine_q8's arguments, layout and return codes (1: not taken, nothing written):
// rows below g_from run pf_qgemv_affine_q8 itself, g_from and more the tile form.
int pf_qgemm_affine_q8(const float* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                       int32_t bits, int64_t group, const void* scale, const void* mins,
                       int32_t half, float* y, int64_t ldy, int32_t nthreads) {
  if (m < 1 || m > kMaxRows || k < 32 || k % 32 || n < 1 || ldy < n || !takes(bits, group))
    return 1;
  if (m < g_from)
    return pf_qgemv_affine_q8(x, m, k, n, codes, bits, group, scale, mins, half, y, ldy,
                              nthreads);
#if defined(PF_QGEMM_AMX)
  Packed p(m, k, group);
  const int64_t H = k / group, row_bytes = bits == 4 ? k / 2 : k;
  const int64_t strips = (n + kT - 1) / kT;
  const bool par = n >= 64 && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    configure(group);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows(); ++r) p.quantize(x, r);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.blocks(); ++t) p.transpose(t);
    std::vector<uint8_t> buf(static_cast<size_t>(kT * k), 0);
    const int64_t chunks = (H + kChunk - 1) / kChunk;
    std::vector<float> sc(static_cast<size_t>(chunks * kT * kChunk), 0.f), mn(sc.size(), 0.f);
#pragma omp for schedule(static)
    for (int64_t s = 0; s < strips; ++s) {
      const int64_t o0 = s * kT;
      const int valid = static_cast<int>(std::min<int64_t>(kT, n - o0));
      // The strip's scales and mins as float32 in chunk_at's order (zero past the last
      // weight row).
      for (int t = 0; t < 2; ++t) {
        const void* src = t ? mins : scale;
        float* dst = (t ? mn : sc).data();
        for (int i = 0; i < kT; ++i)
          for (int64_t h0 = 0; h0 < H; h0 += kT) {
            const int64_t hn = std::min<int64_t>(kT, H - h0);
            const __mmask16 mk = static_cast<__mmask16>((1u << hn) - 1);
            const int64_t at = (o0 + i) * H + h0;
            __m512 v = _mm512_setzero_ps();
            if (i < valid && half)
              v = _mm512_cvtph_ps(
                  _mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(src) + at));
            else if (i < valid)
              v = _mm512_maskz_loadu_ps(mk, static_cast<const float*>(src) + at);
            _mm512_mask_storeu_ps(dst + chunk_at(h0) + i * kChunk, mk, v);
          }
      }
      const uint8_t* a = codes + o0 * row_bytes;
      int64_t lda = row_bytes;
      if (bits == 4 || valid < kT) {  // codes as bytes in a strip buffer (zero rows past n)
        for (int i = 0; i < kT; ++i) {
          uint8_t* dst = buf.data() + i * k;
          if (i >= valid)
            std::memset(dst, 0, k);
          else if (bits == 4)
            unpack4(a + i * row_bytes, k, dst);
          else
            std::memcpy(dst, a + i * row_bytes, k);
        }
        a = buf.data();
        lda = k;
      }
      const bool more = s + 1 < strips;  // (the static schedule's next strip, mostly)
      strip(p, a, lda, sc.data(), mn.data(), o0, valid, y, ldy,
            more ? codes + (o0 + kT) * row_bytes : nullptr,
            more ? std::min<int64_t>(kT, n - o0 - kT) * row_bytes : 0);
    }
    _tile_release();
  }
  return 0;
#else
  return 1;
#endif
}

}  // extern "C"
