// Walking a planned LoopNest: calls fn(len, pointers, inner byte strides) for each piece of an
// innermost run that falls in the flat index range [begin, end). Included inside an ISA namespace.

template <class RunFn>
static inline void for_each_run(const LoopNest& nest, int64_t begin, int64_t end, RunFn&& fn) {
  if (begin >= end) return;
  const int nd = nest.ndim;
  const int inner = nd - 1;
  int64_t idx[kMaxDims];
  int64_t rem = begin;
  for (int d = inner; d >= 0; --d) {
    idx[d] = rem % nest.sizes[d];
    rem /= nest.sizes[d];
  }
  char* p[kNumOperands];
  int64_t inner_stride[kNumOperands];
  for (int op = 0; op < kNumOperands; ++op) {
    char* q = nest.data[op];
    for (int d = 0; d < nd; ++d) q += idx[d] * nest.strides[op][d];
    p[op] = q;
    inner_stride[op] = nest.strides[op][inner];
  }
  int64_t remaining = end - begin;
  while (remaining > 0) {
    const int64_t len = nest.sizes[inner] - idx[inner] < remaining ? nest.sizes[inner] - idx[inner] : remaining;
    fn(len, p, inner_stride);
    remaining -= len;
    if (remaining == 0) break;
    // Step to the start of the next run: carry through the outer dims.
    for (int op = 0; op < kNumOperands; ++op) p[op] -= idx[inner] * inner_stride[op];
    idx[inner] = 0;
    for (int d = inner - 1; d >= 0; --d) {
      for (int op = 0; op < kNumOperands; ++op) p[op] += nest.strides[op][d];
      if (++idx[d] < nest.sizes[d]) break;
      for (int op = 0; op < kNumOperands; ++op) p[op] -= idx[d] * nest.strides[op][d];
      idx[d] = 0;
    }
  }
}
