// The mean-variance normalization driver's class (ops/mvn.cpp opens with the overview), defined in
// three files that are one translation unit (mvn.cpp includes the other two at its end):
//   mvn.cpp          the entry point, setup and planning, empty reductions
//   mvn_rows.h       the row strategies (run_rows)
//   mvn_columns.h    the column strategy (run_columns)
// Defined here: the constants, and what more than one of them calls in its loops (the statistics
// of one group, the strategy tests). One unit keeps the class in an anonymous namespace, with
// kernels/lane_stats.h and iterate.h, as they ask.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "ops/common.h"
#include "simdnorm/check.h"
#include "runtime/cpu.h"
#include "runtime/thread_pool.h"

namespace simdnorm {
namespace {
#include "kernels/iterate.h"
#include "kernels/lane_stats.h"

// Rows: elements per statistics block (the unit of work when groups are split between threads).
constexpr int64_t kBlock = 1 << 15;
// Rows that are not one pipeline (e.g. kept dims that do not merge): groups smaller than this are
// normalized in batches of about this many bytes (one kernel call per batch instead of per short
// group). Larger groups run one at a time: the statistics of a group, then its normalization while
// it is in L1; their reads and writes then interleave finely enough to run at the speed of a copy,
// which batches of them do not.
constexpr int64_t kFusedBatchBytes = 2 << 10;
// Columns: the lanes at a kept index up to this many bytes are one task, its rows x lanes block kept
// in cache (L2, or the large shared L3) between the statistics and the normalize pass.
constexpr int64_t kColumnBlockBytes = 4 << 20;
// A block of columns past this (the L2 of the cores tuned for) is read from memory by both passes.
constexpr int64_t kColumnCachedBytes = 1 << 20;
// The lanes of a task that takes whole rows, at most (its scratch is 49 bytes a lane).
constexpr int64_t kMaxRowLanes = 8192;
// A whole-row task's rows are summed in chunks of about this many bytes (of its lanes), at most
// kMaxColumnChunks of them: their sums (16 bytes a lane each) stay a small part of what they read.
constexpr int64_t kColumnChunkBytes = 1 << 20;
constexpr int64_t kMaxColumnChunks = 64;
// Lanes of at most kFusedColumnRows rows (one reduced dim) are finished and normalized by the fused
// columns kernel (kernel_table.h: FusedColumnsArgs), in tasks of this many lanes.
constexpr int64_t kFusedColumnLanes = 2048;
// Lane groups of at most this many rows (the batch of batch norm training on small NCHW planes) are
// summed a group at a time (run_lane_group_tasks), in tasks of whole groups of about
// kLaneGroupTaskBytes (enough tasks to share between threads, and a small lane scratch).
constexpr int64_t kLaneGroupMaxRows = 64;
constexpr int64_t kLaneGroupTaskBytes = 64 << 10;
// Rounds of passes over the data at most: judge() asks for another pass at most once for a scale
// (down or up) and once to move the pivot, so every group is settled by its third pass.
constexpr int kMaxPassRounds = 3;
// Scale and bias constant along a group's runs shorter than this are copied along them, so that
// each group is one run (MvnRunner::spread_affine_over_short_runs).
constexpr int64_t kSpreadRunsBelow = 256;

// The scales of float64 data's passes after the first (float data, whose |x - pivot| is below 2^129
// and whose squares are 0 or above 2^-298, never needs them). Powers of two, so that scaling is exact.
//   down: squares overflowed. 2^-100 was too little: data near 1e200 still overflowed, and its
//     statistics came out NaN.
//   up: the mean square around the pivot is below tiny (double squares are subnormal below
//     2^-1022), unless epsilon outweighs any variance that small by 1 / margin (underflow_rule()),
//     or the pivot lies past max_pivot (UnderflowRule).
// The up scale keeps d = x * up - pivot * up finite: |pivot| <= max_pivot, and |x - pivot| is below
// sqrt(n * tiny). Squares within range again, a variance outside double's range (data past ~1e154
// or below ~1e-162) stays in scaled units (GroupResult).
struct Scaling {
  double down, up, tiny, max_pivot, margin;
};
constexpr Scaling kDoubleScaling{0x1p-600, 0x1p600, 0x1p-900, 0x1p300, 0x1p-60};

// n elements at p, indexed like the vectors they replace.
template <class T>
struct Span {
  T* p = nullptr;
  int64_t n = 0;
  T* data() const { return p; }
  T& operator[](int64_t i) const { return p[i]; }
  T* begin() const { return p; }
  T* end() const { return p + n; }
};

struct Pass {
  double pivot = 0.0;
  double scale = 1.0;
  bool refined = false;  // pivot already moved to the mean
};

struct Sums {
  double s1 = 0.0, s2 = 0.0;
};

// var / scale^2 is the group's variance (scale 1 unless that lies outside double's range).
struct GroupResult {
  double mean, var;
  double scale = 1.0;
};

// Splits `flat`, a row-major index over dims [first, last) of the nest, into one index per dim:
// fn(d, index) for d from last - 1 down to first. (A group's index is over the kept dims,
// [0, kept_dims).)
template <class Fn>
inline void for_dim_indices(const LoopNest& nest, int first, int last, int64_t flat, Fn&& fn) {
  for (int d = last - 1; d >= first; --d) {
    fn(d, flat % nest.sizes[d]);
    flat /= nest.sizes[d];
  }
}

class MvnRunner {
 public:
  explicit MvnRunner(const MvnArgs& a)
      : a_(a), compute_(compute_type(a.input.dtype)), csize_(itemsize(compute_)),
        user_stats_(a.statistics_only ? DType::f64 : compute_),
        inv_std_rule_{a.normalize_variance, a.epsilon_outside, a.epsilon} {}

