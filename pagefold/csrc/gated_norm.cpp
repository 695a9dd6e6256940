// The gated RMSNorm of Mamba-2 mixers with the gate applied first (pagefold/layers/mamba/
// gated_norm.py's GatedRMSNorm, norm_before_gate False), per row and group of channels:
//   v = x * silu(gate) in float32;  r = 1 / sqrt(mean over the group of v^2 + eps);
//   out = TO(w * TX(v * r))   with TX = TO = x's type (bf16: rounded before the weight
//   multiply and after, as the module's two casts do; float32: no rounding).
// The sum of squares and silu's exp run in another order / form than torch's, so results agree
// up to float32 rounding (then one bf16 rounding, rarely flipped).

#include "common.h"
#include "kernels.h"

namespace pf {
namespace {

template <typename TX, typename TG, typename TW>
void gated_rows(const TX* x, int64_t xs, const TG* gate, int64_t gs, const TW* w, TX* out,
                int64_t N, int D, int group, float eps, int nthreads) {
  const int ng = D / group;
  const bool par = nthreads > 1 && N * D >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
  for (int64_t item = 0; item < N * ng; ++item) {
    const int64_t i = item / ng;
    const int c0 = static_cast<int>(item % ng) * group;
    const TX* xr = x + i * xs + c0;
    const TG* gr = gate + i * gs + c0;
    TX* o = out + i * D + c0;
    float ss = 0.0f;  // v is recomputed in the second pass (cheaper than a scratch row)
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < group; ++d) {
      const float g = load<TG>(gr, d);
      const float v = load<TX>(xr, d) * (g / (1.0f + exp_any(-g)));
      ss += v * v;
    }
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(group) + eps);
#pragma omp simd
    for (int d = 0; d < group; ++d) {
      const float g = load<TG>(gr, d);
      const float v = load<TX>(xr, d) * (g / (1.0f + exp_any(-g)));
      store<TX>(o, d, load<TW>(w, c0 + d) * rnd<TX>(v * r));
    }
  }
}

}  // namespace
}  // namespace pf

using namespace pf;

extern "C" {

// out (N, D) contiguous in x's dtype; x rows xs apart, gate rows gs apart, weight (D,);
// dtypes (0 float32, 1 bf16): x / gate / weight as (0,0,0), (1,1,1) or (0,1,1). Groups of
// `group` channels (D % group == 0). Returns -1 for other combinations.
int pf_gated_norm_gate_first(int x_dtype, int g_dtype, int w_dtype, const void* x, int64_t xs,
                             const void* gate, int64_t gs, const void* w, void* out, int64_t N,
                             int D, int group, float eps, int nthreads) {
  if (group < 1 || D % group) return -1;
  if (x_dtype == 0 && g_dtype == 0 && w_dtype == 0)
    gated_rows<float, float, float>(static_cast<const float*>(x), xs,
                                    static_cast<const float*>(gate), gs,
                                    static_cast<const float*>(w), static_cast<float*>(out), N,
                                    D, group, eps, nthreads);
  else if (x_dtype == 1 && g_dtype == 1 && w_dtype == 1)
    gated_rows<uint16_t, uint16_t, uint16_t>(
        static_cast<const uint16_t*>(x), xs, static_cast<const uint16_t*>(gate), gs,
        static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), N, D, group, eps,
        nthreads);
  else if (x_dtype == 0 && g_dtype == 1 && w_dtype == 1)
    gated_rows<float, uint16_t, uint16_t>(static_cast<const float*>(x), xs,
                                          static_cast<const uint16_t*>(gate), gs,
                                          static_cast<const uint16_t*>(w),
                                          static_cast<float*>(out), N, D, group, eps, nthreads);
  else
    return -1;
  return 0;
}

}  // extern "C"
