// Mean-variance normalization over any subset of axes.
//
// The planner splits the dims into kept and reduced and orders them (plan/plan.cpp):
//   rows     nest = [kept..., reduced...]          one group per kept index, statistics along runs
//   columns  nest = [kept..., reduced..., lanes]   the innermost kept dim is contiguous: statistics
//                                                  are accumulated per lane while the rows are walked
//                                                  (with lane groups, e.g. group norm on channels-last
//                                                  data, then combined a group of lanes at a time)
// Statistics: shifted sums d = (x - pivot) * scale in double lanes (kernels/moments.h). The pivot is
// the group's first element, so a large mean costs no precision; when the sums show that the pivot
// was far from the mean (|mean - pivot| > 8 std) the group is summed again around its mean. Float
// data can neither overflow nor underflow double sums; float64 data is summed again scaled down when
// squares overflow (|x| ~ 1e154, or x - pivot itself near the largest double), and scaled up when
// they may have underflowed (|x| ~ 1e-162, with an epsilon too small to outweigh the variance)
// (Scaling).
// Every group's sums are taken over fixed blocks combined in a fixed order, so the result is
// bitwise the same for any number of threads.
//
// Normalization is the same elementwise kernel as batch norm, with shift = mean and mul = 1/std per
// group (stride 0 along the reduced dims). When there are enough groups, each thread takes whole
// groups and normalizes each right after its statistics, while it is still in cache: the input is
// read from memory once. Rows at one step (layer, RMS norm; instance norm on NCHW), of any length,
// run as one kernel call per thread (per stretch of rows at one step, when the kept dims do not
// merge) that normalizes each row in the loop that sums a later one (kernels/fused_rows.h), so
// that reads from memory and writes overlap. Other groups of 2 KB and more (of any size) are fused
// run by run the same way; smaller ones go in batches of about 2 KB. With few groups, statistics
// are split into blocks over all threads first, then the normalization pass runs over all threads
// (the input is read twice).
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "ops/common.h"
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
// Columns: a task's lanes are chosen so that its rows x lanes block stays in cache (L2, or the large
// shared L3) between the statistics and the normalize pass, while rows stay long enough for SIMD.
constexpr int64_t kColumnBlockBytes = 4 << 20;

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

class MvnRunner {
 public:
  explicit MvnRunner(const MvnArgs& a)
      : a_(a), compute_(compute_type(a.input.dtype)), csize_(itemsize(compute_)),
        inv_std_rule_{a.normalize_variance, a.epsilon_outside, a.epsilon} {}

  void run(std::string* explain) {
    const TensorView& x = a_.input;
    bool empty = false, reduced_empty = false;
    for (int d = 0; d < x.ndim; ++d)
      if (x.sizes[d] == 0) (((a_.reduced >> d) & 1u) ? reduced_empty : empty) = true;
    if (empty || reduced_empty) {
      if (explain != nullptr) *explain = "empty";
      else if (reduced_empty) fill_stats_nan();  // statistics of nothing; the output is empty
      return;
    }

    fold_affine();
    build_plan();
    fit_to_caches(task_);
    if (explain != nullptr) {
      *explain = (plan_.lanes ? "columns" : "rows") + std::string(" groups=") + std::to_string(plan_.groups) +
                 " lanes=" + std::to_string(plan_.lane_count) + " group_size=" + std::to_string(plan_.group_size) +
                 (plan_.lane_group > 1 ? " lane_group=" + std::to_string(plan_.lane_group) : std::string()) +
                 (plan_.lanes ? " lanes_per_task=" + std::to_string(lanes_per_task())
                              : std::string(rows_pipelined() ? " fused pipeline" : rows_fused() ? " fused" : " split")) +
                 " " + describe_normalize(task_);
      return;
    }
    if (!a_.normalize_mean && !a_.normalize_variance) {  // no statistics needed: scale and bias only
      for (int64_t i = 0; i < plan_.groups * plan_.lane_count; ++i) store_stats(i, GroupResult{0.0, 0.0}, nullptr, nullptr);
      return run_normalize(task_);
    }
    if (plan_.lanes) run_columns();
    else run_rows();
  }

 private:
  // ---- setup ----------------------------------------------------------------------------------
  static void identity2(const double* const* in, double* const* out, int64_t n, const void*) {
    std::copy(in[0], in[0] + n, out[0]);
    std::copy(in[1], in[1] + n, out[1]);
  }

  void fold_affine() {
    if (!a_.scale && !a_.bias) return;
    affine_ = std::make_unique<FoldedParams>(
        a_.input.ndim, a_.input.sizes,
        std::initializer_list<FoldedParams::Input>{{a_.scale ? &*a_.scale : nullptr, 1.0},
                                                   {a_.bias ? &*a_.bias : nullptr, 0.0}},
        std::initializer_list<int>{kScale, kBias}, compute_, identity2, nullptr);
  }