  // Normalizes; with `explain`, only describes the plan there.
  inline void run(std::string* explain);

 private:
  // Members defined in the other files are declared inline, as if defined in the class: the
  // compiler then inlines them into their callers as freely (stats_from_first_sums into
  // finish_fused_rows, a call per row otherwise).

  // ---- setup (mvn.cpp) --------------------------------------------------------------------------
  inline void fold_affine();
  inline void spread_affine_over_short_runs();
  inline void build_plan();
  inline void split_lanes(LoopNest& nest) const;
  inline UnderflowRule underflow_rule() const;

  // ---- statistics of one group ------------------------------------------------------------------
  Pass first_pass(const char* first_element) const {
    Pass pass;
    if (a_.normalize_mean) pass.pivot = load_scalar(a_.input.dtype, first_element);
    return pass;
  }

  // Decides whether the sums under `pass` are good; if not, returns false with the next pass.
  bool judge(const Sums& s, Pass& pass, GroupResult& out) const {
    if (!std::isfinite(s.s1) || !std::isfinite(s.s2)) {
      if (pass.scale == 1.0 && compute_ == DType::f64) {  // squares overflowed: again, scaled down
        pass.scale = kDoubleScaling.down;
        return false;
      }
      // An inf or NaN in the data: the group's statistics are NaN (those that are used at all).
      out = {a_.normalize_mean ? NAN : 0.0, NAN};
      return true;
    }
    const double inv_n = inv_group_size_;
    // (Tested first: the pivot's test reads those squares too. The rule's own test first: every
    // row of a layer norm comes here, and the rule is off for the usual epsilons.)
    if (underflow_.sum_sq_below != 0.0 && pass.scale == 1.0 && squares_may_underflow(pass.pivot, s.s2, underflow_)) {
      pass.scale = kDoubleScaling.up;
      return false;
    }
    // Every row's statistics end in this chain of dependent operations, which the row's
    // normalization waits for: no call, and multiplications where they serve. The scale is a
    // power of two, whose inverse is exact; 1/n is not, so m1 may differ from s1 / n in a double's
    // last bit, far below the rounding of the float statistics (a division would lengthen the
    // chain).
    const double unscale = pass.scale == 1.0 ? 1.0 : 1.0 / pass.scale;
    const FirstMoments m = first_moments(s.s1, s.s2, inv_n);
    if (a_.normalize_mean && !pass.refined && pivot_too_far(m)) {
      pass.pivot += m.m1 * unscale;
      pass.refined = true;
      return false;
    }
    out.mean = a_.normalize_mean ? pass.pivot + m.m1 * unscale : 0.0;
    const double second = a_.normalize_mean ? m.var : s.s2 * inv_n;
    out.var = second * (unscale * unscale);
    out.scale = 1.0;
    if (pass.scale != 1.0 && second != 0.0 && !(out.var >= kMinNormal && out.var <= kMaxFinite))
      out.var = second, out.scale = pass.scale;  // (only a double group's variance leaves the range)
    return true;
  }

