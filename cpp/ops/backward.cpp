// The backward of MVN, and through it of batch norm and the conveniences (python/simdnorm/_training.py).
//
// With g = dy * act'(pre) * scale and y the normalized value, per statistics group of n elements:
//   dx = u * ((g - c1) - y * c2),  c1 = mean(g) [normalize_mean],  c2 = k * mean(g y) [normalize_variance]
// (k = 1, or 1 / (1 - epsilon u) with epsilon outside the root), c1 = c2 = 0 where the statistics
// are constants (batch norm's training=False); and the parameters' sums(ga y), sum(ga) over the
// dims they broadcast along. The statistics and the parameters are first folded into compact
// compute-type arrays (mean, u, c1, c2 and scale, bias: FoldedParams), which the kernels read as
// two operands of the nest. Two strategies, chosen by the shapes alone:
//   groups    the reduced dims are the innermost (rows: layer and RMS norm, NCHW batch, instance
//             and group norm): each group is summed, its c1 and c2 set, and its dx written while its
//             runs are still in cache; groups go in fixed blocks, each with its own parameter sums.
//   two pass  anything else (channels last, a single group): one pass of sums over fixed chunks of
//             the elementwise nest, each chunk with its own sums, then one elementwise pass; where
//             the write needs none of the sums (no statistics terms), the sums pass writes too.
// The blocks and chunks are fixed by the shapes and their sums merged in their order, so the result
// is bitwise the same for any number of threads. An activation whose derivative the kernels call
// out of line (silu, gelu) is taken once, not in both passes: a first pass writes ga = dy * act'(pre)
// into grad_input, then the backward without the activation reads it there as its grad_output
// (derivative_first); the same ga, so the same bits.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "ops/common.h"
#include "simd/half.h"
#include "runtime/cpu.h"
#include "runtime/thread_pool.h"
#include "simdnorm/check.h"

namespace simdnorm {
namespace {

// Statistics given with a variance: mean and variance in, (mean, u, c1, c2) out, u = 1 / sqrt(variance
// + epsilon) (ctx: the epsilon; c1, c2 set later), in the active unit's vectors (square roots and
// divisions round the same in every unit). (Given u, the statistics need no fold: fold().)
void fold_variance(const double* const* in, double* const* out, int64_t n, const void* ctx) {
  std::copy(in[0], in[0] + n, out[0]);
  kernels().inv_std_lanes(in[1], out[1], n, 1, InvStdRule{true, false, *static_cast<const double*>(ctx)});
  std::fill(out[2], out[2] + n, 0.0);
  std::fill(out[3], out[3] + n, 0.0);
}
// fold_variance of compact float32 statistics (FoldedParams::CompactFold): the mean copied, u by the
// unit's float32 loop (scale_over_std_f32 without a scale: the same 1 / sqrt in double), c1 and c2
// zero. Declines arrays not aligned to their floats.
bool fold_variance_f32(DType compute, const char* const* in, char* const* out, int64_t n, const void* ctx) {
  if (compute != DType::f32 || in[1] == nullptr || !FoldedParams::floats_aligned(in, 2)) return false;
  FoldedParams::copy_floats(in[0], out[0], n, 0.0f);
  kernels().scale_over_std_f32(reinterpret_cast<const float*>(in[1]), nullptr, reinterpret_cast<float*>(out[1]), n,
                               *static_cast<const double*>(ctx), FLT_MIN, FLT_MAX);  // (its range test unused)
  std::fill_n(reinterpret_cast<float*>(out[2]), n, 0.0f);
  std::fill_n(reinterpret_cast<float*>(out[3]), n, 0.0f);
  return true;
}

// Blocks of groups (or chunks of elements) hold at most this many bytes of partial sums in all.
constexpr int64_t kMaxPartialBytes = int64_t(32) << 20;
constexpr int64_t kMaxBlocks = 64;
// Elements per chunk of the two-pass strategy's sums, at least.
constexpr int64_t kMinChunkElements = int64_t(1) << 16;
// Groups a block of the grouped strategy holds at least: a block's first group is summed and its
// last written alone, not in the loop that overlaps one group's reads with another's writes
// (BackwardKernel::pair_run). But at least kMinGroupBlocks blocks where the work is that large, so
// that a few large groups still share out over the threads.
constexpr int64_t kMinGroupsPerBlock = 16, kMinGroupBlocks = 8;
// Runs of a group at most this long, scattered (scattered_short_runs), take the two passes.
constexpr int64_t kScatteredRunBytes = 1024, kScatteredRunBytesFromMemory = 4096;
// The two passes' slabs (BackwardRunner::slab_elements): x and dy of a slab of about kSlabBytes
// (half a 1 MB L2), whole statistics elements up to half the streaming threshold (a quarter of
// the L3: two threads' slabs then read their second pass from it).
constexpr int64_t kSlabBytes = int64_t(512) << 10;
// Column chunks (BackwardRunner::column_chunks): up to kMaxChunkRows rows; a chunk's lanes a
// multiple of kChunkLaneStep (whole lines and vectors), about kChunkElements elements a chunk (its
// calls' setup small beside it), its rows of x and dy within kSlabBytes and no more than
// kMaxChunkLanes (its arrays in the L2).
constexpr int64_t kMaxChunkRows = 32;
constexpr int64_t kChunkLaneStep = 64;
constexpr int64_t kChunkElements = int64_t(32) << 10;
constexpr int64_t kMinChunkLanes = 256;
constexpr int64_t kMaxChunkLanes = 8192;
// Rows the backward's column sweep takes however their strides fall on the L1's sets
// (BackwardRunner::columns_sweep).
constexpr int64_t kSweepAnyRows = 8;
// The most lanes a unit's vector holds (AVX-512's floats).
constexpr int64_t kMaxVectorLanes = 16;
// Runs (groups) a compute-type slot sums before it is added into its double.
constexpr int64_t kFlushRuns = 32;
// Group norm's channels-last runs of a group's channels up to this many bytes have their statistics
// spread along them (BackwardRunner::spread_over_short_runs).
constexpr int64_t kLaneFoldRunBytes = 256;
// Statistics elements of at least this many input elements each have their parameters spread
// over them (BackwardRunner::spread_params_over_stats).
constexpr int64_t kMinSpreadElements = 128;

// Whether the active unit calls act's derivative out of line (a call and a transcendental a
// vector, 7-10x relu's time): silu and gelu.
bool out_of_line(const Activation& act) {
  return act.kind != ActKind::identity && !(kernels().inline_activations >> static_cast<int>(act.kind) & 1u);
}

class BackwardRunner {
 public:
  explicit BackwardRunner(const MvnBackwardArgs& a)
      : a_(a), compute_(compute_type(a.input.dtype)), csize_(itemsize(compute_)) {}

