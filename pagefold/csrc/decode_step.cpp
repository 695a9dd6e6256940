// A whole decode step of a decoder stack in one call (pagefold.layers.decode_native): the
// blocks of any model whose parts have compiled kernels (dense Llama / Qwen2 / Qwen3, the Gated
// DeltaNet hybrids, the Mamba-2 hybrids).
//
// The module path calls, per layer, about ten kernels through ctypes; each call costs ~4-5 us
// of argument conversion, as much as a small kernel's work, and a 30-layer model's step makes
// ~300 of them. This driver makes the same kernel calls, with the same arguments, in the same
// order, from C: one ctypes call per step. The results are the module path's bit for bit
// (tested), since every number comes out of the same kernels.
//
// A step is a list of blocks, each `part(norm(x + residual))`: the residual add folded into the
// norm (pf_rms_norm), then one part: attention (with or without q/k norm + RoPE, with or
// without a sigmoid output gate), a gated SiLU MLP, a relu^2 MLP, a Mamba-2 mixer or a Gated
// DeltaNet mixer, a sparse MoE block. A dense or Qwen3.5 / Qwen3-Next layer is two blocks
// (mixer, MLP), a Nemotron-H layer one.
// The block records (int64, kFields per block, see enum Field) and their floats (kFloats per
// block) are built once per model; the per-step inputs are the rows, the positions, each
// attention group's decode metadata and each block's per-step values (a cache, a state pool's
// pages). Each matrix's GEMV is a function pointer in its record (gemv_choice's kernel for
// its shape: pf_linear_bf16 / _fma / _amx), or one pointer for all (larger steps: the
// linears' own forwards, called back).

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>


namespace pf {
namespace {

constexpr int kBf16 = 1;  // the kernels' dtype code

// What a block's part is (decode_native.KINDS).
enum Kind : int { kAttention = 1, kMlpSilu = 2, kMlpRelu2 = 3, kMamba2 = 4, kGdn = 5, kMoe = 6 };

// One block's record. Pointers are addresses; a missing bias, q/k norm or conv bias is 0.
// Every part but MoE has two linears: w0 (hidden -> n0: qkv, gate_up, up, in_proj) and w1 (k1
// -> hidden: o, down, out_proj). Fields a part does not use are 0.
enum Field : int {
  kKind, kNormW, kNormZc, kW0, kB0, kN0, kW1, kB1, kK1,
  // attention: rot 0 = no q/k norm and no RoPE (q, k and v read where they lie in qkv's rows);
  // gated: q rows hold per head [query | gate], the output is o * sigmoid(gate)
  kHeads, kKvHeads, kHeadDim, kQSize, kKvSize, kQHeadStride, kQNormW, kKNormW, kQkZc,
  kCos, kSin, kRot, kGated,
  // Mamba-2 (intermediate = k1) and GDN (value heads / dim as ssm heads / head dim, value
  // dim = k1, the norm's group = the value head dim)
  kConvDim, kConvK, kSsmHeads, kSsmHeadDim, kSsmGroups, kSsmState, kConvW, kConvB, kDtBias,
  kDSkip, kGnormW, kGnormGroup, kKHeads, kKHeadDim,
  // sparse MoE (w0 = the router, n0 = experts): stacked expert weights, an optional shared
  // expert (gate_up, down, its width) and its optional gate (one output)
  kTopK, kNormTopK, kExpertsGu, kExpertsDown, kMoeInter, kSharedGu, kSharedDown, kSharedInter,
  kSharedGate,
  // each matrix's GEMV (a GemvFn's address: the kernel chosen for its shape; 0 = none)
  kG0, kG1, kGExpertsGu, kGExpertsDown, kGSharedGu, kGSharedDown, kGSharedGate,
  kFields
};
// eps2: the q/k norm's or the gated norm's; scale: attention's or GDN's query scale.
enum FloatField : int { kNormEps, kEps2, kScale, kFloats };
// Per-step values of a block (kDyn each): attention: cache, block size, its group's index in
// `groups` (kAttnGroup); Mamba-2 and GDN: state pool base, page bytes, pages, pages per state,
// conv offset, ssm offset, fresh flags, -exp(A_log); GDN also cu_seqlens, requests, the ssm
// state's dtype code.
enum Dyn : int {
  kRaw, kPageBytes, kPages, kPagesPer, kConvOff, kSsmOff, kFresh, kNegExp, kCu, kRequests,
  kSsmDtype, kDyn
};
constexpr int kAttnGroup = kPages;
constexpr int kGroupFields = 6;
using MoeFn = int (*)(int block, const void* h, int64_t t, int64_t d, void* dst);  // tables, table stride, seq_lens, kv starts or 0, slots, rows

template <typename P>
P* ptr(int64_t v) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(v));
}

