#include "plan/plan.h"

#include <algorithm>
#include <cstdlib>

#include "simdnorm/check.h"

namespace simdnorm {
namespace {

struct Dim {
  int64_t size;
  int64_t stride[kNumOperands];
  bool reduced;
};

// A fixed array, so that planning a call allocates nothing, as large as a loop nest: the plan is
// copied into one. Every insertion is checked, so no layout can write past it.
struct DimList {
  Dim items[kMaxNestDims];
  int n = 0;
  void push_back(const Dim& d) {
    SIMDNORM_CHECK(n < kMaxNestDims);
    items[n++] = d;
  }
  void pop_back() { --n; }
  bool empty() const { return n == 0; }
  Dim& back() { return items[n - 1]; }
  const Dim& back() const { return items[n - 1]; }
  Dim* begin() { return items; }
  Dim* end() { return items + n; }
  const Dim* begin() const { return items; }
  const Dim* end() const { return items + n; }
};

DimList collect(const Problem& p, uint32_t reduced_mask) {
  SIMDNORM_CHECK(p.ndim >= 0 && p.ndim <= kMaxViewDims);
  DimList dims;
  for (int d = 0; d < p.ndim; ++d) {
    if (p.sizes[d] == 1) continue;
    Dim dim{p.sizes[d], {}, ((reduced_mask >> d) & 1u) != 0};
    for (int op = 0; op < kNumOperands; ++op) dim.stride[op] = p.strides[op][d];
    dims.push_back(dim);
  }
  return dims;
}

// Walk a dim from its other end: every operand at once, so elementwise results are unchanged.
void flip(Dim& d, char** data) {
  for (int op = 0; op < kNumOperands; ++op) {
    if (data[op] != nullptr) data[op] += (d.size - 1) * d.stride[op];
    d.stride[op] = -d.stride[op];
  }
}

// dims are outermost first; a dim merges into the one before it when every operand steps through
// the pair as through one dim.
DimList merge(const DimList& dims) {
  DimList out;
  for (const Dim& d : dims) {
    if (!out.empty()) {
      Dim& o = out.back();
      bool ok = true;
      for (int op = 0; op < kNumOperands && ok; ++op) ok = o.stride[op] == d.stride[op] * d.size;
      if (ok) {
        o.size *= d.size;
        for (int op = 0; op < kNumOperands; ++op) o.stride[op] = d.stride[op];
        continue;
      }
    }
    out.push_back(d);
  }
  return out;
}

bool outer_first(const Dim& a, const Dim& b, Operand primary, Operand secondary) {
  const int64_t pa = std::llabs(a.stride[primary]), pb = std::llabs(b.stride[primary]);
  if (pa != pb) return pa > pb;
  return std::llabs(a.stride[secondary]) > std::llabs(b.stride[secondary]);
}

// Stable insertion sort: at most 8 dims.
void sort_outer_first(DimList& dims, Operand primary, Operand secondary) {
  for (int i = 1; i < dims.n; ++i) {
    const Dim d = dims.items[i];
    int j = i;
    for (; j > 0 && outer_first(d, dims.items[j - 1], primary, secondary); --j) dims.items[j] = dims.items[j - 1];
    dims.items[j] = d;
  }
}

void to_nest(const DimList& dims, char* const* data, LoopNest& nest) {
  nest.ndim = dims.n;
  for (int d = 0; d < nest.ndim; ++d) {
    nest.sizes[d] = dims.items[d].size;
    for (int op = 0; op < kNumOperands; ++op) nest.strides[op][d] = dims.items[d].stride[op];
  }
  for (int op = 0; op < kNumOperands; ++op) nest.data[op] = data[op];
}

Dim unit_dim(bool reduced) { return Dim{1, {}, reduced}; }

int64_t product(const DimList& dims) {
  int64_t n = 1;
  for (const Dim& d : dims) n *= d.size;
  return n;
}

// The innermost reduced dim r, contiguous and short, sits right inside the innermost kept dim k
// (group norm on channels-last data: r the channels of a group, k the groups; MVN over (0, 2, 3)
// and batch norm training of small NCHW planes: r a plane, k the channels), with other reduced
// dims outside: as rows, each group would be many runs of r, each paying a run's fixed costs (its
// ends, its sums' tree: about 250 cycles). k x r merge into one dim of lanes for every operand read
// or written per element. Each lane then costs its own sums and coefficients, which pay where the
// rows are at least as many as r's elements, or (short_groups: the forward, whose column strategy
// sums a group of few rows as one sequence of its runs) r is at most 400 elements over 2 rows or
// more: batch norm training of 2-128 x C x 3x3 to 20x20 planes up to 3x faster than the runs on
// Zen 4 (2 rows of 5x5: even); planes of 441 to 1024 elements gained in some shapes and lost up
// to 1.18x in others.
constexpr int64_t kLaneGroupMaxBytes = 1024;
constexpr int64_t kShortLaneGroup = 400, kShortLaneGroupRows = 2;
bool lane_groups_fit(const DimList& kept, const DimList& reduced, int64_t itemsize, bool short_groups) {
  if (kept.empty() || reduced.n < 2) return false;
  const Dim& r = reduced.back();
  const Dim& k = kept.back();
  if (r.stride[kIn] != itemsize) return false;
  for (Operand op : {kOut, kIn, kScale, kBias})  // (scale and bias may be constant along r: split_lanes)
    if (k.stride[op] != r.size * r.stride[op] && !(short_groups && op >= kScale && r.stride[op] == 0)) return false;
  int64_t rows = 1;
  for (int d = 0; d + 1 < reduced.n; ++d) rows *= reduced.items[d].size;
  if (short_groups && r.size <= kShortLaneGroup && rows >= kShortLaneGroupRows) return true;
  return r.size * itemsize <= kLaneGroupMaxBytes && rows >= r.size;
}

// Lane groups longer than this, with nothing that varies along their run, are normalized as
// runs (split_lanes), one shift and mul a run: as lanes, each would read its own (written for
// every lane), and MVN over (0, 2, 3) of 8x512x9x9 to 16x16 planes ran 1.15-1.3x slower. Shorter
// runs keep the lanes, whose loop has no run ends.
constexpr int64_t kLanesNormalizedMax = 64;

}  // namespace

void plan_elementwise(const Problem& p, LoopNest& nest) {
  char* data[kNumOperands];
  std::copy(p.data, p.data + kNumOperands, data);
  DimList dims = collect(p, 0);
  for (Dim& d : dims)
    if (d.stride[kOut] < 0 || (d.stride[kOut] == 0 && d.stride[kIn] < 0)) flip(d, data);
  sort_outer_first(dims, kOut, kIn);
  dims = merge(dims);
  if (dims.empty()) dims.push_back(unit_dim(false));
  to_nest(dims, data, nest);
}

ReductionPlan plan_reduction(const Problem& p, uint32_t reduced_mask, int64_t itemsize, bool short_lane_groups) {
  char* data[kNumOperands];
  std::copy(p.data, p.data + kNumOperands, data);
  DimList dims = collect(p, reduced_mask);
  // Direction does not matter to a reduction or to the elementwise pass after it: read forwards.
  for (Dim& d : dims)
    if (d.stride[kIn] < 0) flip(d, data);
  DimList kept, reduced;
  for (const Dim& d : dims) (d.reduced ? reduced : kept).push_back(d);
  sort_outer_first(kept, kIn, kOut);
  sort_outer_first(reduced, kIn, kOut);

  ReductionPlan plan;
  // Columns: the input's innermost dim is kept and contiguous, so statistics are accumulated per
  // lane across it while the reduced dims are walked, instead of along badly strided runs.
  const bool innermost_kept = !kept.empty() && (reduced.empty() || std::llabs(kept.back().stride[kIn]) <
                                                                        std::llabs(reduced.back().stride[kIn]));
  plan.lanes = innermost_kept && !reduced.empty() && kept.back().stride[kIn] == itemsize;
  kept = merge(kept);  // (before the lanes are taken: all the kept dims that merge with the innermost)
  reduced = merge(reduced);
  Dim lanes_dim = unit_dim(false);
  if (plan.lanes) {
    lanes_dim = kept.back();
    kept.pop_back();
  }
  if (!plan.lanes && lane_groups_fit(kept, reduced, itemsize, short_lane_groups)) {
    const Dim r = reduced.back(), k = kept.back();
    reduced.pop_back();
    kept.pop_back();
    lanes_dim = r;
    lanes_dim.size = k.size * r.size;
    lanes_dim.reduced = false;
    lanes_dim.stride[kShift] = k.stride[kShift];  // the statistics are per group of r lanes
    lanes_dim.stride[kMul] = k.stride[kMul];
    plan.lanes = true;
    plan.lane_group = r.size;
    for (Operand op : {kScale, kBias}) plan.split_lanes |= k.stride[op] != r.size * r.stride[op];
    if (short_lane_groups && r.size > kLanesNormalizedMax && r.stride[kScale] == 0 && r.stride[kBias] == 0)
      plan.split_lanes = true;
    for (int op = 0; op < kNumOperands; ++op) plan.lane_group_strides[op] = k.stride[op];
  }
  if (kept.empty()) kept.push_back(unit_dim(false));
  if (reduced.empty()) reduced.push_back(unit_dim(true));
  plan.kept_dims = kept.n;
  plan.reduced_dims = reduced.n;
  plan.groups = product(kept);
  plan.group_size = product(reduced);
  plan.lane_count = lanes_dim.size;
  DimList all = kept;
  for (const Dim& d : reduced) all.push_back(d);
  if (plan.lanes) all.push_back(lanes_dim);
  to_nest(all, data, plan.nest);
  return plan;
}

int64_t element_count(const LoopNest& nest) {
  int64_t n = 1;
  for (int d = 0; d < nest.ndim; ++d) n *= nest.sizes[d];
  return n;
}

std::string describe(const LoopNest& nest) {
  static const char* names[kNumOperands] = {"out", "in", "shift", "mul", "scale", "bias"};
  std::string s = "sizes=(";
  for (int d = 0; d < nest.ndim; ++d) s += (d ? "," : "") + std::to_string(nest.sizes[d]);
  s += ")";
  for (int op = 0; op < kNumOperands; ++op) {
    s += std::string(" ") + names[op] + "=(";
    for (int d = 0; d < nest.ndim; ++d) s += (d ? "," : "") + std::to_string(nest.strides[op][d]);
    s += ")";
  }
  return s;
}

}  // namespace simdnorm