  void build_plan() {
    const TensorView& x = a_.input;
    Problem p;
    p.ndim = x.ndim;
    for (int d = 0; d < x.ndim; ++d) {
      const bool red = (a_.reduced >> d) & 1u;
      p.sizes[d] = x.sizes[d];
      p.strides[kOut][d] = a_.output.strides[d];
      p.strides[kIn][d] = x.strides[d];
      // The statistics outputs ride along as the shift/mul operands so that the planner orders and
      // merges their dims with the data's; they are swapped for internal arrays below.
      p.strides[kShift][d] = a_.mean_out && !red ? a_.mean_out->strides[d] : 0;
      p.strides[kMul][d] = a_.inv_std_out && !red ? a_.inv_std_out->strides[d] : 0;
      p.strides[kScale][d] = p.strides[kBias][d] = affine_ ? affine_->strides()[d] : 0;
    }
    p.data[kOut] = a_.output.data;
    p.data[kIn] = x.data;
    p.data[kShift] = a_.mean_out ? a_.mean_out->data : nullptr;
    p.data[kMul] = a_.inv_std_out ? a_.inv_std_out->data : nullptr;
    if (affine_) {
      p.data[kScale] = affine_->data(0);
      p.data[kBias] = affine_->data(1);
    } else {
      p.data[kScale] = reinterpret_cast<char*>(compute_ == DType::f64 ? (void*)&one_d_ : (void*)&one_f_);
      p.data[kBias] = reinterpret_cast<char*>(compute_ == DType::f64 ? (void*)&zero_d_ : (void*)&zero_f_);
    }
    plan_ = plan_reduction(p, a_.reduced, itemsize(x.dtype));
    inv_group_size_ = 1.0 / static_cast<double>(plan_.group_size);
    underflow_ = underflow_rule();
    LoopNest& nest = plan_.nest;
    if (affine_) align_coefficients(nest, *affine_, x.dtype);
    user_mean_ = nest.data[kShift];
    user_inv_std_ = nest.data[kMul];
    for (int d = 0; d < nest.ndim; ++d) {
      user_mean_strides_[d] = nest.strides[kShift][d];
      user_inv_std_strides_[d] = nest.strides[kMul][d];
    }
    // Internal per-group statistics, contiguous over [kept..., lanes], broadcast over reduced dims.
    const int64_t count = plan_.groups * plan_.lane_count;
    shift_.assign(static_cast<size_t>(count * csize_), 0);
    mul_.assign(static_cast<size_t>(count * csize_), 0);
    int64_t step = csize_;
    if (plan_.lanes) {
      nest.strides[kShift][nest.ndim - 1] = nest.strides[kMul][nest.ndim - 1] = step;
      step *= plan_.lane_count;
    }
    for (int d = plan_.kept_dims + plan_.reduced_dims - 1; d >= 0; --d) {
      const bool kept = d < plan_.kept_dims;
      nest.strides[kShift][d] = nest.strides[kMul][d] = kept ? step : 0;
      if (kept) step *= nest.sizes[d];
    }
    nest.data[kShift] = shift_.data();
    nest.data[kMul] = mul_.data();
    task_.loop = nest;
    task_.dtype = x.dtype;
    task_.act = a_.activation;
    // Without scale and bias, fma(x - mean, 1/std, 0): the values of fma((x - mean) / std, 1, 0)
    // (a zero is +0 in both; only a product that underflows to zero keeps its sign here) with one
    // multiply fewer a vector, which float16 and bfloat16, bound by the vector pipes, feel.
    task_.scale_folded = !affine_;
  }

  // ---- statistics of one group ------------------------------------------------------------------
  Pass first_pass(const char* first_element) const {
    Pass pass;
    if (a_.normalize_mean) pass.pivot = load_scalar(a_.input.dtype, first_element);
    return pass;
  }

  // Scaling::up is needed only for float64 data, and only where the variance matters next to
  // epsilon: a variance below tiny changes var + epsilon (or sqrt(var) + epsilon) by less than
  // margin, relative, once epsilon is past tiny / margin (sqrt(tiny) / margin).
  // (A bound on the sum of squares: with one on the mean square, the kernels' lane loops shared
  // sum_sq * inv_n between the two tests, and GCC no longer fused the variance's subtraction into
  // it: float64 columns' statistics changed in their last bits.)
  UnderflowRule underflow_rule() const {
    const Scaling& k = kDoubleScaling;
    const double outweighing = a_.epsilon_outside ? std::sqrt(k.tiny) / k.margin : k.tiny / k.margin;
    const bool off = !a_.normalize_variance || compute_ != DType::f64 || a_.epsilon >= outweighing;
    return {off ? 0.0 : k.tiny * static_cast<double>(plan_.group_size), k.max_pivot};
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
    store_stats(shift_.data() + index * csize_, mul_.data() + index * csize_, r, user_mean, user_inv_std);
  }