// Scratch rows, one region per role; every role is read before the next block writes it. Each
// region starts on a 64-byte line (as torch's tensors do): the batched GEMM that larger steps
// call back into (decode_native.LinearCallback) reads its rows as it reads the module path's.
struct Scratch {
  static constexpr int64_t kLine = 32;  // uint16 elements per 64 bytes
  std::vector<uint16_t> mem;
  uint16_t *h, *mo, *p0, *q, *k, *a1, *a2;

  static int64_t lines(int64_t n) { return (n + kLine - 1) / kLine * kLine; }

  Scratch(const int64_t* blocks, int n, int64_t t, int64_t d) {
    int64_t n0 = 0, qo = 0, kv = 0, k1 = d;  // a2 holds a MoE shared expert's (t, d) too
    for (int i = 0; i < n; ++i) {
      const int64_t* B = blocks + static_cast<int64_t>(i) * kFields;
      n0 = std::max({n0, B[kN0], 2 * B[kSharedInter]});
      qo = std::max(qo, B[kHeads] * B[kHeadDim]);
      kv = std::max(kv, B[kKvHeads] * B[kHeadDim]);
      k1 = std::max({k1, B[kK1], B[kSharedInter]});
    }
    const int64_t sizes[7] = {t * d, t * d, t * n0, t * qo, t * kv, t * k1, t * k1};
    int64_t total = kLine;
    for (int64_t sz : sizes) total += lines(sz);
    mem.resize(static_cast<size_t>(total));
    const auto addr = reinterpret_cast<uintptr_t>(mem.data());
    uint16_t* at = mem.data() + ((64 - addr % 64) % 64) / 2;
    uint16_t** regions[7] = {&h, &mo, &p0, &q, &k, &a1, &a2};
    for (int i = 0; i < 7; ++i) {
      *regions[i] = at;
      at += lines(sizes[i]);
    }
  }
};

int no_gemv(const void*, int64_t, const void*, const void*, void*, int64_t, int, int64_t,
            int64_t, int) {
  return -1;  // a matrix without a GEMV: the step is refused (decode_native never packs one)
}

struct StepArgs {
  GemvFn all;  // every matrix's product when set (the callbacks), else each record's own
  int64_t t, d;
  const int64_t* pos;
  const int64_t* groups;
  int nt;
};

// The product of the matrix whose GEMV is field f of block B.
GemvFn gemv(const StepArgs& s, const int64_t* B, int f) {
  if (s.all) return s.all;
  return B[f] ? reinterpret_cast<GemvFn>(static_cast<intptr_t>(B[f])) : no_gemv;
}