  void run(std::string* explain) {
    const TensorView& x = a_.input;
    int64_t total = 1, group_size = 1;
    for (int d = 0; d < x.ndim; ++d) {
      total *= x.sizes[d];
      if ((a_.reduced >> d) & 1u) group_size *= x.sizes[d];
    }
    fold();
    spread_over_short_runs();
    want_params_ = a_.param_sums[0].has_value() || a_.param_sums[1].has_value();
    want_group_ = a_.statistics_terms && (a_.normalize_mean || a_.normalize_variance) && a_.grad_input &&
                  !a_.write_ga;
    n_ = group_size;
    if (total == 0) {
      if (explain != nullptr) *explain = "empty";
      else if (!plan_only_) write_param_sums(nullptr);
      return;
    }
    task_.dtype = x.dtype;
    task_.act = a_.activation;
    task_.has_fused_add = a_.fused_add.has_value();
    task_.fused_add_dtype = a_.fused_add ? a_.fused_add->dtype : x.dtype;
    task_.write_ga = a_.write_ga;
    task_.stats_pitch = stats_->data(1) - stats_->data(0);
    task_.params_pitch = params_->data(1) - params_->data(0);
    task_.inv_n = 1.0 / static_cast<double>(n_);
    task_.epsilon = a_.epsilon;
    task_.normalize_mean = a_.normalize_mean;
    task_.normalize_variance = a_.normalize_variance;
    task_.epsilon_outside = a_.epsilon_outside;
    task_.statistics_terms = want_group_;
    // As the forward's: non-temporal stores where the operands together pass the caches (not in
    // place, where the data are cached); not 16-bit data, whose vectors are half a line (the
    // kernels store plainly wherever a vector is not a whole line: BackwardKernel::stream_head).
    const void* dx = a_.grad_input ? a_.grad_input->data : nullptr;
    task_.from_memory = 3 * total * itemsize(x.dtype) > stream_threshold_bytes();
    task_.stream_stores = dx != nullptr && !a_.write_ga && dx != x.data && dx != a_.grad_output.data &&
                          itemsize(x.dtype) >= 4 && task_.from_memory;
    task_.pair_prefetch_bytes = pair_prefetch_bytes();
    task_.write_four_rows = backward_writes_four_rows();

    Problem p = problem();
    const ReductionPlan rp = plan_reduction(p, a_.reduced, itemsize(x.dtype));
    const LoopNest ew = elementwise(p);
    const bool grouped =
        want_group_ && !rp.lanes && rp.groups > 1 && lane_fold_ == 1 && !scattered_short_runs(rp, ew);
    LoopNest two_pass = ew;
    if (!grouped && spread_params_over_stats(total)) {
      task_.params_pitch = params_->data(1) - params_->data(0);
      two_pass = elementwise(problem());
    }
    // An out-of-line derivative (a call and a transcendental a vector), grouped: each group's ga is
    // saved by its sums pass for its apply, and the derivative taken once an element.
    task_.save_ga = grouped && a_.grad_input && out_of_line(a_.activation) && n_ <= kMaxSavedGaElements;
    if (plan_only_) return;
    if (explain != nullptr) {
      *explain = std::string(grouped ? "groups" : "two-pass") + " groups=" + std::to_string(grouped ? rp.groups : stats_->count() / lane_fold_) +
                 (lane_fold_ > 1 ? " lane_fold=" + std::to_string(lane_fold_) : std::string()) +
                 " group_size=" + std::to_string(n_) + " nest=" + describe(grouped ? rp.nest : two_pass) +
                 (param_of_stat_.empty() ? std::string() : " params-per-statistic") +
                 (task_.stream_stores ? " streaming-stores" : "") + (task_.save_ga ? " saved-ga" : "");
      const SumTargets t = sum_targets();
      if (!grouped && write_in_sums(t)) *explain += " sums-write";
      if (!grouped && column_chunks(two_pass, t)) {
        *explain += " column_chunks=" + std::to_string(chunk_lanes(two_pass)) + (columns_sweep(two_pass, t) ? " sweep" : "");
        return;
      }
      const std::vector<Slab> slabs = grouped ? std::vector<Slab>() : slabs_of(two_pass, total, t);
      if (!slabs.empty()) *explain += " slabs=" + std::to_string(slabs.size());
      const int in = two_pass.ndim - 1;
      if (slabs.empty() && (t.group || t.params)) {
        const std::vector<Slab> chunks = sum_chunks(two_pass, total, t);
        if (chunks.front().nest.sizes[in] != two_pass.sizes[in])
          *explain += " sum_columns=" + std::to_string(chunks.front().nest.sizes[in]);
      }
      return;
    }
    task_.grouped = grouped;
    if (grouped) run_groups(rp);
    else run_two_pass(two_pass, total);
  }

  // Whether the plan saves each group's ga (BackwardTask::save_ga). Plans only: runs and writes
  // nothing, and builds no plan text.
  bool plans_saved_ga() {
    plan_only_ = true;
    run(nullptr);
    return task_.save_ga;
  }

 private:
  // The statistics and parameters are laid out in the input's memory order (its dims by their
  // strides, outermost first), so that they step with the data where it runs: in the order of
  // the dims, the statistics of a Fortran-ordered layer norm would be strided along every run.
  void fold() {
    const TensorView& x = a_.input;
    int order[kMaxViewDims];
    for (int d = 0; d < x.ndim; ++d) order[d] = d;
    std::stable_sort(order, order + x.ndim,
                     [&](int a, int b) { return std::llabs(x.strides[a]) > std::llabs(x.strides[b]); });
    // (mean, u, c1, c2): the mean (absent 0) and u = 1 / std (absent 1), then two arrays of zeros;
    // given u, with no fold (compact statistics of the compute type are copied whole).
    using In = FoldedParams::Input;
    const In mean{a_.mean ? &*a_.mean : nullptr, 0.0}, u{a_.inv_std ? &*a_.inv_std : nullptr, 1.0}, zeros{nullptr, 0.0};
    const std::initializer_list<int> operands{kStats, kStats, kStats, kStats};
    if (a_.variance_given)
      stats_ = std::make_unique<FoldedParams>(x.ndim, x.sizes, std::initializer_list<In>{mean, u}, operands, compute_,
                                              fold_variance, &a_.epsilon, order, true, fold_variance_f32);
    else
      stats_ = std::make_unique<FoldedParams>(x.ndim, x.sizes, std::initializer_list<In>{mean, u, zeros, zeros},
                                              operands, compute_, nullptr, nullptr, order, true);
    params_ = std::make_unique<FoldedParams>(
        x.ndim, x.sizes,
        std::initializer_list<FoldedParams::Input>{{a_.scale ? &*a_.scale : nullptr, 1.0},
                                                   {a_.bias ? &*a_.bias : nullptr, 0.0}},
        std::initializer_list<int>{kParams, kParams}, compute_, nullptr, nullptr, order);
    user_param_count_ = params_->count();
    param_index_ = params_->row_major_indices(x.ndim, x.sizes);
    for (const auto& out : a_.param_sums)
      if (out) SIMDNORM_CHECK(element_count_of(*out) == params_->count());
  }

  static int64_t element_count_of(const TensorView& v) {
    int64_t n = 1;
    for (int d = 0; d < v.ndim; ++d) n *= v.sizes[d];
    return n;
  }

  Problem problem() const {
    const TensorView& x = a_.input;
    Problem p;
    p.ndim = x.ndim;
    for (int d = 0; d < x.ndim; ++d) {
      p.sizes[d] = x.sizes[d];
      // Without grad_input the input's strides order the nest in its place.
      p.strides[kGradIn][d] = a_.grad_input ? a_.grad_input->strides[d] : x.strides[d];
      p.strides[kX][d] = x.strides[d];
      p.strides[kGradOut][d] = a_.grad_output.strides[d];
      p.strides[kStats][d] = stats_->strides()[d];
      p.strides[kParams][d] = params_->strides()[d];
      p.strides[kFusedAdd][d] = a_.fused_add && a_.fused_add->sizes[d] != 1 ? a_.fused_add->strides[d] : 0;
    }
    // (Without grad_input nothing is written: the input's pointer only keeps the slot's arithmetic
    // off a null pointer.)
    p.data[kGradIn] = a_.grad_input ? a_.grad_input->data : x.data;
    p.data[kX] = x.data;
    p.data[kGradOut] = a_.grad_output.data;
    p.data[kStats] = stats_->data(0);
    p.data[kParams] = params_->data(0);
    p.data[kFusedAdd] = a_.fused_add ? a_.fused_add->data : nullptr;
    return p;
  }