  void store_stats(char* shift, char* mul, const GroupResult& r, const char* user_mean, const char* user_inv_std) {
    const double istd = inv_std(r);
    store_compute(shift, r.mean);
    store_compute(mul, istd);
    if (a_.mean_out && a_.normalize_mean) store_compute(const_cast<char*>(user_mean), r.mean);
    if (a_.inv_std_out && a_.normalize_variance) store_compute(const_cast<char*>(user_inv_std), istd);
  }

  void store_compute(char* p, double v) const { compute_ == DType::f64 ? store_as<double>(p, v) : store_as<float>(p, v); }

  // Offset of kept index `g` (flat over the leading kept dims) in one of the user's stats arrays.
  int64_t user_offset(const int64_t* strides, int64_t g) const {
    int64_t off = 0;
    for (int d = plan_.kept_dims - 1; d >= 0; --d) {
      off += (g % plan_.nest.sizes[d]) * strides[d];
      g /= plan_.nest.sizes[d];
    }
    return off;
  }

  // ---- rows ---------------------------------------------------------------------------------------
  // Sums of block `block` of group `group` (whose first element, when known, is at `first`).
  Sums block_sums(int64_t group, int64_t block, const Pass& pass, const char* first = nullptr) const {
    const int64_t begin = group * plan_.group_size + block * kBlock;
    const int64_t end = begin + kBlock < (group + 1) * plan_.group_size ? begin + kBlock : (group + 1) * plan_.group_size;
    Sums s;
    const KernelTable& k = kernels();
    if (first != nullptr && plan_.reduced_dims == 1) {  // one run: no index arithmetic
      const int64_t stride = plan_.nest.strides[kIn][plan_.nest.ndim - 1];
      RowMomentsArgs args{first + block * kBlock * stride, a_.input.dtype, end - begin, stride, pass.pivot, pass.scale,
                          &s.s1, &s.s2};
      k.row_moments(args);
      return s;
    }
    for_each_run(plan_.nest, begin, end, [&](int64_t len, char* const* p, const int64_t* st) {
      RowMomentsArgs args{p[kIn], a_.input.dtype, len, st[kIn], pass.pivot, pass.scale, &s.s1, &s.s2};
      k.row_moments(args);
    });
    return s;
  }

  int64_t blocks_per_group() const { return (plan_.group_size + kBlock - 1) / kBlock; }

  // Statistics of group g, whose first element is at `first`, starting with `pass` (first_pass()).
  // Summed block by block as the split path does, so the two paths agree bitwise.
  GroupResult group_stats(int64_t g, const char* first, Pass pass) const {
    const int64_t nblocks = blocks_per_group();
    GroupResult r;
    for (;;) {
      Sums total;
      for (int64_t b = 0; b < nblocks; ++b) {
        const Sums s = block_sums(g, b, pass, first);
        total.s1 += s.s1;
        total.s2 += s.s2;
      }
      if (judge(total, pass, r)) return r;
    }
  }

  // The same, given the sums of the first pass, taken by a fused loop: judged here, so that the
  // common case (no second pass) makes no call (inlined into the rows' finish, it also keeps Pass
  // out of memory: passed by value it cost a store-forwarding stall per row).
  GroupResult stats_from_first_sums(int64_t g, const char* first, Pass pass, const Sums& first_sums) const {
    GroupResult r;
    if (judge(first_sums, pass, r)) return r;
    return group_stats(g, first, pass);
  }

  // How many runs (the innermost reduced dim's length each) one group has.
  int64_t runs_per_group() const { return plan_.group_size / plan_.nest.sizes[plan_.nest.ndim - 1]; }

