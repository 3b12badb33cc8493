// The column strategy of the MVN driver (ops/mvn.cpp has the overview): the innermost kept dim is
// contiguous, and statistics are accumulated per lane while the rows (the reduced dims) are walked.
// Part of ops/mvn.cpp's translation unit (ops/mvn_runner.h).
#pragma once
#include "ops/mvn_runner.h"

namespace simdnorm {
namespace {

// When the lanes at a kept index stay in cache together (!whole_row_tasks()), they are one task, the
// tasks split between threads: each task's statistics, then its normalization while its block is
// cached. Else tasks of whole rows, summed in chunks (run_columns_chunked).
void MvnRunner::run_columns() {
  if (lane_group_tasks()) return run_lane_group_tasks();
  if (fused_columns_take()) return run_fused_columns();
  if (whole_row_tasks()) return run_columns_chunked();
  for_item_ranges(plan_.groups, plan_.groups * plan_.lane_count * plan_.group_size, [&](int64_t k0, int64_t k1) {
    LaneScratch lane(plan_.lane_count);
    for (int64_t ko = k0; ko < k1; ++ko) column_range(ko, 0, plan_.lane_count, lane);
  });
}

// Lanes a few rows deep (kernel_table.h: FusedColumnsArgs; batch norm training of (N, C) data):
// tasks of kFusedColumnLanes lanes at a kept index, split between threads, each finished and
// normalized by the fused kernel. Where it leaves a task's lanes from one the first pass does not
// settle, column_range's passes take them. Each lane's results are its own: the same bits for any
// split.
void MvnRunner::run_fused_columns() {
  const int64_t blocks = (plan_.lane_count + kFusedColumnLanes - 1) / kFusedColumnLanes;
  const int64_t work = plan_.groups * plan_.lane_count * plan_.group_size;
  for_item_ranges(plan_.groups * blocks, work, [&](int64_t t0, int64_t t1) {
    std::optional<LaneScratch> lane;  // (only for lanes the kernel leaves)
    for (int64_t t = t0; t < t1; ++t) {
      const ColumnTask c = column_task_at(t, blocks, kFusedColumnLanes);
      const NormalizeTask sub = column_normalize_task(c.ko, c.c0, c.nb);
      FusedColumnsArgs f{a_.normalize_mean, inv_group_size_, inv_std_rule_, underflow_, {}};
      const int64_t lanes_before = c.c0 * csize_;
      if (a_.mean_out && a_.normalize_mean)
        f.stats_out[0] = user_mean_ + user_offset(user_mean_strides_, c.ko) + lanes_before;
      if (a_.inv_std_out && a_.normalize_variance) {
        f.stats_out[1] = user_inv_std_ + user_offset(user_inv_std_strides_, c.ko) + lanes_before;
        if (a_.var_out) f.stats_out[2] = f.stats_out[1] + var_offset();
      }
      const int64_t done = kernels().normalize_columns_fused(sub, f);
      if (done == c.nb) continue;
      if (!lane) lane.emplace(kFusedColumnLanes);
      column_range(c.ko, c.c0 + done, c.nb - done, *lane);
    }
  });
}

// Whether run_fused_columns takes the call: a few rows (one reduced dim), lanes one by one, the
// input, output and statistics contiguous along them, scale and bias constant down the rows and
// both contiguous or both constant along the lanes (as batch norm's, which share a shape); and
// not where tasks of whole rows would run: there the kernel's short runs of rows far apart ran
// far slower than the passes with some placements of the arrays (docs/BENCHMARKS.md).
bool MvnRunner::fused_columns_take() const {
  const LoopNest& n = task_.loop;
  const int lanes_dim = plan_.nest.ndim - 1, rows_dim = lanes_dim - 1;
  if (a_.statistics_only || plan_.lane_group != 1 || plan_.split_lanes || plan_.reduced_dims != 1 ||
      plan_.group_size > kFusedColumnRows || task_.stream_stores || n.ndim != plan_.nest.ndim ||
      whole_row_tasks())
    return false;
  if ((a_.mean_out && a_.normalize_mean && user_mean_strides_[lanes_dim] != csize_) ||
      (a_.inv_std_out && a_.normalize_variance && user_inv_std_strides_[lanes_dim] != csize_))
    return false;
  const int64_t ts = itemsize(a_.input.dtype), affine_step = n.strides[kBias][lanes_dim];
  return n.strides[kIn][lanes_dim] == ts && n.strides[kOut][lanes_dim] == ts && n.strides[kScale][rows_dim] == 0 &&
         n.strides[kBias][rows_dim] == 0 && (affine_step == 0 || affine_step == csize_) &&
         (task_.scale_folded || n.strides[kScale][lanes_dim] == affine_step);
}

// Whole-row tasks (channels-last batch norm: one task of all the channels down 25088 rows): each
// task's rows in column_chunks() chunks, fixed by the shape, their sums taken over all threads and
// added in chunk order (so the same bits for any thread count); then each task's lanes finished,
// and one normalization pass over all threads.
void MvnRunner::run_columns_chunked() {
  const int64_t lanes_per_task = this->lanes_per_task();
  const int64_t blocks = (plan_.lane_count + lanes_per_task - 1) / lanes_per_task;
  const int64_t tasks = plan_.groups * blocks;
  const int64_t chunks = column_chunks(lanes_per_task), rows = plan_.group_size;
  const int64_t task_sums = chunks * 2 * lanes_per_task;  // a task's chunks: s1 then s2 of each
  KeptScratch<kChunkSlot> scratch;
  const Span<double> pivots{reinterpret_cast<double*>(scratch.reserve(
                                static_cast<size_t>(tasks * (lanes_per_task + task_sums)) * sizeof(double))),
                            tasks * lanes_per_task};
  const Span<double> sums{pivots.end(), tasks * task_sums};
  for (int64_t t = 0; t < tasks; ++t) {
    const ColumnTask c = column_task_at(t, blocks, lanes_per_task);
    load_pivots(c.ko, c.c0, c.nb, pivots.data() + t * lanes_per_task);
  }
  for_item_ranges(tasks * chunks, plan_.groups * plan_.lane_count * rows, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, k = i % chunks;
      const ColumnTask c = column_task_at(t, blocks, lanes_per_task);
      double* s1 = sums.data() + t * task_sums + k * 2 * lanes_per_task;
      column_sums(c.ko, c.c0, c.nb, pivots.data() + t * lanes_per_task, 1.0, k * rows / chunks,
                  (k + 1) * rows / chunks, s1, s1 + lanes_per_task);
    }
  });
  for_item_ranges(tasks, tasks * lanes_per_task * 64, [&](int64_t t0, int64_t t1) {
    LaneScratch lane(lanes_per_task);
    for (int64_t t = t0; t < t1; ++t) {
      const ColumnTask c = column_task_at(t, blocks, lanes_per_task);
      // The chunks' sums added in chunk order into the first chunk's, where the lanes read them,
      // as they read their pivots, in place.
      double* s1 = sums.data() + t * task_sums;
      for (int64_t k = 1; k < chunks; ++k) {
        const double* more = s1 + k * 2 * lanes_per_task;
        for (int64_t j = 0; j < c.nb; ++j) {
          s1[j] += more[j];
          s1[lanes_per_task + j] += more[lanes_per_task + j];
        }
      }
      lane.pivot = {pivots.data() + t * lanes_per_task, c.nb};
      lane.s1 = {s1, c.nb};
      lane.s2 = {s1 + lanes_per_task, c.nb};
      finish_lanes(c.ko, c.c0, c.nb, lane);
    }
  });
  if (!a_.statistics_only) run_normalize(task_);
}

