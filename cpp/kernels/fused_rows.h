// Normalizing one row while taking the sums of the next, in one loop. Included inside an ISA
// namespace, after normalize.h and moments.h.
//
// Layer and RMS norm read each row twice: for its statistics, then to normalize it. Run as two
// loops, the reads of the statistics pass and the writes of the normalize pass take turns, and the
// division and square root that end a row's statistics hold up its normalization. Here a run is
// normalized (its data in L1) in the same loop that reads a later one from memory: the next run of
// a group (execute), or a row two or four ahead (execute_rows: layer and RMS norm rows, all in one
// call), so the read and write streams overlap as in a copy. The sums are those of
// MomentsKernel::row, step for step.

template <class T>
struct FusedRowsKernel {
  using N = NormalizeKernel<T>;
  using M = MomentsKernel<T>;

  struct Totals {
    double sum, sum_sq;
  };
  // Runs `run` and takes the first-pass sums of next[r] (their scale must be 1) into out[r], for
  // Rows runs at one phase. ahead[r]: where a run after next[r] probably starts. Asked for ahead of
  // its sums, it arrives in time (measured: float32 4096 x 768 rows 0.82 ms with it, 0.98 without).
  template <bool Keep, int Rows, class Run>
  static void interleave(Run run, const RowMomentsArgs* next, const char* const* ahead, float* const* keep,
                         Totals* out) {
    typename M::template ContiguousSums<false, Keep, Rows> sums(next, keep);
    RowsOf<const char*, Rows> prefetch;  // in registers: the loop's stores may alias any array
    prefetch.each([&](const char*& p, int r) SIMDNORM_INLINE_LAMBDA { p = ahead[r]; });
    while (run.can_step() && sums.can_step()) {
      static_assert(2 * M::W * sizeof(T) <= 128, "one step reads at most two lines");
      prefetch.each([&](const char* p, int) SIMDNORM_INLINE_LAMBDA {
        __builtin_prefetch(p + sums.i * sizeof(T), 0, 3);
        if constexpr (2 * M::W * sizeof(T) > 64) __builtin_prefetch(p + sums.i * sizeof(T) + 64, 0, 3);
      });
      run.step();
      sums.step();
    }
    run.finish();
    sums.rest();
    sums.rows.each([&](const auto& row, int r) { out[r] = {row.sum, row.sum_sq}; });
  }