  // Pointers of consecutive groups: the nest's operands, then the user's mean and inv_std arrays,
  // stepped by an odometer over the kept dims (no division per group).
  static constexpr int kUserMean = kNumOperands, kUserInvStd = kNumOperands + 1, kGroupPointers = kNumOperands + 2;
  struct GroupCursor {
    const MvnRunner& r;
    char* p[kGroupPointers];
    int64_t idx[kMaxNestDims] = {};
    GroupCursor(const MvnRunner& runner, int64_t g) : r(runner) {
      for (int d = r.plan_.kept_dims - 1; d >= 0; --d) {
        idx[d] = g % r.plan_.nest.sizes[d];
        g /= r.plan_.nest.sizes[d];
      }
      for (int op = 0; op < kGroupPointers; ++op) {
        p[op] = r.group_base(op);
        for (int d = 0; d < r.plan_.kept_dims; ++d) p[op] += idx[d] * r.group_stride(op, d);
      }
    }
    void next() {
      for (int d = r.plan_.kept_dims - 1; d >= 0; --d) {
        for (int op = 0; op < kGroupPointers; ++op) p[op] += r.group_stride(op, d);
        if (++idx[d] < r.plan_.nest.sizes[d]) return;
        for (int op = 0; op < kGroupPointers; ++op) p[op] -= idx[d] * r.group_stride(op, d);
        idx[d] = 0;
      }
    }
  };
  // FusedRowsArgs::finish: rows `row` to `row + count` of those from group g0 on; the operands'
  // pointers and the user's statistics arrays are the args'.
  struct FusedRowsContext {
    MvnRunner* runner;
    const FusedRowsArgs* args;
    int64_t g0;
  };
  static void finish_fused_rows(void* context, int64_t row, int count, const double* pivot, const double* sum,
                                const double* sum_sq) {
    const auto& c = *static_cast<const FusedRowsContext*>(context);
    for (int i = 0; i < count; ++i) {
      const int64_t r = row + i;
      auto at = [&](int op) { return c.args->data[op] + r * c.args->step[op]; };
      // (null where store_stats() writes no such statistic)
      auto stat = [&](int k) {
        return c.args->stats_out[k] ? c.args->stats_out[k] + r * c.args->stats_step[k] : nullptr;
      };
      Pass pass;  // first_pass() of the row, as the kernel took it
      pass.pivot = pivot[i];
      c.runner->store_stats(at(kShift), at(kMul),
                            c.runner->stats_from_first_sums(c.g0 + r, at(kIn), pass, {sum[i], sum_sq[i]}),
                            stat(0), stat(1));
    }
  }
  char* group_base(int op) const {
    return op == kUserMean ? user_mean_ : op == kUserInvStd ? user_inv_std_ : plan_.nest.data[op];
  }
  int64_t group_stride(int op, int d) const {
    return op == kUserMean ? user_mean_strides_[d] : op == kUserInvStd ? user_inv_std_strides_[d] : plan_.nest.strides[op][d];
  }

  const char* group_first_element(int64_t group) const {
    const char* p = plan_.nest.data[kIn];
    int64_t g = group;
    for (int d = plan_.kept_dims - 1; d >= 0; --d) {
      p += (g % plan_.nest.sizes[d]) * plan_.nest.strides[kIn][d];
      g /= plan_.nest.sizes[d];
    }
    return p;
  }

  void finish_group(int64_t group, const GroupResult& r) {
    store_stats(group, r, user_mean_ + user_offset(user_mean_strides_, group),
                user_inv_std_ + user_offset(user_inv_std_strides_, group));
  }

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