// Tasks of whole lane groups (groups_per_lane_group_task() of them) at a kept index, split between
// threads, each task's groups summed one at a time (lane_group_sums) and finished as lanes are;
// then one normalize pass over all threads. (Each task normalized while it is cached was slower:
// its rows' short stretches of output, 2-8 KB each, are written as many streams.) A group's
// statistics are the same whatever the split.
void MvnRunner::run_lane_group_tasks() {
  const int64_t k = plan_.lane_group, per_task = groups_per_lane_group_task() * k;
  const int64_t blocks = (plan_.lane_count + per_task - 1) / per_task, tasks = plan_.groups * blocks;
  const int64_t lane_stride = plan_.nest.strides[kIn][plan_.nest.ndim - 1];
  for_item_ranges(tasks, plan_.groups * plan_.lane_count * plan_.group_size, [&](int64_t t0, int64_t t1) {
    LaneScratch lane(per_task);
    for (int64_t t = t0; t < t1; ++t) {
      const ColumnTask c = column_task_at(t, blocks, per_task);
      // The groups' pivots (each its first element) where finish_lanes reads them: inv_std's front.
      double* pivots = lane.inv_std.data();
      if (a_.normalize_mean)
        load_as_double(a_.input.dtype, group_first_element(c.ko) + c.c0 * lane_stride, k * lane_stride, c.nb / k,
                       pivots);
      else
        std::fill_n(pivots, c.nb / k, 0.0);
      lane_group_sums(c.ko, c.c0, c.nb / k, pivots, 1.0, lane.s1.data(), lane.s2.data());
      finish_lanes(c.ko, c.c0, c.nb, lane, /*groups_summed=*/true);
    }
  });
  if (!a_.statistics_only) run_normalize(task_);
}

