// float16 and bfloat16 rows back to back, normalized as one stream of steps: FusedRowsKernel's
// RowStream (kernels/fused_rows.h declares it and chooses it: rows_stream()). Included inside an
// ISA namespace, after fused_rows.h.
//
// Rows kept as float32 (up to kKeptRowMax), each a whole number of steps (2W elements: a 64-byte
// line of 16-bit values at AVX-512), back to back in the input and in the output. Then both passes
// are one stream of steps over all the rows, aligned to the output: the step that holds the end
// of one row and the start of the next is read, kept and written once, its lanes taking each
// row's pivot, sums or coefficients, where pipeline() pays each row a masked head and tail in
// both passes and loops of their own.
// Period q: the len elements from the step that holds row q's first element, i.e. the last o of
// row q - 1 and the first len - o of row q (o: the output's phase to a step, in elements). The
// sums keep a period in a slot of the ring and the normalization reads it back, writing the
// same elements of the output, whole lines. Aligned to the output, not the input: with the two
// at different phases, a load that spans two lines costs less than a store that does (each step
// stores a line of output and two of the ring, and the store unit is the busier: it takes half
// the bytes a cycle that the loads take). Row q's sums close at the first step of period q + 1.
// A row's sums depend only on its data and the output's phase, not on where a thread's rows
// begin: the bits are the same for any number of threads. Not Centered (RMS norm), the rows'
// pivots are 0 and only their squares are summed: the plain sums' lanes would take the registers
// that keep two rows' squares out of memory.

template <class T>
template <bool AffineVary, class F, bool Centered>
struct FusedRowsKernel<T>::RowStream {
  using V = typename N::V;
  using L = typename N::L;
  using LF = Lanes<float>;
  using LC = Lanes<C>;
  using Affine = typename N::template Pair<AffineVary>;
  static constexpr int W = N::W, S = 2 * W;
  static constexpr int kClosedSlots = 2 * kStreamBatch;
  static constexpr int64_t pitch(int64_t len) { return (len + 15) / 16 * 16; }  // of a kept period
  struct Coefficients {
    V shift, mul;
  };
  using Sums = typename M::Sums;
  // The sums of the row open in the period being summed. A local of run() whose address no
  // call takes: it stays in registers across the loop's stores. Its lanes follow the output's
  // phase: step lane P holds the row's lane (P - o) mod S (Sums::tree_rotated).
  struct OpenRow {
    vd piv;
    Sums lanes;
    double pivot;
  };
  // Rows closed and not yet finished, row r in slot r % kClosedSlots (batches never wrap), and
  // the finished rows whose first pass did not settle them (for the caller's finish).
  struct Closed {
    double pivot[kClosedSlots], sum[kClosedSlots], sum_sq[kClosedSlots];
    int64_t finished = 0;
    int64_t unsettled[kStreamBatch];
    int unsettled_count = 0;
  };
  // Where run() is: its next iteration and the state carried between iterations.
  struct Progress {
    int64_t t = 0;
    OpenRow row{};
    Coefficients prev{}, cur{};
    Closed closed;
  };

  const F f;
  const FusedRowsArgs& a;
  const int64_t len, rows;
  const T* const x;
  T* const y;
  const int o;
  const vmask prev0, prev1;  // the lanes of a period's first step that are the previous row's
  vmaskd prev_d[Sums::Q];    // the same, of its double quarters
  float* const kept;         // kStreamSlots periods, 64-byte aligned
  const Affine af;           // scale and bias, rotated by o when they vary: element t of a period
  const bool pairs;          // run_pair(): its footprint fits in L1