  void run_rows() {
    const int64_t groups = plan_.groups, nblocks = blocks_per_group();
    const int parts = parts_for(groups * plan_.group_size, kMinElementsPerThread);
    const KernelTable& k = kernels();
    if (rows_fused()) {
      // Whole groups per thread, each group's statistics and then its normalization while it is
      // cached; short groups in batches (one normalize call per batch).
      const int64_t per = (groups + parts - 1) / parts;
      const int64_t group_bytes = plan_.group_size * itemsize(a_.input.dtype);
      const int64_t batch = group_bytes >= kFusedBatchBytes ? 1 : kFusedBatchBytes / group_bytes;
      const bool run_per_group = batch == 1, pipelined = rows_pipelined();
      parallel_for(parts, [&](int part) {
        const int64_t g0 = part * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (g0 >= g1) return;
        GroupCursor cursor(*this, g0);
        auto take_stats = [&](int64_t g) {
          store_stats(cursor.p[kShift], cursor.p[kMul], group_stats(g, cursor.p[kIn], first_pass(cursor.p[kIn])),
                      cursor.p[kUserMean],
                      cursor.p[kUserInvStd]);
          cursor.next();
        };
        if (pipelined) {
          // Long or short rows alike, and rows of kept dims that do not merge (layer norm of
          // x[:, :T]): batches (a statistics call per row, a normalize call per batch) are slower.
          const int inner = plan_.kept_dims - 1;
          const int64_t stretch = plan_.nest.sizes[inner];
          for (int64_t g = g0; g < g1;) {
            const GroupCursor first(*this, g);
            const int64_t rows = std::min(g1, (g / stretch + 1) * stretch) - g;
            FusedRowsArgs args{rows, plan_.group_size, {}, {}, a_.normalize_mean, finish_fused_rows, nullptr,
                               inv_group_size_, inv_std_rule_, underflow_, {}, {}};
            for (int op = 0; op < kNumOperands; ++op) {
              args.data[op] = first.p[op];
              args.step[op] = group_stride(op, inner);
            }
            // The statistics store_stats() writes besides shift and mul.
            if (a_.mean_out && a_.normalize_mean) args.stats_out[0] = first.p[kUserMean];
            if (a_.inv_std_out && a_.normalize_variance) args.stats_out[1] = first.p[kUserInvStd];
            args.stats_step[0] = group_stride(kUserMean, inner);
            args.stats_step[1] = group_stride(kUserInvStd, inner);
            FusedRowsContext ctx{this, &args, g};
            args.ctx = &ctx;
            k.normalize_rows_fused(task_, args);
            g += rows;
          }
          if (task_.stream_stores) fence_streaming_stores();
          return;
        }
        if (run_per_group) {
          // Groups of several runs (MVN over (0, 2, 3)) or past one block of sums: group g
          // is normalized (from cache) in the loop that takes the first-pass sums of group g + 1
          // (from memory), run by run, so that reads and writes overlap as in a copy; a second
          // pass, when one is needed, runs on its own.
          // Runs are cut where block_sums' blocks end, and each block's sums are added to the
          // group's in order, as group_stats adds them: groups of any size are fused.
          // The loop prefetches the run `lead` runs after the one it sums (past the group's last
          // run, in the group after), at least kPrefetchAheadBytes ahead in the order the sums
          // read, not where the run ends (in MVN over (0, 2, 3) the same plane of the next channel:
          // a group ahead, which the L2 does not keep for large groups).
          // One kernel call a group, which steps the runs itself: with a call a run, this loop's
          // bookkeeping between calls would wait on its state, pushed out of L1 by each run.
          const int last = plan_.nest.ndim - 1;
          const int64_t run = plan_.nest.sizes[last], runs = runs_per_group();
          const int64_t run_bytes = run * itemsize(a_.input.dtype);
          const int64_t lead = std::min(runs, prefetch_units_ahead(run_bytes));
          GroupCursor normalizing = cursor;
          take_stats(g0);
          for (int64_t g = g0; g < g1; ++g, normalizing.next()) {
            if (g + 1 == g1) {
              RunOdometer normalized(plan_.nest, plan_.kept_dims, last);
              char* q[kNumOperands];
              for (int64_t j = 0; j < runs; ++j, normalized.advance()) {
                for (int op = 0; op < kNumOperands; ++op) q[op] = normalizing.p[op] + normalized.off[op];
                k.normalize_run(task_, q, run);
              }
              continue;
            }
            GroupCursor after = cursor;  // group g + 2, whose first runs are prefetched
            if (g + 2 < g1) after.next();
            const Pass pass = first_pass(cursor.p[kIn]);
            Sums total;
            GroupPairArgs args{{}, cursor.p[kIn], after.p[kIn], plan_.kept_dims, lead, kBlock, pass.pivot, pass.scale,
                               &total.s1, &total.s2};
            std::copy(normalizing.p, normalizing.p + kNumOperands, args.group);
            k.normalize_group_and_sum(task_, args);
            store_stats(cursor.p[kShift], cursor.p[kMul], stats_from_first_sums(g + 1, cursor.p[kIn], pass, total),
                        cursor.p[kUserMean],
                        cursor.p[kUserInvStd]);
            cursor.next();
          }
          if (task_.stream_stores) fence_streaming_stores();
          return;
        }
        for (int64_t b0 = g0; b0 < g1; b0 += batch) {
          const int64_t b1 = b0 + batch < g1 ? b0 + batch : g1;
          for (int64_t g = b0; g < b1; ++g) take_stats(g);
          k.normalize(task_, b0 * plan_.group_size, b1 * plan_.group_size);
        }
      });
      return;
    }
    // Few large groups: blocks of every group over all threads, combined in order, then one
    // normalization pass over all threads.
    std::vector<Pass> passes(static_cast<size_t>(groups));
    std::vector<char> done(static_cast<size_t>(groups), 0);
    std::vector<GroupResult> results(static_cast<size_t>(groups));
    for (int64_t g = 0; g < groups; ++g) passes[g] = first_pass(group_first_element(g));
    std::vector<Sums> sums(static_cast<size_t>(groups * nblocks));
    for (int round = 0; round < 3; ++round) {
      std::vector<int64_t> pending;
      for (int64_t g = 0; g < groups; ++g)
        if (!done[g]) pending.push_back(g);
      if (pending.empty()) break;
      const int64_t tasks = static_cast<int64_t>(pending.size()) * nblocks;
      const int tparts = parts_for(tasks * kBlock, kMinElementsPerThread);
      const int64_t per = (tasks + tparts - 1) / tparts;
      parallel_for(tparts, [&](int part) {
        for (int64_t t = part * per; t < (part + 1) * per && t < tasks; ++t) {
          const int64_t g = pending[t / nblocks], b = t % nblocks;
          sums[g * nblocks + b] = block_sums(g, b, passes[g]);
        }
      });
      for (int64_t g : pending) {
        Sums total;
        for (int64_t b = 0; b < nblocks; ++b) {
          total.s1 += sums[g * nblocks + b].s1;
          total.s2 += sums[g * nblocks + b].s2;
        }
        done[g] = judge(total, passes[g], results[g]);
      }
    }
    for (int64_t g = 0; g < groups; ++g) finish_group(g, results[g]);
    run_normalize(task_);
  }