// The sums of `groups` lane groups from lane c0 (a group's first) at kept index ko, around
// pivots[g] times the scale.
void MvnRunner::lane_group_sums(int64_t ko, int64_t c0, int64_t groups, const double* pivots, double scale,
                                double* s1, double* s2) const {
  const LoopNest& nest = plan_.nest;
  const int lanes_dim = nest.ndim - 1, rows_dim = plan_.kept_dims + plan_.reduced_dims - 1;
  std::fill_n(s1, groups, 0.0);
  std::fill_n(s2, groups, 0.0);
  ColMomentsArgs args{group_first_element(ko) + c0 * nest.strides[kIn][lanes_dim], a_.input.dtype, 0,
                      groups * plan_.lane_group, nest.strides[kIn][rows_dim], nest.strides[kIn][lanes_dim], pivots,
                      scale, s1, s2};
  args.lane_group = plan_.lane_group;
  // The rows: the reduced dims' product, walked as the innermost's runs of rows (a single dim
  // unless the reduced dims do not merge).
  const int64_t rows = nest.sizes[rows_dim];
  for (int64_t o = 0; o * rows < plan_.group_size; ++o) {
    const char* p = args.data;
    for_dim_indices(nest, plan_.kept_dims, rows_dim, o, [&](int d, int64_t i) { p += i * nest.strides[kIn][d]; });
    ColMomentsArgs run = args;
    run.data = p;
    run.rows = rows;
    kernels().col_moments(run);
  }
}

// Lanes [c0, c0 + nb) at kept index ko: their statistics, then their normalization while the
// block is cached.
void MvnRunner::column_range(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane) {
  load_pivots(ko, c0, nb, lane.pivot.data());
  column_sums(ko, c0, nb, lane.pivot.data(), 1.0, 0, plan_.group_size, lane.s1.data(), lane.s2.data());
  finish_lanes(ko, c0, nb, lane);
  if (a_.statistics_only) return;
  NormalizeTask sub = column_normalize_task(ko, c0, nb);
  kernels().normalize(sub, 0, plan_.group_size * nb);
}

// Every lane starts unscaled around its first element (first_pass()); with lane groups, around its
// group's first element (tasks start at a group's first lane), so that a group's sums are its
// lanes' sums added.
void MvnRunner::load_pivots(int64_t ko, int64_t c0, int64_t nb, double* pivot) const {
  const int64_t lane_stride = plan_.nest.strides[kIn][plan_.nest.ndim - 1], k = plan_.lane_group;
  const char* first = group_first_element(ko) + c0 * lane_stride;
  if (!a_.normalize_mean) return std::fill(pivot, pivot + nb, 0.0);
  load_as_double(a_.input.dtype, first, lane_stride * k, nb / k, pivot);
  for (int64_t g = nb / k - 1; k > 1 && g >= 0; --g) std::fill_n(pivot + g * k, k, pivot[g]);  // (g * k >= g)
}