  static int lanes_from(int m) { return m < 0 ? 0 : m > W ? W : m; }
  RowStream(const F& formula, const FusedRowsArgs& args, int phase, float* kept_storage, const C* rotated_scale,
            const C* rotated_bias, int64_t l1)
      : f(formula), a(args), len(args.len), rows(args.rows), x(reinterpret_cast<const T*>(args.data[kIn])),
        y(reinterpret_cast<T*>(args.data[kOut])), o(phase), prev0(vlanes_below(lanes_from(phase))),
        prev1(vlanes_below(lanes_from(phase - W))), kept(kept_storage),
        af(AffineVary ? reinterpret_cast<const char*>(rotated_scale) : args.data[kScale],
           AffineVary ? reinterpret_cast<const char*>(rotated_bias) : args.data[kBias]),
        pairs(len * kPairBytesPerElement < l1) {
    for (int q = 0; q < Sums::Q; ++q) prev_d[q] = vlanes_below_d(std::min(std::max(o - q * Sums::WD, 0), Sums::WD));
  }

  const T* in_period(int64_t q) const { return x + q * len - o; }
  T* out_period(int64_t q) const { return y + q * len - o; }
  float* kept_period(int64_t q) const { return kept + static_cast<uint64_t>(q) % kStreamSlots * pitch(len); }
  // The lanes [lo, hi) of period q's steps that hold rows: all but before row 0 and past the last.
  int lo(int64_t q) const { return q == 0 ? o : 0; }
  int hi(int64_t q) const { return q == rows ? o : S; }

  // The sums of period q's first step: closes row q - 1, opens row q.
  SIMDNORM_CURSOR_METHOD void sums_first(int64_t q, OpenRow& row, Closed& closed) const {
    V v0, v1;
    keep_first(q, v0, v1);
    if (q > 0) close_row(q, v0, v1, row, closed);
    if (q < rows) open_row(q, v0, v1, row);
  }
  // Period q's first step, read and kept (lanes outside rows read as 0).
  SIMDNORM_CURSOR_METHOD void keep_first(int64_t q, V& v0, V& v1) const {
    const T* p = in_period(q);
    const int l = lo(q), h = hi(q);
    if (l == 0 && h == S) {
      v0 = L::load(p);
      v1 = L::load(p + W);
    } else {
      v0 = L::load_span(p, lanes_from(l), lanes_from(h));
      v1 = L::load_span(p + W, lanes_from(l - W), lanes_from(h - W));
    }
    float* k = kept_period(q);
    LF::store(k, v0);
    LF::store(k + W, v1);
  }
  // Adds the lanes of a period's first step (v0, v1) that are the previous row's (Previous) or
  // the next row's to `row`.
  template <bool Previous>
  SIMDNORM_CURSOR_METHOD void add_first(V v0, V v1, OpenRow& row) const {
    const vd zero = vbroadcast_vd(0.0);
    for_constant<0, Sums::Q>([&](auto q) SIMDNORM_INLINE_LAMBDA {
      constexpr int qi = decltype(q)::value, h = qi / Sums::kParts, p = qi % Sums::kParts;
      const vd d = Sums::template part<p>(h == 0 ? v0 : v1) - row.piv;
      row.lanes.template add_d<qi, Centered>(Previous ? vselect(prev_d[qi], d, zero) : vselect(prev_d[qi], zero, d));
    });
  }
  // Closes row q - 1 with the lanes of period q's first step (v0, v1) that are its.
  SIMDNORM_CURSOR_METHOD void close_row(int64_t q, V v0, V v1, OpenRow row, Closed& closed) const {
    add_first<true>(v0, v1, row);
    const int slot = static_cast<int>((q - 1) % kClosedSlots);
    closed.sum[slot] = Centered ? Sums::tree_rotated(row.lanes.s1, o) : 0.0;
    closed.sum_sq[slot] = Sums::tree_rotated(row.lanes.s2, o);
    closed.pivot[slot] = row.pivot;
  }
  // Opens row q with the rest of those lanes.
  SIMDNORM_CURSOR_METHOD void open_row(int64_t q, V v0, V v1, OpenRow& row) const {
    row.pivot = Centered && a.centered ? pivot_of(x + q * len) : 0.0;
    row.piv = vbroadcast_vd(row.pivot);
    row.lanes.clear();
    add_first<false>(v0, v1, row);
  }
  // A row's pivot: its first element, or 0 when one of its first W elements lies as far from the
  // first as that is from 0. The mean is then likely a few spreads from 0, inside the 8 standard
  // deviations past which the sums lose digits to cancellation (a row past them is summed
  // again), and the row's steps drop the subtraction. A row whose first W elements hold an
  // outlier as large as its mean pays that second pass. Decided from the row alone, not its
  // address or neighbours: the same bits for any thread count. (A lanewise compare, not the
  // largest distance: one horizontal reduction a row fewer.)
  static double pivot_of(const T* start) {
    const V v = L::load(start);
    const V first = splat<V>(v[0]);
    return vany_ge(vabs(v - first), vabs(first)) ? 0.0 : static_cast<double>(v[0]);
  }
  static bool pivoted(const OpenRow& row) { return Centered && row.pivot != 0.0; }
  // A later step of the period (wholly the open row's), at p in the input and k in its slot;
  // Pivoted false for a row whose pivot is 0 (subtracting it would give the same bits).
  template <bool Pivoted>
  SIMDNORM_CURSOR_METHOD static void sums_step(const T* p, float* k, OpenRow& row) {
    const V v0 = L::load(p), v1 = L::load(p + W);
    LF::store(k, v0);
    LF::store(k + W, v1);
    if constexpr (Pivoted) {
      row.lanes.template add<0, false>(v0, row.piv, row.piv);  // (unscaled: the last operand is unused)
      row.lanes.template add<1, false>(v1, row.piv, row.piv);
    } else {
      row.lanes.template add_unshifted<0, Centered>(v0);
      row.lanes.template add_unshifted<1, Centered>(v1);
    }
  }