// qkv -> (q/k norm + RoPE) -> K/V write -> decode attention -> o (into dst).
int attention(const int64_t* B, const float* F, const int64_t* dy, const StepArgs& s,
              Scratch& m, uint16_t* dst) {
  const GemvFn g0 = gemv(s, B, kG0), g1 = gemv(s, B, kG1);
  const int64_t t = s.t, d = s.d, n0 = B[kN0];
  const int64_t* g = s.groups + dy[kAttnGroup] * kGroupFields;
  const int H = static_cast<int>(B[kHeads]), KVH = static_cast<int>(B[kKvHeads]);
  const int D = static_cast<int>(B[kHeadDim]);
  const int64_t qo = static_cast<int64_t>(H) * D, kv = static_cast<int64_t>(KVH) * D;
  void* cache = ptr<void>(dy[kRaw]);
  const int bs = static_cast<int>(dy[kPageBytes]);
  int rc = g0(m.h, d, ptr<void>(B[kW0]), ptr<void>(B[kB0]), m.p0, n0, static_cast<int>(t),
                  n0, d, s.nt);
  const uint16_t* v = m.p0 + B[kQSize] + B[kKvSize];
  const uint16_t* q = m.p0;  // no RoPE: q and k where they lie in the qkv rows
  if (B[kRot]) {
    rc |= pf_qk_norm_rope(kBf16, m.p0, n0, 0, B[kQHeadStride], B[kQSize], s.pos,
                          ptr<float>(B[kCos]), ptr<float>(B[kSin]), static_cast<int>(B[kRot]),
                          ptr<void>(B[kQNormW]), ptr<void>(B[kKNormW]), F[kEps2],
                          static_cast<int>(B[kQkZc]), m.q, m.k, t, H, KVH, D, s.nt);
    rc |= pf_write_kv(kBf16, m.k, v, kv, n0, ptr<int64_t>(g[4]), cache, static_cast<int>(t),
                      KVH, D);
    q = m.q;
  } else {
    rc |= pf_write_kv(kBf16, m.p0 + B[kQSize], v, n0, n0, ptr<int64_t>(g[4]), cache,
                      static_cast<int>(t), KVH, D);
  }
  rc |= pf_decode_attention(kBf16, q, B[kRot] ? qo : n0, nullptr, cache, ptr<int64_t>(g[0]),
                            g[1], ptr<int64_t>(g[2]), ptr<int64_t>(g[3]), m.a1, qo,
                            static_cast<int>(g[5]), H, KVH, D, bs, F[kScale], s.nt);
  if (B[kGated])  // the gate: the second half of each head's q rows
    rc |= pf_sigmoid_gate(kBf16, m.a1, qo, m.p0 + D, n0, 2 * D, m.a1, qo, t, H, D, s.nt);
  rc |= g1(m.a1, qo, ptr<void>(B[kW1]), ptr<void>(B[kB1]), dst, d, static_cast<int>(t), d,
               qo, s.nt);
  return rc;
}

// up (or gate_up) -> activation -> down (into dst).
int mlp(const int64_t* B, const StepArgs& s, Scratch& m, uint16_t* dst) {
  const GemvFn g0 = gemv(s, B, kG0), g1 = gemv(s, B, kG1);
  const int64_t t = s.t, d = s.d, n0 = B[kN0], inter = B[kK1];
  int rc = g0(m.h, d, ptr<void>(B[kW0]), ptr<void>(B[kB0]), m.p0, n0, static_cast<int>(t),
                  n0, d, s.nt);
  if (B[kKind] == kMlpSilu)
    rc |= pf_silu_mul(kBf16, m.p0, n0, m.a1, t, static_cast<int>(inter), s.nt);
  else
    rc |= pf_relu2(kBf16, m.p0, n0, m.a1, t, static_cast<int>(inter), s.nt);
  rc |= g1(m.a1, inter, ptr<void>(B[kW1]), ptr<void>(B[kB1]), dst, d, static_cast<int>(t),
               d, inter, s.nt);
  return rc;
}

// in_proj (rows z | xBC | dt) -> conv + SSM update on the paged states -> gated norm with z ->
// out_proj (into dst).
int mamba2(const int64_t* B, const float* F, const int64_t* dy, const StepArgs& s, Scratch& m,
           uint16_t* dst) {
  const GemvFn g0 = gemv(s, B, kG0), g1 = gemv(s, B, kG1);
  const int64_t t = s.t, d = s.d, n0 = B[kN0], inter = B[kK1], C = B[kConvDim];
  int rc = g0(m.h, d, ptr<void>(B[kW0]), ptr<void>(B[kB0]), m.p0, n0, static_cast<int>(t),
                  n0, d, s.nt);
  const uint16_t* xbc = m.p0 + inter;
  rc |= pf_mamba2_decode(kBf16, ptr<void>(dy[kRaw]), dy[kPageBytes], ptr<int64_t>(dy[kPages]),
                         static_cast<int>(dy[kPagesPer]), dy[kConvOff], dy[kSsmOff],
                         ptr<uint8_t>(dy[kFresh]), xbc, n0, xbc + C, n0, ptr<void>(B[kConvW]),
                         ptr<void>(B[kConvB]), ptr<float>(B[kDtBias]), ptr<float>(dy[kNegExp]),
                         ptr<float>(B[kDSkip]), m.a1, t, static_cast<int>(C),
                         static_cast<int>(B[kConvK]), static_cast<int>(B[kSsmHeads]),
                         static_cast<int>(B[kSsmHeadDim]), static_cast<int>(B[kSsmGroups]),
                         static_cast<int>(B[kSsmState]), s.nt);
  rc |= pf_gated_norm_gate_first(kBf16, kBf16, kBf16, m.a1, inter, m.p0, n0, ptr<void>(B[kGnormW]),
                                 m.a2, t, static_cast<int>(inter),
                                 static_cast<int>(B[kGnormGroup]), F[kEps2], s.nt);
  rc |= g1(m.a2, inter, ptr<void>(B[kW1]), ptr<void>(B[kB1]), dst, d, static_cast<int>(t),
               d, inter, s.nt);
  return rc;
}

