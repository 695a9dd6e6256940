// Byte ranges of paged states written from a batch of rows: the compiled form behind
// StateView.write (pagefold/executor/cache_tensors.py), which keeps the torch fallback.
//
// A state spans P pages (any block ids, pb bytes each) read as one concatenation; a
// component is a byte range [off, off + nbytes) of it and may cross page boundaries.

#include "common.h"

using namespace pf;

extern "C" {

// For i < N: bytes [off, off + nbytes) of the state over pages[i * P .. i * P + P) of raw
// (num_blocks, pb) get row i of src (src_stride bytes apart), or zeros when src is NULL.
// stream: non-temporal stores (data read much later, e.g. checkpoints). Returns -1 for
// arguments it does not handle.
int pf_page_write(void* raw, int64_t pb, const int64_t* pages, int64_t N, int P, int64_t off,
                  const void* src, int64_t src_stride, int64_t nbytes, int stream,
                  int nthreads) {
  if (raw == nullptr || pb < 1 || P < 1 || N < 0 || off < 0 || nbytes < 0 ||
      off + nbytes > static_cast<int64_t>(P) * pb)
    return -1;
  auto* rw = static_cast<uint8_t*>(raw);
  const auto* s = static_cast<const uint8_t*>(src);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && N * nbytes >= (1 << 20))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i)
      page_copy(rw, pages + i * P, pb, off,
                s ? const_cast<uint8_t*>(s + i * src_stride) : nullptr, nbytes, true,
                stream != 0);
    if (stream) stream_fence();
  }
  return 0;
}

}  // extern "C"
