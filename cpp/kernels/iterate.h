// Walking a planned LoopNest. Included inside an ISA namespace (and by ops/mvn.cpp).

// The runs of one group: dims [first, last) of the nest (a group's reduced dims outside its
// innermost run) stepped as an odometer; off[op] is the current run's byte offset in the group.
// advance() past the last run comes back to the first (offset 0), where a walk that runs ahead
// into the next group continues from that group's start.
struct RunOdometer {
  const LoopNest& nest;
  const int first, last;
  int64_t idx[kMaxNestDims] = {}, off[kNumOperands] = {};
  RunOdometer(const LoopNest& n, int first_dim, int last_dim) : nest(n), first(first_dim), last(last_dim) {}
  void advance() {
    for (int d = last - 1; d >= first; --d) {
      for (int op = 0; op < kNumOperands; ++op) off[op] += nest.strides[op][d];
      if (++idx[d] < nest.sizes[d]) return;
      for (int op = 0; op < kNumOperands; ++op) off[op] -= idx[d] * nest.strides[op][d];
      idx[d] = 0;
    }
  }
};

// Calls fn(len, pointers, inner byte strides) for each piece of an innermost run that falls in the
// flat index range [begin, end).

template <class RunFn>
static inline void for_each_run(const LoopNest& nest, int64_t begin, int64_t end, RunFn&& fn) {
  if (begin >= end) return;
  const int nd = nest.ndim;
  const int inner = nd - 1;
  int64_t idx[kMaxNestDims];
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

// Like for_each_run, but hands over whole rows of the two innermost dims at once:
// fn(rows, len, pointers, inner byte strides, row byte strides). Pieces of a row at the ends of the
// range come as rows == 1. Kernels then choose their loop once per block instead of once per row,
// which matters when rows are short (channels-last with few channels, small images).
template <class BlockFn>
static inline void for_each_block(const LoopNest& nest, int64_t begin, int64_t end, BlockFn&& fn) {
  if (begin >= end) return;
  const int nd = nest.ndim, inner = nd - 1, row = nd - 2;
  int64_t idx[kMaxNestDims];
  int64_t rem = begin;
  for (int d = inner; d >= 0; --d) {
    idx[d] = rem % nest.sizes[d];
    rem /= nest.sizes[d];
  }
  char* p[kNumOperands];
  int64_t inner_stride[kNumOperands], row_stride[kNumOperands];
  for (int op = 0; op < kNumOperands; ++op) {
    char* q = nest.data[op];
    for (int d = 0; d < nd; ++d) q += idx[d] * nest.strides[op][d];
    p[op] = q;
    inner_stride[op] = nest.strides[op][inner];
    row_stride[op] = row >= 0 ? nest.strides[op][row] : 0;
  }
  // Steps dim d (and, on wrap-around, the dims outside it) by one.
  auto carry = [&](int d) {
    for (; d >= 0; --d) {
      for (int op = 0; op < kNumOperands; ++op) p[op] += nest.strides[op][d];
      if (++idx[d] < nest.sizes[d]) return;
      for (int op = 0; op < kNumOperands; ++op) p[op] -= idx[d] * nest.strides[op][d];
      idx[d] = 0;
    }
  };
  const int64_t len = nest.sizes[inner];
  int64_t remaining = end - begin;
  while (remaining > 0) {
    if (row < 0 || idx[inner] != 0 || remaining < len) {
      const int64_t n = len - idx[inner] < remaining ? len - idx[inner] : remaining;
      fn(int64_t{1}, n, p, inner_stride, row_stride);
      remaining -= n;
      idx[inner] += n;
      for (int op = 0; op < kNumOperands; ++op) p[op] += n * inner_stride[op];
      if (idx[inner] == len) {
        for (int op = 0; op < kNumOperands; ++op) p[op] -= len * inner_stride[op];
        idx[inner] = 0;
        carry(row);
      }
    } else {
      int64_t rows = nest.sizes[row] - idx[row];
      if (rows > remaining / len) rows = remaining / len;
      fn(rows, len, p, inner_stride, row_stride);
      remaining -= rows * len;
      idx[row] += rows;
      for (int op = 0; op < kNumOperands; ++op) p[op] += rows * row_stride[op];
      if (idx[row] == nest.sizes[row]) {
        for (int op = 0; op < kNumOperands; ++op) p[op] -= idx[row] * row_stride[op];
        idx[row] = 0;
        carry(row - 1);
      }
    }
  }
}
