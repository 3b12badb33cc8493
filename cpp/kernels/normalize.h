// The elementwise leaf both ops end in:  out = act(fma((in - shift) * mul, scale, bias)), or with
// the scale folded into mul, act(fma(in - shift, mul, bias)), or with the shift folded (float16
// rows, see Formula), act(fma(fma(in, mul, -shift * mul), scale, bias)).
// Included inside an ISA namespace (see vec.h). Templated on the storage type T and the activation;
// the layout is the planner's business, and reaches this file only as the strides of one run.

// Rows shorter than this skip the alignment peel (unless streaming, which needs it).
constexpr int64_t kPeelMinBytes = 1024;

template <class T>
struct NormalizeKernel {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename ComputeOf<T>::type;     // coefficient scalar (float, or double for float64)
  using LC = Lanes<C>;
  static constexpr int W = L::W;

  // The arithmetic of every path, one vector at a time: act(fma((x - shift) * mul, scale, bias)).
  // Fold::scale, the scale folded into mul (batch norm, whose parameters share one shape): scale
  // is not read, act(fma(x - shift, mul, bias)), one multiply and one coefficient stream fewer,
  // and x == shift still gives exactly bias.
  // Fold::shift (float16 layer-norm rows, fused_rows.h): a run's shift is taken as -(shift * mul)
  // once (fold_shift) and the arithmetic is act(fma(fma(x, mul, that), scale, bias)), two
  // operations a vector instead of three.
  enum class Fold { none, scale, shift };
  template <class Act, Fold Folded>
  struct Formula {
    static constexpr bool kScaleFolded = Folded == Fold::scale;
    static constexpr bool kShiftFolded = Folded == Fold::shift;
    // The periodic stream and the fused rows loops are compiled for inline activations only.
    static constexpr bool kInline = !kRunsOutOfLine<Act>;
    using Activation = Act;
    Act act;
    V operator()(V x, V shift, V mul, V scale, V bias) const { return act(affine(x, shift, mul, scale, bias)); }
    // The value the activation takes.
    static V affine(V x, V shift, V mul, V scale, V bias) {
      if constexpr (kScaleFolded) {
        (void)scale;
        return vfma(x - shift, mul, bias);
      } else if constexpr (kShiftFolded) {
        return vfma(vfma(x, mul, shift), scale, bias);
      } else {
        return vfma((x - shift) * mul, scale, bias);
      }
    }
    // Fold::shift: a run's shift as operator() takes it.
    static V fold_shift(V shift, V mul) { return splat<V>(0.0) - shift * mul; }
  };
  // Calls fn(formula) with the formula the task asks for.
  template <class Fn>
  static void visit_formula(const NormalizeTask& task, Fn&& fn) {
    visit_activation<V>(task.act, [&](const auto& act) {
      using Act = std::decay_t<decltype(act)>;
      if (task.scale_folded) fn(Formula<Act, Fold::scale>{act});
      else fn(Formula<Act, Fold::none>{act});
    });
  }

  // Streamed runs step down (steps_down) with vectors of 32 bytes or more: the baseline build's
  // loops stay as they were, and small.
  static constexpr bool kStepsDown = sizeof(V) >= 32;
  // Whether a streamed run takes its whole lines from its end down. Stepped up with the output up
  // to half a page past the input's phase to a page, the loads that follow a non-temporal store
  // fall on its low 12 bits and wait for it to leave; stepped down, they sit below it. (An output
  // up to half a page before the input's phase has that hazard stepped down, and none stepped up.)
  static bool steps_down(const void* y, const void* x) {
    const auto d = (reinterpret_cast<uintptr_t>(y) - reinterpret_cast<uintptr_t>(x)) % kPageBytes;
    return kStepsDown && d != 0 && d < kPageBytes / 2;
  }

