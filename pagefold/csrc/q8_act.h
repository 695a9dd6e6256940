// Activations quantized to int8 per row and group of 32 inputs, as the int8-activation GGUF
// products take them (qgemv_q8.cpp, qgemm_amx.cpp), so both kernels see the same integers:
//   d = amax / 127, q[i] = round(x[i] * (127 / amax)) (0 where amax is 0), rounded to nearest
//   even (the current rounding mode, nearbyint),
// and per weight group of `wg` inputs (32, or 16: two halves of the group) the sum of its q.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pf {

// One group of 32 inputs xs into qs; sums[0] (and sums[1] for wg 16) the weight groups' sums
// of q. Returns d.
inline float q8_group(const float* xs, int8_t* qs, int64_t wg, int32_t sums[2]) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xs[i]));
  const float id = amax > 0.f ? 127.0f / amax : 0.f;
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    qs[i] = static_cast<int8_t>(std::nearbyint(xs[i] * id));
    sums[wg == 16 && i >= 16] += qs[i];
  }
  return amax / 127.0f;
}

}  // namespace pf
