// The Gated DeltaNet layer (conv + delta rule) over a flat varlen batch, on paged states.
//
// Same steps and roundings as the torch path (causal_conv1d_* -> split -> gdn_* -> o in T):
//   conv over [window | x] (float32), SiLU, rounded to T; the window slides by one token;
//   q, k L2-normalised (eps 1e-6), q scaled; value head h uses key head h / (Hv / Hk);
//   g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = T(sigmoid(b));
//   per token: S <- exp(g) S + k d^T with d = beta (v - exp(g) S^T k), o = S^T q (new S).
//
// Two phases, each parallel:
//   1. per sequence: the conv window is read from its pages, every token's conv output, norms,
//      decay, beta and q.k go to a float32 buffer (one row per token), the window goes back.
//   2. per (sequence, value head, block of up to 64 state columns): the columns of S evolve
//      independently (d_j depends on column j only), so each block is its own recurrence. It
//      runs token by token with the block (Dk x 64 floats) in L1 and one pass over it per
//      token: row i is updated for token t and at once accumulated into S^T k and S^T q of
//      token t + 1. A float32 SSM state is updated in place in its pages (rows crossing a page
//      boundary go through scratch); a bf16 one is read into float32 scratch and rounded once
//      on the way back, like the torch path's store.
// fresh sequences read both states as zeros.
//
// Captures (prefix-cache checkpoints inside a chunk): for capture c of a sequence, after its
// token off[c] the conv window (phase 1) and every state block (phase 2) are also written to
// the capture's own pages, exactly the bytes a call ending after that token would leave in
// the sequence's pages (phase 2 splits the token loop there; the recurrence is unchanged).

#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace pf {
namespace {

// A cursor over a state laid across pages (the concatenation of its P pages, as
// pagefold.executor.cache_tensors.StateView sees it): no division per element.
struct PageCursor {
  uint8_t* raw;
  const int64_t* pages;
  int64_t pb, pi, po;
  PageCursor(uint8_t* r, const int64_t* p, int64_t page_bytes, int64_t off)
      : raw(r), pages(p), pb(page_bytes), pi(off / page_bytes), po(off % page_bytes) {}
  uint8_t* ptr() const { return raw + pages[pi] * pb + po; }
  void advance(int64_t n) {
    po += n;
    while (po >= pb) {
      po -= pb;
      ++pi;
    }
  }
};

// Phase-1 row layout of one token: q (Hk*Dk, normalised and scaled) | k (Hk*Dk, normalised) |
// v (Hv*Dv) | decay (Hv) | beta (Hv) | q.k (Hk).
struct Layout {
  int C, Hk, Hv, Dk, Dv;
  int64_t row() const { return C + 2 * Hv + Hk; }
  int k() const { return Hk * Dk; }
  int v() const { return 2 * Hk * Dk; }
  int decay() const { return C; }
  int beta() const { return C + Hv; }
  int qk() const { return C + 2 * Hv; }
};

constexpr int kCols = 64;  // state columns per phase-2 work item

// Phase 1 for one sequence of L tokens. wt: conv weights transposed to (K, C) float32.
template <typename T>
void gdn_prepare(uint8_t* raw, int64_t page_bytes, const int64_t* pages, int64_t conv_off,
                 bool fresh, const T* x, int64_t xs, const T* a, const T* b, int64_t abs_,
                 const float* wt, const float* neg_exp_alog, const T* dt_bias, float* buf,
                 int64_t L, int K, Layout lay, float scale, float* cw, int P,
                 const int64_t* cap_off, const int64_t* cap_pages, int64_t ncap) {
  const int C = lay.C, W = K - 1;
  const int64_t es = static_cast<int64_t>(sizeof(T));
  const int64_t R = lay.row();
  // The window (ring at r) to a state's pages, oldest first.
  auto store_window = [&](const int64_t* pg, int r) {
    PageCursor cc(raw, pg, page_bytes, conv_off);
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < W; ++j) {
        store<T>(reinterpret_cast<T*>(cc.ptr()), 0, cw[static_cast<int64_t>((r + j) % W) * C + c]);
        cc.advance(es);
      }
  };
  int64_t ci = 0;
  // Window as (W, C) floats, oldest first; a ring: row (r + j) % W is the j-th oldest.
  {
    PageCursor cc(raw, pages, page_bytes, conv_off);
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < W; ++j) {
        cw[static_cast<int64_t>(j) * C + c] =
            fresh ? 0.f : load<T>(reinterpret_cast<const T*>(cc.ptr()), 0);
        cc.advance(es);
      }
  }
  int r = 0;
  for (int64_t t = 0; t < L; ++t) {
    const T* xt = x + t * xs;
    float* y = buf + t * R;
#if defined(PF_AVX512)
    for (int c = 0; c < C; c += 16) {
      const __mmask16 m = lanes(C - c);
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < W; ++j) {
        const int64_t jr = (r + j) % W;
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, cw + jr * C + c),
                              _mm512_maskz_loadu_ps(m, wt + static_cast<int64_t>(j) * C + c), acc);
      }
      const __m512 xc = vload<T>(xt + c, m);
      acc = _mm512_fmadd_ps(xc, _mm512_maskz_loadu_ps(m, wt + static_cast<int64_t>(W) * C + c),
                            acc);
      _mm512_mask_storeu_ps(y + c, m, vrnd<T>(vsilu(acc)));
      _mm512_mask_storeu_ps(cw + static_cast<int64_t>(r) * C + c, m, xc);
    }