  static LoopNest elementwise(const Problem& p) {
    LoopNest nest;
    plan_elementwise(p, nest);
    return nest;
  }

  // One block's (or chunk's) sums: doubles, and the compute-type slots of the targets that vary
  // along runs (flush_reached() adds them into the doubles). Layout: [group sum(g), sum(g y)] of statistics
  // elements [group_lo, group_lo + group_count) when the group sums are wanted here, then [param
  // sum(ga y), sum(ga)]. A chunk of the two passes holds the statistics elements it can reach only
  // (reached()): with many (MVN over the channels of NCHW data: one a pixel) the chunks' zeroed
  // arrays and their merge cost as much as the pass.
  struct Partial {
    double* sums = nullptr;  // (allocate_partials: in the calling thread's kept scratch)
    char* vary = nullptr;
    int64_t group_lo = 0, group_count = 0, param_lo = 0, param_count = 0;
    int64_t width() const { return 2 * group_count + 2 * param_count; }
  };
  struct Slots {
    int64_t lo = 0, hi = 0;  // [lo, hi)
  };
  Partial partial(bool group, bool params, Slots held = {0, -1}, Slots held_params = {0, -1}) const {
    const int64_t gc = !group ? 0 : held.hi < 0 ? stats_->count() : held.hi - held.lo;
    const int64_t pc = !params ? 0 : held_params.hi < 0 ? params_->count() : held_params.hi - held_params.lo;
    return Partial{nullptr, nullptr, group ? std::max<int64_t>(0, held.lo) : 0, gc,
                   params ? std::max<int64_t>(0, held_params.lo) : 0, pc};
  }
  // The partials' arrays, zeroed, in one block of the calling thread's kept scratch (allocated per
  // call, arrays of a few hundred KB were fresh pages, or grown and trimmed heap, on every call).
  void allocate_partials(std::vector<Partial>& partials) {
    int64_t width = 0;
    for (const Partial& p : partials) width += p.width();
    char* at = partial_store_.reserve(static_cast<size_t>(width * (8 + csize_)));
    if (width > 0) std::memset(at, 0, static_cast<size_t>(width * (8 + csize_)));  // (at may be null)
    for (Partial& p : partials) {
      p.sums = reinterpret_cast<double*>(at);
      p.vary = at + p.width() * 8;
      at += p.width() * (8 + csize_);
    }
  }
  // Slots [begin, end) of p added into their doubles and cleared.
  void flush_range(Partial& p, int64_t begin, int64_t end) const {
    if (compute_ == DType::f64) add_and_clear(p.sums + begin, reinterpret_cast<double*>(p.vary) + begin, end - begin);
    else add_and_clear(p.sums + begin, reinterpret_cast<float*>(p.vary) + begin, end - begin);
  }
  template <class C>
  static void add_and_clear(double* sums, C* vary, int64_t n) {
    for (int64_t i = 0; i < n; ++i) sums[i] += static_cast<double>(vary[i]);
    std::fill(vary, vary + n, C(0));
  }
  // The elements of `op`'s compact arrays (statistics or parameters) that elements [b, e) of the
  // nest may reach: those in the box of nest indices that holds them (from the first dim where b
  // and e - 1 differ on, every index).
  Slots reached(int op, const LoopNest& nest, int64_t b, int64_t e) const {
    if (e <= b) return {};
    int64_t first[kMaxNestDims], last[kMaxNestDims], rb = b, re = e - 1;
    for (int d = nest.ndim - 1; d >= 0; --d) {
      first[d] = rb % nest.sizes[d], last[d] = re % nest.sizes[d];
      rb /= nest.sizes[d], re /= nest.sizes[d];
    }
    const FoldedParams& f = op == kStats ? *stats_ : *params_;
    int64_t lo = nest.data[op] - f.data(0), hi = lo;
    bool whole = false;  // past the first differing dim: every index
    for (int d = 0; d < nest.ndim; ++d) {
      const int64_t st = nest.strides[op][d];
      const int64_t i0 = whole ? 0 : first[d], i1 = whole ? nest.sizes[d] - 1 : last[d];
      lo += std::min(i0 * st, i1 * st), hi += std::max(i0 * st, i1 * st);
      whole = whole || first[d] != last[d];
    }
    return {std::max<int64_t>(0, lo / csize_), std::min(f.count(), hi / csize_ + 1)};
  }
  // The slots that elements [b, e) of the nest may have added to, flushed (not every slot of p's).
  void flush_reached(Partial& p, bool group, bool params, const LoopNest& nest, int64_t b, int64_t e) const {
    const int64_t gc = p.group_count, pc = p.param_count;
    if (group) {
      const Slots r = reached(kStats, nest, b, e);
      const int64_t s0 = std::max<int64_t>(0, r.lo - p.group_lo), s1 = std::min(gc, r.hi - p.group_lo);
      for (int k = 0; k < 2 && s0 < s1; ++k) flush_range(p, k * gc + s0, k * gc + s1);
    }
    if (params) {
      const Slots r = reached(kParams, nest, b, e);
      const int64_t s0 = std::max<int64_t>(0, r.lo - p.param_lo), s1 = std::min(pc, r.hi - p.param_lo);
      for (int k = 0; k < 2 && s0 < s1; ++k) flush_range(p, 2 * gc + k * pc + s0, 2 * gc + k * pc + s1);
    }
  }
  // Pointers into p for the sums pass. The kernels index the sums from stats_base and params_base:
  // with a part of the statistics (parameters) held, its first element's.
  BackwardSums sums_of(Partial& p, bool group, bool params) const {
    const int64_t np = p.param_count;
    BackwardSums s;
    s.stats_base = stats_->data(0);
    s.params_base = params_->data(0) + p.param_lo * csize_;
    int64_t at = 0;
    if (group) {
      const int64_t gc = p.group_count;
      s.stats_base = stats_->data(0) + p.group_lo * csize_;
      s.group[0] = p.sums, s.group[1] = p.sums + gc;
      s.group_vary[0] = p.vary, s.group_vary[1] = p.vary + gc * csize_;
      at = 2 * gc;
    }
    if (params) {
      s.param[0] = p.sums + at, s.param[1] = p.sums + at + np;
      s.param_vary[0] = p.vary + at * csize_, s.param_vary[1] = p.vary + (at + np) * csize_;
    }
    return s;
  }

