// A few rows of contiguous lanes, statistics and normalization in one call (kernel_table.h:
// FusedColumnsArgs; batch norm training of (N, C) data with a small batch). Included inside an ISA
// namespace after moments.h, normalize.h and lane_stats.h, whose loops it runs a chunk of lanes at
// a time: the chunk's sums down the rows (col_few_rows), its statistics (lane_stats_loop,
// inv_std_lanes_entry), then its rows normalized (normalize_entry, a row at a time), its data, sums
// and statistics in the L1. Run one pass after another over thousands of lanes, the same loops
// made and read arrays of every lane's sums and statistics through the L2, which cost such calls
// more than the sums and the normalization themselves.

template <class T>
struct FusedColumnsKernel {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename ComputeOf<T>::type;
  using Moments = MomentsKernel<T>;
  static constexpr int W = L::W;
  // Lanes a chunk: its arrays (six doubles and two coefficients a lane) and 16 rows of float32 data
  // take 22 KB. The lane loops step 64 lanes at AVX-512, and leave fewer to their scalar tails.
  static constexpr int64_t kChunk = 256;

  static int64_t run(const NormalizeTask& task, const FusedColumnsArgs& a) {
    const LoopNest& nest = task.loop;
    const int64_t rows = nest.sizes[0], lanes = nest.sizes[1], cs = sizeof(C);
    static_assert(kFusedColumnRows <= Moments::kFewRows, "the rows col_few_rows sums in one sweep");
    SIMDNORM_CHECK(rows <= kFusedColumnRows);
    // A chunk's rows: the task's from lane c0, with the chunk's shift and mul, through the
    // normalize kernel (one copy of its loops), a row at a time: rows a multiple of 4 KB apart
    // share the L1's sets, and a few rows' stores then evict the lines of the rows still to be
    // read (rows in step, sharing each coefficient vector, lost to this on (8, 4096)).
    NormalizeTask chunk = task;
    LoopNest& n = chunk.loop;
    chunk.inner = InnerPlan{InnerLoop::contiguous, true, nest.strides[kBias][1] != 0, 0};
    for (int op : {kShift, kMul}) n.strides[op][0] = 0, n.strides[op][1] = cs;
    for (int64_t c0 = 0; c0 < lanes; c0 += kChunk) {
      const int64_t nc = std::min(kChunk, lanes - c0);
      alignas(64) C shift[kChunk], mul[kChunk];
      const int64_t settled = chunk_statistics(task, a, c0, nc, shift, mul);
      for (int op : {kIn, kOut, kScale, kBias}) n.data[op] = nest.data[op] + c0 * nest.strides[op][1];
      n.sizes[1] = settled;
      n.data[kShift] = reinterpret_cast<char*>(shift);
      n.data[kMul] = reinterpret_cast<char*>(mul);
      if (settled > 0) normalize_entry(chunk, 0, rows * settled);
      if (settled < nc) return c0 + settled;  // (the caller's passes take the rest)
    }
    return lanes;
  }

  // Lanes [c0, c0 + nc): their sums and statistics, each lane's shift (the mean) and mul (1 / std)
  // into shift and mul, the user's statistics stored. Returns how many come before the first slow
  // lane (those are the ones done).
  static int64_t chunk_statistics(const NormalizeTask& task, const FusedColumnsArgs& a, int64_t c0, int64_t nc,
                                  C* shift, C* mul) {
    const LoopNest& nest = task.loop;
    const int64_t rows = nest.sizes[0], ts = sizeof(T);
    alignas(64) double pivot[kChunk], s1[kChunk], s2[kChunk], mean[kChunk], var[kChunk], inv_std[kChunk];
    unsigned char slow[kChunk];
    const char* x = nest.data[kIn] + c0 * ts;
    pivots(reinterpret_cast<const T*>(x), nc, a.centered, pivot);
    Moments::template col_few_rows<true>(
        ColMomentsArgs{x, task.dtype, rows, nc, nest.strides[kIn][0], ts, pivot, 1.0, s1, s2});
    int64_t settled = nc;
    if ((a.centered ? lane_stats_loop<true>(nc, a.inv_n, a.underflow, pivot, s1, s2, mean, var, slow)
                    : lane_stats_loop<false>(nc, a.inv_n, a.underflow, pivot, s1, s2, mean, var, slow)) > 0)
      settled = std::find(slow, slow + nc, 1) - slow;
    // (float32's mul is the float of inv_std_lanes' double: where the unit can, without it)
    int64_t near = 0;
    if constexpr (std::is_same<C, float>::value)
      if (a.rule.normalize_variance && !a.rule.epsilon_outside) near = inv_std_floats_near(var, mul, settled, a.rule.epsilon);
    inv_std_lanes_entry(var + near, inv_std + near, settled - near, 1, a.rule);
    for (int64_t j = near; j < settled; ++j) mul[j] = static_cast<C>(inv_std[j]);
    for (int64_t j = 0; j < settled; ++j) shift[j] = static_cast<C>(mean[j]);
    store_stats(a.stats_out[0], c0, shift, settled);
    store_stats(a.stats_out[1], c0, mul, settled);
    if (a.stats_out[2] != nullptr) {
      alignas(64) C var_c[kChunk];
      for (int64_t j = 0; j < settled; ++j) var_c[j] = static_cast<C>(var[j]);
      store_stats(a.stats_out[2], c0, var_c, settled);
    }
    return settled;
  }

  // Each lane's pivot: its row 0 element (col_moments' pivots for lanes of scale 1), else 0. In
  // vectors: scalar stores before col_few_rows' vector loads of them would not forward.
  static void pivots(const T* first, int64_t n, bool centered, double* pivot) {
    using Sums = SumLanes<V>;
    for (int64_t j = 0; j < n; j += W) {
      const V v = centered ? load_up_to<L>(first + j, static_cast<int>(std::min<int64_t>(W, n - j))) : splat<V>(0.0);
      for_constant<0, Sums::kParts>([&](auto part) SIMDNORM_INLINE_LAMBDA {
        constexpr int pi = decltype(part)::value;
        Lanes<double>::store(pivot + j + pi * Sums::WD, Sums::template part<pi>(v));
      });
    }
  }

  static void store_stats(char* out, int64_t c0, const C* values, int64_t n) {
    if (out != nullptr) std::memcpy(out + c0 * static_cast<int64_t>(sizeof(C)), values, n * sizeof(C));
  }
};

static int64_t normalize_columns_fused_entry(const NormalizeTask& task, const FusedColumnsArgs& args) {
  int64_t done = 0;
  with_storage_type(task.dtype, [&](auto t) {
    done = FusedColumnsKernel<typename decltype(t)::type>::run(task, args);
  });
  return done;
}