// The lanes' statistics from their sums (lane.s1, lane.s2 around lane.pivot): the internal shift
// and mul, and the user's statistics.
// A task's lanes are finished together by the lane kernels (kernels/lane_stats.h: judge()'s
// common case, finite sums and the pivot close enough to the mean, for every lane; then the square
// roots and divisions), vectorized: one lane at a time (judge, inv_std and the stores behind
// branches) they would cost lanes of few rows as much as their sums. Lanes that fail the common
// case go through judge() and are summed again.
void MvnRunner::finish_lanes(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane, bool groups_summed) {
  const int lanes_dim = plan_.nest.ndim - 1;
  double *pivot = lane.pivot.data(), *s1 = lane.s1.data(), *s2 = lane.s2.data(), *mean = lane.mean.data(),
         *var = lane.var.data(), *istd = lane.inv_std.data();
  unsigned char* slow = lane.slow.data();
  const KernelTable& table = kernels();
  std::vector<ScaledLane> scaled;  // lanes whose var is in scaled units (GroupResult): rarely any
  // With lane groups, each group's sums are its lanes' added: the groups are judged, at the front
  // of the arrays (the pivots in inv_std's, until it takes the 1/std), as lanes are.
  const int64_t k = plan_.lane_group, judged = nb / k;
  if (k > 1 && !groups_summed) add_lane_groups(nb, k, lane);
  if (table.lane_stats(LaneStatsArgs{judged, inv_group_size_, a_.normalize_mean, underflow_, k > 1 ? istd : pivot, s1,
                                     s2, mean, var, slow}) > 0)
    judge_slow_lanes(ko, c0, nb, lane, scaled, groups_summed);
  for (int64_t g = judged - 1; k > 1 && g >= 0; --g) {  // each group's statistics to its first lane (g * k >= g)
    mean[g * k] = mean[g];
    var[g * k] = var[g];
  }
  table.inv_std_lanes(var, istd, nb, k, inv_std_rule_);
  for (const ScaledLane& l : scaled) istd[l.c] = inv_std_scaled(var[l.c], l.scale, inv_std_rule_);
  // The internal shift and mul, each lane its group's (k > 1) or its own (nothing normalizes with
  // statistics_only).
  const int64_t base = ko * plan_.lane_count + c0, lanes = plan_.split_lanes ? 1 : k;
  if (!a_.statistics_only && compute_ == DType::f64)
    spread_lanes(mean, istd, nb, k, lanes, reinterpret_cast<double*>(shift_) + base, reinterpret_cast<double*>(mul_) + base);
  else if (!a_.statistics_only)
    spread_lanes(mean, istd, nb, k, lanes, reinterpret_cast<float*>(shift_) + base, reinterpret_cast<float*>(mul_) + base);
  // The user's statistics step per group (group c0 / k + g at lane g k).
  const int64_t first = c0 / k;
  if (a_.mean_out && a_.normalize_mean) {
    const int64_t step = user_mean_strides_[lanes_dim];
    char* um = user_mean_ + user_offset(user_mean_strides_, ko) + first * step;
    store_user_lanes(um, step, mean, judged, k);
  }
  if (a_.inv_std_out && a_.normalize_variance) {
    const int64_t step = user_inv_std_strides_[lanes_dim];
    char* ui = user_inv_std_ + user_offset(user_inv_std_strides_, ko) + first * step;
    store_user_lanes(ui, step, istd, judged, k);
    if (a_.var_out && scaled.empty()) {
      store_user_lanes(ui + var_offset(), step, var, judged, k);
    } else if (a_.var_out) {
      for (int64_t g = 0; g < judged; ++g) {
        double v = var[g * k];
        for (const ScaledLane& l : scaled)
          if (l.c == g * k) v /= l.scale * l.scale;
        store_user(ui + g * step + var_offset(), v);
      }
    }
  }
}

