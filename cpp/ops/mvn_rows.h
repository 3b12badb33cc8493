// The row strategies of the MVN driver (ops/mvn.cpp has the overview): statistics along the rows
// of the nest [kept..., reduced...], one group per kept index. run_rows picks one of four.
// Part of ops/mvn.cpp's translation unit (ops/mvn_runner.h).
#pragma once
#include "ops/mvn_runner.h"

namespace simdnorm {
namespace {

// Pointers of consecutive groups: the nest's operands, then the user's mean and inv_std arrays,
// stepped by an odometer over the kept dims (no division per group).
struct MvnRunner::GroupCursor {
  const MvnRunner& r;
  char* p[kGroupPointers];
  int64_t idx[kMaxNestDims] = {};
  GroupCursor(const MvnRunner& runner, int64_t g) : r(runner) {
    for_dim_indices(r.plan_.nest, 0, r.plan_.kept_dims, g, [&](int d, int64_t i) { idx[d] = i; });
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

// finish_fused_rows' context: one kernel call's args, whose row 0 is group g0.
struct MvnRunner::FusedRowsContext {
  MvnRunner* runner;
  const FusedRowsArgs* args;
  int64_t g0;
};

// Whole groups per thread when there are enough of them (rows_fused()), each group's statistics and
// then its normalization while it is cached; else the groups are split between threads.
MvnRunner::RowStrategy MvnRunner::row_strategy() const {
  if (!rows_fused()) return RowStrategy::split;
  if (rows_pipelined()) return RowStrategy::pipelined;
  return groups_per_batch() == 1 ? RowStrategy::paired : RowStrategy::batched;
}

int64_t MvnRunner::groups_per_thread() const {
  const int parts = parts_for(plan_.groups * plan_.group_size, kMinElementsPerThread);
  return (plan_.groups + parts - 1) / parts;
}

int64_t MvnRunner::groups_per_batch() const {
  const int64_t group_bytes = plan_.group_size * itemsize(a_.input.dtype);
  return group_bytes >= kFusedBatchBytes ? 1 : kFusedBatchBytes / group_bytes;
}

void MvnRunner::run_rows() {
  const RowStrategy strategy = row_strategy();
  if (strategy == RowStrategy::split) return run_rows_split();
  if (a_.statistics_only) return run_rows_statistics();
  const int64_t groups = plan_.groups, per = groups_per_thread(), batch = groups_per_batch();
  const int parts = parts_for(groups * plan_.group_size, kMinElementsPerThread);
  const KernelTable& k = kernels();
  parallel_for(parts, [&](int part) {
    const int64_t g0 = part * per, g1 = g0 + per < groups ? g0 + per : groups;
    if (g0 >= g1) return;
    if (strategy == RowStrategy::pipelined) run_rows_pipelined(k, g0, g1);
    else if (strategy == RowStrategy::paired) run_rows_paired(k, g0, g1);
    else run_rows_batched(k, g0, g1, batch);
  });
}

// Chosen when each group is one run of one block (rows_pipelined()); one thread's [g0, g1).
// Long or short rows alike, and rows of kept dims that do not merge (layer norm of x[:, :T]):
// batches (a statistics call per row, a normalize call per batch) are slower.
void MvnRunner::run_rows_pipelined(const KernelTable& k, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1;) {
    FusedRowsArgs args = fused_rows_args(g, g1);
    FusedRowsContext ctx{this, &args, g};
    args.ctx = &ctx;
    k.normalize_rows_fused(task_, args);
    g += args.rows;
  }
  if (task_.stream_stores) fence_streaming_stores();
}

FusedRowsArgs MvnRunner::fused_rows_args(int64_t g, int64_t g1) const {
  const int inner = plan_.kept_dims - 1;
  const int64_t stretch = plan_.nest.sizes[inner];
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
  if (a_.var_out && args.stats_out[1] != nullptr) args.var_offset = var_offset();
  return args;
}

// Chosen for groups of kFusedBatchBytes and more that are not pipelined; one thread's [g0, g1).
// Groups of several runs (MVN over (0, 2, 3)) or past one block of sums: group g is normalized
// (from cache) in the loop that takes the first-pass sums of group g + 1 (from memory), run by run,
// so that reads and writes overlap as in a copy; a second pass, when one is needed, runs on its own.
// Runs are cut where block_sums' blocks end, and each block's sums are added to the group's in
// order, as group_stats adds them: groups of any size are fused.
// The loop prefetches the run `lead` runs after the one it sums (past the group's last run, in the
// group after), at least kPrefetchAheadBytes ahead in the order the sums read, not where the run
// ends (in MVN over (0, 2, 3) the same plane of the next channel: a group ahead, which the L2 does
// not keep for large groups).
// One kernel call a group, which steps the runs itself: with a call a run, this loop's bookkeeping
// between calls would wait on its state, pushed out of L1 by each run.
void MvnRunner::run_rows_paired(const KernelTable& k, int64_t g0, int64_t g1) {
  GroupCursor cursor(*this, g0);
  const int last = plan_.nest.ndim - 1;
  const int64_t run = plan_.nest.sizes[last], runs = runs_per_group();
  const int64_t run_bytes = run * itemsize(a_.input.dtype);
  const int64_t lead = std::min(runs, prefetch_units_ahead(run_bytes));
  GroupCursor normalizing = cursor;
  take_stats(cursor, g0);
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
}

// Chosen for groups smaller than kFusedBatchBytes that are not pipelined; one thread's [g0, g1).
// In batches: one normalize call per batch instead of per short group.
void MvnRunner::run_rows_batched(const KernelTable& k, int64_t g0, int64_t g1, int64_t batch) {
  GroupCursor cursor(*this, g0);
  for (int64_t b0 = g0; b0 < g1; b0 += batch) {
    const int64_t b1 = b0 + batch < g1 ? b0 + batch : g1;
    for (int64_t g = b0; g < b1; ++g) take_stats(cursor, g);
    k.normalize(task_, b0 * plan_.group_size, b1 * plan_.group_size);
  }
}

// Chosen when there are too few groups for whole groups per thread (!rows_fused()).
// Few large groups: blocks of every group over all threads, combined in order, then one
// normalization pass over all threads.
void MvnRunner::run_rows_split() {
  const int64_t groups = plan_.groups, nblocks = blocks_per_group();
  std::vector<Pass> passes(static_cast<size_t>(groups));
  std::vector<char> done(static_cast<size_t>(groups), 0);
  std::vector<GroupResult> results(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) passes[g] = first_pass(group_first_element(g));
  std::vector<Sums> sums(static_cast<size_t>(groups * nblocks));
  for (int round = 0; round < kMaxPassRounds; ++round) {
    std::vector<int64_t> pending;
    for (int64_t g = 0; g < groups; ++g)
      if (!done[g]) pending.push_back(g);
    if (pending.empty()) break;
    const int64_t tasks = static_cast<int64_t>(pending.size()) * nblocks;
    for_item_ranges(tasks, tasks * kBlock, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
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
  if (!a_.statistics_only) run_normalize(task_);
}

// Statistics only (statistics_only), with whole groups per thread: each group summed as
// group_stats sums it, with nothing written but the statistics (the input is read once).
void MvnRunner::run_rows_statistics() {
  const int64_t groups = plan_.groups, per = groups_per_thread();
  const int parts = parts_for(groups * plan_.group_size, kMinElementsPerThread);
  parallel_for(parts, [&](int part) {
    const int64_t g0 = part * per, g1 = g0 + per < groups ? g0 + per : groups;
    if (g0 >= g1) return;
    GroupCursor cursor(*this, g0);
    for (int64_t g = g0; g < g1; ++g) take_stats(cursor, g);
  });
}

// The statistics of group g (its pointers at the cursor), stored; the cursor steps to group g + 1.
void MvnRunner::take_stats(GroupCursor& cursor, int64_t g) {
  store_stats(cursor.p[kShift], cursor.p[kMul], group_stats(g, cursor.p[kIn], first_pass(cursor.p[kIn])),
              cursor.p[kUserMean],
              cursor.p[kUserInvStd]);
  cursor.next();
}

// FusedRowsArgs::finish: rows `row` to `row + count` of those from group g0 on; the operands'
// pointers and the user's statistics arrays are the args'.
void MvnRunner::finish_fused_rows(void* context, int64_t row, int count, const double* pivot, const double* sum,
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

char* MvnRunner::group_base(int op) const {
  return op == kUserMean ? user_mean_ : op == kUserInvStd ? user_inv_std_ : plan_.nest.data[op];
}
int64_t MvnRunner::group_stride(int op, int d) const {
  return op == kUserMean ? user_mean_strides_[d] : op == kUserInvStd ? user_inv_std_strides_[d] : plan_.nest.strides[op][d];
}

// Sums of block `block` of group `group` (whose first element, when known, is at `first`).
Sums MvnRunner::block_sums(int64_t group, int64_t block, const Pass& pass, const char* first) const {
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

// Statistics of group g, whose first element is at `first`, starting with `pass` (first_pass()).
// Summed block by block as the split path does, so the two paths agree bitwise.
GroupResult MvnRunner::group_stats(int64_t g, const char* first, Pass pass) const {
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
GroupResult MvnRunner::stats_from_first_sums(int64_t g, const char* first, Pass pass, const Sums& first_sums) const {
  GroupResult r;
  if (judge(first_sums, pass, r)) return r;
  return group_stats(g, first, pass);
}

// How many runs (the innermost reduced dim's length each) one group has.
int64_t MvnRunner::runs_per_group() const { return plan_.group_size / plan_.nest.sizes[plan_.nest.ndim - 1]; }

void MvnRunner::finish_group(int64_t group, const GroupResult& r) {
  store_stats(group, r, user_mean_ + user_offset(user_mean_strides_, group),
              user_inv_std_ + user_offset(user_inv_std_strides_, group));
}

}  // namespace
}  // namespace simdnorm