#else
    for (int c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int j = 0; j < W; ++j)
        acc += cw[static_cast<int64_t>((r + j) % W) * C + c] * wt[static_cast<int64_t>(j) * C + c];
      const float xc = load<T>(xt, c);
      acc += xc * wt[static_cast<int64_t>(W) * C + c];
      y[c] = rnd<T>(acc / (1.0f + exp_any(-acc)));
      cw[static_cast<int64_t>(r) * C + c] = xc;
    }
#endif
    r = (r + 1) % W;
    for (; ci < ncap && cap_off[ci] == t; ++ci) store_window(cap_pages + ci * P, r);
    const int Dk = lay.Dk;
    for (int h = 0; h < lay.Hk; ++h) {
      float* q = y + h * Dk;
      float* k = y + lay.k() + h * Dk;
      float sq = 0.f, sk = 0.f;
#pragma omp simd reduction(+ : sq, sk)
      for (int d = 0; d < Dk; ++d) {
        sq += q[d] * q[d];
        sk += k[d] * k[d];
      }
      const float rq = 1.0f / std::sqrt(sq + 1e-6f) * scale;
      const float rk = 1.0f / std::sqrt(sk + 1e-6f);
      float qk = 0.f;
#pragma omp simd reduction(+ : qk)
      for (int d = 0; d < Dk; ++d) {
        q[d] *= rq;
        k[d] *= rk;
        qk += q[d] * k[d];
      }
      y[lay.qk() + h] = qk;
    }
    const T* at = a + t * abs_;
    const T* bt = b + t * abs_;
    for (int h = 0; h < lay.Hv; ++h) {
      const float sp_in = load<T>(at, h) + load<T>(dt_bias, h);
      const float sp = sp_in > 20.0f ? sp_in : std::log1p(std::exp(sp_in));
      y[lay.decay() + h] = std::exp(neg_exp_alog[h] * sp);
      y[lay.beta() + h] = rnd<T>(1.0f / (1.0f + std::exp(-load<T>(bt, h))));
    }
  }
  store_window(pages, r);
}

// Phase 2 for one block of n (<= kCols) state columns of one value head over L tokens. rows:
// the Dk rows of the block (float32, n wide). buf: the sequence's phase-1 rows, already offset
// so that q / k of this head's key head start at qo / ko, its v columns at vo, and its decay,
// beta, q.k at the fixed layout positions do, bo, qko. out: (L) rows ostride apart.
struct ColArgs {
  const float* buf;
  int64_t R;
  int qo, ko, vo, do_, bo, qko;
};