  Coefficients coefficients(int64_t r) const {
    const V mul = splat<V>(LC::load_one(reinterpret_cast<const C*>(a.data[kMul] + r * a.step[kMul])));
    V shift = splat<V>(LC::load_one(reinterpret_cast<const C*>(a.data[kShift] + r * a.step[kShift])));
    if constexpr (F::kShiftFolded) shift = F::fold_shift(shift, mul);
    return {shift, mul};
  }
  // The normalization of period p's first step (rows p - 1 and p finished); leaves row p's
  // coefficients in cur for the rest of the period, row p - 1's in prev.
  SIMDNORM_CURSOR_METHOD void normalize_first(int64_t p, Coefficients& prev, Coefficients& cur) const {
    prev = cur;
    if (p < rows) cur = coefficients(p);
    if (p == 0) prev = cur;  // (lanes not written)
    if (p == rows) cur = prev;
    const float* k = kept_period(p);
    const V r0 = f(LF::load(k), vselect(prev0, prev.shift, cur.shift), vselect(prev0, prev.mul, cur.mul),
                   af.first(0), af.second(0));
    const V r1 = f(LF::load(k + W), vselect(prev1, prev.shift, cur.shift), vselect(prev1, prev.mul, cur.mul),
                   af.first(W), af.second(W));
    T* q = out_period(p);
    const int l = lo(p), h = hi(p);
    if (l == 0 && h == S) {
      L::store2(q, r0, r1);
    } else {
      L::store_span(q, r0, lanes_from(l), lanes_from(h));
      L::store_span(q + W, r1, lanes_from(l - W), lanes_from(h - W));
    }
  }
  // A later step of the period, at element i of it: k in its slot, q in the output.
  SIMDNORM_CURSOR_METHOD static void normalize_step(const F& f, const Affine& af, const Coefficients& c,
                                                    const float* k, T* q, int64_t i) {
    L::store2(q, f(LF::load(k), c.shift, c.mul, af.first(i), af.second(i)),
              f(LF::load(k + W), c.shift, c.mul, af.first(i + W), af.second(i + W)));
  }

  // The same step of two periods normalized at once: one load of the scale and bias for both.
  SIMDNORM_CURSOR_METHOD static void normalize_step_pair(const F& f, const Affine& af, const Coefficients& c,
                                                         const Coefficients& c2, const float* k, const float* k2,
                                                         T* q, T* q2, int64_t i) {
    const V scale0 = af.first(i), bias0 = af.second(i), scale1 = af.first(i + W), bias1 = af.second(i + W);
    L::store2(q, f(LF::load(k), c.shift, c.mul, scale0, bias0), f(LF::load(k + W), c.shift, c.mul, scale1, bias1));
    L::store2(q2, f(LF::load(k2), c2.shift, c2.mul, scale0, bias0),
              f(LF::load(k2 + W), c2.shift, c2.mul, scale1, bias1));
  }