// A nest of [reduced..., nb lanes] (split: [reduced..., nb / lane_group, lane_group]) at kept index
// ko, lane c0 (a group's first lane).
NormalizeTask MvnRunner::column_normalize_task(int64_t ko, int64_t c0, int64_t nb) const {
  const LoopNest& nest = task_.loop;
  const int lane_dims = plan_.split_lanes ? 2 : 1, first_lane_dim = nest.ndim - lane_dims;
  const int64_t outer = plan_.split_lanes ? plan_.lane_group : 1;  // lanes a step of the first lane dim
  NormalizeTask sub = task_;
  LoopNest& sn = sub.loop;
  sn.ndim = plan_.reduced_dims + lane_dims;
  for (int op = 0; op < kNumOperands; ++op) {
    char* p = nest.data[op];
    for_dim_indices(nest, 0, plan_.kept_dims, ko, [&](int d, int64_t i) { p += i * nest.strides[op][d]; });
    sn.data[op] = p + c0 / outer * nest.strides[op][first_lane_dim];
    for (int d = 0; d < sn.ndim; ++d) sn.strides[op][d] = nest.strides[op][plan_.kept_dims + d];
  }
  for (int d = 0; d < sn.ndim; ++d) sn.sizes[d] = nest.sizes[plan_.kept_dims + d];
  sn.sizes[plan_.reduced_dims] = nb / outer;
  plan_inner_loop(sub);
  return sub;
}

// Accumulates lanes [c0, c0 + nb) of kept index `ko` down rows [f0, f1) of the reduced dims
// (flat: the innermost reduced dim is the kernel's rows).
void MvnRunner::column_sums(int64_t ko, int64_t c0, int64_t nb, const double* pivots, double scale, int64_t f0,
                            int64_t f1, double* s1, double* s2) const {
  const LoopNest& nest = plan_.nest;
  const int lanes_dim = nest.ndim - 1, r0 = plan_.kept_dims, rlast = plan_.kept_dims + plan_.reduced_dims - 1;
  const char* base = group_first_element(ko) + c0 * nest.strides[kIn][lanes_dim];
  std::fill(s1, s1 + nb, 0.0);
  std::fill(s2, s2 + nb, 0.0);
  const KernelTable& k = kernels();
  // With nothing kept cached for a normalize pass (statistics only, or tasks of whole rows), the
  // kernel's blocks of lanes each sweep the rows, so the rows go in blocks that stay in the L2 for
  // all of them, the first prefetching whole rows (each block of lanes sweeping all the rows, a run
  // of each row at a time from memory: 1.7x slower on (16384, 1024) float32). The blocks' sums add up
  // in order. Not lanes kFusedColumnRows deep or less: the kernel sweeps those rows once, a few
  // lines of each a step, and their sums in one sweep are the fused columns kernel's, so that a
  // lane's statistics do not depend on the output's layout or on statistics_only.
  const bool blocked = (a_.statistics_only || whole_row_tasks()) && plan_.group_size > kFusedColumnRows;
  const int64_t rows = nest.sizes[rlast], row_bytes = nb * itemsize(a_.input.dtype);
  const int64_t block = blocked ? std::max<int64_t>(1, kColumnCachedBytes / 2 / row_bytes) : rows;
  const int64_t row_stride = nest.strides[kIn][rlast];
  for (int64_t o = f0 / rows; o * rows < f1; ++o) {
    const char* p = base;
    for_dim_indices(nest, r0, rlast, o, [&](int d, int64_t i) { p += i * nest.strides[kIn][d]; });
    const int64_t end = std::min(rows, f1 - o * rows);
    for (int64_t r = std::max<int64_t>(0, f0 - o * rows); r < end; r += block) {
      ColMomentsArgs args{p + r * row_stride, a_.input.dtype, std::min(block, end - r), nb, row_stride,
                          nest.strides[kIn][lanes_dim], pivots, scale, s1, s2, blocked};
      k.col_moments(args);
    }
  }
}

// Group g's sums (lanes [g k, g k + k), added in order) in s1[g] and s2[g], its pivot in inv_std[g].
// Four groups at a time, their additions interleaved: one group's are a chain of dependent adds.
void MvnRunner::add_lane_groups(int64_t nb, int64_t k, LaneScratch& lane) {
  double *s1 = lane.s1.data(), *s2 = lane.s2.data();
  constexpr int kAtOnce = 4;
  const int64_t groups = nb / k;
  for (int64_t g0 = 0; g0 < groups; g0 += kAtOnce) {  // (reads lanes from g0 k on: past every slot written)
    const int n = static_cast<int>(std::min<int64_t>(kAtOnce, groups - g0));
    double t1[kAtOnce] = {}, t2[kAtOnce] = {};
    for (int64_t j = 0; j < k; ++j)
      for (int i = 0; i < kAtOnce; ++i)
        if (i < n) t1[i] += s1[(g0 + i) * k + j], t2[i] += s2[(g0 + i) * k + j];
    for (int i = 0; i < n; ++i) {
      s1[g0 + i] = t1[i];
      s2[g0 + i] = t2[i];
      lane.inv_std[g0 + i] = lane.pivot[(g0 + i) * k];
    }
  }
}

