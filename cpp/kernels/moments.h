// Shifted sums for mean-variance normalization statistics. Included inside an ISA namespace.
// d = (x - pivot) * scale is accumulated in double lanes (SumLanes): element e of a run, counted
// from the run's first element, goes to lane e mod S of S (two input vectors' worth), and the lanes
// are added in one fixed tree when the run ends (a float lane group's runs, col_lane_groups: when
// its last run ends). So a run's sums depend only on its values: not on
// its address, not on the loop that reads it (contiguous, strided, fused with a normalization, the
// 16-bit row stream), not on how work was split between threads (runs are cut where ops/mvn.cpp's
// blocks end, whatever the split). In double, float data loses nothing to the subtraction, and its
// squares and their sums can neither overflow nor underflow.
// The scale is 1, or for float64 data a power of two for a pass after squares overflowed or may
// have underflowed (ops/mvn_runner.h: Scaling), and d is taken as x * scale - pivot * scale: the same
// value for a power of two, but x - pivot cannot overflow where x and the pivot lie near the
// largest double with opposite signs (it made such a group's statistics NaN).

// The S double lanes of one run's sums, Q vectors of doubles: a step of two input vectors V (vf,
// two vd each; or vd), step lane q * kWidthD + j in s1.at<q>()[j] and s2.at<q>()[j]. The half of a
// step (H) and the part of a vector (P) are template arguments: every member index is a constant.
template <class V>
struct SumLanes {
  static constexpr int kParts = std::is_same<V, vf>::value ? 2 : 1;  // vd per input vector
  static constexpr int Q = 2 * kParts;
  static constexpr int WD = kWidthD;
  static constexpr int S = Q * WD;
  VdSet<Q> s1, s2;