  // The parameters' sums (sum(ga y) then sum(ga), merged), or zeros when empty, into the caller's
  // (rounded once from the double sums, to inf past their range).
  void write_param_sums(const double* sums) {
    std::vector<double> per_param, ordered;
    if (!param_of_stat_.empty() && sums != nullptr && want_params_) per_param = sums_per_param(sums), sums = per_param.data();
    const int64_t np = user_param_count_;
    if (!param_index_.empty() && sums != nullptr && want_params_) {  // into the caller's (row-major) order
      ordered.resize(static_cast<size_t>(2 * np));
      for (int64_t k = 0; k < 2; ++k)
        for (int64_t i = 0; i < np; ++i)
          ordered[static_cast<size_t>(k * np + param_index_[static_cast<size_t>(i)])] = sums[k * np + i];
      sums = ordered.data();
    }
    write_param_range(sums, np, 0, np);
  }
  // The sums of the caller's parameter elements [lo, lo + n) into its outputs (sums[i], sum(ga y),
  // and sums[pitch + i], sum(ga), of element lo + i; zeros where sums is null).
  void write_param_range(const double* sums, int64_t pitch, int64_t lo, int64_t n) const {
    for (int o = 0; o < 2; ++o) {
      if (!a_.param_sums[o]) continue;
      const double* from = sums == nullptr ? nullptr : sums + o * pitch;
      auto write = [&](auto* out, auto round) {
        for (int64_t i = 0; i < n; ++i) out[lo + i] = round(from == nullptr ? 0.0 : 0.0 + from[i]);  // (-0: +0)
      };
      void* data = a_.param_sums[o]->data;
      switch (a_.param_sums[o]->dtype) {
        case DType::f64: write(static_cast<double*>(data), [](double v) { return v; }); break;
        case DType::f32: write(static_cast<float*>(data), [](double v) { return static_cast<float>(v); }); break;
        case DType::f16: write(static_cast<uint16_t*>(data), double_to_f16_bits); break;
        default: write(static_cast<uint16_t*>(data), double_to_bf16_bits); break;
      }
    }
  }

  int64_t blocks_for(int64_t units, int64_t per_block_bytes, int64_t min_units, int64_t min_blocks = 1) const {
    int64_t blocks =
        std::min<int64_t>(kMaxBlocks, std::max<int64_t>(min_blocks, units / std::max<int64_t>(1, min_units)));
    if (per_block_bytes > 0) blocks = std::min(blocks, std::max<int64_t>(1, kMaxPartialBytes / per_block_bytes));
    return std::min(blocks, units);
  }

  // Runs fn(part) for parts [0, n) on the pool when the work is worth a second thread.
  static void for_parts(int64_t n, int64_t work, const std::function<void(int)>& fn) {
    if (parts_for(work, kMinElementsPerThread) <= 1) {
      for (int i = 0; i < n; ++i) fn(i);
    } else {
      parallel_for(static_cast<int>(n), fn);
    }
  }

  void run_groups(const ReductionPlan& rp) {
    const KernelTable& k = kernels();
    const LoopNest& nest = rp.nest;
    const int64_t groups = rp.groups;
    // Every group's sums (doubles; never in float slots: a group's statistics are constant along
    // its runs), in the calling thread's kept scratch.
    const int64_t ns = stats_->count();
    double* const group_sums = kept_group_sums();
    const int64_t param_bytes = want_params_ ? 2 * params_->count() * (8 + csize_) : 0;
    const int64_t blocks =
        blocks_for(groups, param_bytes, std::max(kMinGroupsPerBlock, kMinChunkElements / std::max<int64_t>(1, n_)),
                   std::clamp<int64_t>(groups * n_ / kMinChunkElements, 1, kMinGroupBlocks));
    std::vector<Partial> partials;
    for (int64_t b = 0; b < blocks; ++b) partials.push_back(partial(false, want_params_));
    allocate_partials(partials);
    const int64_t per = (groups + blocks - 1) / blocks;
    // A group's sub-nest: the reduced dims, its data at the group's offsets.
    LoopNest sub;
    sub.ndim = rp.reduced_dims;
    for (int d = 0; d < sub.ndim; ++d) {
      sub.sizes[d] = nest.sizes[rp.kept_dims + d];
      for (int op = 0; op < kNumOperands; ++op) sub.strides[op][d] = nest.strides[op][rp.kept_dims + d];
    }
    const int inner = rp.kept_dims - 1;  // groups at one step along it go to the kernel in one call
    // Parameters varying along the runs are summed in float slots, one add per run that reaches a
    // slot, so a group adds group_size / (its distinct parameter elements) to each: the slots are
    // flushed into their doubles every kFlushRuns of those adds, within a group (every kFlushRuns
    // runs) where one group adds more. (Parameters constant along the runs sum into doubles.)
    int64_t distinct = 1;
    for (int d = 0; d < sub.ndim; ++d)
      if (sub.strides[kParams][d] != 0) distinct *= sub.sizes[d];
    const int64_t run = sub.ndim > 0 ? sub.sizes[sub.ndim - 1] : 1;
    const int64_t repeats = sub.ndim > 0 && sub.strides[kParams][sub.ndim - 1] != 0 ? n_ / distinct : 1;
    const int64_t flush_every = repeats <= kFlushRuns ? std::max<int64_t>(1, kFlushRuns / repeats) : 1;
    const int64_t flush_elements = repeats <= kFlushRuns ? 0 : kFlushRuns * run;
    for_parts(blocks, groups * n_, [&](int b) {
      const int64_t g0 = b * per, g1 = std::min(groups, g0 + per);
      BackwardGroups call;
      call.group = sub;
      call.sums = sums_of(partials[static_cast<size_t>(b)], false, want_params_);
      call.sums.group[0] = group_sums, call.sums.group[1] = group_sums + ns;
      call.param_count = params_->count();
      call.flush_every = flush_every;
      call.flush_elements = flush_elements;
      call.apply = a_.grad_input.has_value();
      for (int op = 0; op < kNumOperands; ++op) call.step[op] = nest.data[op] != nullptr ? nest.strides[op][inner] : 0;
      for (int64_t g = g0; g < g1; g += call.count) {
        int64_t rem = g;
        for (int op = 0; op < kNumOperands; ++op) call.group.data[op] = nest.data[op];
        for (int d = inner; d >= 0; --d) {
          const int64_t i = rem % nest.sizes[d];
          rem /= nest.sizes[d];
          for (int op = 0; op < kNumOperands; ++op)
            if (nest.data[op] != nullptr) call.group.data[op] += i * nest.strides[op][d];  // (fused_add may be null)
        }
        call.count = std::min(g1, (g / nest.sizes[inner] + 1) * nest.sizes[inner]) - g;
        k.backward_groups(task_, call);
      }
      if (task_.stream_stores) fence_streaming_stores();
    });
    write_param_sums(want_params_ ? merged_params(partials) : nullptr);
  }

  // A group of several short runs apart, statistics and parameters constant along each, no
  // activation (batch norm of NCHW data with small planes: a channel's runs a sample apart): a few
  // lines here and there, which the hardware prefetchers do not follow, where the two passes walk
  // the data in memory order (BackwardKernel::const_rows), reading it twice but as streams. In the
  // caches, where a second thread hides the scattered reads' latency, only the shortest runs.
  // (`ew`: the two passes' nest, whose runs must be these.)
  bool scattered_short_runs(const ReductionPlan& rp, const LoopNest& ew) const {
    const int in = ew.ndim - 1;
    const int64_t es = itemsize(a_.input.dtype);
    const bool contiguous = ew.strides[kX][in] == es && ew.strides[kGradOut][in] == es &&
                            (!a_.grad_input || ew.strides[kGradIn][in] == es);
    return shared_layout() && rp.reduced_dims >= 2 && a_.activation.kind == ActKind::identity && !a_.write_ga &&
           contiguous && ew.strides[kStats][in] == 0 &&
           ew.sizes[in] * es <= (task_.from_memory ? kScatteredRunBytesFromMemory : kScatteredRunBytes);
  }