// in_proj (rows q|k|v | z | b | a) -> conv + delta rule on the paged states -> gated norm with
// z -> out_proj (into dst).
int gdn(const int64_t* B, const float* F, const int64_t* dy, const StepArgs& s, Scratch& m,
        uint16_t* dst) {
  const GemvFn g0 = gemv(s, B, kG0), g1 = gemv(s, B, kG1);
  const int64_t t = s.t, d = s.d, n0 = B[kN0], V = B[kK1], C = B[kConvDim];
  const int Hv = static_cast<int>(B[kSsmHeads]), Dv = static_cast<int>(B[kSsmHeadDim]);
  int rc = g0(m.h, d, ptr<void>(B[kW0]), ptr<void>(B[kB0]), m.p0, n0, static_cast<int>(t),
                  n0, d, s.nt);
  const uint16_t* b = m.p0 + C + V;
  rc |= pf_gdn(kBf16, static_cast<int>(dy[kSsmDtype]), ptr<void>(dy[kRaw]), dy[kPageBytes],
               ptr<int64_t>(dy[kPages]), static_cast<int>(dy[kPagesPer]), dy[kConvOff],
               dy[kSsmOff], ptr<uint8_t>(dy[kFresh]), ptr<int64_t>(dy[kCu]), m.p0, n0, b + Hv,
               b, n0, ptr<void>(B[kConvW]), ptr<float>(dy[kNegExp]), ptr<void>(B[kDtBias]), m.a1,
               dy[kRequests], static_cast<int>(C), static_cast<int>(B[kConvK]),
               static_cast<int>(B[kKHeads]), Hv, static_cast<int>(B[kKHeadDim]), Dv, F[kScale],
               nullptr, nullptr, nullptr, s.nt);
  rc |= pf_rms_norm_gated(kBf16, m.a1, V, Dv, m.p0 + C, n0, Dv, ptr<void>(B[kGnormW]), m.a2, t,
                          Hv, Dv, F[kEps2], s.nt);
  rc |= g1(m.a2, V, ptr<void>(B[kW1]), ptr<void>(B[kB1]), dst, d, static_cast<int>(t), d, V,
               s.nt);
  return rc;
}