#if defined(PF_AVX512)
template <typename T, int NC>
void gdn_cols(float* const* rows, int Dk, int64_t L, ColArgs g, T* out, int64_t ostride,
              __mmask16 last) {
  auto mask = [last](int c) { return c == NC - 1 ? last : static_cast<__mmask16>(0xffff); };
  __m512 ks[NC], qs[NC], delta[NC];
  for (int c = 0; c < NC; ++c) ks[c] = qs[c] = _mm512_setzero_ps();
  if (L > 0) {
    const float* b0 = g.buf;
    for (int i = 0; i < Dk; ++i) {
      const __m512 ki = _mm512_set1_ps(b0[g.ko + i]), qi = _mm512_set1_ps(b0[g.qo + i]);
      for (int c = 0; c < NC; ++c) {
        const __m512 s = _mm512_maskz_loadu_ps(mask(c), rows[i] + 16 * c);
        ks[c] = _mm512_fmadd_ps(ki, s, ks[c]);
        qs[c] = _mm512_fmadd_ps(qi, s, qs[c]);
      }
    }
  }
  for (int64_t t = 0; t < L; ++t) {
    const float* bt = g.buf + t * g.R;
    const __m512 decay = _mm512_set1_ps(bt[g.do_]);
    const __m512 beta = _mm512_set1_ps(bt[g.bo]);
    const __m512 qk = _mm512_set1_ps(bt[g.qko]);
    T* ot = out + t * ostride;
    for (int c = 0; c < NC; ++c) {
      const __m512 v = _mm512_maskz_loadu_ps(mask(c), bt + g.vo + 16 * c);
      delta[c] = _mm512_mul_ps(_mm512_fnmadd_ps(decay, ks[c], v), beta);
      vstore<T>(ot + 16 * c, _mm512_fmadd_ps(qk, delta[c], _mm512_mul_ps(decay, qs[c])),
                mask(c));
    }
    if (t + 1 < L) {
      const float* bn = bt + g.R;
      for (int c = 0; c < NC; ++c) ks[c] = qs[c] = _mm512_setzero_ps();
      for (int i = 0; i < Dk; ++i) {
        const __m512 ki = _mm512_set1_ps(bt[g.ko + i]);
        const __m512 kn = _mm512_set1_ps(bn[g.ko + i]), qn = _mm512_set1_ps(bn[g.qo + i]);
        for (int c = 0; c < NC; ++c) {
          float* p = rows[i] + 16 * c;
          const __m512 s = _mm512_fmadd_ps(decay, _mm512_maskz_loadu_ps(mask(c), p),
                                           _mm512_mul_ps(ki, delta[c]));
          _mm512_mask_storeu_ps(p, mask(c), s);
          ks[c] = _mm512_fmadd_ps(kn, s, ks[c]);
          qs[c] = _mm512_fmadd_ps(qn, s, qs[c]);
        }
      }
    } else {
      for (int i = 0; i < Dk; ++i) {
        const __m512 ki = _mm512_set1_ps(bt[g.ko + i]);
        for (int c = 0; c < NC; ++c) {
          float* p = rows[i] + 16 * c;
          _mm512_mask_storeu_ps(p, mask(c),
                                _mm512_fmadd_ps(decay, _mm512_maskz_loadu_ps(mask(c), p),
                                                _mm512_mul_ps(ki, delta[c])));
        }
      }
    }
  }
}
#endif

// The same recurrence without AVX-512 (and the reference the vector code follows).
template <typename T>
void gdn_cols_scalar(float* const* rows, int Dk, int n, int64_t L, ColArgs g, T* out,
                     int64_t ostride) {
  alignas(64) float ks[kCols], qs[kCols], delta[kCols];
  for (int64_t t = 0; t < L; ++t) {
    const float* bt = g.buf + t * g.R;
    const float decay = bt[g.do_], beta = bt[g.bo], qk = bt[g.qko];
    for (int d = 0; d < n; ++d) ks[d] = qs[d] = 0.f;
    for (int i = 0; i < Dk; ++i) {
      const float ki = bt[g.ko + i], qi = bt[g.qo + i];
#pragma omp simd
      for (int d = 0; d < n; ++d) {
        ks[d] += ki * rows[i][d];
        qs[d] += qi * rows[i][d];
      }
    }
    T* ot = out + t * ostride;
    for (int d = 0; d < n; ++d) {
      delta[d] = (bt[g.vo + d] - decay * ks[d]) * beta;
      store<T>(ot, d, decay * qs[d] + qk * delta[d]);
    }
    for (int i = 0; i < Dk; ++i) {
      const float ki = bt[g.ko + i];
#pragma omp simd
      for (int d = 0; d < n; ++d) rows[i][d] = decay * rows[i][d] + ki * delta[d];
    }
  }
}