  // ---- columns ------------------------------------------------------------------------------------
  // Accumulates lanes [c0, c0 + nb) of kept index `ko` down all rows (the reduced dims).
  void column_sums(int64_t ko, int64_t c0, int64_t nb, const double* pivots, double scale, double* s1,
                   double* s2) const {
    const LoopNest& nest = plan_.nest;
    const int lanes_dim = nest.ndim - 1, r0 = plan_.kept_dims, rlast = plan_.kept_dims + plan_.reduced_dims - 1;
    const char* base = group_first_element(ko) + c0 * nest.strides[kIn][lanes_dim];
    std::fill(s1, s1 + nb, 0.0);
    std::fill(s2, s2 + nb, 0.0);
    // Walk the outer reduced dims; the innermost reduced dim is the kernel's rows.
    int64_t outer = 1;
    for (int d = r0; d < rlast; ++d) outer *= nest.sizes[d];
    const KernelTable& k = kernels();
    for (int64_t o = 0; o < outer; ++o) {
      const char* p = base;
      int64_t rem = o;
      for (int d = rlast - 1; d >= r0; --d) {
        p += (rem % nest.sizes[d]) * nest.strides[kIn][d];
        rem /= nest.sizes[d];
      }
      ColMomentsArgs args{p, a_.input.dtype, nest.sizes[rlast], nb, nest.strides[kIn][rlast],
                          nest.strides[kIn][lanes_dim], pivots, scale, s1, s2};
      k.col_moments(args);
    }
  }

  // One column task's per-lane arrays, allocated once per thread part and reused by its tasks.
  struct LaneScratch {
    static constexpr int64_t kBytesPerLane = 6 * sizeof(double) + 1;
    std::vector<double> pivot, s1, s2, mean, var, inv_std;
    std::vector<unsigned char> slow;
    explicit LaneScratch(int64_t lanes) {
      for (std::vector<double>* v : {&pivot, &s1, &s2, &mean, &var, &inv_std}) v->resize(static_cast<size_t>(lanes));
      slow.resize(static_cast<size_t>(lanes));
    }
  };

  // A task's lanes are finished together by the lane kernels (kernels/lane_stats.h: judge()'s
  // common case, finite sums and the pivot close enough to the mean, for every lane; then the square
  // roots and divisions), vectorized: one lane at a time (judge, inv_std and the stores behind
  // branches) they would cost lanes of few rows as much as their sums. Lanes that fail the common
  // case go through judge() and are summed again.
  void column_task(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane) {
    const LoopNest& nest = plan_.nest;
    const int lanes_dim = nest.ndim - 1;
    const int64_t lane_stride = nest.strides[kIn][lanes_dim];
    const char* first = group_first_element(ko) + c0 * lane_stride;
    double *pivot = lane.pivot.data(), *s1 = lane.s1.data(), *s2 = lane.s2.data(), *mean = lane.mean.data(),
           *var = lane.var.data(), *istd = lane.inv_std.data();
    unsigned char* slow = lane.slow.data();
    // Every lane starts unscaled around its first element (first_pass()).
    if (a_.normalize_mean) load_as_double(a_.input.dtype, first, lane_stride, nb, pivot);
    else std::fill(pivot, pivot + nb, 0.0);
    column_sums(ko, c0, nb, pivot, 1.0, s1, s2);
    const KernelTable& table = kernels();
    std::vector<ScaledLane> scaled;  // lanes whose var is in scaled units (GroupResult): rarely any
    if (table.lane_stats(LaneStatsArgs{nb, inv_group_size_, a_.normalize_mean, underflow_, pivot, s1, s2, mean, var,
                                       slow}) > 0)
      judge_slow_lanes(ko, c0, nb, lane, scaled);
    const int64_t k = plan_.lane_group;
    if (k > 1) combine_lane_groups(mean, var, nb, scaled);  // each group's statistics in its first lane
    table.inv_std_lanes(var, istd, nb, k, inv_std_rule_);
    for (const ScaledLane& l : scaled) istd[l.c] = inv_std_scaled(var[l.c], l.scale, inv_std_rule_);
    // The internal shift and mul: each lane its group's (k > 1) or its own.
    const int64_t base = ko * plan_.lane_count + c0;
    if (compute_ == DType::f64) {
      double* shift = reinterpret_cast<double*>(shift_.data()) + base;
      double* mul = reinterpret_cast<double*>(mul_.data()) + base;
      spread_lanes(mean, istd, nb, k, shift, mul);
    } else {
      float* shift = reinterpret_cast<float*>(shift_.data()) + base;
      float* mul = reinterpret_cast<float*>(mul_.data()) + base;
      spread_lanes(mean, istd, nb, k, shift, mul);
    }
    // The user's statistics step per group.
    if (a_.mean_out && a_.normalize_mean) {
      char* um = user_mean_ + user_offset(user_mean_strides_, ko);
      for (int64_t c = 0; c < nb; c += k) store_compute(um + (c0 + c) / k * user_mean_strides_[lanes_dim], mean[c]);
    }
    if (a_.inv_std_out && a_.normalize_variance) {
      char* ui = user_inv_std_ + user_offset(user_inv_std_strides_, ko);
      for (int64_t c = 0; c < nb; c += k) store_compute(ui + (c0 + c) / k * user_inv_std_strides_[lanes_dim], istd[c]);
    }
    // Normalize this block: a nest of [reduced..., nb lanes] at kept index ko, lane c0.
    NormalizeTask sub = task_;
    LoopNest& sn = sub.loop;
    sn.ndim = plan_.reduced_dims + 1;
    for (int op = 0; op < kNumOperands; ++op) {
      char* p = nest.data[op];
      int64_t g = ko;
      for (int d = plan_.kept_dims - 1; d >= 0; --d) {
        p += (g % nest.sizes[d]) * nest.strides[op][d];
        g /= nest.sizes[d];
      }
      sn.data[op] = p + c0 * nest.strides[op][lanes_dim];
      for (int d = 0; d <= plan_.reduced_dims; ++d) sn.strides[op][d] = nest.strides[op][plan_.kept_dims + d];
    }
    for (int d = 0; d < plan_.reduced_dims; ++d) sn.sizes[d] = nest.sizes[plan_.kept_dims + d];
    sn.sizes[plan_.reduced_dims] = nb;
    table.normalize(sub, 0, plan_.group_size * nb);
  }