  // Group norm of channels-last data: a group's K channels are the input's innermost dim, reduced,
  // with the next (the groups) kept; the statistics, constant along the K channels, keep the two
  // from merging, so every run is K elements long, with its own statistics. Spread along the K
  // channels, the statistics are one per lane, the channel dims merge into runs of all the
  // channels, and each group's sums are its lanes' added in lane order (fold_lanes) before its
  // coefficients. Only runs up to kLaneFoldRunBytes, of groups with other reduced dims (not rows,
  // which the grouped loops take whole). The same holds for any reduction whose innermost dim is
  // such a run below a kept dim (MVN over (0, 2) of (N, C, 8) data).
  void spread_over_short_runs() {
    const TensorView& x = a_.input;
    const int64_t es = itemsize(x.dtype);
    int kd = -1;
    for (int d = 0; d < x.ndim; ++d)
      if (x.sizes[d] > 1 && (kd < 0 || std::llabs(x.strides[d]) < std::llabs(x.strides[kd]))) kd = d;
    // (Batch norm's statistics share the parameters' layout: its short runs take const_rows.)
    if (kd < 0 || !((a_.reduced >> kd) & 1u) || x.sizes[kd] * es > kLaneFoldRunBytes || shared_layout()) return;
    bool other_reduced = false;
    int gd = -1;
    for (int d = 0; d < x.ndim; ++d) {
      if (d == kd || x.sizes[d] == 1) continue;
      if ((a_.reduced >> d) & 1u) other_reduced = true;
      else if (x.strides[d] == x.sizes[kd] * es) gd = d;
    }
    if (!other_reduced || gd < 0 || gd > kd || stats_->strides()[gd] == 0) return;
    for (int d = kd + 1; d < x.ndim; ++d)  // (spread_inner renumbers the elements of dims before kd)
      if (stats_->strides()[d] != 0) return;
    for (const TensorView* t : {&x, &a_.grad_output, a_.grad_input ? &*a_.grad_input : nullptr})
      if (t != nullptr && (t->strides[kd] != es || t->strides[gd] != x.sizes[kd] * es)) return;
    stats_->spread_inner(kd, kd + 1, x.sizes);
    lane_fold_ = x.sizes[kd];
  }

  // Each group's sums (group[i] and group[ns + i], lanes [g K, g K + K) after spread_over_short_runs)
  // added in lane order, from 0, and given to all its lanes: the groups of statistics elements r.
  void fold_lanes(double* group, int64_t ns, Slots r) const {
    const int64_t k = lane_fold_;
    for (int64_t half = 0; half < 2; ++half) {
      double* s = group + half * ns;
      for (int64_t g = r.lo - r.lo % k; g < r.hi; g += k) {
        double t = 0.0;
        for (int64_t j = 0; j < k; ++j) t += s[g + j];
        std::fill_n(s + g, k, t);
      }
    }
  }

  // Where the parameters vary along no dim the statistics do not (instance norm and, spread,
  // group norm of channels-last data: statistics per sample and channel, parameters per channel),
  // the two passes give each statistics element its own copy of its parameters: the layouts are
  // then shared (below), and the sums pass adds each element to two slots, not four. The
  // parameters' sums are then each its statistics elements', added in their order
  // (sums_per_param). Not where a statistics element has few input elements: the copies and their
  // sums would cost more than the slots save.
  bool spread_params_over_stats(int64_t total) {
    if (!want_group_ || shared_layout() || total < kMinSpreadElements * stats_->count()) return false;
    for (int d = 0; d < a_.input.ndim; ++d)
      if (params_->strides()[d] != 0 && stats_->strides()[d] == 0) return false;
    param_of_stat_ = params_->spread_like(*stats_, a_.input.ndim, a_.input.sizes);
    return true;
  }
  std::vector<double> sums_per_param(const double* sums) const {
    const int64_t ns = static_cast<int64_t>(param_of_stat_.size()), np = user_param_count_;
    std::vector<double> m(static_cast<size_t>(2 * np), 0.0);
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t i = 0; i < ns; ++i)
        m[static_cast<size_t>(k * np + param_of_stat_[static_cast<size_t>(i)])] += sums[k * ns + i];
    return m;
  }

  // The statistics and the parameters share one compact layout (batch norm: both per channel):
  // sum(g) and sum(g y) are then the scale times the parameters' sum(ga) and sum(ga y), and only
  // those are summed.
  bool shared_layout() const {
    if (stats_->count() != params_->count()) return false;
    for (int d = 0; d < a_.input.ndim; ++d)
      if (stats_->strides()[d] != params_->strides()[d]) return false;
    return true;
  }

  // The partials' parameter sums (2 np of them), added in the partials' order (as merge_group's,
  // the elements a partial does not hold have nothing to add).
  void merge_params(const Partial* p, size_t n, double* m) const {
    const int64_t np = params_->count();
    for (size_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < 2; ++k)
        for (int64_t i = 0; i < p[j].param_count; ++i)
          m[k * np + p[j].param_lo + i] += p[j].sums[2 * p[j].group_count + k * p[j].param_count + i];
  }
  // (in the calling thread's kept scratch, until the next call; one partial holding every
  // parameter element: its own sums, which write_param_sums and derive_group_sums add to +0 as the
  // merge does)
  const double* merged_params(const std::vector<Partial>& partials) {
    if (partials.size() == 1 && partials[0].param_lo == 0 && partials[0].param_count == params_->count())
      return partials[0].sums + 2 * partials[0].group_count;
    double* m = reinterpret_cast<double*>(merged_store_.reserve(static_cast<size_t>(2 * params_->count()) * sizeof(double)));
    std::fill_n(m, 2 * params_->count(), 0.0);
    merge_params(partials.data(), partials.size(), m);
    return m;
  }
  // The statistics' sums (two doubles an element) in the calling thread's kept scratch, zeroed
  // unless the caller sets every one (derive_group_sums of all the elements).
  double* kept_group_sums(bool zeroed = true) {
    const int64_t ns = stats_->count();
    double* g = reinterpret_cast<double*>(group_store_.reserve(static_cast<size_t>(2 * ns) * sizeof(double)));
    if (zeroed) std::fill_n(g, 2 * ns, 0.0);
    return g;
  }
  // The statistics' sums of elements [lo, lo + n) derived from the parameters' (derive:
  // shared_layout): sum_g[j] = scale sum(ga), sum_gy[j] = scale sum(ga y) of element lo + j;
  // param_sums: sum(ga y) of element lo on, their sum(ga) `pitch` after.
  void derive_group_sums(double* sum_g, double* sum_gy, const double* param_sums, int64_t pitch, int64_t lo,
                         int64_t n) const {
    load_as_double(compute_, params_->data(0) + lo * csize_, csize_, n, sum_gy);  // (the scale)
    for (int64_t j = 0; j < n; ++j) {
      const double scale = sum_gy[j];
      sum_g[j] = scale * (0.0 + param_sums[pitch + j]);  // (as merged from 0: never -0)
      sum_gy[j] = scale * (0.0 + param_sums[j]);
    }
  }
  // The partials' group sums (n of them, from p) into m's statistics elements of r, each its
  // statistics elements', added in the partials' order (the elements a partial does not hold
  // have nothing to add: their sums are +0, never -0).
  void merge_group(const Partial* p, size_t n, double* m, Slots r) const {
    const int64_t ns = stats_->count();
    for (size_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < 2; ++k)
        for (int64_t i = std::max(r.lo, p[j].group_lo); i < std::min(r.hi, p[j].group_lo + p[j].group_count); ++i)
          m[k * ns + i] += p[j].sums[k * p[j].group_count + i - p[j].group_lo];
  }

