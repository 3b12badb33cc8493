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
  using C = typename N::C;

  struct Totals {
    double sum, sum_sq;
  };
  // Asks for the lines of one step of the sums (2W elements from element i) of the array at p,
  // into L1 (Locality 3) or L2 (2).
  template <int Locality>
  SIMDNORM_CURSOR_METHOD static void prefetch_step(const char* p, int64_t i) {
    static_assert(2 * M::W * sizeof(T) <= 128, "one step reads at most two lines");
    __builtin_prefetch(p + i * sizeof(T), 0, Locality);
    if constexpr (2 * M::W * sizeof(T) > kLineBytes) __builtin_prefetch(p + i * sizeof(T) + kLineBytes, 0, Locality);
  }
  static constexpr int kPairSumsLead = 2;  // steps the sums of paired rows start ahead (interleave)
  // Runs `run` and takes the first-pass sums of next[r] (their scale must be 1) into out[r], for
  // Rows runs at one phase. ahead[r]: where a run after next[r] probably starts, prefetched ahead
  // of its sums so that it arrives in time, into the L2 only: with prefetcht0, NCHW batch norm
  // training, MVN over (0, 2, 3), instance and group norm and layer norm of 4096 ran 1.15-1.4x
  // slower at 1 thread.
  template <bool Keep, int Rows, class Run>
  static void interleave(Run run, const RowMomentsArgs* next, const char* const* ahead, float* const* keep,
                         Totals* out) {
    typename M::template ContiguousSums<false, Keep, Rows> sums(next, keep);
    RowsOf<const char*, Rows> prefetch;  // in registers: the loop's stores may alias any array
    prefetch.each([&](const char*& p, int r) SIMDNORM_INLINE_LAMBDA { p = ahead[r]; });
    // Paired long rows: the sums start kPairSumsLead steps ahead of the normalization. In step
    // they would run up to a vector behind it (each cursor aligns to its own array), and with the
    // output at the input's phase to a page (numpy's large arrays all sit 16 bytes past one) their
    // loads would fall on the low 12 bits of its last stores and wait for them. Single rows keep
    // the lockstep, stepping down where the row summed sits near the output's phase (beside).
    if constexpr (Rows == 1) run.beside(next[0].data);
    if constexpr (Rows == 2) {
      for (int s = 0; s < kPairSumsLead && sums.can_step(); ++s) {
        prefetch.each([&](const char* p, int) SIMDNORM_INLINE_LAMBDA { prefetch_step<2>(p, sums.i); });
        sums.step();
      }
    }
    while (run.can_step() && sums.can_step()) {
      prefetch.each([&](const char* p, int) SIMDNORM_INLINE_LAMBDA { prefetch_step<2>(p, sums.i); });
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
      return {f, n, p, stream, N::peels(n)};
    }
  };

  // The layouts the fused loops take: contiguous data, one mean and 1/std per run, scale and bias
  // constant or read beside the data, an activation applied inline (inline_here; anything else runs
  // the two loops one after the other).
  struct InnerRun {
    bool fusable, affine_vary;
    explicit InnerRun(const NormalizeTask& task) {
      constexpr int64_t ts = sizeof(T), cs = sizeof(typename N::C);
      const int inner = task.loop.ndim - 1;
      auto stride = [&](int op) { return task.loop.strides[op][inner]; };
      const bool affine_const = stride(kScale) == 0 && stride(kBias) == 0;
      affine_vary = stride(kScale) == cs && stride(kBias) == cs;
      fusable = stride(kIn) == ts && stride(kOut) == ts && stride(kShift) == 0 && stride(kMul) == 0 &&
                (affine_const || affine_vary) && inline_here(task.act.kind);
    }
    // Calls fn(runs) with the RunMaker of the task's activation and layout (fusable only).
    // Float16 rows read from their float32 copy fold the shift into the multiply (Formula): the
    // conversions leave the loop short of FP issue slots, and the fold takes an operation a vector
    // off it. It rounds -(shift * mul) once more, by at most 2^-24 |mean| / std in normalized
    // units; float16's range (|x| <= 65504) keeps that product finite wherever the unfolded form
    // is; bfloat16's does not (a constant row at 1e38: mean / sqrt(epsilon) overflows), so its
    // streamed rows keep the unfolded form.
    // A task without scale (MVN without scale and bias: task.scale_folded) takes Fold::scale as
    // NormalizeKernel does, with no activation: other activations, and the float16 rows above,
    // read the scale of 1 and keep the same values (Fold::scale for every activation would compile
    // the loops below once more each, growing the module and its build time).
    template <class In = T, class Fn>
    void visit(const NormalizeTask& task, Fn&& fn) const {
      constexpr bool shift_folded = std::is_same<T, f16_t>::value && std::is_same<In, float>::value;
      constexpr auto fold = shift_folded ? N::Fold::shift : N::Fold::none;
      visit_activation<typename N::V>(task.act, [&](const auto& act) {
        using Act = std::decay_t<decltype(act)>;
        if constexpr (kRunsOutOfLine<Act>) {
          check_failed("an out-of-line activation reached the fused rows loops", __FILE__, __LINE__);
        } else {
          if constexpr (!shift_folded && std::is_same<Act, ActIdentity<typename N::V>>::value) {
            if (task.scale_folded) {
              using FS = typename N::template Formula<Act, N::Fold::scale>;
              return fn(RunMaker<false, FS, In>{FS{act}, task.stream_stores});
            }
          }
          using F = typename N::template Formula<Act, fold>;
          const F f{act};
          if (affine_vary) fn(RunMaker<true, F, In>{f, task.stream_stores});
          else fn(RunMaker<false, F, In>{f, task.stream_stores});
        }
      });
    }
  };

  // GroupPairArgs: each run of group g normalized in the loop that sums the same run of group
  // g + 1, the runs stepped here: with a call a run, the caller's bookkeeping between calls would
  // run after each run had pushed the L1's lines out, waiting on loads of its own state.
  static void execute_group(const NormalizeTask& task, const GroupPairArgs& a) {
    const LoopNest& nest = task.loop;
    const int inner = nest.ndim - 1;
    const int64_t run = nest.sizes[inner], in_stride = nest.strides[kIn][inner];
    int64_t runs = 1;
    for (int d = a.first_dim; d < inner; ++d) runs *= nest.sizes[d];
    const int64_t size = runs * run;
    RunOdometer summed(nest, a.first_dim, inner), ahead(nest, a.first_dim, inner);
    for (int64_t j = 0; j < a.lead; ++j) ahead.advance();
    double block_sum = 0.0, block_sum_sq = 0.0;
    int64_t position = 0;  // in the group, of the next element summed
    // Calls piece(pointers, n, next, ahead) for each run, cut where the blocks of sums end.
    auto each_piece = [&](auto&& piece) SIMDNORM_INLINE_LAMBDA {
      for (int64_t j = 0; j < runs; ++j, summed.advance(), ahead.advance()) {
        const char* ahead_run = (j + a.lead < runs ? a.next : a.after) + ahead.off[kIn];
        for (int64_t from = 0; from < run;) {
          const int64_t left = a.block - position % a.block, len = run - from < left ? run - from : left;
          char* p[kNumOperands];
          for (int op = 0; op < kNumOperands; ++op) p[op] = a.group[op] + summed.off[op] + from * nest.strides[op][inner];
          const RowMomentsArgs next{a.next + summed.off[kIn] + from * in_stride, task.dtype, len, in_stride,
                                    a.pivot, a.scale, &block_sum, &block_sum_sq};
          piece(p, len, next, ahead_run + from * in_stride);
          from += len;
          position += len;
          if (position % a.block == 0 || position == size) {
            *a.sum += block_sum;
            *a.sum_sq += block_sum_sq;
            block_sum = block_sum_sq = 0.0;
          }
        }
      }
    };
    const InnerRun layout(task);
    if (!layout.fusable || in_stride != static_cast<int64_t>(sizeof(T)) || a.scale != 1.0) {
      return each_piece([&](char* const* p, int64_t n, const RowMomentsArgs& next, const char*) {
        normalize_run_kernel(task, p, n);
        row_moments_kernel(next);
      });
    }
    layout.visit(task, [&](const auto& maker) {
      each_piece([&](char* const* p, int64_t n, const RowMomentsArgs& next, const char* ahead_at) {
        Totals t;
        float* const no_keep = nullptr;
        interleave<false, 1>(maker.template rows<1>(&p, n), &next, &ahead_at, &no_keep, &t);
        *next.sum += t.sum;
        *next.sum_sq += t.sum_sq;
      });
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
  static constexpr int64_t kKeptRowMax = 1024;  // longest 16-bit row kept converted in the ring
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
    constexpr int64_t per_line = kLineBytes / sizeof(E);
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
  // next row, rereads the row it normalizes and the whole scale and bias: past the L1 those come
  // from L2 each time, and paired they are read once for two rows (under kPairFootprint pairs lose).
  // The rows must sit at one phase to a 64-byte line (their steps whole lines, as with the usual
  // hidden sizes), and share their scale and bias (a pair reads its first row's).
  // With AVX-512 only: on a Zen 3 core (AVX2) pairs ran slower than single rows wherever the output
  // sat from the input (mod 4 KB), 3-10x slower where it sat 16-128 bytes past it.
  static constexpr int64_t kPairFootprint = 48 << 10;  // two rows and the scale and bias, bytes
  static constexpr bool kPairsPay = N::W * sizeof(typename N::C) >= 64;
  static bool rows_pair_up(const FusedRowsArgs& a, bool affine_vary) {
    const int64_t per_element = 2 * static_cast<int64_t>(sizeof(T) + sizeof(typename N::C));
    return kPairsPay && affine_vary && a.step[kScale] == 0 && a.step[kBias] == 0 &&
           a.len * per_element >= kPairFootprint && a.rows >= 2 * kPairRows && a.step[kIn] % kLineBytes == 0 &&
           a.step[kOut] % kLineBytes == 0;
  }
  // All rows through pipeline<false, 2> when they pair up (the last of an odd count on its own),
  // else through pipeline<Keep, 1>. (Kept float16 rows, at most 1024, never pair up.)
  template <bool Keep, class Runs, class KeptRow>
  static void pipeline_rows(const NormalizeTask& task, const FusedRowsArgs& a, bool paired_up, int k,
                            int64_t rows_ahead, const Runs& runs, KeptRow kept_row) {
    if constexpr (!Keep && kPairsPay) {
      if (paired_up) {
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

  // ---- short rows: a batch summed, finished, then normalized while it sits in L1 ----
  // Rows of a few vectors gain nothing from normalizing one row in the loop that sums another (a
  // row is a few steps: there is no stream to overlap), and the pipeline's cost per row (its
  // cursors' set-up, their loops' entries, a call to the caller's finish) outweighed the rows' own
  // arithmetic. Here kShortBatch rows are summed one after another, finished two to a vector of
  // doubles (finish_two; the caller's finish only for a row the first pass leaves unsettled), and
  // normalized one after another while they sit in L1. The sums are the
  // pipeline's; 16-bit rows are read twice, never kept or streamed (those loops lost to this one
  // on rows under 512 bytes; from 512 bytes the row stream won). Float32 and float64 rows under
  // 1 KB (float32 rows of 128 to 192: the pipeline took 1.2-1.5x this loop's time on Zen 4, in
  // the caches and from memory; at 255 even; at 512 this loop took twice the pipeline's time).
  // Rows shorter than a vector too: a row at a time, each a call of the row kernels and of
  // the caller's finish, they took 1.2-2.5x this loop's time (rows of 4 to 15 elements), but
  // float16's with AVX2 or less, which ran 1.08-1.14x slower here (rows of 3 to 6).
  static constexpr int64_t kShortRowMaxBytes = sizeof(T) >= 4 ? 1024 : 512;
  static constexpr int kShortBatch = 4;
  static constexpr bool kShorterThanAVector = !(std::is_same<T, f16_t>::value && N::W < 16);
  static bool short_rows(const FusedRowsArgs& a) {
    return a.len >= (kShorterThanAVector ? 1 : N::W) && a.len * static_cast<int64_t>(sizeof(T)) < kShortRowMaxBytes;
  }

  // Rows row and row + 1 (count 1 or 2; the lanes past count are ignored) finished by
  // lane_stats.h's formulas, a row a lane: their statistics stored where the args say, but for the
  // rows the first pass leaves unsettled, which it returns (bit i: row + i) for the caller's
  // finish. (Compiled with the ISA's flags, its variance may differ in a double's last bit from
  // the caller's finish, which the fused rows call for each row otherwise.)
  SIMDNORM_CURSOR_METHOD static int finish_two(const FusedRowsArgs& a, int64_t row, int count, double2 pivot,
                                               double2 sum, double2 sum_sq) {
    // (float data's squares never underflow the double sums)
    constexpr bool kMayUnderflow = std::is_same<T, double>::value;
    const auto stats = lane_stats_of<kMayUnderflow>(pivot, sum, sum_sq, a.inv_n, a.centered, a.underflow);
    const double2 inv_std = inv_std_of(stats.var, a.rule);
    int unsettled = 0;
    for (int i = 0; i < count; ++i) {
      const int64_t r = row + i;
      if (stats.slow[i]) {
        unsettled |= 1 << i;
        continue;
      }
      store_as<C>(a.data[kShift] + r * a.step[kShift], stats.mean[i]);
      store_as<C>(a.data[kMul] + r * a.step[kMul], inv_std[i]);
      if (a.stats_out[0] != nullptr) store_as<C>(a.stats_out[0] + r * a.stats_step[0], stats.mean[i]);
      if (a.stats_out[1] != nullptr) store_as<C>(a.stats_out[1] + r * a.stats_step[1], inv_std[i]);
      if (a.var_offset != 0) store_as<C>(a.stats_out[1] + r * a.stats_step[1] + a.var_offset, stats.var[i]);
    }
    return unsettled;
  }

  // A batch's rows, their first-pass sums and pivots, two rows to a vector.
  struct ShortBatch {
    int64_t first;
    int count;
    double2 pivot[kShortBatch / 2], sum[kShortBatch / 2], sum_sq[kShortBatch / 2];
  };
  // The sums of the batch from row r on. (Out of line, as finish_short_batch: neither depends on
  // the activation or the layout of the scale and bias, each of which compiles the loop again.)
  template <bool Centered>
  static void sum_short_rows(DType dtype, const FusedRowsArgs& a, int64_t r, ShortBatch& b) {
    using Sums = typename M::template ContiguousSums<false, false, 1, Centered>;
    b.first = r;
    b.count = static_cast<int>(a.rows - r < kShortBatch ? a.rows - r : kShortBatch);
    const char* x = a.data[kIn] + r * a.step[kIn];
    for (int j = 0; j < b.count; ++j, x += a.step[kIn]) {
      const double p = Centered ? static_cast<double>(M::L::load_one(reinterpret_cast<const T*>(x))) : 0.0;
      Sums sums(RowMomentsArgs{x, dtype, a.len, static_cast<int64_t>(sizeof(T)), p, 1.0, nullptr, nullptr});
      sums.rest();
      b.pivot[j / 2][j % 2] = p;
      b.sum[j / 2][j % 2] = sums.rows.r0.sum;
      b.sum_sq[j / 2][j % 2] = sums.rows.r0.sum_sq;
    }
    if (b.count % 2 != 0) {  // a lone last row in both lanes (finish_two's other lane is unused)
      const int k = b.count / 2;
      b.pivot[k][1] = b.pivot[k][0];
      b.sum[k][1] = b.sum[k][0];
      b.sum_sq[k][1] = b.sum_sq[k][0];
    }
  }
  __attribute__((noinline)) static void sum_short_batch(DType dtype, const FusedRowsArgs& a, int64_t r, ShortBatch& b) {
    if (a.centered) sum_short_rows<true>(dtype, a, r, b);
    else sum_short_rows<false>(dtype, a, r, b);
  }
  __attribute__((noinline)) static void finish_short_batch(const FusedRowsArgs& a, const ShortBatch& b) {
    for (int j = 0; j < b.count; j += 2) {
      const int two = b.count - j < 2 ? b.count - j : 2;
      const int unsettled = finish_two(a, b.first + j, two, b.pivot[j / 2], b.sum[j / 2], b.sum_sq[j / 2]);
      for (int i = 0; i < two; ++i) {
        if (!(unsettled >> i & 1)) continue;
        const double p = b.pivot[j / 2][i], s = b.sum[j / 2][i], s2 = b.sum_sq[j / 2][i];
        a.finish(a.ctx, b.first + j + i, 1, &p, &s, &s2);
      }
    }
  }
  // Batch b + 1 is summed before batch b is normalized and finished after: from memory, the
  // normalization then runs while the sums wait for their loads, as the pipeline's reads and
  // writes overlap. (Four rows normalized in step, each scale and bias load shared, were no
  // faster than one row after another, and compiled the loop's code again for every activation.)
  template <class Runs>
  static void run_short_rows(const NormalizeTask& task, const FusedRowsArgs& a, const Runs& runs) {
    ShortBatch batch[2];
    sum_short_batch(task.dtype, a, 0, batch[0]);
    finish_short_batch(a, batch[0]);
    char* q[kNumOperands];
    char* const* row = q;
    for (int64_t r = 0, k = 0; r < a.rows; r += kShortBatch, k ^= 1) {
      const bool more = r + kShortBatch < a.rows;
      if (more) sum_short_batch(task.dtype, a, r + kShortBatch, batch[k ^ 1]);
      for (int j = 0; j < batch[k].count; ++j) {
        for (int op = 0; op < kNumOperands; ++op) q[op] = a.data[op] + (r + j) * a.step[op];
        runs.template rows<1>(&row, a.len).finish();
      }
      if (more) finish_short_batch(a, batch[k ^ 1]);
    }
  }

  // ---- float16 and bfloat16 rows back to back, as one stream of steps (kernels/row_stream.h) ----
  static constexpr int kStreamBatch = 2;                 // rows finished together
  static constexpr int kStreamLead = kStreamBatch + 2;   // periods the sums run ahead (see run())
  // Kept periods. The period summed writes into the slot of the one normalized in the same
  // iteration, each step reading that slot's elements before it overwrites them, so the ring
  // holds kStreamLead periods, not kStreamLead + 1: with the scale and bias that is 18 KB at rows
  // of 768, on a 32 KB L1 that also takes a line of input and one of output each step. (Three
  // periods ahead in three slots, each batch finished right after it closes, is slower.)
  static constexpr int kStreamSlots = kStreamLead;

  static bool rows_stream(const FusedRowsArgs& a) {
    constexpr int64_t ts = sizeof(T);
    const auto x = reinterpret_cast<uintptr_t>(a.data[kIn]), y = reinterpret_cast<uintptr_t>(a.data[kOut]);
    return N::W > 1 && a.len <= kKeptRowMax && a.len % (2 * N::W) == 0 && a.step[kIn] == a.len * ts &&
           a.step[kOut] == a.len * ts && a.step[kScale] == 0 && a.step[kBias] == 0 && x % ts == 0 && y % ts == 0;
  }

  template <bool AffineVary, class F, bool Centered>
  struct RowStream;
  template <bool AffineVary, class F>
  static void stream_rows(const RunMaker<AffineVary, F, float>& runs, const FusedRowsArgs& a, int64_t rows_ahead,
                          int64_t l1);

  // 16-bit rows back to back stream (RowStream). bfloat16 gains less from keeping a float32 copy
  // (its conversion in is a shift): its rows that do not stream convert twice.
  static constexpr bool kKeptRows = std::is_same<T, f16_t>::value;
  static constexpr bool kStreamedRows = kKeptRows || std::is_same<T, bf16_t>::value;

  // The loop execute_rows runs: the layouts the fused loops take (InnerRun), 16-bit rows back to
  // back streamed, float16 rows of the L1 kept, long rows paired.
  static RowsLoop rows_loop(const InnerRun& layout, const NormalizeTask& task, const FusedRowsArgs& a) {
    if (!layout.fusable) return RowsLoop::separate;
    const bool in_l1 = !task.stream_stores && a.len <= kKeptRowMax;
    if (in_l1 && short_rows(a)) return RowsLoop::short_rows;
    if (kStreamedRows && in_l1 && rows_stream(a)) return RowsLoop::row_stream;
    if (kKeptRows && in_l1) return RowsLoop::pipeline_kept;
    return rows_pair_up(a, layout.affine_vary) ? RowsLoop::pipeline_paired : RowsLoop::pipeline;
  }

  // The pipeline of FusedRowsArgs: every row's sums, its statistics (the caller's finish), and its
  // normalization while a later row is summed. One call for all rows: the cost of entering the
  // kernel, choosing the loop and the activation is paid once, not per row.
  static void execute_rows(const NormalizeTask& task, const FusedRowsArgs& a) {
    const InnerRun layout(task);
    const RowsLoop loop = rows_loop(layout, task, a);
    if (loop == RowsLoop::separate) {
      for (int64_t r = 0; r < a.rows; ++r) {
        double sum = 0.0, sum_sq = 0.0;
        const RowMomentsArgs m = first_pass(task, a, r, &sum, &sum_sq);
        row_moments_kernel(m);
        a.finish(a.ctx, r, 1, &m.pivot, &sum, &sum_sq);
        char* q[kNumOperands];
        for (int op = 0; op < kNumOperands; ++op) q[op] = a.data[op] + r * a.step[op];
        normalize_run_kernel(task, q, a.len);
      }
      return;
    }
    // Row r is normalized in the loop that sums row r + k, and rows are finished k at a time,
    // before the first of them is normalized. A row's statistics end in a chain of dependent
    // divisions and a square root that nothing after it can retire past: finished one at a time,
    // one row ahead, the chain would hold up every row; k rows' chains are independent and
    // overlap. The k rows wait in L1 between their two passes.
    const int k = batch_rows(a.len);
    // The prefetch runs at least kPrefetchAheadBytes ahead of the sums.
    const int64_t step_bytes = a.step[kIn] < 0 ? -a.step[kIn] : a.step[kIn];  // 0: a broadcast input
    const int64_t rows_ahead = step_bytes == 0 ? 1 : prefetch_units_ahead(step_bytes);
    // Scale and bias that vary along the row are the same for every row: copied once to where their
    // loads line up with the output's stores, so that no load in the loop straddles two lines.
    FusedRowsArgs args = a;
    if constexpr (kStreamedRows) {
      if (loop == RowsLoop::row_stream)
        return layout.template visit<float>(task,
                                            [&](const auto& runs) { stream_rows(runs, a, rows_ahead, task.l1_bytes); });
    }
    if (loop == RowsLoop::short_rows)
      return layout.visit(task, [&](const auto& runs) { run_short_rows(task, a, runs); });
    constexpr int64_t pitch_c = kLinedUpMax + kLineBytes / sizeof(C);
    C affine[N::W > 1 ? 2 * pitch_c : 1];
    if (N::W > 1 && layout.affine_vary && a.step[kScale] == 0 && a.step[kBias] == 0 && a.len <= kLinedUpMax) {
      for (int op = kScale; op <= kBias; ++op) {
        C* copy = lined_up(affine + (op - kScale) * pitch_c, a.data[kOut]);
        if ((reinterpret_cast<uintptr_t>(copy) - reinterpret_cast<uintptr_t>(a.data[op])) % kLineBytes == 0) continue;
        std::memcpy(copy, a.data[op], a.len * sizeof(C));
        args.data[op] = reinterpret_cast<char*>(copy);
      }
    }
    // float16 rows: the conversions bound the loop (vcvtph2ps and vcvtps2ph, six per 32 elements).
    // The sums pass keeps each row as it converts it, in a ring of k + 1 float32 rows in L1, and
    // the normalize pass reads that copy: two conversions fewer per 32 elements, the same values.
    // Rows past kKeptRowMax (the ring and the rows outgrow L1) and rows from memory (streaming
    // stores: the loads are the bound) keep converting twice.
    if constexpr (kKeptRows) {
      if (loop == RowsLoop::pipeline_kept) {
        const int64_t pitch = kept_pitch(a.len);
        float storage[kRingFloats];
        float* ring = lined_up(storage, a.data[kOut]);
        auto kept_row = [&](int64_t r) { return ring + (r % (k + 1)) * pitch; };
        return layout.template visit<float>(task, [&](const auto& runs) {
          pipeline_rows<true>(task, args, false, k, rows_ahead, runs, kept_row);
        });
      }
    }
    layout.visit(task, [&](const auto& runs) {
      pipeline_rows<false>(task, args, loop == RowsLoop::pipeline_paired, k, rows_ahead, runs,
                           [](int64_t) { return static_cast<float*>(nullptr); });
    });
  }
};

static void normalize_rows_fused_entry(const NormalizeTask& task, const FusedRowsArgs& args) {
  with_storage_type(task.dtype, [&](auto t) {
    FusedRowsKernel<typename decltype(t)::type>::execute_rows(task, args);
  });
}

static RowsLoop rows_loop_entry(const NormalizeTask& task, const FusedRowsArgs& args) {
  RowsLoop loop = RowsLoop::separate;
  with_storage_type(task.dtype, [&](auto t) {
    using K = FusedRowsKernel<typename decltype(t)::type>;
    loop = K::rows_loop(typename K::InnerRun(task), task, args);
  });
  return loop;
}

static void normalize_group_and_sum_entry(const NormalizeTask& task, const GroupPairArgs& args) {
  with_storage_type(task.dtype, [&](auto t) {
    FusedRowsKernel<typename decltype(t)::type>::execute_group(task, args);
  });
}
