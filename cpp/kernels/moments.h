// Shifted sums for mean-variance normalization statistics. Included inside an ISA namespace.
// d = (x - pivot) * scale is accumulated in the compute type over fixed chunks, and each chunk's
// lane sums are added to double totals in order: the totals depend only on the data and where it
// lies in memory, never on how the work was split between threads.
// The scale is 1, or a power of two for a pass after squares overflowed or may have underflowed
// (ops/mvn.cpp: Scaling), and d is taken as x * scale - pivot * scale: the same value for a power of
// two, but x - pivot cannot overflow where x and the pivot lie near the largest float with opposite
// signs (it made such a group's statistics NaN).

template <class T>
struct MomentsKernel {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename ComputeOf<T>::type;
  static constexpr int W = L::W;
  static constexpr int64_t kChunkSteps = kMomentChunk / W;  // vector steps per float chunk

  // The shifted sums of one contiguous run, as a cursor: a caller may interleave its steps with
  // other work (kernels/normalize.h normalizes the previous row in the same loop) and gets the same
  // bits as row(), which runs the same steps back to back. Unscaled, it skips the multiply by a
  // scale of 1 (x * 1 == x exactly: the same bits, one multiply fewer per vector). With Keep, it
  // also stores the row as it reads it, converted, at `keep` (float; room for a vector past n).
  // With Rows > 1 it sums that many runs of n in step, at the same phase to a vector (each run's
  // sums are those it would have alone).
  template <bool Scaled, bool Keep = false, int Rows = 1>
  struct ContiguousSums {
    struct Row {
      float* keep;
      const T* x;
      V pivot, s1a, s1b, s2a, s2b;
      double sum, sum_sq;
    };
    RowsOf<Row, Rows> rows;
    int64_t n, i = 0, steps = 0;
    V scale;