template <typename T>
void gdn_cols_any(float* const* rows, int Dk, int n, int64_t L, ColArgs g, T* out,
                  int64_t ostride) {
#if defined(PF_AVX512)
  const __mmask16 last = lanes(n - 16 * ((n - 1) / 16));
  switch ((n + 15) / 16) {
    case 1: return gdn_cols<T, 1>(rows, Dk, L, g, out, ostride, last);
    case 2: return gdn_cols<T, 2>(rows, Dk, L, g, out, ostride, last);
    case 3: return gdn_cols<T, 3>(rows, Dk, L, g, out, ostride, last);
    default: return gdn_cols<T, 4>(rows, Dk, L, g, out, ostride, last);
  }
#else
  gdn_cols_scalar<T>(rows, Dk, n, L, g, out, ostride);
#endif
}

// Element d of a state row that starts at byte off of the sequence's state and may cross
// into the next page.
template <typename S>
inline S* row_elem(uint8_t* raw, int64_t page_bytes, const int64_t* pages, int64_t off, int d) {
  const int64_t o = off + static_cast<int64_t>(d) * sizeof(S);
  return reinterpret_cast<S*>(raw + pages[o / page_bytes] * page_bytes + o % page_bytes);
}

// One phase-2 item: value head h, columns d0..d0+n of one sequence. S: the SSM element type.
// A float32 block whose rows each lie inside one page is updated in place; otherwise (bf16, or
// a row crossing a page boundary) it goes through float32 scratch.
// Rows (float32, n wide) to the block of a state whose row i starts at byte offs[i].
template <typename S>
void store_rows(uint8_t* raw, int64_t page_bytes, const int64_t* pages, const int64_t* offs,
                float* const* rows, int Dk, int n) {
  const int64_t es = static_cast<int64_t>(sizeof(S));
  for (int i = 0; i < Dk; ++i) {
    if (offs[i] % page_bytes + n * es <= page_bytes) {
      S* dst = row_elem<S>(raw, page_bytes, pages, offs[i], 0);
      for (int d = 0; d < n; ++d) store<S>(dst, d, rows[i][d]);
    } else {
      for (int d = 0; d < n; ++d)
        store<S>(row_elem<S>(raw, page_bytes, pages, offs[i], d), 0, rows[i][d]);
    }
  }
}

