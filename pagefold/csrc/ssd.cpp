// Mamba-2 chunked SSD scan over a flat varlen prefill batch (the compiled form of
// pagefold/layers/mamba/ssd.py's ssd_chunked, which stays the tested torch fallback).
//
// Same chunking and the same steps as the torch form, per (sequence, head), all float32:
//   each sequence cut into chunks of L tokens from its start (the last one may be short);
//   a_l = dt_l A, acum = cumsum(a), seg[l][s] = a_{s+1} + ... + a_l (summed from s+1 up, as
//   the masked cumsum does), decay = exp(seg) for s <= l;
//   X_s = dt_s x_s;  Y_l = sum_{s<=l} (C_l . B_s) decay[l][s] X_s + exp(acum_l) (C_l h_start);
//   h_end = exp(acum_last) h_start + sum_s decay[last][s] X_s B_s^T;  y = Y + D x.
// Sums run in another order than torch's matmuls, so results agree up to float32 rounding;
// values below FLT_MIN (~1e-38) are flushed to zero.
//
// Two parallel phases: C_l . B_s of every chunk and group (shared by the group's heads), then
// the recurrence over chunks per (sequence, head) with the state held transposed, (N, P), so
// every product is a row update over P contiguous floats.
//
// Captures (prefix-cache checkpoints): the state right after flat token cap_tok[m] goes to
// cap_out[m] (H, P, N): a token ending its chunk copies the chunk-end state; a token inside a
// chunk takes that chunk's state passing with its own row for the last one. Paged captures
// (a Pages destination instead of cap_out) go straight into their checkpoint's pages, in
// non-temporal stores: written once here, read only by a later prefix-cache hit.

#include <vector>

#include "common.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace pf {
namespace {

#if defined(PF_AVX512)
// R rows x NV 16-float vectors of out = beta * out (beta 0: zeros) + w v, in registers.
template <int R, int NV>
inline void mk(float* out, int ldo, float beta, const float* w, int ldw, const float* v,
               int ldv, int K) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i)
      acc[r][i] = beta == 0.0f ? _mm512_setzero_ps()
                               : _mm512_mul_ps(_mm512_set1_ps(beta),
                                               _mm512_loadu_ps(out + r * ldo + 16 * i));
  for (int k = 0; k < K; ++k) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_ps(v + static_cast<int64_t>(k) * ldv + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * ldw + k]);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(b, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + r * ldo + 16 * i, acc[r][i]);
}

template <int R>
inline void mk_cols(float* out, float beta, const float* w, int ldw, const float* v, int K,
                    int P) {
  int p = 0;
  for (; p + 64 <= P; p += 64) mk<R, 4>(out + p, P, beta, w, ldw, v + p, P, K);
  for (; p < P; p += 16) mk<R, 1>(out + p, P, beta, w, ldw, v + p, P, K);
}
#endif