  // Gives the normalize cursor of Rows runs of n, reading the input as In (T, or a float32 copy of
  // it), p[r] the operands of run r.
  template <bool AffineVary, class F, class In>
  struct RunMaker {
    F f;
    bool stream;
    template <int Rows>
    using Run = typename N::template ContiguousRun<false, AffineVary, F, In, true, Rows>;
    template <int Rows>
    SIMDNORM_CURSOR_METHOD Run<Rows> rows(char* const* const* p, int64_t n) const {
      return {f, n, p, stream, N::peels(n, AffineVary)};
    }
  };

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
    // Calls fn(runs) with the RunMaker of the task's activation and layout.
    // Float16 rows read from their float32 copy fold the shift into the multiply (Formula): the
    // conversions leave the loop short of FP issue slots, and one operation fewer per vector took
    // 3.15 -> 2.75 cycles a vector in a model of the loop (float16 rows of 768, all in L1). The
    // fold rounds -(shift * mul) once more, by at most 2^-24 |mean| / std in normalized units;
    // float16's range (|x| <= 65504) keeps that product finite wherever the unfolded form is.
    template <class In = T, class Fn>
    void visit(const NormalizeTask& task, Fn&& fn) const {
      constexpr bool shift_folded = std::is_same<T, f16_t>::value && std::is_same<In, float>::value;
      constexpr auto fold = shift_folded ? N::Fold::shift : N::Fold::none;
      visit_activation<typename N::V>(task.act, [&](const auto& act) {
        using F = typename N::template Formula<std::decay_t<decltype(act)>, fold>;
        const F f{act};
        if (affine_vary) fn(RunMaker<true, F, In>{f, task.stream_stores});
        else fn(RunMaker<false, F, In>{f, task.stream_stores});
      });
    }
  };

  static void execute(const NormalizeTask& task, char* const* p, int64_t n, const RowMomentsArgs& next,
                      const char* ahead) {
    const InnerRun layout(task);
    if (!layout.fusable || next.stride != static_cast<int64_t>(sizeof(T)) || next.scale != 1.0) {
      N::execute_run(task, p, n);
      return M::row(next);
    }
    layout.visit(task, [&](const auto& runs) {
      Totals t;
      float* const no_keep = nullptr;
      interleave<false, 1>(runs.template rows<1>(&p, n), &next, &ahead, &no_keep, &t);
      *next.sum += t.sum;
      *next.sum_sq += t.sum_sq;
    });
  }

  static constexpr int kPairRows = 2;  // long rows run in pairs (pipeline_rows)
  static constexpr int kMaxBatch = 4;
  static_assert(kMaxBatch % kPairRows == 0 && 2 % kPairRows == 0, "batches (batch_rows) are whole pairs");
  // Rows finished together (see execute_rows): four under 1 KB, else two.
  static constexpr int64_t kFourBelowBytes = 1024;
  static constexpr int batch_rows(int64_t len) {
    return len * static_cast<int64_t>(sizeof(T)) < kFourBelowBytes ? kMaxBatch : 2;
  }
  static constexpr int64_t kKeptRowMax = 1024;  // longest float16 row kept converted in the ring
  // Floats per kept row: the row, a vector of room past it, whole 64-byte lines.
  static constexpr int64_t kept_pitch(int64_t len) { return (len + M::W + 15) / 16 * 16; }
  // The ring: the batch's rows and the one being summed.
  static constexpr int64_t ring_floats(int64_t len) { return (batch_rows(len) + 1) * kept_pitch(len); }
  // On the stack: the larger ring of the longest row of each batch size, and a line to align.
  static constexpr int64_t kLongestOfFour = kFourBelowBytes / sizeof(T) - 1;  // < kKeptRowMax
  static_assert(batch_rows(kLongestOfFour) == kMaxBatch && batch_rows(kLongestOfFour + 1) == 2,
                "the ring is sized for the longest row of each batch size");
  static constexpr int64_t kRingFloats = 16 + (ring_floats(kLongestOfFour) > ring_floats(kKeptRowMax)
                                                   ? ring_floats(kLongestOfFour)
                                                   : ring_floats(kKeptRowMax));

  static constexpr int64_t kLinedUpMax = 2048;  // longest scale and bias copied to line up
  // Where in `storage` (room for a line more than needed) an array read beside the output starts,
  // so that its loads are 64-byte aligned where the output's stores are (past the run's peel):
  // for the first row, and for every row when the rows' step is whole lines.
  template <class E>
  static E* lined_up(E* storage, const char* out) {
    constexpr int64_t per_line = 64 / sizeof(E);
    const int64_t head = N::head_to_line(out);
    const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(storage) / sizeof(E));
    return storage + (per_line - (base + head) % per_line) % per_line;
  }

  // The first pass over row r (its pivot goes to the caller's finish); ContiguousSums::finish
  // adds its sums to *sum and *sum_sq, interleave() returns them.
  static RowMomentsArgs first_pass(const NormalizeTask& task, const FusedRowsArgs& a, int64_t r, double* sum = nullptr,
                                   double* sum_sq = nullptr) {
    const char* first = a.data[kIn] + r * a.step[kIn];
    const double pivot = a.centered ? static_cast<double>(M::L::load_one(reinterpret_cast<const T*>(first))) : 0.0;
    return RowMomentsArgs{first, task.dtype, a.len, task.loop.strides[kIn][task.loop.ndim - 1], pivot, 1.0, sum, sum_sq};
  }

  // execute_rows' loop over rows [first, last): sums k rows ahead, finishes k at a time,
  // normalizes, Rows rows in step (k and last - first multiples of Rows). With Keep, the sums store
  // each row converted at kept_row(r) and the normalize cursor reads that copy.
  template <bool Keep, int Rows, class Runs, class KeptRow>
  static void pipeline(const NormalizeTask& task, const FusedRowsArgs& a, int64_t first, int64_t last, int k,
                       int64_t rows_ahead, const Runs& runs, KeptRow kept_row) {
    double pivot[kMaxBatch], sum[kMaxBatch] = {}, sum_sq[kMaxBatch] = {};  // row j in slot (j - first) % k
    for (int64_t r = first; r < first + k && r < last; ++r) {
      const int slot = static_cast<int>(r - first);
      const RowMomentsArgs m = first_pass(task, a, r, &sum[slot], &sum_sq[slot]);
      typename M::template ContiguousSums<false, Keep>(m, kept_row(r)).finish(&sum[slot], &sum_sq[slot]);
      pivot[slot] = m.pivot;
    }
    for (int64_t r = first; r < last; r += Rows) {
      const int slot = static_cast<int>((r - first) % k);
      if (slot == 0) {
        const int64_t left = last - r;
        a.finish(a.ctx, r, static_cast<int>(left < k ? left : k), pivot, sum, sum_sq);
      }
      char* q[Rows][kNumOperands];
      char* const* rows[Rows];
      for (int j = 0; j < Rows; ++j) {
        for (int op = 0; op < kNumOperands; ++op) q[j][op] = a.data[op] + (r + j) * a.step[op];
        if constexpr (Keep) q[j][kIn] = reinterpret_cast<char*>(kept_row(r + j));
        rows[j] = q[j];
      }
      if (r + k < last) {
        RowMomentsArgs m[Rows];
        const char* ahead[Rows];
        float* keep[Rows];
        Totals t[Rows];
        for (int j = 0; j < Rows; ++j) {
          m[j] = first_pass(task, a, r + k + j);
          ahead[j] = m[j].data + rows_ahead * a.step[kIn];
          keep[j] = kept_row(r + k + j);
        }
        interleave<Keep, Rows>(runs.template rows<Rows>(rows, a.len), m, ahead, keep, t);
        for (int j = 0; j < Rows; ++j) {
          pivot[slot + j] = m[j].pivot;
          sum[slot + j] = t[j].sum;
          sum_sq[slot + j] = t[j].sum_sq;
        }
      } else {
        runs.template rows<Rows>(rows, a.len).finish();
      }
    }
  }

  // Long rows run two in step, sharing each load of the scale and bias. Per row the loop reads the
  // next row, rereads the row it normalizes and the whole scale and bias: past the L1 (48 KB here)
  // those come from L2 each time. Paired, the scale and bias are read once for two rows. Kernel
  // driver, rows 16 bytes past a line, ns a row, single -> paired: float32 (streamed) 3072
  // 428 -> 393, 4096 666 -> 550; float16 4096 454 -> 386, 8192 921 -> 745. Under the footprint,
  // pairs lost: float32 2048 212 -> 221, float16 3072 266 -> 288. The rows must sit at one phase
  // to a 64-byte line (their steps whole lines, as with the usual hidden sizes).
  static constexpr int64_t kPairFootprint = 48 << 10;  // two rows and the scale and bias, bytes
  static bool rows_pair_up(const FusedRowsArgs& a, bool affine_vary) {
    const int64_t per_element = 2 * static_cast<int64_t>(sizeof(T) + sizeof(typename N::C));
    return N::W > 1 && affine_vary && a.len * per_element >= kPairFootprint && a.rows >= 2 * kPairRows &&
           a.step[kIn] % 64 == 0 && a.step[kOut] % 64 == 0;
  }
  // All rows through pipeline<false, 2> when they pair up (the last of an odd count on its own),
  // else through pipeline<Keep, 1>. (Kept float16 rows, at most 1024, never pair up.)
  template <bool Keep, class Runs, class KeptRow>
  static void pipeline_rows(const NormalizeTask& task, const FusedRowsArgs& a, bool affine_vary, int k,
                            int64_t rows_ahead, const Runs& runs, KeptRow kept_row) {
    if constexpr (!Keep) {
      if (rows_pair_up(a, affine_vary)) {
        const int64_t paired = a.rows / kPairRows * kPairRows;
        // Each of a pair's sums prefetches the rows a pair after it (not its neighbour's).
        const int64_t ahead = (rows_ahead + kPairRows - 1) / kPairRows * kPairRows;
        pipeline<false, kPairRows>(task, a, 0, paired, k, ahead, runs, kept_row);
        if (paired < a.rows) pipeline<false, 1>(task, a, paired, a.rows, k, rows_ahead, runs, kept_row);
        return;
      }
    }
    pipeline<Keep, 1>(task, a, 0, a.rows, k, rows_ahead, runs, kept_row);
  }

  // The pipeline of FusedRowsArgs: every row's sums, its statistics (the caller's finish), and its
  // normalization while a later row is summed. One call for all rows: the cost of entering the
  // kernel, choosing the loop and the activation is paid once, not per row (measured on 1024 rows
  // of 768 float16: 102 us against 180 us with a call per row).
  static void execute_rows(const NormalizeTask& task, const FusedRowsArgs& a) {
    const InnerRun layout(task);
    if (!layout.fusable) {
      for (int64_t r = 0; r < a.rows; ++r) {
        double sum = 0.0, sum_sq = 0.0;
        const RowMomentsArgs m = first_pass(task, a, r, &sum, &sum_sq);
        M::row(m);
        a.finish(a.ctx, r, 1, &m.pivot, &sum, &sum_sq);
        char* q[kNumOperands];
        for (int op = 0; op < kNumOperands; ++op) q[op] = a.data[op] + r * a.step[op];
        N::execute_run(task, q, a.len);
      }
      return;
    }
    // Row r is normalized in the loop that sums row r + k, and rows are finished k at a time,
    // before the first of them is normalized. A row's statistics end in a chain of dependent
    // divisions and a square root that nothing after it can retire past: finished one at a time,
    // one row ahead, the chain held up every row; k rows' chains are independent and overlap.
    // Measured, ns per row: float16 4096 x 768 86 -> 68 (k = 2; 72 with k = 4), 16384 x 192
    // 41 -> 31 (k = 4; 33 with k = 2 or 8), 65536 x 16 24.5 -> 18. The k rows wait in L1 between
    // their two passes.
    const int k = batch_rows(a.len);
    // The prefetch runs at least kPrefetchAheadBytes ahead of the sums.
    const int64_t step_bytes = a.step[kIn] < 0 ? -a.step[kIn] : a.step[kIn];  // 0: a broadcast input
    const int64_t rows_ahead = step_bytes == 0 ? 1 : prefetch_units_ahead(step_bytes);
    // Scale and bias that vary along the row are the same for every row: copied once to where
    // their loads line up with the output's stores, so that no load in the loop straddles two
    // lines. Measured (kernel driver, the two 16 bytes off the output's phase): float16 rows of 768
    // 60 -> 54 ns, float32 rows of 2048 265 -> 188 ns (aligned: 188).
    // (float64 computes a lane at a time: nothing to line up.)
    FusedRowsArgs args = a;
    using C = typename N::C;
    constexpr int64_t pitch_c = kLinedUpMax + 64 / sizeof(C);
    C affine[N::W > 1 ? 2 * pitch_c : 1];
    if (N::W > 1 && layout.affine_vary && a.step[kScale] == 0 && a.step[kBias] == 0 && a.len <= kLinedUpMax) {
      for (int op = kScale; op <= kBias; ++op) {
        C* copy = lined_up(affine + (op - kScale) * pitch_c, a.data[kOut]);
        if ((reinterpret_cast<uintptr_t>(copy) - reinterpret_cast<uintptr_t>(a.data[op])) % 64 == 0) continue;
        std::memcpy(copy, a.data[op], a.len * sizeof(C));
        args.data[op] = reinterpret_cast<char*>(copy);
      }
    }
    // float16 rows: the conversions bound the loop (vcvtph2ps and vcvtps2ph, six per 32 elements).
    // The sums pass keeps each row as it converts it, in a ring of k + 1 float32 rows in L1, and
    // the normalize pass reads that copy: two conversions fewer per 32 elements, the same values.
    // Measured (ns a row, kernel driver): 768 elements 63-65 -> 55-57, 192 28.6 -> 22.1, 1024
    // 86 -> 75; with rows of 1536 and more the ring and the rows outgrow L1 (115 -> 148), and from
    // memory (streaming stores) the loads are the bound: those keep converting twice.
    if constexpr (std::is_same<T, f16_t>::value) {
      if (!task.stream_stores && a.len <= kKeptRowMax) {
        const int64_t pitch = kept_pitch(a.len);
        float storage[kRingFloats];
        float* ring = lined_up(storage, a.data[kOut]);
        auto kept_row = [&](int64_t r) { return ring + (r % (k + 1)) * pitch; };
        return layout.template visit<float>(task, [&](const auto& runs) {
          pipeline_rows<true>(task, args, layout.affine_vary, k, rows_ahead, runs, kept_row);
        });
      }
    }
    layout.visit(task, [&](const auto& runs) {
      pipeline_rows<false>(task, args, layout.affine_vary, k, rows_ahead, runs,
                           [](int64_t) { return static_cast<float*>(nullptr); });
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
                                        const RowMomentsArgs& next, const char* ahead) {
  switch (task.dtype) {
    case DType::f32: return FusedRowsKernel<float>::execute(task, p, n, next, ahead);
    case DType::f16: return FusedRowsKernel<f16_t>::execute(task, p, n, next, ahead);
    case DType::bf16: return FusedRowsKernel<bf16_t>::execute(task, p, n, next, ahead);
    case DType::f64: return FusedRowsKernel<double>::execute(task, p, n, next, ahead);
  }
}
