// A whole decode step of a dense decoder stack (Llama / Qwen2 / Qwen3 layers) in one call.
//
// pagefold.layers.decode_fast's DensePlan calls, per layer, about ten kernels through ctypes;
// each call costs ~4-5 us of argument conversion, as much as a small kernel's work, and a
// 30-layer model's step makes ~300 of them. This driver makes the same calls, with the same
// arguments, in the same order, from C: one ctypes call per step. The results are the Python
// plan's bit for bit (tested), since every number comes out of the same kernels.
//
// The layer records (int64, kLayerFields per layer, see enum Field) and their floats
// (kLayerFloats per layer) are built once per plan; the per-step inputs are the rows, the
// positions, each attention group's decode metadata and each layer's cache. The GEMV is a
// function pointer: cpu_ops' choice for this CPU (pf_linear_bf16 / _fma / _amx).

#include "common.h"

#include <algorithm>
#include <vector>

extern "C" {
int pf_rms_norm(int dtype, const void* x, int64_t x_stride, void* res, int64_t res_stride,
                const void* w, void* out, int64_t out_stride, int64_t N, int D, float eps,
                int zero_centered, int nthreads);
int pf_qk_norm_rope(int dtype, const void* qkv, int64_t row_stride, int64_t q_off,
                    int64_t q_head_stride, int64_t k_off, const int64_t* positions,
                    const float* cos, const float* sin, int rot, const void* qw, const void* kw,
                    float eps, int zero_centered, void* q_out, void* k_out, int64_t N, int H,
                    int KVH, int D, int nthreads);
int pf_write_kv(int dtype, const void* k, const void* v, int64_t k_stride, int64_t v_stride,
                const int64_t* slots, void* cache, int N, int KVH, int D);
int pf_decode_attention(int dtype, const void* q, int64_t q_stride, const int64_t* rows,
                        const void* cache, const int64_t* tables, int64_t table_stride,
                        const int64_t* seq_lens, const int64_t* kv_starts, void* out,
                        int64_t out_stride, int B, int H, int KVH, int D, int bs, float scale,
                        int nthreads);
int pf_silu_mul(int dtype, const void* gu, int64_t stride, void* out, int64_t N, int I,
                int nthreads);
}