  double inv_std(const GroupResult& r) const {
    return r.scale == 1.0 ? inv_std_of(r.var, inv_std_rule_) : inv_std_scaled(r.var, r.scale, inv_std_rule_);
  }

  // Stores a group's (or lane's) statistics: internal shift/mul at `index`, and the user's arrays.
  void store_stats(int64_t index, const GroupResult& r, const char* user_mean, const char* user_inv_std) {
    store_stats(shift_ + index * csize_, mul_ + index * csize_, r, user_mean, user_inv_std);
  }

  void store_stats(char* shift, char* mul, const GroupResult& r, const char* user_mean, const char* user_inv_std) {
    const double istd = inv_std(r);
    store_compute(shift, r.mean);
    store_compute(mul, istd);
    if (a_.mean_out && a_.normalize_mean) store_user(const_cast<char*>(user_mean), r.mean);
    if (a_.inv_std_out && a_.normalize_variance) {
      store_user(const_cast<char*>(user_inv_std), istd);
      if (a_.var_out) store_user(const_cast<char*>(user_inv_std) + var_offset(), r.var / (r.scale * r.scale));
    }
  }
  // Bytes from an element of inv_std_out to the same element of var_out.
  int64_t var_offset() const { return a_.var_out->data - a_.inv_std_out->data; }

  void store_compute(char* p, double v) const { compute_ == DType::f64 ? store_as<double>(p, v) : store_as<float>(p, v); }
  // The user's statistics arrays: the compute type, or float64 with statistics_only.
  void store_user(char* p, double v) const { user_stats_ == DType::f64 ? store_as<double>(p, v) : store_as<float>(p, v); }
  // values[g k] of groups g < n to the user's statistics array at p, `step` bytes apart: one loop
  // that vectorizes where they are one after another (thousands of channels a call), else
  // store_user's.
  void store_user_lanes(char* p, int64_t step, const double* values, int64_t n, int64_t k) const {
    auto each = [&](auto* typed) {
      using E = std::remove_pointer_t<decltype(typed)>;
      if (k == 1 && step == static_cast<int64_t>(sizeof(E)) && reinterpret_cast<uintptr_t>(p) % sizeof(E) == 0) {
        E* out = reinterpret_cast<E*>(p);
        for (int64_t g = 0; g < n; ++g) out[g] = static_cast<E>(values[g]);
      } else {
        for (int64_t g = 0; g < n; ++g) store_as<E>(p + g * step, values[g * k]);
      }
    };
    if (user_stats_ == DType::f64) each(static_cast<double*>(nullptr));
    else each(static_cast<float*>(nullptr));
  }

  // ---- where a group is ---------------------------------------------------------------------------
  // Offset of kept index `g` (flat over the leading kept dims) in one of the user's stats arrays.
  int64_t user_offset(const int64_t* strides, int64_t g) const {
    int64_t off = 0;
    for_dim_indices(plan_.nest, 0, plan_.kept_dims, g, [&](int d, int64_t i) { off += i * strides[d]; });
    return off;
  }

  const char* group_first_element(int64_t group) const {
    const char* p = plan_.nest.data[kIn];
    for_dim_indices(plan_.nest, 0, plan_.kept_dims, group,
                    [&](int d, int64_t i) { p += i * plan_.nest.strides[kIn][d]; });
    return p;
  }

  // ---- rows (mvn_rows.cpp) ------------------------------------------------------------------------
  // run_rows runs the strategy row_strategy() names (each run_rows_*'s comment says when).
  enum class RowStrategy { pipelined, paired, batched, split };
  inline RowStrategy row_strategy() const;
  // Groups a batch of run_rows_batched holds; whole groups a thread takes.
  inline int64_t groups_per_batch() const;
  inline int64_t groups_per_thread() const;
  // run_rows_pipelined's kernel call for groups [g, g1) (fewer where the innermost kept dim's
  // stretch ends), its ctx unset.
  inline FusedRowsArgs fused_rows_args(int64_t g, int64_t g1) const;
  void run_rows();
  inline void run_rows_pipelined(const KernelTable& k, int64_t g0, int64_t g1);
  inline void run_rows_paired(const KernelTable& k, int64_t g0, int64_t g1);
  inline void run_rows_batched(const KernelTable& k, int64_t g0, int64_t g1, int64_t batch);
  inline void run_rows_split();
  inline void run_rows_statistics();
  // The normalize task of a column task's lanes [c0, c0 + nb) at kept index ko, planned.
  inline NormalizeTask column_normalize_task(int64_t ko, int64_t c0, int64_t nb) const;
  // What run() would do, for explain.
  std::string describe();