// out[r][0:P] = beta * out[r][0:P] + sum_k w[r * ldw + k] * v[k * P + 0:P] for r < R, k < K
// (beta 0: out is not read). v is K rows of P floats.
inline void rows_gemm(float* out, int R, float beta, const float* w, int ldw, const float* v,
                      int K, int P) {
#if defined(PF_AVX512)
  if (P % 16 == 0) {
    int r = 0;
    for (; r + 4 <= R; r += 4)
      mk_cols<4>(out + static_cast<int64_t>(r) * P, beta, w + r * ldw, ldw, v, K, P);
    float* o = out + static_cast<int64_t>(r) * P;
    const float* wr = w + r * ldw;
    switch (R - r) {
      case 3: mk_cols<3>(o, beta, wr, ldw, v, K, P); break;
      case 2: mk_cols<2>(o, beta, wr, ldw, v, K, P); break;
      case 1: mk_cols<1>(o, beta, wr, ldw, v, K, P); break;
      default: break;
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    float* a = out + static_cast<int64_t>(r) * P;
    if (beta == 0.0f)
      std::memset(a, 0, sizeof(float) * P);
    else
      for (int p = 0; p < P; ++p) a[p] *= beta;
    for (int k = 0; k < K; ++k) {
      const float c = w[r * ldw + k];
      const float* vk = v + static_cast<int64_t>(k) * P;
#pragma omp simd
      for (int p = 0; p < P; ++p) a[p] += c * vk[p];
    }
  }
}

// Where paged captures go: capture m is the byte range [off, off + H*P*N*4) of the state
// laid over pages[m * np .. m * np + np) of raw (pb bytes a page).
struct Pages {
  uint8_t* raw;
  int64_t pb;
  const int64_t* pages;
  int np;
  int64_t off;
};

// out (P, N) = the transpose of st (N, P): 4 x 4 tiles through SSE registers where both sides
// are multiples of 4 (a state leaves the kernel this way at every capture and at the end).
inline void transpose(const float* st, int N, int P, float* out) {
#if defined(__SSE__)
  if (N % 4 == 0 && P % 4 == 0) {
    for (int n = 0; n < N; n += 4)
      for (int p = 0; p < P; p += 4) {
        __m128 r0 = _mm_loadu_ps(st + n * P + p), r1 = _mm_loadu_ps(st + (n + 1) * P + p);
        __m128 r2 = _mm_loadu_ps(st + (n + 2) * P + p), r3 = _mm_loadu_ps(st + (n + 3) * P + p);
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
        _mm_storeu_ps(out + p * N + n, r0);
        _mm_storeu_ps(out + (p + 1) * N + n, r1);
        _mm_storeu_ps(out + (p + 2) * N + n, r2);
        _mm_storeu_ps(out + (p + 3) * N + n, r3);
      }
    return;
  }
#endif
  for (int p = 0; p < P; ++p)
    for (int n = 0; n < N; ++n) out[p * N + n] = st[n * P + p];
}

template <typename TX, typename T>
void ssd_chunked(const TX* x, int64_t x_stride, const T* B, const T* C, int64_t bc_stride,
                 const float* dt, int64_t dt_stride, const float* A, const float* D,
                 const float* init, float* final_state, const int64_t* cu, int64_t S, float* y,
                 int H, int P, int G, int N, int L, const int64_t* cap_tok, float* cap_out,
                 int64_t M, const Pages* cap_pages, int nthreads) {
  // Chunks of every sequence: (sequence, first token, tokens).
  struct Chunk {
    int64_t seq, t0;
    int n;
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(S + 1);
  for (int64_t s = 0; s < S; ++s) {
    first_chunk[s] = static_cast<int64_t>(chunks.size());
    for (int64_t t = cu[s]; t < cu[s + 1]; t += L)
      chunks.push_back({s, t, static_cast<int>(cu[s + 1] - t < L ? cu[s + 1] - t : L)});
  }
  first_chunk[S] = static_cast<int64_t>(chunks.size());
  const int64_t nc = static_cast<int64_t>(chunks.size());
  const int64_t LL = static_cast<int64_t>(L) * L;
  // cb[(chunk * G + g) * L * L + l * L + s] = C_l . B_s (s <= l) of group g.
  std::vector<float> cb(static_cast<size_t>(nc * G) * LL);
  const int hg = H / G;
  const int64_t state_sz = static_cast<int64_t>(P) * N;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
#if defined(__SSE__)
    // Strong decays drive terms and states below FLT_MIN; subnormal arithmetic is ~100x
    // slower on x86, so this thread flushes them to zero (restored at the end).
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
#endif
    std::vector<float> bf(static_cast<size_t>(L) * N), cf(static_cast<size_t>(L) * N);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nc * G; ++item) {
      const Chunk& ch = chunks[item / G];
      const int g = static_cast<int>(item % G);
      for (int l = 0; l < ch.n; ++l) {
        to_float<T>(B + (ch.t0 + l) * bc_stride + static_cast<int64_t>(g) * N, &bf[l * N], N);
        to_float<T>(C + (ch.t0 + l) * bc_stride + static_cast<int64_t>(g) * N, &cf[l * N], N);
      }
      float* out = cb.data() + item * LL;
      for (int l = 0; l < ch.n; ++l)
        for (int s = 0; s <= l; ++s) {
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int n = 0; n < N; ++n) acc += cf[l * N + n] * bf[s * N + n];
          out[l * L + s] = acc;
        }
    }

    // Per-thread buffers of one (sequence, head). hx: the state transposed (N, P) followed
    // by X (L, P), so Y = [exp(acum) C | decay * CB] [h; X] is one product per row block.
    const int K = N + L;
    std::vector<float> hx(static_cast<size_t>(K) * P), Y(static_cast<size_t>(L) * P);
    std::vector<float> dec(LL), a(L), eac(L), wy(static_cast<size_t>(L) * K);
    std::vector<float> bt(static_cast<size_t>(N) * L), wb(static_cast<size_t>(N) * L);
    std::vector<float> cap(state_sz), tr(cap_pages ? state_sz : 0);
    float* hT = hx.data();
    float* X = hx.data() + state_sz;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < S * H; ++item) {
      const int64_t s = item / H;
      const int h = static_cast<int>(item % H), g = h / hg;
      const float Ah = A[h], Dh = D ? D[h] : 0.0f;
      const float* h0 = init + (s * H + h) * state_sz;
      for (int p = 0; p < P; ++p)
        for (int n = 0; n < N; ++n) hT[n * P + p] = h0[p * N + n];
      for (int64_t ci = first_chunk[s]; ci < first_chunk[s + 1]; ++ci) {
        const Chunk& ch = chunks[ci];
        const int n_tok = ch.n;
        float run = 0.0f;
        for (int l = 0; l < n_tok; ++l) {
          const int64_t t = ch.t0 + l;
          const float d = dt[t * dt_stride + h];
          a[l] = d * Ah;
          run += a[l];
          eac[l] = std::exp(run);
          const TX* xr = x + t * x_stride + static_cast<int64_t>(h) * P;
#pragma omp simd
          for (int p = 0; p < P; ++p) X[l * P + p] = load<TX>(xr, p) * d;
          const int64_t bc = t * bc_stride + static_cast<int64_t>(g) * N;
          float* wr = wy.data() + static_cast<int64_t>(l) * K;
          to_float<T>(C + bc, wr, N);
          for (int n = 0; n < N; ++n) {
            wr[n] *= eac[l];
            bt[n * L + l] = load<T>(B + bc, n);
          }
        }
        // seg[l][s] = a_{s+1} + ... + a_l, column by column as the masked cumsum; then
        // decay = exp(seg) row by row (vectorised; 0 above the diagonal).
        for (int j = 0; j < n_tok; ++j) {
          float seg = 0.0f;
          dec[j * L + j] = 0.0f;
          for (int i = j + 1; i < n_tok; ++i) {
            seg += a[i];
            dec[i * L + j] = seg;
          }
        }
        const float* cbc = cb.data() + (ci * G + g) * LL;
        for (int l = 0; l < n_tok; ++l) {
          float* dr = dec.data() + static_cast<int64_t>(l) * L;
          float* sr = wy.data() + static_cast<int64_t>(l) * K + N;
          const float* cr = cbc + static_cast<int64_t>(l) * L;
#pragma omp simd
          for (int j = 0; j < n_tok; ++j) {
            const float e = j <= l ? exp_any(dr[j]) : 0.0f;
            dr[j] = e;
            sr[j] = cr[j] * e;
          }
        }
        // Y rows l0.. (blocks of 4): only the X rows up to the block's last row contribute.
        for (int l0 = 0; l0 < n_tok; l0 += 4) {
          const int R = n_tok - l0 < 4 ? n_tok - l0 : 4;
          rows_gemm(Y.data() + static_cast<int64_t>(l0) * P, R, 0.0f,
                    wy.data() + static_cast<int64_t>(l0) * K, K, hx.data(), N + l0 + R, P);
        }
        for (int l = 0; l < n_tok; ++l) {
          const int64_t t = ch.t0 + l;
          const TX* xr = x + t * x_stride + static_cast<int64_t>(h) * P;
          float* yo = y + (t * H + h) * P;
#pragma omp simd
          for (int p = 0; p < P; ++p) yo[p] = Y[l * P + p] + load<TX>(xr, p) * Dh;
        }
        // State passing with row r for the last: exp(acum_r) h + sum_{j<=r} decay[r][j] X_j B_j^T
        // (captures inside the chunk from the chunk-start state, then the chunk end).
        auto pass = [&](int r, float* out) {
          for (int n = 0; n < N; ++n)
            for (int j = 0; j <= r; ++j) wb[n * L + j] = dec[r * L + j] * bt[n * L + j];
          if (out != hT) std::memcpy(out, hT, sizeof(float) * state_sz);
          rows_gemm(out, N, eac[r], wb.data(), L, X, r + 1, P);
        };
        auto put = [&](const float* st, int64_t m) {
          float* co = cap_pages ? tr.data() : cap_out + (m * H + h) * state_sz;
          transpose(st, N, P, co);
          if (cap_pages)
            page_copy(cap_pages->raw, cap_pages->pages + m * cap_pages->np, cap_pages->pb,
                      cap_pages->off + h * state_sz * static_cast<int64_t>(sizeof(float)),
                      reinterpret_cast<uint8_t*>(co), state_sz * sizeof(float), true, true);
        };
        const int last = n_tok - 1;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t r = cap_tok[m] - ch.t0;
          if (r < 0 || r >= last) continue;
          pass(static_cast<int>(r), cap.data());
          put(cap.data(), m);
        }
        pass(last, hT);
        for (int64_t m = 0; m < M; ++m)
          if (cap_tok[m] == ch.t0 + last) put(hT, m);
      }
      transpose(hT, N, P, final_state + (s * H + h) * state_sz);
    }
    if (cap_pages) stream_fence();
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// Chunked SSD over S sequences (cu: (S+1,) int64 token bounds of the T = cu[S] tokens).
// Row t of x (H*P, in x_dtype: 0 float32, 1 bf16), of B and C (G*N each; the same row stride
// bc_stride; in bc_dtype), of dt (H, float32: already discretised). A (H,) the negative decay, D (H,) or NULL,
// init (S, H, P, N) float32 (not modified), final_state (S, H, P, N) float32, y (T, H, P)
// float32 contiguous; L the chunk length. Captures: cap_tok (M,) flat token indices, and
// either cap_out (M, H, P, N) float32 or, when cap_raw is not NULL, their pages: capture m's
// (H, P, N) float32 at byte cap_off of the state over cap_pages[m * cap_np ..] (cap_np page
// ids) of cap_raw (cap_pb bytes a page). Returns -1 for shapes it does not handle.
int pf_ssd_chunked(int x_dtype, int bc_dtype, const void* x, int64_t x_stride, const void* B,
                   const void* C, int64_t bc_stride, const float* dt, int64_t dt_stride,
                   const float* A, const float* D, const float* init, float* final_state,
                   const int64_t* cu, int64_t S, float* y, int H, int P, int G, int N, int L,
                   const int64_t* cap_tok, float* cap_out, int64_t M, void* cap_raw,
                   int64_t cap_pb, const int64_t* cap_pages, int cap_np, int64_t cap_off,
                   int nthreads) {
  const bool paged = cap_raw != nullptr;
  if (x_dtype < 0 || x_dtype > 1 || bc_dtype < 0 || bc_dtype > 1 || G < 1 || H % G || L < 1 ||
      P < 1 || N < 1 || S < 0 ||
      (M > 0 && (cap_tok == nullptr || (cap_out == nullptr && !paged))) ||
      (paged && (cap_pages == nullptr || cap_pb < 1 || cap_np < 1 || cap_off < 0 ||
                 cap_off + static_cast<int64_t>(H) * P * N * 4 > cap_np * cap_pb)))
    return -1;
  const Pages pg{static_cast<uint8_t*>(cap_raw), cap_pb, cap_pages, cap_np, cap_off};
#define PF_SSD(TX, TB)                                                                      \
  ssd_chunked<TX, TB>(static_cast<const TX*>(x), x_stride, static_cast<const TB*>(B),       \
                      static_cast<const TB*>(C), bc_stride, dt, dt_stride, A, D, init,      \
                      final_state, cu, S, y, H, P, G, N, L, cap_tok, cap_out, M,            \
                      paged ? &pg : nullptr, nthreads)
  if (x_dtype == 0 && bc_dtype == 0)
    PF_SSD(float, float);
  else if (x_dtype == 0)
    PF_SSD(float, uint16_t);
  else if (bc_dtype == 0)
    PF_SSD(uint16_t, float);
  else
    PF_SSD(uint16_t, uint16_t);
#undef PF_SSD
  return 0;
}

}  // extern "C"