namespace pf {
namespace {

constexpr int kBf16 = 1;  // the kernels' dtype code

using GemvFn = int (*)(const void* x, int64_t x_stride, const void* w, const void* bias, void* y,
                       int64_t y_stride, int M, int64_t N, int64_t K, int nthreads);

// One layer's record. Pointers are addresses; a missing bias or q/k norm is 0. N = the
// linear's output features (its input features follow from the layer: hidden, H * D, inter).
enum Field : int {
  kInNormW, kInNormZc, kPostNormW, kPostNormZc,
  kQkvW, kQkvB, kQkvN, kOW, kOB,
  kHeads, kKvHeads, kHeadDim, kQSize, kKvSize, kQHeadStride, kQNormW, kKNormW, kQkZc,
  kCos, kSin, kRot, kGroup,
  kGateUpW, kGateUpB, kInter, kDownW, kDownB,
  kLayerFields
};
enum FloatField : int { kInEps, kPostEps, kQkEps, kScale, kLayerFloats };
constexpr int kGroupFields = 6;  // tables, table stride, seq_lens, kv starts or 0, slots, rows

template <typename P>
P* ptr(int64_t v) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(v));
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// The layer record's sizes: Python checks them against its own field list once per build.
int pf_dense_decode_fields() { return kLayerFields * 100 + kLayerFloats; }

// Every layer on x (t rows of d, contiguous bf16). res: the residual stream (t x d, updated in
// place), or null: the first layer's input is the residual (x is then updated in place, as the
// module path's first add writes into it). out (t x d): the last layer's MLP output. caches:
// per layer (cache address, block size). groups: kGroupFields per attention group. Returns 0,
// or the first nonzero kernel result OR-ed over the step (the kernels refused an input).
int pf_dense_decode(const int64_t* layers, const float* floats, int n_layers,
                    const int64_t* caches, const int64_t* groups, void* gemv_fn, void* x,
                    void* res, void* out, int64_t t, int64_t d, const int64_t* pos,
                    int nthreads) {
  if (n_layers < 1 || t < 1 || gemv_fn == nullptr) return -1;
  const GemvFn gemv = reinterpret_cast<GemvFn>(gemv_fn);
  int64_t qkv_max = 0, qo_max = 0, k_max = 0, inter_max = 0;
  for (int i = 0; i < n_layers; ++i) {
    const int64_t* L = layers + static_cast<int64_t>(i) * kLayerFields;
    qkv_max = std::max(qkv_max, L[kQkvN]);
    qo_max = std::max(qo_max, L[kHeads] * L[kHeadDim]);
    k_max = std::max(k_max, L[kKvHeads] * L[kHeadDim]);
    inter_max = std::max(inter_max, L[kInter]);
  }
  // Scratch rows, each role as the Python plan's buffers: h, qkv, q, k, o, mixer out, gate_up,
  // act. Every role is read before the next layer writes it.
  std::vector<uint16_t> scratch(static_cast<size_t>(t) *
                                (2 * d + qkv_max + 2 * qo_max + k_max + 3 * inter_max));
  uint16_t* h = scratch.data();
  uint16_t* qkv = h + t * d;
  uint16_t* q = qkv + t * qkv_max;
  uint16_t* k = q + t * qo_max;
  uint16_t* o = k + t * k_max;
  uint16_t* mo = o + t * qo_max;
  uint16_t* gu = mo + t * d;
  uint16_t* act = gu + t * 2 * inter_max;
  uint16_t* resid = static_cast<uint16_t*>(res ? res : x);
  const uint16_t* cur = static_cast<const uint16_t*>(x);
  uint16_t* y = static_cast<uint16_t*>(out);
  int rc = 0;
  for (int i = 0; i < n_layers; ++i) {
    const int64_t* L = layers + static_cast<int64_t>(i) * kLayerFields;
    const float* F = floats + static_cast<int64_t>(i) * kLayerFloats;
    const int64_t* g = groups + L[kGroup] * kGroupFields;
    void* cache = ptr<void>(caches[2 * i]);
    const int bs = static_cast<int>(caches[2 * i + 1]);
    const int H = static_cast<int>(L[kHeads]), KVH = static_cast<int>(L[kKvHeads]);
    const int D = static_cast<int>(L[kHeadDim]);
    const int64_t qkv_n = L[kQkvN], qo = static_cast<int64_t>(H) * D;
    const int64_t kv = static_cast<int64_t>(KVH) * D, inter = L[kInter];
    // Input norm; the first layer without a residual normalises x itself.
    if (i == 0 && res == nullptr)
      rc |= pf_rms_norm(kBf16, cur, d, nullptr, 0, ptr<void>(L[kInNormW]), h, d, t,
                        static_cast<int>(d), F[kInEps], static_cast<int>(L[kInNormZc]),
                        nthreads);
    else
      rc |= pf_rms_norm(kBf16, cur, d, resid, d, ptr<void>(L[kInNormW]), h, d, t,
                        static_cast<int>(d), F[kInEps], static_cast<int>(L[kInNormZc]),
                        nthreads);
    // Attention: qkv, q/k norm + RoPE, K/V write, decode attention, o.
    rc |= gemv(h, d, ptr<void>(L[kQkvW]), ptr<void>(L[kQkvB]), qkv, qkv_n, static_cast<int>(t),
               qkv_n, d, nthreads);
    rc |= pf_qk_norm_rope(kBf16, qkv, qkv_n, 0, L[kQHeadStride], L[kQSize], pos,
                          ptr<float>(L[kCos]), ptr<float>(L[kSin]), static_cast<int>(L[kRot]),
                          ptr<void>(L[kQNormW]), ptr<void>(L[kKNormW]), F[kQkEps],
                          static_cast<int>(L[kQkZc]), q, k, t, H, KVH, D, nthreads);
    rc |= pf_write_kv(kBf16, k, qkv + L[kQSize] + L[kKvSize], kv, qkv_n, ptr<int64_t>(g[4]),
                      cache, static_cast<int>(t), KVH, D);
    rc |= pf_decode_attention(kBf16, q, qo, nullptr, cache, ptr<int64_t>(g[0]), g[1],
                              ptr<int64_t>(g[2]), ptr<int64_t>(g[3]), o, qo,
                              static_cast<int>(g[5]), H, KVH, D, bs, F[kScale], nthreads);
    rc |= gemv(o, qo, ptr<void>(L[kOW]), ptr<void>(L[kOB]), mo, d, static_cast<int>(t), d, qo,
               nthreads);
    // Post-attention norm (adds into the residual), then the gated MLP into out.
    rc |= pf_rms_norm(kBf16, mo, d, resid, d, ptr<void>(L[kPostNormW]), h, d, t,
                      static_cast<int>(d), F[kPostEps], static_cast<int>(L[kPostNormZc]),
                      nthreads);
    rc |= gemv(h, d, ptr<void>(L[kGateUpW]), ptr<void>(L[kGateUpB]), gu, 2 * inter,
               static_cast<int>(t), 2 * inter, d, nthreads);
    rc |= pf_silu_mul(kBf16, gu, 2 * inter, act, t, static_cast<int>(inter), nthreads);
    rc |= gemv(act, inter, ptr<void>(L[kDownW]), ptr<void>(L[kDownB]), y, d,
               static_cast<int>(t), d, inter, nthreads);
    cur = y;
    if (rc) return rc;
  }
  return 0;
}

}  // extern "C"