  template <int P>
  SIMDNORM_CURSOR_METHOD static vd part(V x) {
    if constexpr (kParts == 1) return x;
    else if constexpr (P == 0) return vwiden_lo(x);
    else return vwiden_hi(x);
  }
  SIMDNORM_CURSOR_METHOD void clear() {
    for_constant<0, Q>([&](auto q) SIMDNORM_INLINE_LAMBDA {
      s1.template at<decltype(q)::value>() = s2.template at<decltype(q)::value>() = vbroadcast_vd(0.0);
    });
  }
  // Without Plain only the squares (RMS norm's rows, whose plain sums nobody reads).
  template <int q, bool Plain = true>
  SIMDNORM_CURSOR_METHOD void add_d(vd d) {
    if constexpr (Plain) s1.template at<q>() += d;
    s2.template at<q>() = vfma(d, d, s2.template at<q>());
  }
  // (x - pivot) * scale, the pivot given times the scale (see the top of the file).
  template <bool Scaled>
  SIMDNORM_CURSOR_METHOD static vd shifted(vd x, vd scaled_pivot, vd scale) {
    if constexpr (Scaled) return x * scale - scaled_pivot;
    else return x - scaled_pivot;
  }
  // The input vector x at half H of a step (0: the step's first W elements).
  template <int H, bool Scaled>
  SIMDNORM_CURSOR_METHOD void add(V x, vd scaled_pivot, vd scale) {
    for_constant<0, kParts>([&](auto p) SIMDNORM_INLINE_LAMBDA {
      constexpr int pi = decltype(p)::value;
      add_d<H * kParts + pi>(shifted<Scaled>(part<pi>(x), scaled_pivot, scale));
    });
  }
  // The same with a pivot of 0 (x itself: subtracting 0 would give the same bits).
  template <int H, bool Plain = true>
  SIMDNORM_CURSOR_METHOD void add_unshifted(V x) {
    for_constant<0, kParts>([&](auto p) SIMDNORM_INLINE_LAMBDA {
      constexpr int pi = decltype(p)::value;
      add_d<H * kParts + pi, Plain>(part<pi>(x));
    });
  }
  // The same, read from float32 data at p: each part loaded and widened on its own (an extract fewer);
  // not Shifted: around 0, as add_unshifted.
  template <int H, bool Scaled, bool Shifted = true>
  SIMDNORM_CURSOR_METHOD void add_widened(const float* p, vd scaled_pivot, vd scale) {
    static_assert(kParts == 2, "float32 data has two parts a vector");
    for_constant<0, kParts>([&](auto part_index) SIMDNORM_INLINE_LAMBDA {
      constexpr int pi = decltype(part_index)::value;
      const vd x = vload_widened(p + pi * WD);
      add_d<H * kParts + pi>(Shifted ? shifted<Scaled>(x, scaled_pivot, scale) : x);
    });
  }
  // Its lanes [0, m) only, at half h.
  template <bool Scaled>
  SIMDNORM_CURSOR_METHOD void add_partial(int h, V x, int m, vd scaled_pivot, vd scale) {
    auto at_half = [&](auto half) SIMDNORM_INLINE_LAMBDA {
      for_constant<0, kParts>([&](auto p) SIMDNORM_INLINE_LAMBDA {
        constexpr int pi = decltype(p)::value;
        const int lanes = m - pi * WD < 0 ? 0 : m - pi * WD > WD ? WD : m - pi * WD;
        const vd d = shifted<Scaled>(part<pi>(x), scaled_pivot, scale);
        add_d<decltype(half)::value * kParts + pi>(vselect(vlanes_below_d(lanes), d, vbroadcast_vd(0.0)));
      });
    };
    if (h == 0) at_half(std::integral_constant<int, 0>{});
    else at_half(std::integral_constant<int, 1>{});
  }
  // The lanes' total, in one tree.
  SIMDNORM_CURSOR_METHOD static double tree(const VdSet<Q>& s) {
    if constexpr (Q == 4) return vreduce_add((s.v0 + s.v1) + (s.v2 + s.v3));
    else return vreduce_add(s.v0 + s.v1);
  }
  // The same, of lanes that a loop aligned elsewhere filled rotated: step lane P holding run lane
  // (P - o) mod S (the 16-bit row stream, whose steps follow the output's phase o).
  static double tree_rotated(const VdSet<Q>& s, int o) {
    if (o == 0) return tree(s);
    alignas(64) double lanes[2 * S];
    for_constant<0, Q>([&](auto q) SIMDNORM_INLINE_LAMBDA {
      constexpr int qi = decltype(q)::value;
      Lanes<double>::store(lanes + qi * WD, s.template at<qi>());
      Lanes<double>::store(lanes + S + qi * WD, s.template at<qi>());
    });
    VdSet<Q> t;
    for_constant<0, Q>([&](auto q) SIMDNORM_INLINE_LAMBDA {
      constexpr int qi = decltype(q)::value;
      t.template at<qi>() = Lanes<double>::load(lanes + o + qi * WD);
    });
    return tree(t);
  }
};

template <class T>
struct MomentsKernel {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename ComputeOf<T>::type;
  using Sums = SumLanes<V>;
  static constexpr int W = L::W;
  static_assert(Sums::S == 2 * W, "a step of the sums is two input vectors");

  // The shifted sums of one contiguous run, as a cursor: a caller may interleave its steps with
  // other work (kernels/fused_rows.h normalizes an earlier row in the same loop) and gets the same
  // bits as row(), which runs the same steps back to back. Unscaled, it skips the multiply by a
  // scale of 1 (x * 1 == x exactly: the same bits, one multiply fewer per vector). With Keep, it
  // also stores the row as it reads it, converted, at `keep` (float; room for a vector past n).
  // With Rows > 1 it sums that many runs of n in step (each run's sums are those it would have
  // alone). Not Centered (RMS norm: the pivots must be 0), it takes only the squares and reports
  // a sum of 0, which such statistics never read: the squares are the same bits, an add and a
  // subtraction fewer a vector of doubles.
  template <bool Scaled, bool Keep = false, int Rows = 1, bool Centered = true>
  struct ContiguousSums {
    static_assert(!(Keep && std::is_same<T, float>::value), "float32 rows are read where they lie, never kept");
    struct Row {
      float* keep;
      const T* x;
      vd pivot;
      Sums lanes;
      double sum, sum_sq;
    };
    RowsOf<Row, Rows> rows;
    int64_t n, i = 0;
    vd scale;