  // Finishes the rows closed so far, kStreamBatch at a time (the rest once all are closed).
  SIMDNORM_CURSOR_METHOD void finish_closed(int64_t closed_rows, Closed& c) const {
    while (c.finished < closed_rows && (closed_rows - c.finished >= kStreamBatch || closed_rows == rows)) {
      const int64_t left = closed_rows - c.finished;
      const int count = static_cast<int>(left < kStreamBatch ? left : kStreamBatch);
      finish_rows(c.finished, count, c);
      c.finished += count;
    }
  }
  // The statistics of `count` rows from row on, by FusedRowsKernel::finish_two (no call to the op's
  // finish; a lone last row in both lanes: every row takes the same instructions, whatever its
  // batch). A row whose first pass does not settle it is left to the op's finish (settle()).
  // It is inlined into run_pair(): reading a's pointers and steps into locals here (the stores
  // may alias a) makes GCC keep two of the pair loop's sums on the stack, loaded and stored every
  // step. After any change near run_pair(), look for rsp in its loop (objdump) before timing it.
  SIMDNORM_CURSOR_METHOD void finish_rows(int64_t row, int count, Closed& c) const {
    static_assert(kStreamBatch == 2, "a batch of rows is one double2");
    double2 pivot, sum, sum_sq;
    for (int i = 0; i < kStreamBatch; ++i) {
      const int slot = static_cast<int>((row + (i < count ? i : count - 1)) % kClosedSlots);
      pivot[i] = c.pivot[slot];
      sum[i] = c.sum[slot];
      sum_sq[i] = c.sum_sq[slot];
    }
    const int unsettled = finish_two(a, row, count, pivot, sum, sum_sq);
    for (int i = 0; i < count; ++i)
      if (unsettled >> i & 1) c.unsettled[c.unsettled_count++] = row + i;
  }
  // The caller's finish of the rows finish_rows() left: a second pass, or NaN statistics. Their
  // sums are still in their slots (rows close one an iteration, and this runs in the iteration
  // that finished them).
  __attribute__((noinline)) void settle(Closed& c) const {
    for (int i = 0; i < c.unsettled_count; ++i) {
      const int64_t r = c.unsettled[i];
      const int slot = static_cast<int>(r % kClosedSlots);
      a.finish(a.ctx, r, 1, c.pivot + slot, c.sum + slot, c.sum_sq + slot);
    }
    c.unsettled_count = 0;
  }
  // Iteration t sums period t and normalizes period t - kStreamLead, in one loop over their
  // steps; between the first steps of the two, the rows closed so far (0 .. t - 2) are
  // finished. The normalization's first step comes first, its coefficients loaded before the
  // finish stores others: loaded after, they would wait for those stores (whose addresses come
  // at the end of a chain through a division and a square root) though the row was finished an
  // iteration before. Rows that need the caller's finish are settled between runs of the loop:
  // a call in the loop would make the compiler keep the sums in memory across it. Forced inline:
  // with two streams in stream_rows (squares only, and centered) GCC left it out of line, and the
  // centered rows' loops ran slower.
  SIMDNORM_CURSOR_METHOD void run(int64_t rows_ahead) const {
    Progress state;
    while (state.t <= rows + kStreamLead) {
      run_until_unsettled(state, rows_ahead);
      settle(state.closed);
    }
  }
  // The stream asks for its input and its output into L2 (prefetcht1), kL2Ahead times as far
  // ahead as the pipeline asks for its input into L1: the lines it keeps in L1 (ring, scale and
  // bias: 18 KB at rows of 768, 24 KB at 1024) then stay there on a 32 KB L1, and the output's
  // lines are in cache before its stores (the first store to a line that is not waits for it,
  // and the output of a large op is rarely still cached). (The pipeline's float32 rows, bound by
  // memory, gain nothing from the same prefetch of their output.)
  static constexpr int kL2Ahead = 2;
  // Iterations t and t + 1 (t even, both periods summed and normalized) as one loop over their
  // steps, each load of the scale and bias serving both normalizations, one loop's entry, exit
  // and bookkeeping for two rows; the rows closed in iterations t - 1 and t are finished in it
  // (a batch). Each row takes the same steps in the same order as alone: the same bits,
  // whichever rows pair up. Rows whose ring, scale, bias and two periods of input and output
  // outgrow the L1 (its size read at run time: rows of 1024 outgrow a 32 KB L1, not a 48 KB
  // one) keep one period an iteration.
  static constexpr int64_t kPairBytesPerElement = kStreamSlots * sizeof(float) + 2 * sizeof(C) + 4 * sizeof(T);
  // Where iteration t's later steps read and write: period t summed into its slot of the ring,
  // period p = t - kStreamLead normalized from that same slot (kStreamSlots == kStreamLead: each
  // step reads its elements before the sums overwrite them) into the output, and the periods
  // prefetched kL2Ahead * rows_ahead ahead of both.
  struct Cursors {
    const T* src;
    const char* ahead;
    const char* out_ahead;
    float* kept;
    T* dst;
  };
  Cursors cursors(int64_t t, int64_t rows_ahead) const {
    const int64_t p = t - kStreamLead, ahead_rows = kL2Ahead * rows_ahead;
    return {in_period(t) + S, reinterpret_cast<const char*>(in_period(t + ahead_rows) + S),
            reinterpret_cast<const char*>(out_period(p + ahead_rows) + S), kept_period(t) + S, out_period(p) + S};
  }
  SIMDNORM_CURSOR_METHOD void run_pair(int64_t t, int64_t rows_ahead, OpenRow& row, Coefficients& prev,
                                       Coefficients& cur, Closed& closed) const {
    const int64_t p = t - kStreamLead;
    normalize_first(p, prev, cur);
    const Coefficients c = cur;
    normalize_first(p + 1, prev, cur);
    const Coefficients c2 = cur;
    sums_first(t, row, closed);  // closes row t - 1, opens row t
    finish_closed(t, closed);
    OpenRow next;
    V w0, w1;  // period t + 1's first step: opens row t + 1 now, closes row t after the loop
    keep_first(t + 1, w0, w1);
    open_row(t + 1, w0, w1, next);
    const F fl = f;
    const Affine afl = af;
    const int64_t end = len - S;
    const Cursors at = cursors(t, rows_ahead);  // period t + 1's: len elements on (k2: the next slot)
    const T* src = at.src;
    const char *ahead = at.ahead, *out_ahead = at.out_ahead;
    float* k = at.kept;
    float* k2 = kept_period(t + 1) + S;
    T* dst = at.dst;
    prefetch_step<2>(ahead, -S);
    prefetch_step<2>(ahead, len - S);
    prefetch_step<2>(out_ahead, -S);
    prefetch_step<2>(out_ahead, len - S);
    auto sum_and_normalize = [&](auto pivoted) SIMDNORM_INLINE_LAMBDA {
      for (int64_t i = 0; i < end; i += S) {
        prefetch_step<2>(ahead, i);
        prefetch_step<2>(ahead, len + i);
        prefetch_step<2>(out_ahead, i);
        prefetch_step<2>(out_ahead, len + i);
        normalize_step_pair(fl, afl, c, c2, k + i, k2 + i, dst + i, dst + len + i, S + i);
        sums_step<decltype(pivoted)::value>(src + i, k + i, row);
        sums_step<decltype(pivoted)::value>(src + len + i, k2 + i, next);
      }
    };
    // (A pivot of 0 subtracted gives the same bits.)
    if (pivoted(row) || pivoted(next))
      sum_and_normalize(std::integral_constant<bool, Centered>{});
    else
      sum_and_normalize(std::false_type{});
    close_row(t + 1, w0, w1, row, closed);
    row = next;
  }
  // Runs iterations until one leaves a row to settle, or the last.
  SIMDNORM_CURSOR_METHOD void run_until_unsettled(Progress& state, int64_t rows_ahead) const {
    OpenRow row = state.row;
    Coefficients prev = state.prev, cur = state.cur;
    Closed& closed = state.closed;
    const F fl = f;
    const Affine afl = af;
    const int64_t end = len - S;  // the later steps of a period: [S, len)
    int64_t t = state.t;
    for (; t <= rows + kStreamLead && closed.unsettled_count == 0; ++t) {
      const int64_t p = t - kStreamLead;
      if (pairs && p >= 0 && t + 1 < rows && t % kStreamBatch == 0) {
        run_pair(t, rows_ahead, row, prev, cur, closed);
        ++t;
        continue;
      }
      if (p >= 0) normalize_first(p, prev, cur);
      finish_closed(t - 1 < 0 ? 0 : t - 1 > rows ? rows : t - 1, closed);
      if (t <= rows) sums_first(t, row, closed);
      const bool summing = t < rows, normalizing = p >= 0 && p < rows;
      const Cursors at = cursors(t, rows_ahead);
      const T* src = at.src;
      const char *ahead = at.ahead, *out_ahead = at.out_ahead;
      float* k = at.kept;
      T* dst = at.dst;
      const Coefficients c = cur;
      // The period's first step too (the loop starts past it): from memory, its lines would
      // otherwise come late.
      prefetch_step<2>(ahead, -S);
      prefetch_step<2>(out_ahead, -S);
      auto sum_and_normalize = [&](auto pivoted) SIMDNORM_INLINE_LAMBDA {
        for (int64_t i = 0; i < end; i += S) {
          prefetch_step<2>(ahead, i);
          prefetch_step<2>(out_ahead, i);
          normalize_step(fl, afl, c, k + i, dst + i, S + i);
          sums_step<decltype(pivoted)::value>(src + i, k + i, row);
        }
      };
      if (summing && normalizing) {
        if (pivoted(row))
          sum_and_normalize(std::integral_constant<bool, Centered>{});
        else
          sum_and_normalize(std::false_type{});
      } else if (summing) {
        for (int64_t i = 0; i < end; i += S) sums_step<Centered>(src + i, k + i, row);
      } else if (normalizing) {
        for (int64_t i = 0; i < end; i += S) normalize_step(fl, afl, c, k + i, dst + i, S + i);
      }
    }
    state.t = t;
    state.row = row;
    state.prev = prev;
    state.cur = cur;
  }
};