// router (logits -> softmax top-k) -> the routed experts (into dst) -> the shared expert and
// its gate, added into dst. The kernels SparseMoeBlock's forward calls on such rows.
int moe(const int64_t* B, const StepArgs& s, Scratch& m, uint16_t* dst) {
  const GemvFn g0 = gemv(s, B, kG0);
  const int64_t t = s.t, d = s.d, E = B[kN0];
  const int k = static_cast<int>(B[kTopK]);
  std::vector<int64_t> idx(static_cast<size_t>(t) * k);
  std::vector<uint16_t> w(static_cast<size_t>(t) * k), gate(static_cast<size_t>(t));
  int rc = g0(m.h, d, ptr<void>(B[kW0]), ptr<void>(B[kB0]), m.p0, E, static_cast<int>(t),
                  E, d, s.nt);
  rc |= pf_moe_route(m.p0, E, static_cast<int>(t), static_cast<int>(E), k,
                     static_cast<int>(B[kNormTopK]), idx.data(), w.data(), s.nt);
  if (rc) return rc;
  const int ti = static_cast<int>(t);
  rc |= pf_moe_experts_few(reinterpret_cast<void*>(gemv(s, B, kGExpertsGu)),
                           reinterpret_cast<void*>(gemv(s, B, kGExpertsDown)), m.h, d, ti, k,
                           idx.data(), w.data(), ptr<uint16_t>(B[kExpertsGu]),
                           ptr<uint16_t>(B[kExpertsDown]), static_cast<int>(E), d, B[kMoeInter],
                           dst, s.nt);
  const int64_t si = B[kSharedInter];
  if (rc || si == 0) return rc;
  rc |= gemv(s, B, kGSharedGu)(m.h, d, ptr<void>(B[kSharedGu]), nullptr, m.p0, 2 * si, ti,
                               2 * si, d, s.nt);
  rc |= pf_silu_mul(kBf16, m.p0, 2 * si, m.a1, t, static_cast<int>(si), s.nt);
  rc |= gemv(s, B, kGSharedDown)(m.a1, si, ptr<void>(B[kSharedDown]), nullptr, m.a2, d, ti, d,
                                 si, s.nt);
  if (B[kSharedGate])
    rc |= gemv(s, B, kGSharedGate)(m.h, d, ptr<void>(B[kSharedGate]), nullptr, gate.data(), 1,
                                   ti, 1, d, s.nt);
  rc |= pf_moe_shared_add(dst, m.a2, B[kSharedGate] ? gate.data() : nullptr, 1, dst, t, d,
                           s.nt);
  return rc;
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// The record's sizes: Python checks them against its own field lists once per build.
int pf_blocks_decode_fields() { return (kFields * 100 + kFloats) * 100 + kDyn; }

// Every block on x (t rows of d, contiguous bf16). res: the residual stream (t x d, updated in
// place), or null: the first block's input is the residual (x is then updated in place, as the
// module path's first add writes into it). out (t x d): the last block's part output. gemv_fn:
// null (each matrix's own GEMV, from its record) or the product of every matrix. moe_fn:
// null, or what runs the sparse MoE blocks instead of moe() (steps above the few-row experts'
// kernel: the Python block's own forward), called with (block index, normed rows, t, d, dst). dyn:
// kDyn per block. groups: kGroupFields per attention group. Returns 0, -1 for a bad block, or
// the first nonzero kernel result OR-ed over a block (the kernels refused an input).
// final_out: null, or where the stack's final norm of (out + residual) goes, the module path's
// last pf_rms_norm call (weight final_w, final_eps, mode final_zc; the residual updated in
// place as there), so a step needs no second call for it.
int pf_blocks_decode(const int64_t* blocks, const float* floats, int n_blocks,
                     const int64_t* dyn, const int64_t* groups, void* gemv_fn, void* x, void* res,
                     void* out, int64_t t, int64_t d, const int64_t* pos, int nthreads,
                     void* moe_fn, const void* final_w, float final_eps, int final_zc,
                     void* final_out) {
  if (n_blocks < 1 || t < 1) return -1;
  const StepArgs s{reinterpret_cast<GemvFn>(gemv_fn), t, d, pos, groups, nthreads};
  Scratch m(blocks, n_blocks, t, d);
  uint16_t* resid = static_cast<uint16_t*>(res ? res : x);
  const uint16_t* cur = static_cast<const uint16_t*>(x);
  for (int i = 0; i < n_blocks; ++i) {
    const int64_t* B = blocks + static_cast<int64_t>(i) * kFields;
    const float* F = floats + static_cast<int64_t>(i) * kFloats;
    const int64_t* dy = dyn + static_cast<int64_t>(i) * kDyn;
    // The norm; the first block without a residual normalises x itself.
    const bool first = i == 0 && res == nullptr;
    int rc = pf_rms_norm(kBf16, cur, d, first ? nullptr : resid, first ? 0 : d,
                         ptr<void>(B[kNormW]), m.h, d, t, static_cast<int>(d), F[kNormEps],
                         static_cast<int>(B[kNormZc]), nthreads);
    uint16_t* dst = i == n_blocks - 1 ? static_cast<uint16_t*>(out) : m.mo;
    switch (B[kKind]) {
      case kAttention: rc |= attention(B, F, dy, s, m, dst); break;
      case kMlpSilu:
      case kMlpRelu2: rc |= mlp(B, s, m, dst); break;
      case kMamba2: rc |= mamba2(B, F, dy, s, m, dst); break;
      case kGdn: rc |= gdn(B, F, dy, s, m, dst); break;
      case kMoe:
        rc |= moe_fn ? reinterpret_cast<MoeFn>(moe_fn)(i, m.h, t, d, dst) : moe(B, s, m, dst);
        break;
      default: return -1;
    }
    if (rc) return rc;
    cur = dst;
  }
  if (final_out != nullptr)
    return pf_rms_norm(kBf16, out, d, resid, d, final_w, final_out, d, t, static_cast<int>(d),
                       final_eps, final_zc, nthreads);
  return 0;
}

// A greedy decode step from token ids to token ids (decode_native.GreedyStep): the embedding
// rows of ids gathered into x (a copy, as the module path's lookup), pf_blocks_decode with its
// final norm, the head's GEMV of the normalised rows into bf16 logits and pf_argmax_bf16 over
// them: the calls the module path makes for a greedy step, in its order, with its arguments
// (so the same bits), from one ctypes call of two arguments. The values in `plan` (enum
// GreedyField) are set once per run of steps; only what they point to changes between calls
// (the ids, positions and the attention metadata, advanced in place by the caller). Returns
// pf_blocks_decode's result, -2 for an id outside the table, or the head's GEMV's or argmax's.
enum GreedyField : int {
  kGBlocks, kGFloats, kGNBlocks, kGDyn, kGGroups, kGGemvAll, kGMoeFn, kGX, kGOut, kGT, kGD,
  kGPos, kGThreads, kGFinalW, kGFinalZc, kGNormed, kGEmbed, kGEmbedRows, kGIds, kGHeadFn,
  kGHeadW, kGHeadB, kGVocab, kGLogits, kGTokens, kGreedyFields
};

int pf_blocks_greedy_fields() { return kGreedyFields; }

int pf_blocks_greedy(const int64_t* plan, float final_eps) {
  const int64_t t = plan[kGT], d = plan[kGD], rows = plan[kGEmbedRows];
  const int64_t* ids = ptr<const int64_t>(plan[kGIds]);
  const uint16_t* table = ptr<const uint16_t>(plan[kGEmbed]);
  uint16_t* x = ptr<uint16_t>(plan[kGX]);
  for (int64_t r = 0; r < t; ++r) {
    if (ids[r] < 0 || ids[r] >= rows) return -2;
    std::copy_n(table + ids[r] * d, d, x + r * d);
  }
  const int nt = static_cast<int>(plan[kGThreads]);
  void* normed = ptr<void>(plan[kGNormed]);
  int rc = pf_blocks_decode(ptr<const int64_t>(plan[kGBlocks]), ptr<const float>(plan[kGFloats]),
                            static_cast<int>(plan[kGNBlocks]), ptr<const int64_t>(plan[kGDyn]),
                            ptr<const int64_t>(plan[kGGroups]), ptr<void>(plan[kGGemvAll]), x,
                            nullptr, ptr<void>(plan[kGOut]), t, d, ptr<const int64_t>(plan[kGPos]),
                            nt, ptr<void>(plan[kGMoeFn]), ptr<const void>(plan[kGFinalW]),
                            final_eps, static_cast<int>(plan[kGFinalZc]), normed);
  if (rc) return rc;
  const int64_t n = plan[kGVocab];
  void* logits = ptr<void>(plan[kGLogits]);
  const auto head = reinterpret_cast<GemvFn>(static_cast<intptr_t>(plan[kGHeadFn]));
  if (head == nullptr) return -1;
  rc = head(normed, d, ptr<const void>(plan[kGHeadW]), ptr<const void>(plan[kGHeadB]), logits,
            n, static_cast<int>(t), n, d, nt);
  if (rc) return rc;
  return pf_argmax_bf16(logits, t, n, n, ptr<int64_t>(plan[kGTokens]));
}

}  // extern "C"