// The lanes (with lane groups, the groups, at the front of the arrays) marked slow: judged one by
// one, summed again (the kernel takes one scale per call, so lanes needing another scale get a pass
// of their own: applied to ordinary lanes, the scale down would underflow their squares), at most
// three passes of each scale (kMaxPassRounds). Their mean and var replace the first pass's; a lane
// still unsettled after that gets NaN. Lanes whose var comes in scaled units are added to `scaled`,
// in order.
void MvnRunner::judge_slow_lanes(int64_t ko, int64_t c0, int64_t nb, LaneScratch& lane,
                                 std::vector<ScaledLane>& scaled, bool groups_summed) {
  struct Slow {
    int64_t c;
    Pass pass;
    bool done;
    double result_scale;
  };
  const int64_t k = plan_.lane_group;
  std::vector<Slow> lanes;
  for (int64_t c = 0; c < nb / k; ++c) {
    if (!lane.slow[c]) continue;
    Slow l{c, Pass{k > 1 ? lane.inv_std[c] : lane.pivot[c], 1.0, false}, false, 1.0};  // (finish_lanes' pivots)
    GroupResult r{NAN, NAN};
    l.done = judge(Sums{lane.s1[c], lane.s2[c]}, l.pass, r);
    lane.mean[c] = r.mean;
    lane.var[c] = r.var;
    l.result_scale = r.scale;
    lanes.push_back(l);
  }
  for (int round = 1; round < kMaxPassRounds; ++round) {  // (round 0: column_range's first pass)
    for (const double scale : {1.0, kDoubleScaling.down, kDoubleScaling.up}) {
      bool any = false;
      for (Slow& l : lanes) {
        const bool take = !l.done && l.pass.scale == scale;
        if (take && !groups_summed) std::fill_n(lane.pivot.data() + l.c * k, k, l.pass.pivot);  // others' sums are dropped
        any |= take;
      }
      if (!any) continue;
      if (!groups_summed)
        column_sums(ko, c0, nb, lane.pivot.data(), scale, 0, plan_.group_size, lane.s1.data(), lane.s2.data());
      for (Slow& l : lanes) {
        if (l.done || l.pass.scale != scale) continue;
        Sums sums;
        if (groups_summed) lane_group_sums(ko, c0 + l.c * k, 1, &l.pass.pivot, scale, &sums.s1, &sums.s2);
        else
          for (int64_t j = l.c * k; j < l.c * k + k; ++j) sums.s1 += lane.s1[j], sums.s2 += lane.s2[j];
        GroupResult r;
        l.done = judge(sums, l.pass, r);
        if (l.done) lane.mean[l.c] = r.mean, lane.var[l.c] = r.var, l.result_scale = r.scale;
      }
    }
  }
  for (const Slow& l : lanes)
    if (l.done && l.result_scale != 1.0) scaled.push_back({l.c * k, l.result_scale});
}

// shift[c], mul[c] (compute type E) from the first lane of c's group of k, for its first `lanes`
// lanes (1 where the normalize pass reads a group's first lane only: split_lanes).
template <class E>
void MvnRunner::spread_lanes(const double* mean, const double* istd, int64_t n, int64_t k, int64_t lanes, E* shift,
                             E* mul) {
  if (k == 1) {
    for (int64_t c = 0; c < n; ++c) {
      shift[c] = static_cast<E>(mean[c]);
      mul[c] = static_cast<E>(istd[c]);
    }
    return;
  }
  for (int64_t c0 = 0; c0 < n; c0 += k) {
    const E m = static_cast<E>(mean[c0]), i = static_cast<E>(istd[c0]);
    for (int64_t j = 0; j < lanes; ++j) {
      shift[c0 + j] = m;
      mul[c0 + j] = i;
    }
  }
}

}  // namespace
}  // namespace simdnorm