    SIMDNORM_CURSOR_METHOD explicit ContiguousSums(const RowMomentsArgs& a, float* keep_at = nullptr)
        : ContiguousSums(&a, &keep_at) {}
    // a[r], keep_at[r]: run r's (the scale is run 0's, shared).
    SIMDNORM_CURSOR_METHOD ContiguousSums(const RowMomentsArgs* a, float* const* keep_at)
        : n(a[0].len), scale(splat<V>(a[0].scale)) {
      rows.each([&](Row& row, int r) SIMDNORM_INLINE_LAMBDA {
        row.keep = keep_at[r];
        row.x = reinterpret_cast<const T*>(a[r].data);
        row.pivot = splat<V>(Scaled ? a[r].pivot * a[0].scale : a[r].pivot);  // (see shifted())
        row.s1a = row.s1b = row.s2a = row.s2b = splat<V>(0.0);
        row.sum = row.sum_sq = 0.0;
      });
      if constexpr (W > 1) {  // align the loads (line-straddling loads cost on this hardware)
        constexpr uintptr_t vbytes = W * sizeof(T);
        const uintptr_t addr = reinterpret_cast<uintptr_t>(rows.r0.x);
        if (addr % sizeof(T) == 0) {
          int64_t head = static_cast<int64_t>(((vbytes - addr % vbytes) % vbytes) / sizeof(T));
          if (head > n) head = n;
          if (head > 0) {
            const int m = static_cast<int>(head);
            rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA { add_partial(row, L::load_partial(row.x, m), m); });
          }
          i = head;
        }
      }
    }
    SIMDNORM_CURSOR_METHOD bool can_step() const { return i + 2 * W <= n; }
    SIMDNORM_CURSOR_METHOD void step() {
      rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
        const V x0 = L::load(row.x + i), x1 = L::load(row.x + i + W);
        kept(row, i, x0);
        kept(row, i + W, x1);
        const V d0 = shifted(x0, row.pivot);
        const V d1 = shifted(x1, row.pivot);
        row.s1a += d0;
        row.s1b += d1;
        row.s2a = vfma(d0, d0, row.s2a);
        row.s2b = vfma(d1, d1, row.s2b);
      });
      i += 2 * W;
      if ((steps += 2) >= kChunkSteps) {
        flush();
        steps = 0;
      }
    }
    // The rest of the runs; adds run r's totals to the caller's total[r] and total_sq[r].
    SIMDNORM_CURSOR_METHOD void finish(double* total, double* total_sq) {
      rest();
      rows.each([&](const Row& row, int r) SIMDNORM_INLINE_LAMBDA {
        total[r] += row.sum;
        total_sq[r] += row.sum_sq;
      });
    }
    // The rest of the runs, leaving the totals in each row's sum and sum_sq.
    SIMDNORM_CURSOR_METHOD void rest() {
      while (can_step()) step();
      if (i + W <= n) {
        rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
          const V xv = L::load(row.x + i);
          kept(row, i, xv);
          const V d = shifted(xv, row.pivot);
          row.s1a += d;
          row.s2a = vfma(d, d, row.s2a);
        });
        i += W;
      }
      if (i < n) {
        const int m = static_cast<int>(n - i);
        rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA { add_partial(row, L::load_partial(row.x + i, m), m); });
      }
      flush();
    }
    SIMDNORM_CURSOR_METHOD void add_partial(Row& row, V x_part, int m) {
      kept(row, i, x_part);  // a whole vector: the lanes past m land where later steps or the padding go
      const V d = vselect(lanes_mask(static_cast<V*>(nullptr), m), shifted(x_part, row.pivot), splat<V>(0.0));
      row.s1a += d;
      row.s2a = vfma(d, d, row.s2a);
    }
    SIMDNORM_CURSOR_METHOD void kept(const Row& row, int64_t at, V v) const {
      if constexpr (Keep) Lanes<float>::store(row.keep + at, v);
    }
    // (x - pivot) * scale, the pivot given times the scale (see the top of the file).
    SIMDNORM_CURSOR_METHOD V shifted(V x, V scaled_pivot) const {
      if constexpr (Scaled) return x * scale - scaled_pivot;
      else return x - scaled_pivot;
    }
    SIMDNORM_CURSOR_METHOD void flush() {
      rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
        row.sum += static_cast<double>(vreduce_add(row.s1a + row.s1b));
        row.sum_sq += static_cast<double>(vreduce_add(row.s2a + row.s2b));
        row.s1a = row.s1b = row.s2a = row.s2b = splat<V>(0.0);
      });
    }
  };

  static void row(const RowMomentsArgs& a) {
    if (a.stride == static_cast<int64_t>(sizeof(T)))
      return a.scale == 1.0 ? ContiguousSums<false>(a).finish(a.sum, a.sum_sq)
                            : ContiguousSums<true>(a).finish(a.sum, a.sum_sq);
    const V pivot = splat<V>(a.pivot * a.scale), scale = splat<V>(a.scale), zero = splat<V>(0.0);
    V s1 = zero, s2 = zero;
    double sum = 0.0, sum_sq = 0.0;
    T buf[W];
    int64_t steps = 0;
    for (int64_t i = 0; i < a.len; i += W) {
      const int m = static_cast<int>(a.len - i < W ? a.len - i : W);
      for (int k = 0; k < m; ++k) std::memcpy(&buf[k], a.data + (i + k) * a.stride, sizeof(T));
      const V d = vselect(lanes_mask(static_cast<V*>(nullptr), m), L::load_partial(buf, m) * scale - pivot, zero);
      s1 += d;
      s2 = vfma(d, d, s2);
      if (++steps >= kChunkSteps) {
        sum += static_cast<double>(vreduce_add(s1));
        sum_sq += static_cast<double>(vreduce_add(s2));
        s1 = s2 = zero;
        steps = 0;
      }
    }
    sum += static_cast<double>(vreduce_add(s1));
    sum_sq += static_cast<double>(vreduce_add(s2));
    *a.sum += sum;
    *a.sum_sq += sum_sq;
  }

  // Lane blocks of at most kLanes, rows in chunks of kRowChunk before each flush to double.
  static constexpr int kLanes = 256;
  static constexpr int64_t kRowChunk = 64;

  static void col(const ColMomentsArgs& a) {
    constexpr int kVecs = kLanes / W;
    for (int64_t c0 = 0; c0 < a.cols; c0 += kLanes) {
      const int nb = static_cast<int>(a.cols - c0 < kLanes ? a.cols - c0 : kLanes);
      const int nv = (nb + W - 1) / W;
      const int last = nb - (nv - 1) * W;  // lanes in the last vector
      C piv[kLanes];
      for (int c = 0; c < nb; ++c) piv[c] = static_cast<C>(a.pivot[c0 + c] * a.scale);
      for (int c = nb; c < nv * W; ++c) piv[c] = 0;
      V vp[kVecs], s1[kVecs], s2[kVecs];
      for (int v = 0; v < nv; ++v) vp[v] = Lanes<C>::load(piv + v * W);
      const V scale = splat<V>(a.scale), zero = splat<V>(0.0);
      const bool contiguous = a.col_stride == static_cast<int64_t>(sizeof(T));
      // Rows are prefetched kPrefetchAheadBytes ahead (at least a row): channels-last instance
      // norm of (8, 56, 56, 256) float32, 1 thread, 3.0 -> 2.0 ms. (Sums kept in registers, eight
      // vectors of lanes at a time down the rows rather than all sixteen spilled: no gain.)
      const int64_t step = a.row_stride < 0 ? -a.row_stride : a.row_stride;
      const int64_t ahead = step == 0 ? 0 : prefetch_units_ahead(step);
      const int64_t block_bytes = nb * static_cast<int64_t>(sizeof(T));
      for (int64_t r0 = 0; r0 < a.rows; r0 += kRowChunk) {
        const int64_t r1 = r0 + kRowChunk < a.rows ? r0 + kRowChunk : a.rows;
        for (int v = 0; v < nv; ++v) s1[v] = s2[v] = zero;
        for (int64_t r = r0; r < r1; ++r) {
          const char* row = a.data + r * a.row_stride + c0 * a.col_stride;
          if (contiguous && ahead > 0 && r + ahead < a.rows) {
            const char* later = row + ahead * a.row_stride;
            for (int64_t b = 0; b < block_bytes; b += 64) __builtin_prefetch(later + b, 0, 3);
          }
          for (int v = 0; v < nv; ++v) {
            const int m = v == nv - 1 ? last : W;
            V x;
            if (contiguous) {
              const T* px = reinterpret_cast<const T*>(row) + v * W;
              x = m == W ? L::load(px) : L::load_partial(px, m);
            } else {
              T buf[W];
              for (int k = 0; k < m; ++k) std::memcpy(&buf[k], row + (v * W + k) * a.col_stride, sizeof(T));
              x = L::load_partial(buf, m);
            }
            const V d = x * scale - vp[v];
            s1[v] += d;
            s2[v] = vfma(d, d, s2[v]);
          }
        }
        C t1[kLanes], t2[kLanes];
        for (int v = 0; v < nv; ++v) {
          Lanes<C>::store(t1 + v * W, s1[v]);
          Lanes<C>::store(t2 + v * W, s2[v]);
        }
        for (int c = 0; c < nb; ++c) {
          a.sum[c0 + c] += static_cast<double>(t1[c]);
          a.sum_sq[c0 + c] += static_cast<double>(t2[c]);
        }
      }
    }
  }
};

static void row_moments_entry(const RowMomentsArgs& a) {
  switch (a.dtype) {
    case DType::f32: return MomentsKernel<float>::row(a);
    case DType::f16: return MomentsKernel<f16_t>::row(a);
    case DType::bf16: return MomentsKernel<bf16_t>::row(a);
    case DType::f64: return MomentsKernel<double>::row(a);
  }
}

static void col_moments_entry(const ColMomentsArgs& a) {
  switch (a.dtype) {
    case DType::f32: return MomentsKernel<float>::col(a);
    case DType::f16: return MomentsKernel<f16_t>::col(a);
    case DType::bf16: return MomentsKernel<bf16_t>::col(a);
    case DType::f64: return MomentsKernel<double>::col(a);
  }
}
