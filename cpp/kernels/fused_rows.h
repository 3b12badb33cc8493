// Normalizing one row while taking the sums of the next, in one loop. Included inside an ISA
// namespace, after normalize.h and moments.h.
//
// Layer and RMS norm read each row twice: for its statistics, then to normalize it. Run as two
// loops, the reads of the statistics pass and the writes of the normalize pass take turns, and the
// division and square root that end a row's statistics hold up its normalization. Here row r is
// normalized (its data in L1) in the same loop that reads row r + 1 from memory, so the read and
// write streams overlap as in a copy. The sums are those of MomentsKernel::row, step for step.

template <class T>
struct FusedRowsKernel {
  using N = NormalizeKernel<T>;
  using M = MomentsKernel<T>;

  // `ahead`: where the run after `next` probably starts. Asked for ahead of its sums, it arrives in
  // time (measured: float32 4096 x 768 rows 0.82 ms with it, 0.98 without).
  template <class Run>
  static void interleave(Run run, const RowMomentsArgs& next, const char* ahead) {
    typename M::ContiguousSums sums(next);
    while (run.can_step() && sums.can_step()) {
      static_assert(2 * M::W * sizeof(T) <= 128, "one step reads at most two lines");
      __builtin_prefetch(ahead + sums.i * sizeof(T), 0, 3);
      if constexpr (2 * M::W * sizeof(T) > 64) __builtin_prefetch(ahead + sums.i * sizeof(T) + 64, 0, 3);
      run.step();
      sums.step();
    }
    run.finish();
    sums.finish(next.sum, next.sum_sq);
  }

  static void execute(const NormalizeTask& task, char* const* p, int64_t n, const RowMomentsArgs& next) {
    constexpr int64_t ts = sizeof(T), cs = sizeof(typename N::C);
    const LoopNest& nest = task.loop;
    const int inner = nest.ndim - 1;
    auto stride = [&](int op) { return nest.strides[op][inner]; };
    const bool contiguous = stride(kIn) == ts && stride(kOut) == ts && next.stride == ts;
    const bool stats_const = stride(kShift) == 0 && stride(kMul) == 0;
    const bool affine_const = stride(kScale) == 0 && stride(kBias) == 0;
    const bool affine_vary = stride(kScale) == cs && stride(kBias) == cs;
    if (task.scale_folded || !contiguous || !stats_const || !(affine_const || affine_vary)) {
      N::execute_run(task, p, n);
      return M::row(next);
    }
    const bool peel = N::peels(n, affine_vary);
    // Runs of a group usually follow each other.
    const char* ahead = next.data + next.len * ts;
    visit_activation<typename N::V>(task.act, [&](const auto& act) {
      using F = typename N::template Formula<std::decay_t<decltype(act)>, false>;
      if (affine_const)
        interleave(typename N::template ContiguousRun<false, false, F>(F{act}, n, p, task.stream_stores, peel), next,
                   ahead);
      else
        interleave(typename N::template ContiguousRun<false, true, F>(F{act}, n, p, task.stream_stores, peel), next,
                   ahead);
    });
  }