  // A group's elements: its rows, times its lanes with lane groups.
  int64_t elements_per_group() const { return plan_.group_size * plan_.lane_group; }
  int64_t blocks_per_group() const { return (plan_.group_size + kBlock - 1) / kBlock; }

  // Enough groups to give every thread whole groups (the statistics and normalization of a group
  // then run back to back, while it is cached)?
  bool rows_fused() const {
    const int parts = parts_for(plan_.groups * plan_.group_size, kMinElementsPerThread);
    return parts == 1 || plan_.groups >= 2 * parts;
  }

  // Each group one run (layer and RMS norm, instance norm on NCHW), with whole groups per thread:
  // a kernel call runs sums, statistics and normalization of rows at one step as a pipeline
  // (kernels/fused_rows.h: FusedRowsKernel::execute_rows), one call per thread when the kept dims
  // merge into one, else one per stretch of the innermost kept dim (rows of a sliced batch).
  bool rows_pipelined() const {
    return rows_fused() && plan_.reduced_dims == 1 && blocks_per_group() == 1;
  }

  inline Sums block_sums(int64_t group, int64_t block, const Pass& pass, const char* first = nullptr) const;
  inline GroupResult group_stats(int64_t g, const char* first, Pass pass) const;
  inline GroupResult stats_from_first_sums(int64_t g, const char* first, Pass pass, const Sums& first_sums) const;
  inline int64_t runs_per_group() const;
  inline void finish_group(int64_t group, const GroupResult& r);

  // Pointers of consecutive groups: the nest's operands, then the user's mean and inv_std arrays.
  static constexpr int kUserMean = kNumOperands, kUserInvStd = kNumOperands + 1, kGroupPointers = kNumOperands + 2;
  struct GroupCursor;
  inline char* group_base(int op) const;
  inline int64_t group_stride(int op, int d) const;
  inline void take_stats(GroupCursor& cursor, int64_t g);
  struct FusedRowsContext;
  static inline void finish_fused_rows(void* context, int64_t row, int count, const double* pivot, const double* sum,
                                       const double* sum_sq);

  // ---- columns (mvn_columns.cpp) ------------------------------------------------------------------
  void run_columns();

  // One column task's per-lane arrays, taken once per thread part and reused by its tasks.
  struct LaneScratch {
    static constexpr int64_t kBytesPerLane = 6 * sizeof(double) + 1;
    KeptScratch<kLaneSlot> storage;
    Span<double> pivot, s1, s2, mean, var, inv_std;
    Span<unsigned char> slow;
    explicit LaneScratch(int64_t lanes) {
      double* p = reinterpret_cast<double*>(storage.reserve(static_cast<size_t>(lanes * kBytesPerLane)));
      for (Span<double>* v : {&pivot, &s1, &s2, &mean, &var, &inv_std}) *v = {p, lanes}, p += lanes;
      slow = {reinterpret_cast<unsigned char*>(p), lanes};
    }
  };

  struct ScaledLane {
    int64_t c;
    double scale;
  };

  // Column tasks: all the lanes at a kept index, when their block stays in cache between the passes
  // and there are other kept indices for other threads; else tasks of whole rows (at most
  // kMaxRowLanes lanes, whole lane groups), summed in chunks of rows (run_columns_chunked): a single
  // task (batch norm's statistics) would leave the other threads idle. Tasks of a stripe of lanes,
  // a few lines of every row, read memory at a fraction of its speed (5x slower at 32 of 256 lanes;
  // 2.6x slower than the chunks at 160 of 512, NHWC batch norm on 8x512x28x28).
  bool whole_row_tasks() const {
    return lane_unit() * lane_bytes() > kColumnCachedBytes || plan_.lane_count * lane_bytes() > kColumnBlockBytes ||
           (plan_.groups == 1 && plan_.lane_count * plan_.group_size >= 2 * kMinElementsPerThread);
  }
  int64_t lanes_per_task() const {
    return whole_row_tasks() ? std::min(plan_.lane_count, kMaxRowLanes / lane_unit() * lane_unit()) : plan_.lane_count;
  }
  int64_t lane_bytes() const { return plan_.group_size * itemsize(a_.input.dtype) + LaneScratch::kBytesPerLane; }
  int64_t lane_unit() const { return 16 / std::gcd<int64_t>(16, plan_.lane_group) * plan_.lane_group; }
  // The chunks of a whole-row task's rows: about kColumnChunkBytes each, at most kMaxColumnChunks.
  int64_t column_chunks(int64_t lanes_per_task) const {
    const int64_t bytes = plan_.group_size * lanes_per_task * itemsize(a_.input.dtype);
    return std::clamp<int64_t>(bytes / kColumnChunkBytes, 1, std::min(kMaxColumnChunks, plan_.group_size));
  }