  // A pair of coefficients along a run of contiguous data: either constant over the run (kept in
  // registers: NCHW batch norm, per-group MVN statistics) or contiguous arrays read beside the data
  // (channels-last batch norm, layer-norm scale and bias). Without ReadFirst the first is never
  // read (a scale folded into mul: its pointer need not address an array).
  template <bool Vary, bool ReadFirst = true>
  struct Pair {
    const C* a;
    const C* b;
    V va, vb;
    Pair() = default;
    Pair(const char* pa, const char* pb) : a(reinterpret_cast<const C*>(pa)), b(reinterpret_cast<const C*>(pb)) {
      va = splat<V>(0.0);
      if (!Vary) {
        if (ReadFirst) va = splat<V>(LC::load_one(a));
        vb = splat<V>(LC::load_one(b));
      }
    }
    V first(int64_t i) const {
      if constexpr (Vary && ReadFirst) return LC::load(a + i);
      else return va;
    }
    V second(int64_t i) const { if constexpr (Vary) return LC::load(b + i); else return vb; }
    V first(int64_t i, int m) const {
      if constexpr (Vary && ReadFirst) return LC::load_partial(a + i, m);
      else return va;
    }
    V second(int64_t i, int m) const { if constexpr (Vary) return LC::load_partial(b + i, m); else return vb; }
  };

  // One contiguous run, as a cursor: kernels/fused_rows.h interleaves its steps with the sums of
  // the next row; run_contiguous() runs them back to back.
  // The input may be read as In rather than T: a float32 copy of a 16-bit row (fused_rows.h).
  // With Rows > 1 the cursor runs that many rows in step, at the same phase to a 64-byte line
  // (their outputs and inputs whole lines apart): each scale and bias vector is loaded once for
  // all of them (layer norm rows two at a time, fused_rows.h).
  template <bool StatsVary, bool AffineVary, class F, class In = T, bool StreamEdges = false, int Rows = 1>
  struct ContiguousRun {
    static_assert(!(F::kShiftFolded && StatsVary), "a folded shift is one per run");
    using LI = Lanes<In>;
    struct Row {
      T* y;
      const In* x;
      Pair<StatsVary> st;
    };
    const F f;
    RowsOf<Row, Rows> rows;
    const Pair<AffineVary, !F::kScaleFolded> af;
    int64_t n, i = 0;
    // The steps cover [i, steps_end) after the peel, 2W elements each, in the order of `stride`.
    int64_t steps_end = 0, steps_left = 0, stride = 2 * W;
    bool stream;