  // The pipeline of FusedRowsArgs: every row's sums, its statistics (the caller's finish), and its
  // normalization while the next row is summed. One call for all rows: the per-row cost of
  // entering the kernel, choosing the loop and the activation is paid once (measured on 4096 rows
  // of 768 float32: ~100 ns per row when each row was a call of its own).
  static void execute_rows(const NormalizeTask& task, const FusedRowsArgs& a) {
    constexpr int64_t ts = sizeof(T), cs = sizeof(typename N::C);
    const int inner = task.loop.ndim - 1;
    auto stride = [&](int op) { return task.loop.strides[op][inner]; };
    auto row = [&](int64_t r, char** q) {
      for (int op = 0; op < kNumOperands; ++op) q[op] = a.data[op] + r * a.step[op];
    };
    // The first-pass sums of row r, into s[0], s[1]; the pivot is returned to the caller's finish.
    auto moments = [&](int64_t r, double* s) {
      const char* first = a.data[kIn] + r * a.step[kIn];
      const double pivot = a.pivot_first ? static_cast<double>(M::L::load_one(reinterpret_cast<const T*>(first))) : 0.0;
      s[0] = s[1] = 0.0;
      return RowMomentsArgs{first, task.dtype, a.len, stride(kIn), pivot, 1.0, &s[0], &s[1]};
    };
    const bool contiguous = stride(kIn) == ts && stride(kOut) == ts;
    const bool stats_const = stride(kShift) == 0 && stride(kMul) == 0;
    const bool affine_const = stride(kScale) == 0 && stride(kBias) == 0;
    const bool affine_vary = stride(kScale) == cs && stride(kBias) == cs;
    if (task.scale_folded || !contiguous || !stats_const || !(affine_const || affine_vary)) {
      for (int64_t r = 0; r < a.rows; ++r) {
        double s[2];
        const RowMomentsArgs m = moments(r, s);
        M::row(m);
        a.finish(a.ctx, r, m.pivot, s[0], s[1]);
        char* q[kNumOperands];
        row(r, q);
        N::execute_run(task, q, a.len);
      }
      return;
    }
    const bool peel = N::peels(a.len, affine_vary);
    // Row r + 1's statistics are finished before row r is normalized (while row r + 2 is summed):
    // the divisions and the square root that end them then run beside a whole row's loop instead
    // of holding up the next row's start. Row r's sums and pivot live in slot r % 2.
    auto pipeline = [&](auto make_run) {
      double s[2][2];
      RowMomentsArgs m[2];
      for (int64_t r = 0; r < 2 && r < a.rows; ++r) {
        m[r] = moments(r, s[r]);
        M::row(m[r]);
      }
      a.finish(a.ctx, 0, m[0].pivot, s[0][0], s[0][1]);
      for (int64_t r = 0; r < a.rows; ++r) {
        const int next = static_cast<int>((r + 1) & 1), own = static_cast<int>(r & 1);
        if (r + 1 < a.rows) a.finish(a.ctx, r + 1, m[next].pivot, s[next][0], s[next][1]);
        char* q[kNumOperands];
        row(r, q);
        if (r + 2 < a.rows) {
          m[own] = moments(r + 2, s[own]);
          interleave(make_run(q), m[own], m[own].data + a.step[kIn]);
        } else {
          make_run(q).finish();
        }
      }
    };
    visit_activation<typename N::V>(task.act, [&](const auto& act) {
      using F = typename N::template Formula<std::decay_t<decltype(act)>, false>;
      const F f{act};
      if (affine_const)
        pipeline([&](char* const* q) {
          return typename N::template ContiguousRun<false, false, F>(f, a.len, q, task.stream_stores, peel);
        });
      else
        pipeline([&](char* const* q) {
          return typename N::template ContiguousRun<false, true, F>(f, a.len, q, task.stream_stores, peel);
        });
    });
  }
};

static void normalize_rows_fused_entry(const NormalizeTask& task, const FusedRowsArgs& args) {
  switch (task.dtype) {
    case DType::f32: return FusedRowsKernel<float>::execute_rows(task, args);
    case DType::f16: return FusedRowsKernel<f16_t>::execute_rows(task, args);
    case DType::bf16: return FusedRowsKernel<bf16_t>::execute_rows(task, args);
    case DType::f64: return FusedRowsKernel<double>::execute_rows(task, args);
  }
}

static void normalize_run_and_sum_entry(const NormalizeTask& task, char* const* p, int64_t n,
                                        const RowMomentsArgs& next) {
  switch (task.dtype) {
    case DType::f32: return FusedRowsKernel<float>::execute(task, p, n, next);
    case DType::f16: return FusedRowsKernel<f16_t>::execute(task, p, n, next);
    case DType::bf16: return FusedRowsKernel<bf16_t>::execute(task, p, n, next);
    case DType::f64: return FusedRowsKernel<double>::execute(task, p, n, next);
  }
}