  struct ScaledLane {
    int64_t c;
    double scale;
  };
  // The lanes marked slow: judged one by one, summed again (the kernel takes one scale per call, so
  // lanes needing another scale get a pass of their own: applied to ordinary lanes, the scale down
  // would underflow their squares), at most three passes of each scale. Their mean and var replace
  // the first pass's; a lane still unsettled after that gets NaN. Lanes whose var comes in scaled
  // units are added to `scaled`, in order.
  void judge_slow_lanes(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane, std::vector<ScaledLane>& scaled) {
    struct Slow {
      int64_t c;
      Pass pass;
      bool done;
      double result_scale;
    };
    std::vector<Slow> lanes;
    for (int64_t c = 0; c < nb; ++c) {
      if (!lane.slow[c]) continue;
      Slow l{c, Pass{lane.pivot[c], 1.0, false}, false, 1.0};
      GroupResult r{NAN, NAN};
      l.done = judge(Sums{lane.s1[c], lane.s2[c]}, l.pass, r);
      lane.mean[c] = r.mean;
      lane.var[c] = r.var;
      l.result_scale = r.scale;
      lanes.push_back(l);
    }
    for (int round = 1; round < 3; ++round) {
      for (const double scale : {1.0, kDoubleScaling.down, kDoubleScaling.up}) {
        bool any = false;
        for (Slow& l : lanes) {
          const bool take = !l.done && l.pass.scale == scale;
          if (take) lane.pivot[l.c] = l.pass.pivot;  // other lanes' sums are taken and dropped
          any |= take;
        }
        if (!any) continue;
        column_sums(ko, c0, nb, lane.pivot.data(), scale, lane.s1.data(), lane.s2.data());
        for (Slow& l : lanes) {
          if (l.done || l.pass.scale != scale) continue;
          GroupResult r;
          l.done = judge(Sums{lane.s1[l.c], lane.s2[l.c]}, l.pass, r);
          if (l.done) lane.mean[l.c] = r.mean, lane.var[l.c] = r.var, l.result_scale = r.scale;
        }
      }
    }
    for (const Slow& l : lanes)
      if (l.done && l.result_scale != 1.0) scaled.push_back({l.c, l.result_scale});
  }