    // Peels a masked head up to a 64-byte boundary, so that full stores never straddle a cache
    // line (such a store can cost as much as two, and numpy hands out 16/32-byte aligned buffers) and
    // each pair of vectors below covers whole lines (what non-temporal stores need to avoid
    // partial-line writes). An element pointer that is not even element-aligned cannot be peeled
    // into alignment: it takes plain stores.
    // With StreamEdges, a streamed run's head and tail lines are streamed as well, in 4- and
    // 16-byte pieces (stream_bytes): for rows pipelined with the reads of later rows. Runs that
    // only stream (NCHW batch norm planes) lose with them, so they keep plain edges. A template
    // parameter: as a run-time flag it slowed channels-last batch norm.
    SIMDNORM_CURSOR_METHOD ContiguousRun(const F& formula, int64_t len, char* const* p, bool streaming, bool peel)
        : ContiguousRun(formula, len, &p, streaming, peel) {}
    // p[r]: the operands of row r (the scale and bias are row 0's, shared).
    SIMDNORM_CURSOR_METHOD ContiguousRun(const F& formula, int64_t len, char* const* const* p, bool streaming,
                                         bool peel)
        : f(formula), af(p[0][kScale], p[0][kBias]), n(len) {
      rows.each([&](Row& row, int r) SIMDNORM_INLINE_LAMBDA {
        row.y = reinterpret_cast<T*>(p[r][kOut]);
        row.x = reinterpret_cast<const In*>(p[r][kIn]);
        row.st = Pair<StatsVary>(p[r][kShift], p[r][kMul]);
        if constexpr (F::kShiftFolded) row.st.va = F::fold_shift(row.st.va, row.st.vb);
      });
      const uintptr_t addr = reinterpret_cast<uintptr_t>(rows.r0.y);
      const bool aligned_elements = addr % sizeof(T) == 0;
      stream = streaming && aligned_elements;
      if constexpr (W > 1) {
        if (aligned_elements && (peel || stream)) {
          int64_t head = head_to_line(rows.r0.y);
          if (head > n) head = n;
          while (head > 0) {
            const int m = static_cast<int>(head < W ? head : W);
            partial(m);
            head -= m;
          }
        }
      }
      steps_left = (n - i) / (2 * W);
      steps_end = i + steps_left * 2 * W;
      if (may_step_down() && steps_down(rows.r0.y, rows.r0.x)) step_down();
    }
    // Single rows of whole-line steps, streamed, the input of the storage type, two steps or more,
    // still stepping up: the runs that may take their steps from the last down.
    SIMDNORM_CURSOR_METHOD bool may_step_down() const {
      return kStepsDown && Rows == 1 && kLinePairs == 1 && stream && sizeof(In) == sizeof(T) && stride > 0 &&
             steps_left > 1;
    }
    SIMDNORM_CURSOR_METHOD void step_down() {
      i = steps_end - 2 * W;
      stride = -2 * W;
    }
    // Before the first step, beside the sums of a later row at `summed` (fused_rows.h), whose loads
    // step up with these steps: with that row near the output's phase to a page, they would fall
    // on the low 12 bits of the steps' last stores (rows of 4 KB at any output); stepped down, the
    // two cross once. Not where stepping down has that hazard with the run's own loads (an output
    // just before the input's phase).
    SIMDNORM_CURSOR_METHOD void beside(const void* summed) {
      if (!may_step_down()) return;
      const auto y = reinterpret_cast<uintptr_t>(rows.r0.y);
      const auto d = (y - reinterpret_cast<uintptr_t>(rows.r0.x)) % kPageBytes;
      const auto e = (y - reinterpret_cast<uintptr_t>(summed) + kLineBytes) % kPageBytes;
      if (e < kPageBytes / 4 && d < kPageBytes - kPageBytes / 16) step_down();
    }
    SIMDNORM_CURSOR_METHOD bool can_step() const { return steps_left > 0; }
    SIMDNORM_CURSOR_METHOD void step() {
      const V s0 = af.first(i), b0 = af.second(i), s1 = af.first(i + W), b1 = af.second(i + W);
      if constexpr (Rows == 2) {
        // Both rows loaded before either is stored: rows a multiple of 4 KB apart (4096 float16
        // elements) put the second row's loads on the low 12 bits of the first row's stores (see
        // also the sums' lead, interleave() in fused_rows.h). Single rows keep their loads and
        // stores in turn: written through these lambdas, their loop is slower.
        auto result = [&](const Row& row, int64_t at, V s, V b) SIMDNORM_INLINE_LAMBDA {
          return f(LI::load(row.x + at), row.st.first(at), row.st.second(at), s, b);
        };
        const V a0 = result(rows.r0, i, s0, b0), a1 = result(rows.r0, i + W, s1, b1);
        const V c0 = result(rows.r1, i, s0, b0), c1 = result(rows.r1, i + W, s1, b1);
        store_pair(rows.r0, a0, a1);
        store_pair(rows.r1, c0, c1);
      } else {
        rows.each([&](const Row& row, int) SIMDNORM_INLINE_LAMBDA {
          // Runs on their own (not the fused rows', whose input is cached) read from memory, and
          // stepping down the hardware prefetches too little ahead of them.
          if (!StreamEdges && stride < 0) __builtin_prefetch(row.x + i - kPrefetchAheadBytes / sizeof(In), 0, 2);
          const V r0 = f(LI::load(row.x + i), row.st.first(i), row.st.second(i), s0, b0);
          const V r1 = f(LI::load(row.x + i + W), row.st.first(i + W), row.st.second(i + W), s1, b1);
          store_pair(row, r0, r1);
        });
      }
      i += stride;
      --steps_left;
    }
    SIMDNORM_CURSOR_METHOD void store_pair(const Row& row, V r0, V r1) {
      if (stream)  // a predictable branch: cheaper than twice the code
        L::store2_stream(row.y + i, r0, r1);
      else
        L::store2(row.y + i, r0, r1);
    }
    SIMDNORM_CURSOR_METHOD void finish() {
      while (can_step()) step();
      i = steps_end;
      if (StreamEdges && stream) {  // the last lines, streamed as the rest
        while (i < n) partial(static_cast<int>(n - i < W ? n - i : W));
        return;
      }
      for (; i + W <= n; i += W) whole(i);
      if (i == n) return;
      // The last m < W elements as the run's last whole vector written again (the same values: a
      // masked store costs several plain ones), unless the output is the input, whose elements
      // there are already written, or streamed, whose line must not take a plain store too.
      bool again = n >= W && !stream;
      rows.each([&](const Row& row, int) SIMDNORM_INLINE_LAMBDA {
        again = again && static_cast<const void*>(row.y) != static_cast<const void*>(row.x);
      });
      if (again) whole(n - W), i = n;
      else partial(static_cast<int>(n - i));
    }
    SIMDNORM_CURSOR_METHOD void whole(int64_t at) const {
      const V s = af.first(at), b = af.second(at);
      rows.each([&](const Row& row, int) SIMDNORM_INLINE_LAMBDA {
        L::store(row.y + at, f(LI::load(row.x + at), row.st.first(at), row.st.second(at), s, b));
      });
    }
    SIMDNORM_CURSOR_METHOD void partial(int m) {
      const V s = af.first(i, m), b = af.second(i, m);
      rows.each([&](const Row& row, int) SIMDNORM_INLINE_LAMBDA {
        const V v = f(LI::load_partial(row.x + i, m), row.st.first(i, m), row.st.second(i, m), s, b);
        if (StreamEdges && stream) L::store_partial_stream(row.y + i, v, m);
        else L::store_partial(row.y + i, v, m);
      });
      i += m;
    }
  };