template <class T>
template <bool AffineVary, class F>
void FusedRowsKernel<T>::stream_rows(const RunMaker<AffineVary, F, float>& runs, const FusedRowsArgs& a,
                                     int64_t rows_ahead, int64_t l1) {
  using Stream = RowStream<AffineVary, F, true>;
  alignas(64) float kept[kStreamSlots * Stream::pitch(kKeptRowMax)];
  const int o = static_cast<int>(reinterpret_cast<uintptr_t>(a.data[kOut]) / sizeof(T) % Stream::S);
  // Scale and bias that vary along the row, rotated to start where a period does.
  alignas(64) C rotated[2][AffineVary ? kKeptRowMax : 1];
  if constexpr (AffineVary) {
    for (int k = 0; k < 2; ++k) {
      const C* src = reinterpret_cast<const C*>(a.data[kScale + k]);
      std::memcpy(rotated[k], src + a.len - o, o * sizeof(C));
      std::memcpy(rotated[k] + o, src, (a.len - o) * sizeof(C));
    }
  }
  // Squares only for RMS norm without an activation; with one (or in the fallback unit) it sums
  // around a pivot of 0 as layer norm's rows do, the same bits: the module keeps no copy of the
  // stream for each activation.
  if constexpr (!kFewInline && std::is_same<typename F::Activation, ActIdentity<typename N::V>>::value) {
    using SquaresOnly = RowStream<AffineVary, F, false>;
    if (!a.centered) return SquaresOnly(runs.f, a, o, kept, rotated[0], rotated[1], l1).run(rows_ahead);
  }
  Stream(runs.f, a, o, kept, rotated[0], rotated[1], l1).run(rows_ahead);
}