  // What the two passes sum: derive, the statistics' sums are the scale times the parameters'
  // (shared_layout: only those are summed); group, the statistics' own; params, the parameters'.
  struct SumTargets {
    bool derive, group, params;
  };
  SumTargets sum_targets() const {
    const bool derive = want_group_ && shared_layout();
    return {derive, want_group_ && !derive, want_params_ || derive};
  }

  // The partial sums of elements [b, e) of the nest: the slots they reach.
  Partial partial_for(const SumTargets& t, const LoopNest& nest, int64_t b, int64_t e) const {
    return partial(t.group, t.params, t.group ? reached(kStats, nest, b, e) : Slots{},
                   t.params ? reached(kParams, nest, b, e) : Slots{});
  }
  // Without statistics terms (batch norm's training=False) the write needs none of the sums: the
  // sums pass writes grad_input too (BackwardTask::sums_write), and x and dy are read once.
  bool write_in_sums(const SumTargets& t) const {
    return a_.grad_input && !a_.write_ga && !want_group_ && t.params;
  }
  // Partial p's sums of elements [begin, end) of the nest, flushed every flush_every elements.
  void sum_range(Partial& p, const SumTargets& t, const LoopNest& nest, int64_t begin, int64_t end,
                 int64_t flush_every) const {
    const BackwardSums s = sums_of(p, t.group, t.params);
    for (int64_t b = begin; b < end; b += flush_every) {
      const int64_t e = std::min(end, b + flush_every);
      kernels().backward_sums(task_, nest, b, e, s);
      flush_reached(p, t.group, t.params, nest, b, e);
    }
  }

  // A slab of the two passes: elements [begin, end) of a nest, the whole nest's or a block of it.
  struct Slab {
    LoopNest nest;
    int64_t begin, end;
  };

  // The two passes' slabs (none: the passes over the whole nest). From memory, or past the L2, the
  // second pass would read x and dy there again; a slab is summed, then written while they are in
  // the L2 (or, a sample of channels-last data too large for it, in the L3). The write needs the
  // slab's coefficients (want_group_; without, the sums pass writes: write_in_sums), so a slab
  // holds whole statistics elements: where the statistics vary along the nest's outer dims, a run
  // of their indices (group and instance norm of channels-last data: whole samples, from memory);
  // where they vary from a middle dim on (batch norm of NCHW data with small planes: the channels),
  // a block of that dim's indices with every index of the others. Its x and dy of about
  // kSlabBytes, all the slabs' partial sums within kMaxPartialBytes.
  std::vector<Slab> slabs_of(const LoopNest& nest, int64_t total, const SumTargets& t) const {
    if (!a_.grad_input || !want_group_) return {};
    const int64_t per_element = itemsize(a_.input.dtype) + itemsize(a_.grad_output.dtype);
    const int64_t most = std::max<int64_t>(1, kSlabBytes / per_element);
    std::vector<Slab> slabs;
    if (nest.strides[kStats][0] != 0) {
      int64_t unit = total;  // elements of one index of the outer dims the statistics vary along
      for (int d = 0; d < nest.ndim && nest.strides[kStats][d] != 0; ++d) unit /= nest.sizes[d];
      if (!task_.from_memory || unit >= total || unit * per_element > stream_threshold_bytes() / 2) return {};
      const int64_t slab = unit * std::max<int64_t>(1, most / unit);
      for (int64_t b = 0; b < total; b += slab) slabs.push_back({nest, b, std::min(total, b + slab)});
    } else {
      int sd = 0;
      while (sd < nest.ndim && nest.strides[kStats][sd] == 0) ++sd;
      if (sd >= nest.ndim - 1) return {};  // (none varies, or only the runs' dim)
      const int64_t unit = total / nest.sizes[sd];  // elements of one index of dim sd
      if (unit * per_element > stream_threshold_bytes() / 2) return {};
      int64_t block = std::max<int64_t>(1, most / unit);
      if (block >= kFlushRuns) block -= block % kFlushRuns;  // (the sums' flushes a whole row of slots each)
      if (block >= nest.sizes[sd]) return {};
      for (int64_t i = 0; i < nest.sizes[sd]; i += block) {
        Slab s{nest, 0, 0};
        s.nest.sizes[sd] = std::min(block, nest.sizes[sd] - i);
        for (int op = 0; op < kNumOperands; ++op)
          if (s.nest.data[op] != nullptr) s.nest.data[op] += i * nest.strides[op][sd];
        s.end = unit * s.nest.sizes[sd];
        slabs.push_back(s);
      }
    }
    int64_t bytes = 0, prev_hi = 0;
    for (const Slab& s : slabs) {
      const Slots r = reached(kStats, s.nest, s.begin, s.end);
      const Slots q = t.params ? reached(kParams, s.nest, s.begin, s.end) : Slots{};
      // (statistics shared between slabs, or a group's lanes split: not this layout)
      if (r.lo < prev_hi || r.lo % lane_fold_ != 0 || r.hi % lane_fold_ != 0) return {};
      prev_hi = r.hi;
      bytes += ((t.group ? 2 * (r.hi - r.lo) : 0) + 2 * (q.hi - q.lo)) * (8 + csize_);
      if (bytes > kMaxPartialBytes) return {};
    }
    return slabs;
  }

  // The sums pass's chunks, each with partial sums of its own: fixed by the shape, never by the
  // thread count, so that the sums are the same bits on any. Ranges of the nest's elements; but
  // where the statistics or parameters vary along the runs (the channels of batch norm's rows) and
  // the chunks' partials would outweigh an eighth of their data (each chunk holds every channel's
  // sums, to clear, flush and merge), blocks of the runs' columns instead, each over every row,
  // holding its own channels' sums alone. Not where the sums pass streams grad_input out: a block's
  // pieces of each row suit non-temporal stores worse than whole rows.
  std::vector<Slab> sum_chunks(const LoopNest& nest, int64_t total, const SumTargets& t) const {
    const int64_t bytes = ((t.group ? 2 * stats_->count() : 0) + (t.params ? 2 * params_->count() : 0)) * (8 + csize_);
    // (A chunk holds only the slots it reaches; the bound is for the chunks that reach them all.)
    const int64_t chunks = blocks_for(total, bytes, kMinChunkElements);
    const int in = nest.ndim - 1;
    const bool varying = nest.strides[kStats][in] != 0 || nest.strides[kParams][in] != 0;
    const int64_t n = nest.sizes[in], es = itemsize(a_.input.dtype), line = std::max<int64_t>(1, kLineBytes / es);
    const int64_t data_bytes = total * (es + itemsize(a_.grad_output.dtype));
    std::vector<Slab> out;
    const bool streams_out = write_in_sums(t) && task_.stream_stores;
    if (varying && chunks > 1 && n >= 2 * line && chunks * bytes > data_bytes / 8 && !streams_out) {
      const int64_t blocks = std::min(chunks, n / line);
      const int64_t cols = (n + blocks - 1) / blocks, per = (cols + line - 1) / line * line;
      for (int64_t c0 = 0; c0 < n; c0 += per) {
        Slab c{nest, 0, total / n * std::min(per, n - c0)};
        c.nest.sizes[in] = std::min(per, n - c0);
        for (int op = 0; op < kNumOperands; ++op) c.nest.data[op] += c0 * nest.strides[op][in];
        out.push_back(c);
      }
      return out;
    }
    const int64_t per = (total + chunks - 1) / chunks;
    for (int64_t c = 0; c < chunks; ++c) out.push_back({nest, c * per, std::min(total, (c + 1) * per)});
    return out;
  }