  // Pairs of vectors (2W elements) that make a 64-byte line, at least one.
  static constexpr int kLinePairs = 2 * W * sizeof(T) >= kLineBytes ? 1 : kLineBytes / (2 * W * sizeof(T));
  // Elements before the first 64-byte line boundary of an output at `out`: what a run peels so that
  // its full stores are whole lines (0 for a pointer not aligned to its elements: never peeled).
  static int64_t head_to_line(const void* out) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(out);
    if (addr % sizeof(T) != 0) return 0;
    return static_cast<int64_t>(((kLineBytes - addr % kLineBytes) % kLineBytes) / sizeof(T));
  }

  // Whether a contiguous run peels its head to a 64-byte boundary. Short rows do not: the peel
  // makes each row's loop counts depend on where it starts (mispredicted branches) and takes masked
  // stores, which cost more than whole vectors across a line; without it every row runs the same
  // loop.
  static bool peels(int64_t n) { return n * static_cast<int64_t>(sizeof(T)) >= kPeelMinBytes; }

  template <bool StatsVary, bool AffineVary, class F>
  static void run_contiguous(const F& f, int64_t n, char* const* p, bool stream, bool peel = true) {
    if constexpr (F::kInline) ContiguousRun<StatsVary, AffineVary, F>(f, n, p, stream, peel).finish();
    else run_contiguous_blocks<StatsVary, AffineVary>(f, n, p, stream);
  }

  // A contiguous run whose activation runs out of line (ActOutOfLine): blocks of vectors are
  // computed up to the activation into a buffer, the activation takes each block in one call, and
  // the block is stored. A head up to the first 64-byte line of the output goes first where the run
  // streams, so that the streamed pairs cover whole lines.
  template <bool StatsVary, bool AffineVary, class F>
  static void run_contiguous_blocks(const F& f, int64_t n, char* const* p, bool stream) {
    constexpr int kBlock = 16;  // vectors: 512 bytes of float lanes on AVX2, 1 KB on AVX-512
    T* const y = reinterpret_cast<T*>(p[kOut]);
    const T* const x = reinterpret_cast<const T*>(p[kIn]);
    const Pair<StatsVary> st(p[kShift], p[kMul]);
    const Pair<AffineVary, !F::kScaleFolded> af(p[kScale], p[kBias]);
    stream = stream && reinterpret_cast<uintptr_t>(y) % sizeof(T) == 0;
    V v[kBlock];
    // The vectors of [i, end) (whole ones but maybe the last), at most kBlock of them.
    auto block = [&](int64_t i, int64_t end) {
      int count = 0;
      for (int64_t at = i; at < end; at += W, ++count) {
        const int m = static_cast<int>(end - at < W ? end - at : W);
        if (m == W)
          v[count] = F::affine(L::load(x + at), st.first(at), st.second(at), af.first(at), af.second(at));
        else
          v[count] = F::affine(L::load_partial(x + at, m), st.first(at, m), st.second(at, m), af.first(at, m),
                               af.second(at, m));
      }
      f.act(v, count);
      int k = 0;
      int64_t at = i;
      for (; at + 2 * W <= end; at += 2 * W, k += 2) {
        if (stream)
          L::store2_stream(y + at, v[k], v[k + 1]);
        else
          L::store2(y + at, v[k], v[k + 1]);
      }
      for (; at < end; at += W, ++k) store_up_to<L>(y + at, v[k], static_cast<int>(end - at < W ? end - at : W));
    };
    int64_t i = 0;
    if (stream) {
      const int64_t head = head_to_line(y);
      i = head < n ? head : n;
      if (i > 0) block(0, i);
    }
    for (; i < n; i += kBlock * W) block(i, n - i < kBlock * W ? n : i + kBlock * W);
  }

  // Stores `total` elements at y, read from x through `c`, a cursor over the stream: c.up(i, m)
  // gives the m <= W elements from element i on, called for i in order up; c.down(i, m) the same,
  // called for i in order down; c.seek(i) readies either for the vector at or before element i.
  // Vectors up to the first 64-byte line, then whole lines from the last down (streamed, where
  // steps_down), or pairs of whole vectors up (streamed when asked), then vectors to the end. An
  // output not aligned to its elements has no lines to reach: it is stored from its start, never
  // streamed. Inlined into its caller, whose loop state the cursor holds.
  template <class Cursor>
  SIMDNORM_CURSOR_METHOD static void store_stream(T* y, const void* x, int64_t total, bool stream, Cursor& c) {
    const bool aligned_elements = reinterpret_cast<uintptr_t>(y) % sizeof(T) == 0;
    stream = stream && aligned_elements;
    const int64_t line = head_to_line(y), head = line < total ? line : total;
    int64_t i = 0;
    auto vectors_until = [&](int64_t end) SIMDNORM_INLINE_LAMBDA {
      while (i < end) {
        const int m = static_cast<int>(end - i < W ? end - i : W);
        const V v = c.up(i, m);
        if (m == W)
          L::store(y + i, v);
        else
          L::store_partial(y + i, v, m);
        i += m;
      }
    };
    vectors_until(head);
    // Stepped down, whole lines at a time: a line's vectors are loaded from the top down and
    // stored from the bottom up (a line filled from its top end, as by 32-byte halves of 16-bit
    // data, ran 1.2x slower), prefetched into the L2 as the ascending streams are by the hardware.
    if (kStepsDown && stream && steps_down(y, x)) {
      constexpr int kPerLine = kLinePairs * 2;
      const int64_t line = kPerLine * W, lines = (total - i) / line, lines_end = i + lines * line;
      if (lines > 1) {
        c.seek(lines_end);
        for (int64_t at = lines_end - line; at >= i; at -= line) {
          __builtin_prefetch(static_cast<const T*>(x) + at - kPrefetchAheadBytes / sizeof(T), 0, 2);
          V v[kPerLine];
          for_constant<0, kPerLine>([&](auto k) SIMDNORM_INLINE_LAMBDA {
            constexpr int kAt = kPerLine - 1 - decltype(k)::value;
            v[kAt] = c.down(at + kAt * W, W);
          });
          for_constant<0, kLinePairs>([&](auto k) SIMDNORM_INLINE_LAMBDA {
            L::store2_stream(y + at + 2 * W * k, v[2 * k], v[2 * k + 1]);
          });
        }
        c.seek(lines_end);
        i = lines_end;
      }
    }
    const int64_t pairs = (total - i) / (2 * W);
    // Each pair is loaded before the one before it is stored. Loaded after, its loads would
    // follow that store in program order, and with the output 40-62 bytes past the input's phase
    // to a page both would match the store's low 12 bits and wait for a non-temporal store to
    // leave.
    auto run_pairs = [&](auto streamed) SIMDNORM_INLINE_LAMBDA {
      auto store = [&](int64_t at, V r0, V r1) SIMDNORM_INLINE_LAMBDA {
        if constexpr (decltype(streamed)::value)
          L::store2_stream(y + at, r0, r1);
        else
          L::store2(y + at, r0, r1);
      };
      V r0 = c.up(i, W), r1 = c.up(i + W, W);
      for (; i + 4 * W <= total; i += 2 * W) {
        const V n0 = c.up(i + 2 * W, W), n1 = c.up(i + 3 * W, W);
        store(i, r0, r1);
        r0 = n0;
        r1 = n1;
      }
      store(i, r0, r1);
      i += 2 * W;
    };
    if (pairs > 0) {
      if (stream)
        run_pairs(std::true_type{});
      else
        run_pairs(std::false_type{});
    }
    vectors_until(total);
  }

  // Rows of n >= W contiguous elements that follow each other in memory (NCHW batch norm over
  // small images, per-group MVN over short rows), coefficients constant along each row and
  // stepping by rs per row: one stream of rows * n elements, so that stores stay 64-byte aligned
  // across rows and a row costs no head and tail of its own. A vector that straddles two rows
  // takes each lane's coefficients from its row (n >= W: at most one boundary per vector).
  template <class F>
  static void run_row_stream(const F& f, int64_t rows, int64_t n, char* const* p, const int64_t* rs,
                             bool stream) {
    T* y = reinterpret_cast<T*>(p[kOut]);
    // A row's coefficients, and where they are: named members, not arrays (an array of vectors
    // indexed in a loop was kept on the stack: each row's switch stored and reloaded it), the
    // steps copied (the loop's stores may alias rs).
    struct Coefficients {
      V shift, mul, scale, bias;
    };
    // cur: the row that ends at row_end, the row of the last vector's first element.
    struct Cursor {
      const F f;
      const T* x;
      int64_t n, rows, row_end;
      const char *shift0, *mul0, *scale0, *bias0;        // row 0's
      const char *shift_at, *mul_at, *scale_at, *bias_at;  // cur's
      int64_t shift_step, mul_step, scale_step, bias_step;
      Coefficients cur;
      SIMDNORM_CURSOR_METHOD static V at(const char* q) { return splat<V>(LC::load_one(reinterpret_cast<const C*>(q))); }
      SIMDNORM_CURSOR_METHOD void load() { cur = {at(shift_at), at(mul_at), at(scale_at), at(bias_at)}; }
      // rows_by rows on: the next row (1) or the one before (-1).
      SIMDNORM_CURSOR_METHOD void move(int64_t rows_by) {
        shift_at += rows_by * shift_step;
        mul_at += rows_by * mul_step;
        scale_at += rows_by * scale_step;
        bias_at += rows_by * bias_step;
        row_end += rows_by * n;
        load();
      }
      SIMDNORM_CURSOR_METHOD void seek(int64_t i) {
        int64_t r = i / n;
        if (r == rows) --r;
        shift_at = shift0;
        mul_at = mul0;
        scale_at = scale0;
        bias_at = bias0;
        row_end = n;
        move(r);
      }
      // The lanes below `below` take lo's coefficients, the rest hi's.
      SIMDNORM_CURSOR_METHOD V mixed(V in, int below, const Coefficients& lo, const Coefficients& hi) const {
        const auto own = lanes_mask(static_cast<V*>(nullptr), below);
        return f(in, vselect(own, lo.shift, hi.shift), vselect(own, lo.mul, hi.mul),
                 vselect(own, lo.scale, hi.scale), vselect(own, lo.bias, hi.bias));
      }
      SIMDNORM_CURSOR_METHOD V up(int64_t at, int m) {
        const V in = load_up_to<L>(x + at, m);
        if (at + m <= row_end) return f(in, cur.shift, cur.mul, cur.scale, cur.bias);
        const Coefficients lo = cur;
        move(1);
        return mixed(in, static_cast<int>(row_end - n - at), lo, cur);
      }
      SIMDNORM_CURSOR_METHOD V down(int64_t at, int m) {
        const V in = load_up_to<L>(x + at, m);
        const int64_t row_start = row_end - n;
        if (at >= row_start) return f(in, cur.shift, cur.mul, cur.scale, cur.bias);
        const Coefficients hi = cur;
        move(-1);
        return mixed(in, static_cast<int>(row_start - at), cur, hi);
      }
    };
    Cursor c{f, reinterpret_cast<const T*>(p[kIn]), n, rows, 0, p[kShift], p[kMul], p[kScale], p[kBias],
             nullptr, nullptr, nullptr, nullptr, rs[kShift], rs[kMul], rs[kScale], rs[kBias], {}};
    c.seek(0);
    store_stream(y, c.x, rows * n, stream, c);
  }

  // Rows of n elements back to back in memory whose coefficients are the same for every row:
  // channels-last batch norm and instance norm, their channels (repeated along runs of ~1024, see
  // lengthen_repeating_runs) innermost. Run as one stream of rows * n elements, as
  // run_row_stream() runs rows of constant coefficients: the stores stay 64-byte aligned across
  // rows. Row by row, an output that does not start on a line would give each row a head and a
  // tail of plain stores into lines the rest of the stream keeps out of the cache (non-temporal
  // stores): each such line would be read from memory first, and the stores behind it wait.
  // Element j of the stream takes the coefficients of element j mod n of a row, read from copies
  // of the arrays that repeat their first W elements past their end, so that a vector that wraps
  // to the next row reads them in one piece.
  template <bool StatsVary, bool AffineVary, class F>
  static void run_periodic_stream(const F& f, int64_t rows, int64_t n, char* const* p, bool stream) {
    T* y = reinterpret_cast<T*>(p[kOut]);
    const T* x = reinterpret_cast<const T*>(p[kIn]);
    // The copies start where the loads of the steps after the head line up with the stores
    // (whenever a row is whole lines of coefficients, the usual case).
    constexpr int64_t kPerLine = 64 / sizeof(C), kPitch = kPeriodicMaxRun + W + kPerLine;
    alignas(64) C copies[4][kPitch];
    const int64_t lead = (kPerLine - head_to_line(y) % kPerLine) % kPerLine;
    char* q[kNumOperands];
    std::memcpy(q, p, sizeof q);
    auto copy = [&](int op) {
      C* c = copies[op - kShift] + lead;
      std::memcpy(c, p[op], n * sizeof(C));
      std::memcpy(c + n, p[op], W * sizeof(C));
      q[op] = reinterpret_cast<char*>(c);
    };
    if constexpr (StatsVary) {
      copy(kShift);
      copy(kMul);
    }
    if constexpr (AffineVary) {
      if constexpr (!F::kScaleFolded) copy(kScale);
      copy(kBias);
    }
    // k: the index in its row of the next vector's first element up (of the last one's, down);
    // m <= W <= n: one wrap at most.
    struct Cursor {
      const F f;
      const T* x;
      const Pair<StatsVary> st;
      const Pair<AffineVary, !F::kScaleFolded> af;
      int64_t n, k = 0;
      SIMDNORM_CURSOR_METHOD V at(int64_t i, int m) const {
        return f(load_up_to<L>(x + i, m), st.first(k), st.second(k), af.first(k), af.second(k));
      }
      SIMDNORM_CURSOR_METHOD V up(int64_t i, int m) {
        const V r = at(i, m);
        k += m;
        if (k >= n) k -= n;
        return r;
      }
      SIMDNORM_CURSOR_METHOD V down(int64_t i, int m) {
        k -= m;
        if (k < 0) k += n;
        return at(i, m);
      }
      SIMDNORM_CURSOR_METHOD void seek(int64_t i) { k = i % n; }
    };
    Cursor c{f, x, Pair<StatsVary>(q[kShift], q[kMul]), Pair<AffineVary, !F::kScaleFolded>(q[kScale], q[kBias]), n};
    store_stream(y, x, rows * n, stream, c);
  }

  // Any other strides: gather a vector's worth into buffers and run the same arithmetic, so an
  // element gets the same bits whichever path it takes.
  template <class F>
  static void run_strided(const F& f, int64_t n, char* const* p, const int64_t* s) {
    T xb[W], yb[W];
    C cb[4][W];
    for (int64_t i = 0; i < n; i += W) {
      const int m = static_cast<int>(n - i < W ? n - i : W);
      for (int k = 0; k < m; ++k) {
        std::memcpy(&xb[k], p[kIn] + (i + k) * s[kIn], sizeof(T));
        for (int c = 0; c < 4; ++c) std::memcpy(&cb[c][k], p[kShift + c] + (i + k) * s[kShift + c], sizeof(C));
      }
      const V r = f(L::load_partial(xb, m), LC::load_partial(cb[0], m), LC::load_partial(cb[1], m),
                          LC::load_partial(cb[2], m), LC::load_partial(cb[3], m));
      L::store_partial(yb, r, m);
      for (int k = 0; k < m; ++k) std::memcpy(p[kOut] + (i + k) * s[kOut], &yb[k], sizeof(T));
    }
  }

  // Calls fn(std::integral_constant<bool, stats_vary>, std::integral_constant<bool, affine_vary>).
  template <class Fn>
  static void visit_pairs(const InnerPlan& plan, Fn&& fn) {
    using T0 = std::false_type;
    using T1 = std::true_type;
    if (plan.stats_vary) {
      if (plan.affine_vary) fn(T1{}, T1{});
      else fn(T1{}, T0{});
    } else {
      if (plan.affine_vary) fn(T0{}, T1{});
      else fn(T0{}, T0{});
    }
  }

  // `rows` runs of n elements, run r at p + r * rs, by the task's plan (InnerPlan, chosen by
  // ops/common.cpp). A lone run (a piece at either end of a thread's range, or execute_run's) takes
  // the contiguous loop: the streams and the blocks are loops over many runs. An out-of-line
  // activation has no periodic stream (plan_inner_loop does not choose it for it): its runs go one
  // by one. (It keeps the row stream, whose short runs would each end in a partial vector, and so in
  // a call for a few elements.)
  template <class F>
  static void run_rows(const F& f, const InnerPlan& plan, int64_t rows, int64_t n, char* const* p, const int64_t* s,
                       const int64_t* rs, bool stream) {
    char* q[kNumOperands];
    std::memcpy(q, p, sizeof q);
    auto each_row = [&](auto&& one_row) {
      for (int64_t r = 0; r < rows; ++r) {
        one_row(q);
        for (int op = 0; op < kNumOperands; ++op) q[op] += rs[op];
      }
    };
    const InnerLoop loop = rows == 1 && plan.loop != InnerLoop::strided ? InnerLoop::contiguous : plan.loop;
    if (loop == InnerLoop::strided) return each_row([&](char* const* r) { run_strided(f, n, r, s); });
    if (loop == InnerLoop::row_stream) return run_row_stream(f, rows, n, p, rs, stream);
    visit_pairs(plan, [&](auto stats_vary, auto affine_vary) {
      constexpr bool kStats = decltype(stats_vary)::value, kAffine = decltype(affine_vary)::value;
      if constexpr ((kStats || kAffine) && F::kInline) {
        if (loop == InnerLoop::periodic_stream) return run_periodic_stream<kStats, kAffine>(f, rows, n, p, stream);
      }
      if (loop == InnerLoop::column_blocks) {
        // Block by block, each over all the rows; the boundaries after the first sit on the first
        // row's output lines.
        const int64_t block = plan.block_columns, first = head_to_line(p[kOut]) + block;
        for (int64_t b0 = 0, b1; b0 < n; b0 = b1) {
          b1 = b0 == 0 ? first : b0 + block;
          if (b1 > n) b1 = n;
          for (int op = 0; op < kNumOperands; ++op) q[op] = p[op] + b0 * s[op];
          each_row([&](char* const* r) { run_contiguous<kStats, kAffine>(f, b1 - b0, r, stream); });
        }
        return;
      }
      const bool peel = peels(n);
      // Runs that step down are taken from the last: rows back to back (NCHW planes) are then one
      // stream down through memory, not a stream per row for the prefetchers to find anew.
      const bool last_first = stream && steps_down(p[kOut], p[kIn]);
      for (int64_t k = 0; k < rows; ++k) {
        const int64_t r = last_first ? rows - 1 - k : k;
        for (int op = 0; op < kNumOperands; ++op) q[op] = p[op] + r * rs[op];
        run_contiguous<kStats, kAffine>(f, n, q, stream, peel);
      }
    });
  }

  static void execute(const NormalizeTask& task, int64_t begin, int64_t end) {
    const bool stream = task.stream_stores;
    visit_formula(task, [&](const auto& f) {
      for_each_block(task.loop, begin, end,
                     [&](int64_t rows, int64_t len, char* const* p, const int64_t* s, const int64_t* rs) {
                       run_rows(f, task.inner, rows, len, p, s, rs, stream);
                     });
    });
    if (stream) stream_fence();
  }

  // One run of n elements at p (inner strides from the task's nest); no fence (the caller orders
  // its streaming stores once, after its last run).
  static void execute_run(const NormalizeTask& task, char* const* p, int64_t n) {
    int64_t s[kNumOperands];
    for (int op = 0; op < kNumOperands; ++op) s[op] = task.loop.strides[op][task.loop.ndim - 1];
    const int64_t no_step[kNumOperands] = {};
    visit_formula(task, [&](const auto& f) { run_rows(f, task.inner, 1, n, p, s, no_step, task.stream_stores); });
  }
};

static void normalize_run_entry(const NormalizeTask& task, char* const* p, int64_t n) {
  with_storage_type(task.dtype, [&](auto t) {
    NormalizeKernel<typename decltype(t)::type>::execute_run(task, p, n);
  });
}

static void normalize_entry(const NormalizeTask& task, int64_t begin, int64_t end) {
  with_storage_type(task.dtype, [&](auto t) {
    NormalizeKernel<typename decltype(t)::type>::execute(task, begin, end);
  });
}
