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
//
// With statistics_only (simdnorm.moments) the same sums give float64 statistics and nothing is
// normalized: groups per thread (run_rows_statistics) or split blocks, and the column tasks, stop
// after their statistics.
#include "ops/mvn_runner.h"

namespace simdnorm {
namespace {

void MvnRunner::run(std::string* explain) {
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
  plan_normalize(task_);
  if (explain != nullptr) {
    *explain = describe();
    return;
  }
  if (!a_.normalize_mean && !a_.normalize_variance) {  // no statistics needed: scale and bias only
    for (int64_t i = 0; i < plan_.groups * plan_.lane_count; ++i) store_stats(i, GroupResult{0.0, 0.0}, nullptr, nullptr);
    if (!a_.statistics_only) run_normalize(task_);
    return;
  }
  if (plan_.lanes) run_columns();
  else run_rows();
}

std::string MvnRunner::describe() {
  std::string d = (plan_.lanes ? "columns" : "rows") + std::string(" groups=") + std::to_string(plan_.groups) +
                  " lanes=" + std::to_string(plan_.lane_count) + " group_size=" + std::to_string(plan_.group_size) +
                  (plan_.lane_group > 1 ? " lane_group=" + std::to_string(plan_.lane_group) : std::string());
  const bool statistics = a_.normalize_mean || a_.normalize_variance;
  if (a_.statistics_only) return d + " statistics-only";
  if (statistics && plan_.lanes && fused_columns_take())
    return d + " fused_columns lanes_per_task=" + std::to_string(std::min(kFusedColumnLanes, plan_.lane_count)) + " " +
           describe_normalize(column_normalize_task(0, 0, plan_.lane_count));
  if (statistics && plan_.lanes) {
    // Tasks of lane groups and of whole rows run one normalize pass over the whole nest; other
    // column tasks normalize their own lanes.
    const bool grouped = lane_group_tasks(), one_pass = grouped || whole_row_tasks();
    const int64_t lanes = grouped ? groups_per_lane_group_task() * plan_.lane_group : lanes_per_task();
    return d + (grouped ? " lane_group_tasks" : "") + " lanes_per_task=" + std::to_string(lanes) + " " +
           describe_normalize(one_pass ? task_ : column_normalize_task(0, 0, lanes));
  }
  if (!statistics || plan_.lanes) return d + " " + describe_normalize(task_);
  static const char* const kNames[] = {"fused pipeline", "fused paired", "fused batched", "split"};
  const RowStrategy strategy = row_strategy();
  d += std::string(" ") + kNames[static_cast<int>(strategy)];
  if (strategy == RowStrategy::pipelined || strategy == RowStrategy::paired) {
    // Normalized run by run, in the loops that sum later ones; pipelined 16-bit rows back to back
    // as one stream (the first thread's call tells).
    RowsLoop loop = RowsLoop::pipeline;
    if (strategy == RowStrategy::pipelined) {
      static const char* const kLoops[] = {"separate", "pipeline", "pipeline_paired", "pipeline_kept", "row_stream",
                                                "short_rows"};
      loop = kernels().rows_loop(task_, fused_rows_args(0, std::min(groups_per_thread(), plan_.groups)));
      d += std::string(" rows_loop=") + kLoops[static_cast<int>(loop)];
    }
    NormalizeTask run = task_;
    if (run.inner.loop != InnerLoop::strided)
      run.inner = InnerPlan{loop == RowsLoop::row_stream ? InnerLoop::row_stream : InnerLoop::contiguous,
                            run.inner.stats_vary, run.inner.affine_vary, 0};
    return d + " " + describe_normalize(run);
  }
  return d + " " + describe_normalize(task_);
}

// ---- setup --------------------------------------------------------------------------------------
void MvnRunner::fold_affine() {
  if (!a_.scale && !a_.bias) return;
  affine_ = std::make_unique<FoldedParams>(
      a_.input.ndim, a_.input.sizes,
      std::initializer_list<FoldedParams::Input>{{a_.scale ? &*a_.scale : nullptr, 1.0},
                                                 {a_.bias ? &*a_.bias : nullptr, 0.0}},
      std::initializer_list<int>{kScale, kBias}, compute_, nullptr, nullptr, nullptr, false, nullptr,
      coefficient_phase(a_.output.data, a_.input.dtype));  // (where align_coefficients wants them: one copy)
  spread_affine_over_short_runs();
}

// Group norm on small NCHW planes: scale and bias vary along a reduced dim (the group's channels)
// and are constant along the reduced dims inside it (a 7x7 plane), so the plan cannot merge those:
// each plane is a run of its own, and pays the kernels' per-run costs (a partial head and tail,
// its sums' tree) every few vectors (8x512x7x7: 7x the time without scale and bias). Copied along
// the plane, they vary as the data do, and each group is one run, as without them.
void MvnRunner::spread_affine_over_short_runs() {
  const TensorView& x = a_.input;
  const int nd = x.ndim;
  const int64_t* strides = affine_->strides();
  int varies = nd - 1;  // the innermost dim the affine varies along
  while (varies >= 0 && strides[varies] == 0) --varies;
  if (varies < 0 || varies == nd - 1 || !((a_.reduced >> varies) & 1u)) return;
  int64_t run = 1;
  for (int d = varies + 1; d < nd; ++d) {
    if (!((a_.reduced >> d) & 1u)) return;
    run *= x.sizes[d];
  }
  // The rule looks at a group's own layout only (never at the batch or the channel count), so
  // that a group's statistics are the same bits alone as in any batch (tests/test_training.py:
  // test_backward_groups_in_pairs_as_alone).
  if (run <= 1 || run >= kSpreadRunsBelow) return;
  // Only where the planner can then merge the dims: input and output contiguous over them.
  for (const TensorView* t : {&x, &a_.output}) {
    int64_t step = itemsize(x.dtype);
    for (int d = nd - 1; d >= varies; --d) {
      if (t->sizes[d] != 1 && t->strides[d] != step) return;
      step *= t->sizes[d];
    }
  }
  affine_->spread_inner(varies + 1, nd, x.sizes);
}

void MvnRunner::build_plan() {
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
  plan_ = plan_reduction(p, a_.reduced, itemsize(x.dtype), /*short_lane_groups=*/true);
  inv_group_size_ = 1.0 / static_cast<double>(elements_per_group());
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
  shift_ = stats_scratch_.reserve(static_cast<size_t>(2 * count * csize_));
  mul_ = shift_ + count * csize_;
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
  nest.data[kShift] = shift_;
  nest.data[kMul] = mul_;
  task_.loop = nest;
  if (plan_.split_lanes) split_lanes(task_.loop);
  task_.dtype = x.dtype;
  task_.act = a_.activation;
  // Without scale and bias, fma(x - mean, 1/std, 0): the values of fma((x - mean) / std, 1, 0)
  // (a zero is +0 in both; only a product that underflows to zero keeps its sign here) with one
  // multiply fewer a vector, which float16 and bfloat16, bound by the vector pipes, feel.
  task_.scale_folded = !affine_;
}

// The nest's last dim, the lanes, as (lane_count / lane_group) x lane_group: the outer dim steps as
// the kept dim the lanes took in (plan.lane_group_strides), the internal statistics by a group
// (their first lane's), the inner one as the lanes did, but for the statistics, constant.
void MvnRunner::split_lanes(LoopNest& nest) const {
  SIMDNORM_CHECK(nest.ndim < kMaxNestDims);
  const int last = nest.ndim - 1;
  const int64_t k = plan_.lane_group;
  nest.sizes[last + 1] = k;
  nest.sizes[last] = plan_.lane_count / k;
  for (int op = 0; op < kNumOperands; ++op) {
    const bool stats = op == kShift || op == kMul;
    nest.strides[op][last + 1] = stats ? 0 : nest.strides[op][last];
    nest.strides[op][last] = stats ? k * nest.strides[op][last] : plan_.lane_group_strides[op];
  }
  nest.ndim += 1;
}

// Scaling::up is needed only for float64 data, and only where the variance matters next to
// epsilon: a variance below tiny changes var + epsilon (or sqrt(var) + epsilon) by less than
// margin, relative, once epsilon is past tiny / margin (sqrt(tiny) / margin).
// (A bound on the sum of squares: with one on the mean square, the kernels' lane loops shared
// sum_sq * inv_n between the two tests, and GCC no longer fused the variance's subtraction into
// it: float64 columns' statistics changed in their last bits.)
UnderflowRule MvnRunner::underflow_rule() const {
  const Scaling& k = kDoubleScaling;
  const double outweighing = a_.epsilon_outside ? std::sqrt(k.tiny) / k.margin : k.tiny / k.margin;
  const bool off = !a_.normalize_variance || compute_ != DType::f64 || a_.epsilon >= outweighing;
  return {off ? 0.0 : k.tiny * static_cast<double>(elements_per_group()), k.max_pivot};
}

// ---- empty reductions ---------------------------------------------------------------------------
void MvnRunner::fill_stats_nan() {
  for (const std::optional<TensorView>* t : {&a_.mean_out, &a_.inv_std_out, &a_.var_out}) {
    if (!*t) continue;
    const TensorView& v = **t;
    int64_t count = 1;
    for (int d = 0; d < v.ndim; ++d) count *= v.sizes[d];
    int64_t idx[kMaxViewDims] = {};
    for (int64_t i = 0; i < count; ++i) {
      char* p = v.data;
      for (int d = 0; d < v.ndim; ++d) p += idx[d] * v.strides[d];
      store_user(p, NAN);
      for (int d = v.ndim - 1; d >= 0; --d) {
        if (++idx[d] < v.sizes[d]) break;
        idx[d] = 0;
      }
    }
  }
}

}  // namespace
}  // namespace simdnorm

// The strategies, in this translation unit (ops/mvn_runner.h).
#include "ops/mvn_rows.h"
#include "ops/mvn_columns.h"

namespace simdnorm {

void mean_variance_normalization(const MvnArgs& args, std::string* explain) {
  MvnRunner(args).run(explain);
}

}  // namespace simdnorm