  // The two passes slab by slab, each slab by one thread: its sums, its statistics' coefficients,
  // its grad_input. The parameters' sums are each slab's, added in the slabs' order. derive: the
  // group sums are the scale times the parameters' (shared_layout), which the slab holds whole.
  void run_slabs(const std::vector<Slab>& slabs, int64_t total, const SumTargets& t, int64_t flush_every) {
    const KernelTable& k = kernels();
    const int64_t ns = stats_->count();
    double* const group = kept_group_sums();
    std::vector<Partial> partials;
    for (const Slab& s : slabs) partials.push_back(partial_for(t, s.nest, s.begin, s.end));
    allocate_partials(partials);
    for_parts(static_cast<int64_t>(slabs.size()), total, [&](int i) {
      const Slab& s = slabs[static_cast<size_t>(i)];
      Partial& mine = partials[static_cast<size_t>(i)];
      sum_range(mine, t, s.nest, s.begin, s.end, flush_every);
      const Slots r = reached(kStats, s.nest, s.begin, s.end);
      if (t.derive) {
        SIMDNORM_CHECK(mine.param_lo <= r.lo && r.hi <= mine.param_lo + mine.param_count);
        derive_group_sums(group + r.lo, group + ns + r.lo, mine.sums + (r.lo - mine.param_lo), mine.param_count, r.lo,
                          r.hi - r.lo);
      } else {
        merge_group(&mine, 1, group, r);
      }
      if (lane_fold_ > 1) fold_lanes(group, ns, r);
      k.backward_coefficients(task_, stats_->data(0) + r.lo * csize_, group + r.lo, group + ns + r.lo, r.hi - r.lo);
      k.backward_apply(task_, s.nest, s.begin, s.end);
      if (task_.stream_stores) fence_streaming_stores();
    });
    write_param_sums(t.params ? merged_params(partials) : nullptr);
  }

  // Rows of lanes, each lane with statistics and parameter elements of its own (batch norm of (N, C)
  // data, or of channels-last data of a few pixels), a few rows: the two passes by chunks of lanes,
  // each chunk summed, its coefficients set, its grad_input written while its rows are in the L2,
  // and its parameters' sums written out, each of its per-lane arrays a few KB. Over all the lanes
  // at once, the passes between the sums and the write (zeroing, flushing, merging, deriving, the
  // coefficients, the parameters' sums) each went through arrays of every lane, which past the L2
  // cost more than the rows themselves. Only a few rows: past them those passes are a small part
  // of the call, and a chunk's pieces of rows from memory came in no faster than whole rows; not
  // where the sums pass streams grad_input out (as sum_chunks).
  bool column_chunks(const LoopNest& nest, const SumTargets& t) const {
    const int64_t cs = csize_;
    const bool sums_write = write_in_sums(t);
    if (nest.ndim != 2 || nest.sizes[0] > kMaxChunkRows || lane_fold_ != 1 || !param_of_stat_.empty() ||
        !param_index_.empty() || !(want_group_ || sums_write) || (sums_write && task_.stream_stores))
      return false;
    if (nest.strides[kStats][0] != 0 || nest.strides[kParams][0] != 0) return false;
    return (!t.group || nest.strides[kStats][1] == cs) && (!t.params || nest.strides[kParams][1] == cs);
  }
  // The lanes a chunk holds: about kChunkElements elements, its rows of x and dy within kSlabBytes.
  int64_t chunk_lanes(const LoopNest& nest) const {
    const int64_t rows = nest.sizes[0];
    const int64_t per_element = itemsize(a_.input.dtype) + itemsize(a_.grad_output.dtype);
    const int64_t fit = kSlabBytes / (rows * per_element) / kChunkLaneStep * kChunkLaneStep;
    const int64_t want = (kChunkElements / rows + kChunkLaneStep - 1) / kChunkLaneStep * kChunkLaneStep;
    const int64_t most = std::max(kChunkLaneStep, std::min(fit, std::clamp(want, kMinChunkLanes, kMaxChunkLanes)));
    // (the lanes shared out evenly: no last chunk of a few lanes)
    const int64_t lanes = nest.sizes[1], chunks = (lanes + most - 1) / most;
    return ((lanes + chunks - 1) / chunks + kChunkLaneStep - 1) / kChunkLaneStep * kChunkLaneStep;
  }
  // Whether a chunk's two passes are one sweep of the kernels' (KernelTable::backward_columns):
  // derived group sums (or none: no statistics terms, the sums pass writing), grad_input written
  // plainly, every operand contiguous along the lanes and constant down the rows, an activation
  // whose derivative runs inline, no fused_add. Past 8 rows, only rows spread over the L1's sets:
  // the sweep reads a line of every row at each step, and more rows a multiple of 4 KB apart
  // ((32, 1024) float32) evicted each other, slower than the chunk's two passes.
  bool columns_sweep(const LoopNest& nest, const SumTargets& t) const {
    const int64_t es = itemsize(a_.input.dtype), rows = nest.sizes[0];
    auto spread = [&](int64_t stride) {
      constexpr int64_t kSets = 4096 / kLineBytes;  // (the sets 4 KB of lines cover)
      int count[kSets] = {};
      for (int64_t r = 0; r < rows; ++r)
        if (++count[((r * stride / kLineBytes) % kSets + kSets) % kSets] > 2) return false;
      return true;
    };
    const bool sums = (t.derive && want_group_) || (write_in_sums(t) && shared_layout());  // (the latter: no terms)
    return sums && !task_.stream_stores && !task_.has_fused_add && !out_of_line(task_.act) &&
           rows <= kFlushRuns && nest.strides[kX][1] == es && nest.strides[kGradOut][1] == es &&
           nest.strides[kGradIn][1] == es && nest.strides[kStats][1] == csize_ && nest.strides[kParams][1] == csize_ &&
           (rows <= kSweepAnyRows || (spread(nest.strides[kX][0]) && spread(nest.strides[kGradOut][0])));
  }
  void run_column_chunks(const LoopNest& nest, int64_t total, const SumTargets& t) {
    const KernelTable& k = kernels();
    const int64_t rows = nest.sizes[0], lanes = nest.sizes[1], per = chunk_lanes(nest);
    const bool sweep = columns_sweep(nest, t);
    for_parts((lanes + per - 1) / per, total, [&](int i) {
      const int64_t c0 = i * per, n = std::min(per, lanes - c0);
      Slab c{nest, 0, rows * n};
      c.nest.sizes[1] = n;
      for (int op = 0; op < kNumOperands; ++op)
        if (c.nest.data[op] != nullptr) c.nest.data[op] += c0 * nest.strides[op][1];
      if (sweep) {  // (the parameters' sums, whole vectors of them: kMaxVectorLanes past the lanes)
        const int64_t pitch = n + kMaxVectorLanes;
        KeptScratch<kColumnChunkSlot> scratch;
        double* const sums = reinterpret_cast<double*>(scratch.reserve(static_cast<size_t>(2 * pitch * 8)));
        k.backward_columns(task_, c.nest, sums, pitch);
        if (want_params_) write_param_range(sums, pitch, c0, n);
        return;
      }
      // The chunk's partial sums (zeroed), then its statistics' sums (sum(g) | sum(g y), 2 n).
      Partial p = partial_for(t, c.nest, 0, c.end);
      const int64_t bytes = p.width() * (8 + csize_);
      KeptScratch<kColumnChunkSlot> scratch;
      char* const at = scratch.reserve(static_cast<size_t>(bytes + 2 * n * 8));
      std::memset(at, 0, static_cast<size_t>(bytes));
      p.sums = reinterpret_cast<double*>(at), p.vary = at + p.width() * 8;
      double* const group = reinterpret_cast<double*>(at + bytes);
      sum_range(p, t, c.nest, 0, c.end, kFlushRuns * n);
      if (want_group_) {
        if (t.derive) {
          derive_group_sums(group, group + n, p.sums, p.param_count, c0, n);
        } else {
          for (int64_t j = 0; j < 2 * n; ++j) group[j] = 0.0 + p.sums[j];  // (as merged from 0)
        }
        k.backward_coefficients(task_, stats_->data(0) + c0 * csize_, group, group + n, n);
        k.backward_apply(task_, c.nest, 0, c.end);
      }
      if (task_.stream_stores) fence_streaming_stores();
      if (want_params_) write_param_range(p.sums + 2 * p.group_count, p.param_count, c0, n);
    });
  }