template <typename T, typename S>
void gdn_item(uint8_t* raw, int64_t page_bytes, const int64_t* pages, int64_t ssm_off,
              bool fresh, const float* buf, int64_t L, Layout lay, int h, int d0, int n,
              T* out, float* scratch, int P, const int64_t* cap_off, const int64_t* cap_pages,
              int64_t ncap) {
  const int Dk = lay.Dk, Dv = lay.Dv;
  const int64_t es = static_cast<int64_t>(sizeof(S));
  int64_t offs[kMaxHeadDim];
  S* src[kMaxHeadDim];  // the row's start in its page, or NULL when it crosses into the next
  bool inplace = std::is_same<S, float>::value;
  for (int i = 0; i < Dk; ++i) {
    offs[i] = ssm_off + ((static_cast<int64_t>(h) * Dk + i) * Dv + d0) * es;
    const bool whole = offs[i] % page_bytes + n * es <= page_bytes;
    src[i] = whole ? row_elem<S>(raw, page_bytes, pages, offs[i], 0) : nullptr;
    inplace = inplace && whole;
  }
  float* rows[kMaxHeadDim];
  for (int i = 0; i < Dk; ++i) {
    rows[i] = inplace ? reinterpret_cast<float*>(src[i]) : scratch + static_cast<int64_t>(i) * kCols;
    if (fresh) {
      for (int d = 0; d < n; ++d) rows[i][d] = 0.f;
    } else if (!inplace && src[i]) {
#if defined(PF_AVX512)
      for (int d = 0; d < n; d += 16)
        _mm512_mask_storeu_ps(rows[i] + d, lanes(n - d), vload<S>(src[i] + d, lanes(n - d)));
#else
      for (int d = 0; d < n; ++d) rows[i][d] = load<S>(src[i], d);
#endif
    } else if (!inplace) {
      for (int d = 0; d < n; ++d)
        rows[i][d] = load<S>(row_elem<S>(raw, page_bytes, pages, offs[i], d), 0);
    }
  }
  const int kh = h / (lay.Hv / lay.Hk);
  const ColArgs g{buf, lay.row(), kh * Dk, lay.k() + kh * Dk, lay.v() + h * Dv + d0,
                  lay.decay() + h, lay.beta() + h, lay.qk() + kh};
  T* o = out + static_cast<int64_t>(h) * Dv + d0;
  const int64_t os = static_cast<int64_t>(lay.Hv) * Dv;
  int64_t t0 = 0;
  for (int64_t c = 0; c < ncap; ++c) {  // run up to each captured token, save, go on
    const int64_t t1 = cap_off[c] + 1;
    ColArgs gc = g;
    gc.buf = g.buf + t0 * g.R;
    gdn_cols_any<T>(rows, Dk, n, t1 - t0, gc, o + t0 * os, os);
    store_rows<S>(raw, page_bytes, cap_pages + c * P, offs, rows, Dk, n);
    t0 = t1;
  }
  ColArgs gc = g;
  gc.buf = g.buf + t0 * g.R;
  gdn_cols_any<T>(rows, Dk, n, L - t0, gc, o + t0 * os, os);
  if (inplace) return;
  for (int i = 0; i < Dk; ++i) {
    if (src[i]) {
#if defined(PF_AVX512)
      for (int d = 0; d < n; d += 16)
        vstore<S>(src[i] + d, _mm512_maskz_loadu_ps(lanes(n - d), rows[i] + d), lanes(n - d));
#else
      for (int d = 0; d < n; ++d) store<S>(src[i], d, rows[i][d]);
#endif
    } else {
      for (int d = 0; d < n; ++d)
        store<S>(row_elem<S>(raw, page_bytes, pages, offs[i], d), 0, rows[i][d]);
    }
  }
}

