// One Mamba-2 decode step on paged states: every sequence has exactly one new token.
//
// The steps and roundings of the torch path (causal_conv1d_update -> split -> ssd_recurrent):
//   conv over [window | x] in float32 (+ bias), SiLU, rounded to T; the window slides by one;
//   x | B | C split from that row; dt = softplus(dt + dt_bias) in float32 (no clamp: decode
//   tokens are not clamped, as in transformers' single-token update);
//   per (head h, row p): s <- exp(dt A) s + (dt x_p) B, y_p = s . C + D x_p, rounded to T,
//   with B and C of the head's group. The float32 SSM state is updated in place in its pages;
//   a row that crosses a page boundary goes through scratch. Fresh sequences read zeros.
// Sums run in another order than torch's matmul, so results agree up to float32 rounding.
//
// Two parallel phases: the conv per sequence (its window read from and written back to its
// pages), then the recurrence per (sequence, head).

#include <vector>

#include "common.h"
#include "kernels.h"

namespace pf {
namespace {

inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

template <typename T>
void conv_one(uint8_t* raw, int64_t pb, const int64_t* pages, int64_t conv_off, bool fresh,
              const T* x, const T* w, const T* bias, int C, int K, float* out) {
  const int W = K - 1;
  std::vector<T> win(static_cast<size_t>(C) * W);
  const int64_t bytes = static_cast<int64_t>(win.size()) * sizeof(T);
  if (fresh)
    std::memset(win.data(), 0, bytes);
  else
    page_copy(raw, pages, pb, conv_off, reinterpret_cast<uint8_t*>(win.data()), bytes, false);
  for (int c = 0; c < C; ++c) {
    T* wc = win.data() + static_cast<int64_t>(c) * W;
    const T* kc = w + static_cast<int64_t>(c) * K;
    float acc = 0.0f;
    for (int j = 0; j < W; ++j) acc += load<T>(wc, j) * load<T>(kc, j);
    acc += load<T>(x, c) * load<T>(kc, W);
    if (bias) acc += load<T>(bias, c);
    out[c] = rnd<T>(acc / (1.0f + std::exp(-acc)));
    for (int j = 0; j + 1 < W; ++j) wc[j] = wc[j + 1];
    wc[W - 1] = x[c];
  }
  page_copy(raw, pages, pb, conv_off, reinterpret_cast<uint8_t*>(win.data()), bytes, true);
}

template <typename T>
void mamba2_decode(uint8_t* raw, int64_t pb, const int64_t* pages, int P, int64_t conv_off,
                   int64_t ssm_off, const uint8_t* fresh, const T* xbc, int64_t x_stride,
                   const T* dt, int64_t dt_stride, const T* w, const T* bias,
                   const float* dt_bias, const float* A, const float* D, T* y, int64_t N, int C,
                   int K, int H, int Dh, int G, int Ns, int nthreads) {
  std::vector<float> conv(static_cast<size_t>(N) * C);
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < N; ++i)
    conv_one<T>(raw, pb, pages + i * P, conv_off, fresh && fresh[i], xbc + i * x_stride, w,
                bias, C, K, conv.data() + i * C);
  const int inter = H * Dh, hg = H / G;
  const int64_t row_bytes = static_cast<int64_t>(Ns) * sizeof(float);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> scratch(Ns);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < N * H; ++item) {
      const int64_t i = item / H;
      const int h = static_cast<int>(item % H), g = h / hg;
      const int64_t* pg = pages + i * P;
      const float* row = conv.data() + i * C;
      const float* xs = row + h * Dh;
      const float* Bv = row + inter + g * Ns;
      const float* Cv = row + inter + G * Ns + g * Ns;
      const float d = softplus(load<T>(dt + i * dt_stride, h) + dt_bias[h]);
      const float decay = std::exp(d * A[h]);
      const bool zero = fresh && fresh[i];
      for (int p = 0; p < Dh; ++p) {
        const int64_t off = ssm_off + (static_cast<int64_t>(h) * Dh + p) * row_bytes;
        const int64_t pi = off / pb, po = off % pb;
        const bool whole = po + row_bytes <= pb;
        float* s = whole ? reinterpret_cast<float*>(raw + pg[pi] * pb + po) : scratch.data();
        if (zero)
          std::memset(s, 0, row_bytes);
        else if (!whole)
          page_copy(raw, pg, pb, off, reinterpret_cast<uint8_t*>(s), row_bytes, false);
        const float xdt = d * xs[p];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int n = 0; n < Ns; ++n) {
          const float v = s[n] * decay + xdt * Bv[n];
          s[n] = v;
          acc += v * Cv[n];
        }
        if (!whole)
          page_copy(raw, pg, pb, off, reinterpret_cast<uint8_t*>(s), row_bytes, true);
        store<T>(y + i * inter, static_cast<int64_t>(h) * Dh + p, acc + D[h] * xs[p]);
      }
    }
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// A Mamba-2 mixer's conv and SSM update for N sequences of one token each: row i of xbc
// (C = H*Dh + 2*G*Ns wide, x_stride apart) and of dt (H wide, dt_stride apart). raw: the
// layer's (num_blocks, page_bytes) bytes; pages (N, P) int64; fresh (N,) uint8 or NULL;
// conv_w (C, K) and conv_b (C,) or NULL in T; dt_bias, A (= -exp(A_log)), D (H,) float32.
// Conv state (C, K-1) in T at conv_off, SSM state (H, Dh, Ns) float32 at ssm_off, both
// possibly crossing page boundaries. y: (N, H*Dh) contiguous in T. Returns -1 for shapes it
// does not handle.
int pf_mamba2_decode(int dtype, void* raw, int64_t page_bytes, const int64_t* pages, int P,
                     int64_t conv_off, int64_t ssm_off, const uint8_t* fresh, const void* xbc,
                     int64_t x_stride, const void* dt, int64_t dt_stride, const void* conv_w,
                     const void* conv_b, const float* dt_bias, const float* A, const float* D,
                     void* y, int64_t N, int C, int K, int H, int Dh, int G, int Ns,
                     int nthreads) {
  if ((dtype != 0 && dtype != 1) || K < 2 || G < 1 || H % G || C != H * Dh + 2 * G * Ns)
    return -1;
  auto* rw = static_cast<uint8_t*>(raw);
  if (dtype == 0)
    mamba2_decode<float>(rw, page_bytes, pages, P, conv_off, ssm_off, fresh,
                         static_cast<const float*>(xbc), x_stride,
                         static_cast<const float*>(dt), dt_stride,
                         static_cast<const float*>(conv_w), static_cast<const float*>(conv_b),
                         dt_bias, A, D, static_cast<float*>(y), N, C, K, H, Dh, G, Ns,
                         nthreads);
  else
    mamba2_decode<uint16_t>(rw, page_bytes, pages, P, conv_off, ssm_off, fresh,
                            static_cast<const uint16_t*>(xbc), x_stride,
                            static_cast<const uint16_t*>(dt), dt_stride,
                            static_cast<const uint16_t*>(conv_w),
                            static_cast<const uint16_t*>(conv_b), dt_bias, A, D,
                            static_cast<uint16_t*>(y), N, C, K, H, Dh, G, Ns, nthreads);
  return 0;
}

}  // extern "C"