  void run_two_pass(const LoopNest& nest, int64_t total) {
    const KernelTable& k = kernels();
    const int64_t ns = stats_->count(), np = params_->count();
    const SumTargets t = sum_targets();
    const bool derive = t.derive, group_sums = t.group, param_sums = t.params;
    // Each chunk's varying sums flushed into its doubles every kFlushRuns runs of the nest; where
    // no target varies along the runs, the slots stay empty and are flushed once.
    const int in = nest.ndim - 1;
    const bool varying = nest.strides[kStats][in] != 0 || nest.strides[kParams][in] != 0;
    const int64_t flush_every = varying ? kFlushRuns * nest.sizes[in] : total;
    task_.sums_write = write_in_sums(t);
    if (column_chunks(nest, t)) return run_column_chunks(nest, total, t);
    const std::vector<Slab> slabs = slabs_of(nest, total, t);  // (none where the sums pass writes)
    if (!slabs.empty()) return run_slabs(slabs, total, t, flush_every);
    if (group_sums || param_sums) {
      const std::vector<Slab> chunks = sum_chunks(nest, total, t);
      std::vector<Partial> partials;
      for (const Slab& c : chunks) partials.push_back(partial_for(t, c.nest, c.begin, c.end));
      allocate_partials(partials);
      for_parts(static_cast<int64_t>(chunks.size()), total, [&](int i) {
        const Slab& c = chunks[static_cast<size_t>(i)];
        sum_range(partials[static_cast<size_t>(i)], t, c.nest, c.begin, c.end,
                  varying ? kFlushRuns * c.nest.sizes[in] : total);
        if (task_.sums_write && task_.stream_stores) fence_streaming_stores();
      });
      const double* const params = param_sums ? merged_params(partials) : nullptr;
      if (want_group_) {
        double* const group = kept_group_sums(!derive);
        if (derive) {
          derive_group_sums(group, group + ns, params, np, 0, ns);
        } else {
          merge_group(partials.data(), partials.size(), group, {0, ns});
        }
        if (lane_fold_ > 1) fold_lanes(group, ns, {0, ns});
        k.backward_coefficients(task_, stats_->data(0), group, group + ns, ns);
      }
      write_param_sums(params);
    } else {
      write_param_sums(nullptr);
    }
    if (!a_.grad_input || task_.sums_write) return;
    for_element_ranges(total, [&](int64_t begin, int64_t end) {
      k.backward_apply(task_, nest, begin, end);
      if (task_.stream_stores) fence_streaming_stores();
    });
  }

  const MvnBackwardArgs& a_;
  const DType compute_;
  const int64_t csize_;
  std::unique_ptr<FoldedParams> stats_, params_;
  BackwardTask task_;
  bool want_params_ = false, want_group_ = false;
  int64_t n_ = 1;
  bool plan_only_ = false;  // (plans_saved_ga)
  int64_t lane_fold_ = 1;  // lanes whose group sums are one group's (spread_over_short_runs)
  int64_t user_param_count_ = 1;  // the caller's parameter elements (params_ may be spread)
  std::vector<int64_t> param_of_stat_;  // spread_params_over_stats: each element's parameter element
  std::vector<int64_t> param_index_;  // each parameter element's row-major index, where not its own
  KeptScratch<kPartialsSlot, kKeptStatisticsBytes> partial_store_;  // (allocate_partials)
  KeptScratch<kMergedSlot, kKeptStatisticsBytes> merged_store_;  // (merged_params)
  KeptScratch<kGroupSumsSlot, kKeptStatisticsBytes> group_store_;  // (kept_group_sums)
};

// The bytes [lo, hi) a view may touch.
struct ByteSpan {
  uintptr_t lo, hi;
};
ByteSpan span_of(const TensorView& v) {
  uintptr_t lo = reinterpret_cast<uintptr_t>(v.data), hi = lo;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.sizes[d] == 0) return {0, 0};
    const int64_t reach = (v.sizes[d] - 1) * v.strides[d];
    if (reach < 0) lo -= static_cast<uintptr_t>(-reach);
    else hi += static_cast<uintptr_t>(reach);
  }
  return {lo, hi + static_cast<uintptr_t>(itemsize(v.dtype))};
}
bool apart(const TensorView& a, const std::optional<TensorView>& b) {
  if (!b) return true;
  const ByteSpan x = span_of(a), y = span_of(*b);
  return x.hi <= y.lo || y.hi <= x.lo || x.lo == x.hi || y.lo == y.hi;
}
bool same_view(const TensorView& a, const TensorView& b) {
  bool same = a.data == b.data && a.ndim == b.ndim;
  for (int d = 0; same && d < a.ndim; ++d) same = a.sizes[d] == b.sizes[d] && (a.sizes[d] < 2 || a.strides[d] == b.strides[d]);
  return same;
}

// Whether the backward may write ga = dy * act'(pre) into grad_input first, then run without the
// activation on it: where the unit calls the derivative out of line, and grad_input can hold ga
// (the compute type: float32 and float64 data) apart from everything else the backward reads (or
// in place of grad_output, which the first pass reads element by element before it writes there).
// (Grouped plans save each group's ga instead: mvn_backward.)
bool derivative_first(const MvnBackwardArgs& a) {
  if (!a.grad_input || a.write_ga || !out_of_line(a.activation) || compute_type(a.input.dtype) != a.input.dtype ||
      a.grad_input->dtype != a.input.dtype)
    return false;
  const TensorView& dx = *a.grad_input;
  return apart(dx, a.input) && apart(dx, a.mean) && apart(dx, a.inv_std) && apart(dx, a.scale) &&
         apart(dx, a.bias) && apart(dx, a.fused_add) && apart(dx, a.param_sums[0]) && apart(dx, a.param_sums[1]) &&
         (apart(dx, a.grad_output) || same_view(dx, a.grad_output));
}

}  // namespace

void mvn_backward(const MvnBackwardArgs& args, std::string* explain) {
  // The derivative once an element: grouped, each group's ga saved for its apply (from the L2);
  // else written into grad_input first, a pass of its own.
  if (!derivative_first(args) || BackwardRunner(args).plans_saved_ga()) return BackwardRunner(args).run(explain);
  MvnBackwardArgs ga = args;
  ga.write_ga = true;
  ga.param_sums[0].reset(), ga.param_sums[1].reset();
  MvnBackwardArgs rest = args;
  rest.grad_output = *args.grad_input;
  rest.activation = Activation{};
  rest.fused_add.reset();
  if (explain != nullptr) {
    BackwardRunner(rest).run(explain);
    *explain = "derivative-first " + *explain;
    return;
  }
  BackwardRunner(ga).run(nullptr);
  BackwardRunner(rest).run(nullptr);
}

}  // namespace simdnorm