template <typename T, typename S>
void gdn_all(uint8_t* raw, int64_t page_bytes, const int64_t* pages, int P, int64_t conv_off,
             int64_t ssm_off, const uint8_t* fresh, const int64_t* cu, const T* x,
             int64_t x_stride, const T* a, const T* b, int64_t ab_stride, const T* conv_w,
             const float* neg_exp_alog, const T* dt_bias, T* out, int64_t N, int K, Layout lay,
             float scale, const int64_t* cap_cu, const int64_t* cap_off,
             const int64_t* cap_pages, int nthreads) {
  auto ncap = [&](int64_t i) { return cap_cu ? cap_cu[i + 1] - cap_cu[i] : 0; };
  auto coff = [&](int64_t i) { return cap_cu ? cap_off + cap_cu[i] : nullptr; };
  auto cpg = [&](int64_t i) { return cap_cu ? cap_pages + cap_cu[i] * P : nullptr; };
  const int C = lay.C;
  const int64_t T_ = cu[N];
  const int64_t R = lay.row();
  // One buffer per calling thread, grown as needed: phase-1 rows, then the (K, C) weights.
  thread_local std::vector<float> store_;
  const size_t need = static_cast<size_t>(T_ * R + static_cast<int64_t>(K) * C);
  if (store_.size() < need) store_.resize(need);
  float* buf = store_.data();
  float* wt = buf + T_ * R;
  for (int c = 0; c < C; ++c)
    for (int j = 0; j < K; ++j)
      wt[static_cast<int64_t>(j) * C + c] = load<T>(conv_w, static_cast<int64_t>(c) * K + j);
  const int blocks = (lay.Dv + kCols - 1) / kCols;
  const int64_t items = N * lay.Hv * blocks;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && (N > 1 || items > 1))
  {
    std::vector<float> scratch(static_cast<size_t>(C) * (K - 1) +
                               static_cast<size_t>(lay.Dk) * kCols);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; ++i)
      gdn_prepare<T>(raw, page_bytes, pages + i * P, conv_off, fresh && fresh[i],
                     x + cu[i] * x_stride, x_stride, a + cu[i] * ab_stride, b + cu[i] * ab_stride,
                     ab_stride, wt, neg_exp_alog, dt_bias, buf + cu[i] * R, cu[i + 1] - cu[i], K,
                     lay, scale, scratch.data(), P, coff(i), cpg(i), ncap(i));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t i = it / (lay.Hv * blocks);
      const int h = static_cast<int>(it / blocks % lay.Hv);
      const int d0 = static_cast<int>(it % blocks) * kCols;
      const int n = lay.Dv - d0 < kCols ? lay.Dv - d0 : kCols;
      gdn_item<T, S>(raw, page_bytes, pages + i * P, ssm_off, fresh && fresh[i],
                     buf + cu[i] * R, cu[i + 1] - cu[i], lay, h, d0, n,
                     out + cu[i] * lay.Hv * lay.Dv, scratch.data() + C * (K - 1), P, coff(i),
                     cpg(i), ncap(i));
    }
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// A Gated DeltaNet layer over N sequences of a flat varlen batch: sequence i owns rows
// cu[i]..cu[i+1] of x (C wide, x_stride apart), of a and b (Hv wide, ab_stride apart) and of
// out ((T, Hv, Dv) contiguous). raw: the layer's (num_blocks, page_bytes) bytes; pages (N, P)
// int64; fresh (N,) uint8 or NULL; conv_w (C, K). conv state (C, K-1) in T, SSM state
// (Hv, Dk, Dv) float32 (ssm_dtype 0) or bf16 (1); both may cross page boundaries anywhere.
// Captures (cap_cu NULL for none): sequence i's are cap_cu[i]..cap_cu[i+1], with local token
// offsets cap_off ascending and their own pages cap_pages (., P).
// Returns -1 for shapes it does not handle.
int pf_gdn(int dtype, int ssm_dtype, void* raw, int64_t page_bytes, const int64_t* pages, int P,
           int64_t conv_off, int64_t ssm_off, const uint8_t* fresh, const int64_t* cu,
           const void* x, int64_t x_stride, const void* a, const void* b, int64_t ab_stride,
           const void* conv_w, const float* neg_exp_alog, const void* dt_bias, void* out,
           int64_t N, int C, int K, int Hk, int Hv, int Dk, int Dv, float scale,
           const int64_t* cap_cu, const int64_t* cap_off, const int64_t* cap_pages,
           int nthreads) {
  if ((dtype != 0 && dtype != 1) || (ssm_dtype != 0 && ssm_dtype != 1) || Dk > kMaxHeadDim ||
      Hk < 1 || Hv % Hk || K < 2 || C != 2 * Hk * Dk + Hv * Dv)
    return -1;
  const Layout lay{C, Hk, Hv, Dk, Dv};
  auto* rw = static_cast<uint8_t*>(raw);
  if (dtype == 0) {
    auto run = [&](auto ssm_tag) {
      using S = decltype(ssm_tag);
      gdn_all<float, S>(rw, page_bytes, pages, P, conv_off, ssm_off, fresh, cu,
                        static_cast<const float*>(x), x_stride, static_cast<const float*>(a),
                        static_cast<const float*>(b), ab_stride,
                        static_cast<const float*>(conv_w), neg_exp_alog,
                        static_cast<const float*>(dt_bias), static_cast<float*>(out), N, K, lay,
                        scale, cap_cu, cap_off, cap_pages, nthreads);
    };
    ssm_dtype == 0 ? run(float{}) : run(uint16_t{});
  } else {
    auto run = [&](auto ssm_tag) {
      using S = decltype(ssm_tag);
      gdn_all<uint16_t, S>(rw, page_bytes, pages, P, conv_off, ssm_off, fresh, cu,
                           static_cast<const uint16_t*>(x), x_stride,
                           static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b),
                           ab_stride, static_cast<const uint16_t*>(conv_w), neg_exp_alog,
                           static_cast<const uint16_t*>(dt_bias), static_cast<uint16_t*>(out), N,
                           K, lay, scale, cap_cu, cap_off, cap_pages, nthreads);
    };
    ssm_dtype == 0 ? run(float{}) : run(uint16_t{});
  }
  return 0;
}

}  // extern "C"