  struct ColumnTask {
    int64_t ko, c0, nb;  // kept index, first lane, lanes
  };
  ColumnTask column_task_at(int64_t t, int64_t blocks, int64_t lanes_per_task) const {
    const int64_t c0 = (t % blocks) * lanes_per_task;
    return {t / blocks, c0, std::min(lanes_per_task, plan_.lane_count - c0)};
  }

  void run_columns_chunked();
  // Lane groups of few rows, each run at least two vectors (a shorter one would leave the group's
  // sums a chain of dependent additions down the rows): tasks of whole groups, each group summed as
  // one sequence of its runs.
  bool lane_group_tasks() const {
    const int64_t vector_lanes = kernels().float_lanes * 4 / csize_;
    return plan_.lane_group >= 2 * vector_lanes && plan_.group_size <= kLaneGroupMaxRows &&
           plan_.nest.strides[kIn][plan_.nest.ndim - 1] == itemsize(a_.input.dtype);
  }
  int64_t groups_per_lane_group_task() const {
    const int64_t group_bytes = elements_per_group() * itemsize(a_.input.dtype);
    return std::clamp<int64_t>(kLaneGroupTaskBytes / group_bytes, 1, plan_.lane_count / plan_.lane_group);
  }
  void run_lane_group_tasks();
  inline void lane_group_sums(int64_t ko, int64_t c0, int64_t groups, const double* pivots, double scale, double* s1,
                              double* s2) const;
  inline void column_sums(int64_t ko, int64_t c0, int64_t nb, const double* pivots, double scale, int64_t f0,
                          int64_t f1, double* s1, double* s2) const;
  inline void column_range(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane);
  inline void run_fused_columns();
  inline bool fused_columns_take() const;
  inline void load_pivots(int64_t ko, int64_t c0, int64_t nb, double* pivot) const;
  // groups_summed: the lane groups' sums and pivots are already at the front of s1, s2 and
  // inv_std (lane_group_sums), not yet in the lanes' arrays.
  inline void finish_lanes(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane, bool groups_summed = false);
  inline void judge_slow_lanes(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane,
                               std::vector<ScaledLane>& scaled, bool groups_summed);
  static inline void add_lane_groups(int64_t nb, int64_t k, LaneScratch& lane);
  template <class E>
  static inline void spread_lanes(const double* mean, const double* istd, int64_t n, int64_t k, int64_t lanes,
                                  E* shift, E* mul);

  // ---- empty reductions (mvn.cpp) ---------------------------------------------------------------
  inline void fill_stats_nan();

  const MvnArgs& a_;
  const DType compute_;
  const int64_t csize_;
  const DType user_stats_;
  std::unique_ptr<FoldedParams> affine_;
  ReductionPlan plan_;
  double inv_group_size_ = 0.0;  // 1 / elements_per_group(): judge's mean is a multiplication
  const InvStdRule inv_std_rule_;
  UnderflowRule underflow_{};  // (set with the plan: it bounds a sum over the group)
  NormalizeTask task_;
  KeptScratch<kStatsSlot> stats_scratch_;
  char* shift_ = nullptr;  // internal per-group statistics (compute type), in stats_scratch_
  char* mul_ = nullptr;
  char* user_mean_ = nullptr;
  char* user_inv_std_ = nullptr;
  int64_t user_mean_strides_[kMaxNestDims] = {};
  int64_t user_inv_std_strides_[kMaxNestDims] = {};
  const float one_f_ = 1.0f, zero_f_ = 0.0f;
  const double one_d_ = 1.0, zero_d_ = 0.0;
};

}  // namespace
}  // namespace simdnorm
