// The strided-iteration planner shared by every op: from N-d sizes and per-operand byte strides to a
// LoopNest with size-1 dims dropped, dims ordered by stride, reversed dims flipped and adjacent dims
// merged wherever every operand allows.
#pragma once
#include <string>

#include "simdnorm/types.h"

namespace simdnorm {

// Operands a problem does not use have data == nullptr and zero strides.
struct Problem {
  int ndim = 0;
  int64_t sizes[kMaxViewDims] = {};
  int64_t strides[kNumOperands][kMaxViewDims] = {};
  char* data[kNumOperands] = {};
};

// Elementwise: order by the output's strides (ties by the input's), flip dims the output walks
// backwards, merge.
void plan_elementwise(const Problem& problem, LoopNest& nest);

// A reduction over the dims in `reduced` (bit mask over problem dims).
struct ReductionPlan {
  LoopNest nest;
  int kept_dims = 0;      // nest dims [0, kept_dims) are kept dims
  int reduced_dims = 0;   // then this many reduced dims
  bool lanes = false;     // a last, contiguous kept dim follows: statistics run across it (columns)
  int64_t groups = 1;     // product of the leading kept dims
  int64_t lane_count = 1; // size of the lanes dim (1 when !lanes)
  int64_t group_size = 1; // product of the reduced dims
  // Lanes per statistics group: 1, or the size of a short contiguous innermost reduced dim merged
  // into the lanes with the kept dim around it (group norm on channels-last data: the channels of
  // each group). Every lane is summed around its group's first element, and a group's sums are
  // its lanes' added; the stats operands' lanes stride is per group.
  int64_t lane_group = 1;
  // Scale or bias constant along a group's lanes and not across groups (batch norm training of
  // NCHW planes: per channel), or, with short_lane_groups, nothing varying along a run of more than
  // 64 elements: the normalize pass takes the lanes as (lane_count / lane_group) x lane_group, the
  // outer dim's strides these (the kept dim's).
  bool split_lanes = false;
  int64_t lane_group_strides[kNumOperands] = {};
};


// Rows (the input's innermost dim is reduced): nest = [kept..., reduced...].
// Columns (the innermost dim is kept and contiguous): nest = [kept..., reduced..., lanes].
// Columns of lane groups (the innermost dim is a short reduced run right inside a kept dim):
// nest = [kept..., reduced..., kept x run].
// short_lane_groups (the forward's column strategy takes them): lane groups also where the run is
// at most 400 elements with 2 rows or more outside it, and with scale and bias constant along the
// run (split_lanes). The backward's strategies take neither.
ReductionPlan plan_reduction(const Problem& problem, uint32_t reduced, int64_t itemsize, bool short_lane_groups = false);

int64_t element_count(const LoopNest& nest);
std::string describe(const LoopNest& nest);

}  // namespace simdnorm