    SIMDNORM_CURSOR_METHOD explicit ContiguousSums(const RowMomentsArgs& a, float* keep_at = nullptr)
        : ContiguousSums(&a, &keep_at) {}
    // a[r], keep_at[r]: run r's (the scale is run 0's, shared).
    SIMDNORM_CURSOR_METHOD ContiguousSums(const RowMomentsArgs* a, float* const* keep_at)
        : n(a[0].len), scale(vbroadcast_vd(a[0].scale)) {
      rows.each([&](Row& row, int r) SIMDNORM_INLINE_LAMBDA {
        row.keep = keep_at[r];
        row.x = reinterpret_cast<const T*>(a[r].data);
        row.pivot = vbroadcast_vd(Scaled ? a[r].pivot * a[0].scale : a[r].pivot);
        row.lanes.clear();
        row.sum = row.sum_sq = 0.0;
      });
    }
    SIMDNORM_CURSOR_METHOD bool can_step() const { return i + 2 * W <= n; }
    SIMDNORM_CURSOR_METHOD void step() {
      rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
        if constexpr (std::is_same<T, float>::value) {  // (nothing to keep: only 16-bit rows are kept)
          row.lanes.template add_widened<0, Scaled, Centered>(row.x + i, row.pivot, scale);
          row.lanes.template add_widened<1, Scaled, Centered>(row.x + i + W, row.pivot, scale);
        } else {
          const V x0 = L::load(row.x + i), x1 = L::load(row.x + i + W);
          kept(row, i, x0);
          kept(row, i + W, x1);
          add<0>(row, x0);
          add<1>(row, x1);
        }
      });
      i += 2 * W;
    }
    template <int H>
    SIMDNORM_CURSOR_METHOD void add(Row& row, V x) const {
      if constexpr (Centered) row.lanes.template add<H, Scaled>(x, row.pivot, scale);
      else row.lanes.template add_unshifted<H>(x);
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
          add<0>(row, xv);
        });
        i += W;
      }
      if (i < n) {
        const int m = static_cast<int>(n - i), h = static_cast<int>(i / W % 2);
        rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
          const V x_part = L::load_partial(row.x + i, m);
          kept(row, i, x_part);  // a whole vector: the lanes past m land where later steps or the padding go
          row.lanes.template add_partial<Scaled>(h, x_part, m, row.pivot, scale);
        });
        i = n;
      }
      rows.each([&](Row& row, int) SIMDNORM_INLINE_LAMBDA {
        row.sum = Centered ? Sums::tree(row.lanes.s1) : 0.0;
        row.sum_sq = Sums::tree(row.lanes.s2);
      });
    }
    SIMDNORM_CURSOR_METHOD void kept(const Row& row, int64_t at, V v) const {
      if constexpr (Keep) Lanes<float>::store(row.keep + at, v);
    }
  };

  static void row(const RowMomentsArgs& a) {
    if (a.stride == static_cast<int64_t>(sizeof(T)))
      return a.scale == 1.0 ? ContiguousSums<false>(a).finish(a.sum, a.sum_sq)
                            : ContiguousSums<true>(a).finish(a.sum, a.sum_sq);
    // Gathered a step at a time, each element into the lane it takes in a contiguous run.
    const vd pivot = vbroadcast_vd(a.pivot * a.scale), scale = vbroadcast_vd(a.scale);
    Sums lanes;
    lanes.clear();
    T buf[2 * W];
    for (int64_t i = 0; i < a.len; i += 2 * W) {
      const int m = static_cast<int>(a.len - i < 2 * W ? a.len - i : 2 * W);
      for (int k = 0; k < m; ++k) std::memcpy(&buf[k], a.data + (i + k) * a.stride, sizeof(T));
      lanes.template add_partial<true>(0, L::load_partial(buf, m < W ? m : W), m < W ? m : W, pivot, scale);
      if (m > W) lanes.template add_partial<true>(1, L::load_partial(buf + W, m - W), m - W, pivot, scale);
    }
    *a.sum += Sums::tree(lanes.s1);
    *a.sum_sq += Sums::tree(lanes.s2);
  }

  // Lane blocks of at most kLanes, each lane's sums in double down all the rows.
  static constexpr int kLanes = 256;
  // Rows a lane's sums take in registers between a load and a store of them: one row at a time,
  // the sums' loads and stores (in memory: too many for registers) cost the loop 4x the time of
  // the rows' sums. Each lane still adds its rows in order, so the sums are the same bits.
  static constexpr int kRows = 4;

  // Few rows (a lane group's batch: batch norm training of 8x512x7x7), contiguous lanes: a step of
  // Vecs vectors of lanes summed down all the rows in registers, then added to the lanes' totals.
  // Blocks of lanes would set up and store their sums for those few rows at a cost of the rows'
  // own. The same sums: each lane adds its rows in order, from 0, then that to its total. Fresh:
  // the totals are stored, not added to (the caller's totals were 0: 0 + t is t, never -0).
  static constexpr int64_t kFewRows = 16;
  template <int Vecs, bool Fresh>
  SIMDNORM_CURSOR_METHOD static void col_few_rows_step(const ColMomentsArgs& a, int64_t c, int m) {
    constexpr int kParts = Sums::kParts, WD = Sums::WD, Q = Vecs * kParts;
    const vd scale = vbroadcast_vd(a.scale), zero = vbroadcast_vd(0.0);
    constexpr int kWhole = Vecs * W;
    vd negp[Q], t1[Q], t2[Q];
    alignas(64) double piv[kWhole];  // the pivots times the scale, 0 past m (as col's)
    if (m < kWhole)
      for (int j = 0; j < kWhole; ++j) piv[j] = j < m ? a.pivot[c + j] * a.scale : 0.0;
    for (int q = 0; q < Q; ++q) {
      negp[q] = zero - (m < kWhole ? Lanes<double>::load(piv + q * WD) : Lanes<double>::load(a.pivot + c + q * WD) * scale);
      t1[q] = t2[q] = zero;
    }
    for (int64_t r = 0; r < a.rows; ++r) {
      const T* px = reinterpret_cast<const T*>(a.data + r * a.row_stride) + c;
      for_constant<0, Vecs>([&](auto vi) SIMDNORM_INLINE_LAMBDA {
        constexpr int v = decltype(vi)::value;
        const V x = m >= (v + 1) * W ? L::load(px + v * W) : m > v * W ? L::load_partial(px + v * W, m - v * W) : V{};
        for_constant<0, kParts>([&](auto pi) SIMDNORM_INLINE_LAMBDA {
          constexpr int q = v * kParts + decltype(pi)::value;
          const vd d = vfma(Sums::template part<decltype(pi)::value>(x), scale, negp[q]);
          t1[q] += d;
          t2[q] = vfma(d, d, t2[q]);
        });
      });
    }
    if (m == kWhole) {
      for (int q = 0; q < Q; ++q) {
        Lanes<double>::store(a.sum + c + q * WD, Fresh ? t1[q] : Lanes<double>::load(a.sum + c + q * WD) + t1[q]);
        Lanes<double>::store(a.sum_sq + c + q * WD,
                             Fresh ? t2[q] : Lanes<double>::load(a.sum_sq + c + q * WD) + t2[q]);
      }
      return;
    }
    add_to_totals<kWhole, Fresh>(t1, t2, Q, m, a.sum + c, a.sum_sq + c);
  }
  // Adds lanes [0, n) of the q vectors s1 and s2 to sum[0, n) and sum_sq[0, n) (Fresh: stores them).
  template <int MaxLanes, bool Fresh = false>
  SIMDNORM_CURSOR_METHOD static void add_to_totals(const vd* s1, const vd* s2, int q, int n, double* sum,
                                                   double* sum_sq) {
    alignas(64) double t1[MaxLanes], t2[MaxLanes];
    for (int v = 0; v < q; ++v) {
      Lanes<double>::store(t1 + v * Sums::WD, s1[v]);
      Lanes<double>::store(t2 + v * Sums::WD, s2[v]);
    }
    for (int c = 0; c < n; ++c) {
      sum[c] = Fresh ? t1[c] : sum[c] + t1[c];
      sum_sq[c] = Fresh ? t2[c] : sum_sq[c] + t2[c];
    }
  }
  template <bool Fresh = false>
  static void col_few_rows(const ColMomentsArgs& a) {
    int64_t c = 0;
    for (; c + 2 * W <= a.cols; c += 2 * W) col_few_rows_step<2, Fresh>(a, c, 2 * W);  // (two vectors: two chains)
    if (c < a.cols) col_few_rows_step<2, Fresh>(a, c, static_cast<int>(a.cols - c));
  }

  // Lane groups (a.lane_group contiguous lanes each, a few dozen rows: batch norm training of small
  // NCHW planes), one group at a time: its runs are one sequence whose every run starts at lane 0
  // (element j of a run into lane j mod S), its lanes added in one tree after its last run. So a
  // group's sums depend on its own values and shape only, and need no per-lane scratch.
  // float64 runs end in a tree each, their totals added in order, as a group's runs are summed as
  // rows (FusedRowsKernel::execute_group: a group of lane groups is at most 64 x 400 elements, one
  // block), so that a channel's float64 statistics are the same bits alone as in a batch. Float
  // data's sums come out the same either way once rounded to float; one tree a group is cheaper.
  static constexpr bool kTreePerRun = std::is_same<T, double>::value;
  template <bool Scaled>
  static void col_lane_groups(const ColMomentsArgs& a) {
    constexpr int64_t ts = sizeof(T);
    const int64_t k = a.lane_group, groups = a.cols / k, steps = k / (2 * W);
    // After the steps of two vectors: a single vector (a step's first half), then a partial one of m
    // lanes (in the half after it).
    const bool single = k % (2 * W) >= W;
    const int m = static_cast<int>(k % W);
    const vd scale = vbroadcast_vd(a.scale);
    // Each row's lines of the group two ahead (the batch's rows are as many streams, more than the
    // hardware follows).
    const int64_t ahead = 2 * k * ts, lines = (k * ts + kLineBytes - 1) / kLineBytes;
    // The partial vector's lanes, of each part (the masks fixed for the call).
    constexpr int kParts = Sums::kParts, WD = Sums::WD;
    vmaskd tail_mask[kParts];
    for (int pi = 0; pi < kParts; ++pi) {
      const int in_part = m - pi * WD;
      tail_mask[pi] = vlanes_below_d(in_part < 0 ? 0 : in_part > WD ? WD : in_part);
    }
    const vd zero = vbroadcast_vd(0.0);
    for (int64_t g = 0; g < groups; ++g) {
      const vd pivot = vbroadcast_vd(Scaled ? a.pivot[g] * a.scale : a.pivot[g]);
      Sums lanes;
      lanes.clear();
      double sum = 0.0, sum_sq = 0.0;
      // The m elements at x, at half H of a step; a part past them adds nothing and is skipped.
      auto add_tail = [&](auto at_half, const T* x) SIMDNORM_INLINE_LAMBDA {
        const V v = L::load_partial(x, m);
        for_constant<0, kParts>([&](auto part) SIMDNORM_INLINE_LAMBDA {
          constexpr int pi = decltype(part)::value;
          if (pi * WD >= m) return;
          const vd d = Sums::template shifted<Scaled>(Sums::template part<pi>(v), pivot, scale);
          lanes.template add_d<decltype(at_half)::value * kParts + pi>(vselect(tail_mask[pi], d, zero));
        });
      };
      const char* row = a.data + g * k * ts;
      for (int64_t r = 0; r < a.rows; ++r, row += a.row_stride) {
        if (g + 2 < groups)
          for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(row + ahead + l * kLineBytes, 0, 3);
        const T* x = reinterpret_cast<const T*>(row);
        for (int64_t s = 0; s < steps; ++s, x += 2 * W) {
          if constexpr (std::is_same<T, float>::value) {
            lanes.template add_widened<0, Scaled>(x, pivot, scale);
            lanes.template add_widened<1, Scaled>(x + W, pivot, scale);
          } else {
            lanes.template add<0, Scaled>(L::load(x), pivot, scale);
            lanes.template add<1, Scaled>(L::load(x + W), pivot, scale);
          }
        }
        if (single) {
          lanes.template add<0, Scaled>(L::load(x), pivot, scale);
          x += W;
        }
        if (m > 0) {
          if (single) add_tail(std::integral_constant<int, 1>{}, x);
          else add_tail(std::integral_constant<int, 0>{}, x);
        }
        if constexpr (kTreePerRun) {
          sum += Sums::tree(lanes.s1);
          sum_sq += Sums::tree(lanes.s2);
          lanes.clear();
        }
      }
      a.sum[g] += kTreePerRun ? sum : Sums::tree(lanes.s1);
      a.sum_sq[g] += kTreePerRun ? sum_sq : Sums::tree(lanes.s2);
    }
  }

  static void col(const ColMomentsArgs& a) {
    if (a.lane_group > 1) return a.scale == 1.0 ? col_lane_groups<false>(a) : col_lane_groups<true>(a);
    if (a.rows <= kFewRows && a.col_stride == static_cast<int64_t>(sizeof(T))) return col_few_rows(a);
    constexpr int kParts = Sums::kParts, WD = Sums::WD, kVecs = kLanes / W;
    for (int64_t c0 = 0; c0 < a.cols; c0 += kLanes) {
      const int nb = static_cast<int>(a.cols - c0 < kLanes ? a.cols - c0 : kLanes);
      const int nv = (nb + W - 1) / W;
      const int last = nb - (nv - 1) * W;  // lanes in the last vector
      alignas(64) double piv[kLanes];
      for (int c = 0; c < nb; ++c) piv[c] = a.pivot[c0 + c] * a.scale;
      for (int c = nb; c < nv * W; ++c) piv[c] = 0.0;
      // d = fma(x, scale, -pivot * scale): the value of x * scale - pivot * scale (scale is a power
      // of two: the product is exact), one instruction fewer.
      vd negp[kVecs * kParts], s1[kVecs * kParts], s2[kVecs * kParts];  // (in memory: too many for registers)
      for (int v = 0; v < nv * kParts; ++v) {
        negp[v] = vbroadcast_vd(0.0) - Lanes<double>::load(piv + v * WD);
        s1[v] = s2[v] = vbroadcast_vd(0.0);
      }
      const vd scale = vbroadcast_vd(a.scale);
      const bool contiguous = a.col_stride == static_cast<int64_t>(sizeof(T));
      // Rows are prefetched kPrefetchAheadBytes ahead (at least a row): a block of lanes reads a
      // short run of each row, which the hardware prefetcher does not follow far enough. Each
      // vector's step prefetches its share of the lines: all of a row's lines at once overflow the
      // core's queue of misses, which then drops most of them (1.7x slower from memory).
      const int64_t step = a.row_stride < 0 ? -a.row_stride : a.row_stride;
      const int64_t ahead = step == 0 || !contiguous ? 0 : prefetch_units_ahead(step);
      const int64_t block_bytes = (a.rows_cached ? (c0 == 0 ? a.cols : 0) : nb) * static_cast<int64_t>(sizeof(T));
      const int64_t block_lines = (block_bytes + kLineBytes - 1) / kLineBytes;
      const int64_t lines_per_vector = (block_lines + nv - 1) / nv;
      // Rows back to back, the block all of each (channels-last batch norm's statistics): the rows
      // ahead are one run of lines, shared out evenly between the vectors' steps: a few straight
      // prefetches a step, not a loop over the rows with its tests, which was a quarter of the
      // instructions of those statistics.
      const bool one_run = nb == a.cols && a.row_stride == a.cols * static_cast<int64_t>(sizeof(T));
      const int64_t row_bytes = a.cols * static_cast<int64_t>(sizeof(T));
      // Rows [r, r + R): vector v of each, then each of its parts' sums over those rows.
      auto rows = [&](int64_t r, auto count) SIMDNORM_INLINE_LAMBDA {
        constexpr int R = decltype(count)::value;
        const char* first = a.data + r * a.row_stride + c0 * a.col_stride;
        const char* later = first + ahead * a.row_stride;
        const int64_t left = ahead == 0 ? 0 : std::max<int64_t>(0, a.rows - r - ahead);  // rows to prefetch
        const int rows_ahead = static_cast<int>(std::min<int64_t>(left, R));
        const int64_t run_lines = one_run && rows_ahead > 0 ? (rows_ahead * row_bytes + kLineBytes - 1) / kLineBytes + 1 : 0;
        const int64_t run_share = (run_lines + nv - 1) / nv;
        auto prefetch_share = [&](int v) SIMDNORM_INLINE_LAMBDA {
          if (one_run) {
            for (int64_t b = v * run_share, e = std::min(run_lines, b + run_share); b < e; ++b)
              __builtin_prefetch(later + b * kLineBytes, 0, 3);
            return;
          }
          const int64_t b0 = v * lines_per_vector;
          if (b0 >= block_lines) return;
          const int64_t n = std::min(lines_per_vector, block_lines - b0);
          for (int j = 0; j < R && j < rows_ahead; ++j) {  // (the first line peeled: one a row is the common case)
            const char* line = later + j * a.row_stride + b0 * kLineBytes;
            __builtin_prefetch(line, 0, 3);
            for (int64_t b = 1; b < n; ++b) __builtin_prefetch(line + b * kLineBytes, 0, 3);
          }
        };
        // Each part's sums over the R rows, from load(j, part): that row's part of vector v.
        auto add = [&](int v, auto load) SIMDNORM_INLINE_LAMBDA {
          for_constant<0, kParts>([&](auto p) SIMDNORM_INLINE_LAMBDA {
            const int q = v * kParts + decltype(p)::value;
            vd t1 = s1[q], t2 = s2[q];
            for (int j = 0; j < R; ++j) {
              const vd d = vfma(load(j, p), scale, negp[q]);  // lanes past nb: 0 - 0
              t1 += d;
              t2 = vfma(d, d, t2);
            }
            s1[q] = t1;
            s2[q] = t2;
          });
        };
        const int whole = contiguous ? (last == W ? nv : nv - 1) : 0;
        for (int v = 0; v < whole; ++v) {  // loaded where they are used (a vector array spilled to the stack)
          prefetch_share(v);
          add(v, [&](int j, auto p) SIMDNORM_INLINE_LAMBDA {
            const T* px = reinterpret_cast<const T*>(first + j * a.row_stride) + v * W;
            if constexpr (std::is_same<T, float>::value) return vload_widened(px + decltype(p)::value * WD);
            else return Sums::template part<decltype(p)::value>(L::load(px));
          });
        }
        for (int v = whole; v < nv; ++v) {  // a last vector of fewer lanes, or gathered lanes
          prefetch_share(v);
          const int m = v == nv - 1 ? last : W;
          V x[R];
          for (int j = 0; j < R; ++j) {
            const char* row = first + j * a.row_stride;
            if (contiguous) {
              x[j] = L::load_partial(reinterpret_cast<const T*>(row) + v * W, m);
            } else {
              T buf[W];
              for (int k = 0; k < m; ++k) std::memcpy(&buf[k], row + (v * W + k) * a.col_stride, sizeof(T));
              x[j] = L::load_partial(buf, m);
            }
          }
          add(v, [&](int j, auto p) SIMDNORM_INLINE_LAMBDA { return Sums::template part<decltype(p)::value>(x[j]); });
        }
      };
      int64_t r = 0;
      for (; r + kRows <= a.rows; r += kRows) rows(r, std::integral_constant<int, kRows>{});
      for (; r < a.rows; ++r) rows(r, std::integral_constant<int, 1>{});
      add_to_totals<kLanes>(s1, s2, nv * kParts, nb, a.sum + c0, a.sum_sq + c0);
    }
  }
};

static void row_moments_entry(const RowMomentsArgs& a) {
  with_storage_type(a.dtype, [&](auto t) {
    MomentsKernel<typename decltype(t)::type>::row(a);
  });
}

static void col_moments_entry(const ColMomentsArgs& a) {
  with_storage_type(a.dtype, [&](auto t) {
    MomentsKernel<typename decltype(t)::type>::col(a);
  });
}
