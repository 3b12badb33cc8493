// Normalizing one row while taking the sums of the next, in one loop. Included inside an ISA
// namespace, after normalize.h and moments.h.
//
// Layer and RMS norm read each row twice: for its statistics, then to normalize it. Run as two
// loops, the reads of the statistics pass and the writes of the normalize pass take turns, and the
// division and square root that end a row's statistics hold up its normalization. Here a run is
// normalized (its data in L1) in the same loop that reads a later one from memory: the next run of
// a group (execute), or the row after next (execute_rows: layer and RMS norm rows, all in one
// call), so the read and write streams overlap as in a copy. The sums are those of
// MomentsKernel::row, step for step.

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

  // The layouts the fused loops take: contiguous data, one mean and 1/std per run, scale and bias
  // constant or read beside the data (anything else runs the two loops one after the other).
  struct InnerRun {
    bool fusable, affine_vary;
    explicit InnerRun(const NormalizeTask& task) {
      constexpr int64_t ts = sizeof(T), cs = sizeof(typename N::C);
      const int inner = task.loop.ndim - 1;
      auto stride = [&](int op) { return task.loop.strides[op][inner]; };
      const bool affine_const = stride(kScale) == 0 && stride(kBias) == 0;
      affine_vary = stride(kScale) == cs && stride(kBias) == cs;
      fusable = !task.scale_folded && stride(kIn) == ts && stride(kOut) == ts && stride(kShift) == 0 &&
                stride(kMul) == 0 && (affine_const || affine_vary);
    }
    // Calls fn(make_run), make_run(pointers, n) giving the normalize cursor of one run.
    template <class Fn>
    void visit(const NormalizeTask& task, Fn&& fn) const {
      const bool vary = affine_vary;
      visit_activation<typename N::V>(task.act, [&](const auto& act) {
        using F = typename N::template Formula<std::decay_t<decltype(act)>, false>;
        const F f{act};
        const bool stream = task.stream_stores;
        if (vary)
          fn([&](char* const* q, int64_t n) {
            return typename N::template ContiguousRun<false, true, F>(f, n, q, stream, N::peels(n, true));
          });
        else
          fn([&](char* const* q, int64_t n) {
            return typename N::template ContiguousRun<false, false, F>(f, n, q, stream, N::peels(n, false));
          });
      });
    }
  };

  static void execute(const NormalizeTask& task, char* const* p, int64_t n, const RowMomentsArgs& next) {
    const InnerRun layout(task);
    if (!layout.fusable || next.stride != static_cast<int64_t>(sizeof(T))) {
      N::execute_run(task, p, n);
      return M::row(next);
    }
    // Runs of a group usually follow each other.
    const char* ahead = next.data + next.len * static_cast<int64_t>(sizeof(T));
    layout.visit(task, [&](auto make_run) { interleave(make_run(p, n), next, ahead); });
  }

  // The pipeline of FusedRowsArgs: every row's sums, its statistics (the caller's finish), and its
  // normalization while a later row is summed. One call for all rows: the cost of entering the
  // kernel, choosing the loop and the activation is paid once, not per row (measured on 1024 rows
  // of 768 float16: 102 us against 180 us with a call per row).
  static void execute_rows(const NormalizeTask& task, const FusedRowsArgs& a) {
    auto row = [&](int64_t r, char** q) {
      for (int op = 0; op < kNumOperands; ++op) q[op] = a.data[op] + r * a.step[op];
    };
    // The first-pass sums of row r, into s[0], s[1]; the pivot is returned to the caller's finish.
    auto moments = [&](int64_t r, double* s) {
      const char* first = a.data[kIn] + r * a.step[kIn];
      const double pivot = a.centered ? static_cast<double>(M::L::load_one(reinterpret_cast<const T*>(first))) : 0.0;
      s[0] = s[1] = 0.0;
      return RowMomentsArgs{first, task.dtype, a.len, task.loop.strides[kIn][task.loop.ndim - 1], pivot, 1.0, &s[0],
                            &s[1]};
    };
    const InnerRun layout(task);
    if (!layout.fusable) {
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
    // Row r + 1's statistics are finished before row r is normalized (while row r + 2 is summed):
    // the divisions and the square root that end them then run beside a whole row's loop instead
    // of holding up the next row's start. Row r's sums and pivot live in slot r % 2. (Finishing
    // k rows at a time, 2k rows ahead, was 3-12% slower: more rows to keep in L1.)
    layout.visit(task, [&](auto make_run) {
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
          interleave(make_run(q, a.len), m[own], m[own].data + a.step[kIn]);
        } else {
          make_run(q, a.len).finish();
        }
      }
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