  // Each lane's mean and variance, over the same count, combined lane_group lanes at a time into
  // their group's (Chan et al.: the mean of the means; the mean of the variances plus the variance
  // of the means), left in the group's first lane. In double, from each lane's judged statistics.
  // `scaled` (lanes whose var is in scaled units) becomes the groups whose var is.
  void combine_lane_groups(double* mean, double* var, int64_t nb, std::vector<ScaledLane>& scaled) const {
    const int64_t k = plan_.lane_group;
    std::vector<ScaledLane> lanes;
    lanes.swap(scaled);
    size_t next = 0;  // the first of `lanes` at or past c0
    for (int64_t c0 = 0; c0 < nb; c0 += k) {
      double m = 0.0, v = 0.0, spread = 0.0;
      for (int64_t j = 0; j < k; ++j) m += mean[c0 + j];
      m /= static_cast<double>(k);
      const size_t first = next;
      while (next < lanes.size() && lanes[next].c < c0 + k) ++next;
      if (first == next) {
        for (int64_t j = 0; j < k; ++j) {
          const double d = mean[c0 + j] - m;
          v += var[c0 + j];
          spread += d * d;
        }
        const double group_var = (v + spread) / static_cast<double>(k);
        if (!std::isinf(group_var) || !std::isfinite(m)) {  // (inf: float64 means +-1e200 apart)
          mean[c0] = m;
          var[c0] = group_var;
          continue;
        }
      }
      // Past double's range: in units of the largest standard deviation or distance between means.
      auto lane_std = [&, first](int64_t c) {
        for (size_t i = first; i < next; ++i)
          if (lanes[i].c == c) return std::sqrt(var[c]) / lanes[i].scale;
        return std::sqrt(var[c]);
      };
      double largest = 0.0;
      for (int64_t j = 0; j < k; ++j)
        largest = std::max({largest, lane_std(c0 + j), std::fabs(mean[c0 + j] - m)});
      int exponent = 0;
      std::frexp(largest, &exponent);
      const double scale = std::ldexp(1.0, -exponent);
      v = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const double sd = lane_std(c0 + j) * scale, d = (mean[c0 + j] - m) * scale;
        v += sd * sd + d * d;
      }
      mean[c0] = m;
      var[c0] = v / static_cast<double>(k);
      if (scale != 1.0) scaled.push_back({c0, scale});
    }
  }

  // shift[c], mul[c] (compute type E) from the first lane of c's group of k.
  template <class E>
  static void spread_lanes(const double* mean, const double* istd, int64_t n, int64_t k, E* shift, E* mul) {
    if (k == 1) {
      for (int64_t c = 0; c < n; ++c) {
        shift[c] = static_cast<E>(mean[c]);
        mul[c] = static_cast<E>(istd[c]);
      }
      return;
    }
    for (int64_t c0 = 0; c0 < n; c0 += k) {
      const E m = static_cast<E>(mean[c0]), i = static_cast<E>(istd[c0]);
      for (int64_t j = 0; j < k; ++j) {
        shift[c0 + j] = m;
        mul[c0 + j] = i;
      }
    }
  }

  // Lanes per task: a multiple of 16 (and of the lane group: a task takes whole groups), so that
  // its rows x lanes block stays in cache.
  int64_t lanes_per_task() const {
    const int64_t lane_bytes = plan_.group_size * itemsize(a_.input.dtype) + LaneScratch::kBytesPerLane;
    const int64_t k = plan_.lane_group, unit = 16 / std::gcd<int64_t>(16, k) * k;
    int64_t lanes = kColumnBlockBytes / lane_bytes;
    lanes = lanes < unit ? unit : lanes / unit * unit;
    return lanes > plan_.lane_count ? plan_.lane_count : lanes;
  }

  void run_columns() {
    const int64_t lanes_per_task = this->lanes_per_task();
    const int64_t blocks = (plan_.lane_count + lanes_per_task - 1) / lanes_per_task;
    const int64_t tasks = plan_.groups * blocks;
    int parts = parts_for(plan_.groups * plan_.lane_count * plan_.group_size, kMinElementsPerThread);
    if (parts > tasks) parts = static_cast<int>(tasks);
    const int64_t per = (tasks + parts - 1) / parts;
    parallel_for(parts, [&](int part) {
      LaneScratch lane(lanes_per_task);
      for (int64_t t = part * per; t < (part + 1) * per && t < tasks; ++t) {
        const int64_t ko = t / blocks, c0 = (t % blocks) * lanes_per_task;
        const int64_t nb = c0 + lanes_per_task < plan_.lane_count ? lanes_per_task : plan_.lane_count - c0;
        column_task(ko, c0, nb, lane);
      }
    });
  }

  // ---- empty reductions -------------------------------------------------------------------------
  void fill_stats_nan() {
    for (const std::optional<TensorView>* t : {&a_.mean_out, &a_.inv_std_out}) {
      if (!*t) continue;
      const TensorView& v = **t;
      int64_t count = 1;
      for (int d = 0; d < v.ndim; ++d) count *= v.sizes[d];
      int64_t idx[kMaxViewDims] = {};
      for (int64_t i = 0; i < count; ++i) {
        char* p = v.data;
        for (int d = 0; d < v.ndim; ++d) p += idx[d] * v.strides[d];
        store_compute(p, NAN);
        for (int d = v.ndim - 1; d >= 0; --d) {
          if (++idx[d] < v.sizes[d]) break;
          idx[d] = 0;
        }
      }
    }
  }

  const MvnArgs& a_;
  const DType compute_;
  const int64_t csize_;
  std::unique_ptr<FoldedParams> affine_;
  ReductionPlan plan_;
  double inv_group_size_ = 0.0;  // 1 / plan_.group_size: judge's mean is a multiplication
  const InvStdRule inv_std_rule_;
  UnderflowRule underflow_{};  // (set with the plan: it bounds a sum over the group)
  NormalizeTask task_;
  std::vector<char> shift_, mul_;
  char* user_mean_ = nullptr;
  char* user_inv_std_ = nullptr;
  int64_t user_mean_strides_[kMaxNestDims] = {};
  int64_t user_inv_std_strides_[kMaxNestDims] = {};
  const float one_f_ = 1.0f, zero_f_ = 0.0f;
  const double one_d_ = 1.0, zero_d_ = 0.0;
};

}  // namespace

void mean_variance_normalization(const MvnArgs& args, std::string* explain) { MvnRunner(args).run(explain); }

}  // namespace simdnorm
