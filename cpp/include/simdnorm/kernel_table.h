// The interface between the ISA-independent code (planner, ops, binding) and the kernels, which are
// compiled once per instruction set (cpp/kernels/isa_unit.cpp). A table of plain function pointers:
// nothing compiled with AVX flags runs before runtime/cpu.cpp has checked that the CPU and OS allow it.
#pragma once
#include "simdnorm/types.h"

namespace simdnorm {

// Shifted sums for the moments of a normalization group (see ops/mvn.cpp for how they merge):
//   sum += sum_i d_i,  sum_sq += sum_i d_i^2,  d_i = (x_i - pivot) * scale
// accumulated in double lanes that element i of the run takes by its index alone (kernels/moments.h),
// so the result depends only on the run's values, never on its address.

// One strided run of `len` elements.
struct RowMomentsArgs {
  const char* data;
  DType dtype;
  int64_t len;
  int64_t stride;   // bytes
  double pivot;
  double scale;
  double* sum;      // one value, +=
  double* sum_sq;   // one value, +=
};

// How far ahead of the sums the fused loops prefetch what they will sum, at least: from memory, a
// row of 1.5 KB ahead is too late, and twice this far gains nothing more.
constexpr int64_t kPrefetchAheadBytes = 6144;
// Units (rows, runs) of `unit_bytes` > 0 that cover kPrefetchAheadBytes: at least one.
constexpr int64_t prefetch_units_ahead(int64_t unit_bytes) {
  return (kPrefetchAheadBytes + unit_bytes - 1) / unit_bytes;
}

// A block of `rows` rows by `cols` lanes; element (r, c) at data + r * row_stride + c * col_stride.
// Each lane c accumulates down the rows into sum[c], sum_sq[c], with its own pivot[c].
struct ColMomentsArgs {
  const char* data;
  DType dtype;
  int64_t rows, cols;
  int64_t row_stride, col_stride;  // bytes
  const double* pivot;             // [cols]
  double scale;
  double* sum;                     // [cols], +=
  double* sum_sq;                  // [cols], +=
  // The rows fit in the cache: the first block of lanes prefetches whole rows, in order (one
  // stream from memory), and the other blocks find them there.
  bool rows_cached = false;
  // Above 1: the lanes are contiguous groups of this many (cols a multiple of it), each summed as
  // one sequence of its runs; pivot, sum and sum_sq are then a group's, [cols / lane_group].
  int64_t lane_group = 1;
};

// 1 / std from a variance: 1 / sqrt(var + epsilon), or 1 / (sqrt(var) + epsilon) outside; 1 when
// the variance is not normalized (kernels/lane_stats.h).
struct InvStdRule {
  bool normalize_variance, epsilon_outside;
  double epsilon;
};

// Batch norm's running statistics updated from a call's batch statistics, n channels of aligned,
// contiguous arrays apart from each other (ops/batch_norm.cpp: update_running_statistics, which
// takes any others): running float32 or float64 (running_f64), batch float32 or float64
// (batch_f64). PyTorch's convention: r = (1 - m) r + m b, the variance's m b times unbias; ONNX's:
// r = m r + (1 - m) b. In double, without contraction; each result rounded once.
struct RunningUpdateArgs {
  void* running_mean;
  void* running_var;
  const void* mean;
  const void* var;
  bool running_f64, batch_f64, pytorch;
  int64_t n;
  double momentum, unbias;
};

// When a group's first-pass sums may have lost digits to squares that underflowed: its sum of
// squares around the pivot below `sum_sq_below`, and the pivot within +-max_pivot (past it, squares
// that small mean every element equals the pivot, and scaled up they would overflow). ops/mvn.cpp
// sets both per call; sum_sq_below is 0 (never) where epsilon outweighs any variance so small.
struct UnderflowRule {
  double sum_sq_below, max_pivot;
};

// The statistics of many small groups at once (the columns path's lanes), from their first-pass
// sums around pivot[c] (scale 1), by the formulas of kernels/lane_stats.h. With `centered` (the
// mean is normalized) mean[c] = pivot[c] + the mean of the differences and var[c] the variance,
// else mean[c] = 0 and var[c] = sum_sq[c] / n. slow[c] = 1 where the first pass does not settle the
// lane (sums not finite, a pivot too far from the mean, or squares that may have underflowed): the
// caller sums those again.
struct LaneStatsArgs {
  int64_t n;
  double inv_n;  // 1 / the group size
  bool centered;
  UnderflowRule underflow;
  const double *pivot, *sum, *sum_sq;
  double *mean, *var;
  unsigned char* slow;
};

// Rows of one run each at fixed byte steps (layer and RMS norm over contiguous rows), statistics and
// normalization in one call: a row's first-pass sums are taken in the loop that normalizes an
// earlier row, and finish(ctx, row, count, ...) turns the sums of rows [row, row + count) into
// their shift and mul (taking a second pass itself where the sums ask for one) before the first of
// them is normalized.
struct FusedRowsArgs {
  int64_t rows, len;
  char* data[kNumOperands];    // row 0's operands (shift and mul: row 0's slots)
  int64_t step[kNumOperands];  // bytes from one row to the next
  // The statistics need the mean: the first pass is around the row's first element (else around
  // 0, RMS norm); its scale is 1.
  bool centered;
  // Rows [row, row + count): their pivots and first-pass sums, indexed from 0.
  void (*finish)(void* ctx, int64_t row, int count, const double* pivot, const double* sum, const double* sum_sq);
  void* ctx;
  // What a kernel needs to finish rows itself, by the formulas of kernels/lane_stats.h (the float16
  // rows stream does, calling finish only for rows whose first pass does not settle them): 1 / len,
  // the rule for 1 / std, and the caller's arrays of each row's mean and 1 / std in the compute type
  // (null where not wanted), stepping by stats_step per row.
  double inv_n;
  InvStdRule rule;
  UnderflowRule underflow;
  char* stats_out[2];
  int64_t stats_step[2];
  // With the variance wanted: its bytes from stats_out[1]'s elements (0: not wanted).
  int64_t var_offset = 0;
};

// A few rows (at most kFusedColumnRows) of contiguous lanes, each lane a group (batch norm training
// of (N, C) data): the task's nest is [rows, lanes], the input and output contiguous along the
// lanes, the scale and bias contiguous or constant along them and constant down the rows. Chunks
// of lanes are summed, finished and normalized in turn, with the bits of col_moments, lane_stats,
// inv_std_lanes and normalize run one after another; the kernel stops at the first lane that
// lane_stats calls slow, leaving it and the lanes after it to the caller's passes.
constexpr int64_t kFusedColumnRows = 16;  // (the few-rows sums' limit: kernels/moments.h)
struct FusedColumnsArgs {
  bool centered;  // as LaneStatsArgs' (the pivots: row 0's elements, else 0)
  double inv_n;
  InvStdRule rule;
  UnderflowRule underflow;
  char* stats_out[3];  // each lane's mean, 1 / std and variance, compute type, contiguous (null: not wanted)
};

// The loop FusedRowsKernel runs a FusedRowsArgs call with (kernels/fused_rows.h), chosen by the
// kernel table's rows_loop from the rows' layout, their dtype and the ISA; execute switches on it
// and explain prints it.
enum class RowsLoop : int {
  separate,         // layouts the fused loops do not take: each row summed, then normalized
  pipeline,         // each row normalized in the loop that sums a later one
  pipeline_paired,  // long rows: two normalized in step, sharing each scale and bias load
  pipeline_kept,    // float16: the normalize pass reads the float32 copy the sums pass kept
  row_stream,       // 16-bit rows back to back: one stream of steps (kernels/row_stream.h)
  short_rows,       // rows of a few vectors: a batch summed, finished, normalized in step
};

// Group g of an MVN normalized run by run while the first-pass sums of group g + 1 are taken over
// the same runs (groups of several runs, as in MVN over (0, 2, 3), one channel's planes across the
// batch). The nest's dims [first_dim, ndim - 1) step the runs (each nest.sizes[ndim - 1] long) at the
// same offsets in every group. The sums are added up in blocks of `block` elements of the group,
// each block's added to the totals in order, as the split statistics add theirs: the same bits.
struct GroupPairArgs {
  char* group[kNumOperands];  // group g's operands
  const char* next;           // group g + 1's input, summed
  const char* after;          // group g + 2's input, prefetched as the sums reach group g + 1's end
  int first_dim;
  int64_t lead;               // runs the prefetch runs ahead of the sums, at least one
  int64_t block;
  double pivot, scale;        // group g + 1's first pass
  double *sum, *sum_sq;       // group g + 1's totals, +=
};

// The backward ops' element arithmetic (kernels/backward.h). The kStats operand points at the mean
// of a run's statistics element; u (1 / std), c1 and c2 follow at stats_pitch bytes each. The
// kParams operand points at the scale; the bias follows at params_pitch.
constexpr int64_t kMaxSavedGaElements = int64_t(1) << 18;  // (BackwardTask::save_ga: 1 MB of floats)
struct BackwardTask {
  DType dtype = DType::f32;
  DType fused_add_dtype = DType::f32;  // the input's or float32
  Activation act;                       // identity, relu, leaky_relu, silu or gelu
  bool has_fused_add = false;           // the kFusedAdd operand is read (with an activation)
  bool write_ga = false;                // apply writes dy * act'(pre) instead of dx
  bool grouped = false;                 // each group's sums, then its apply (BackwardGroups)
  bool stream_stores = false;           // grad_input written with non-temporal stores (the caller fences)
  bool from_memory = false;             // the operands together pass the caches (streamed or not)
  // The sums pass writes grad_input as well, in the same loop (without statistics terms, where the
  // write needs none of the sums: x and dy are read once).
  bool sums_write = false;
  // An out-of-line derivative, grouped, groups of at most kMaxSavedGaElements: each group's sums
  // pass saves its elements' ga = dy * act'(pre) (compute type, in the nest's order) in ga_buffer, a
  // block's own (backward_groups_of), and its apply reads them back there, so the derivative is
  // taken once an element.
  bool save_ga = false;
  void* ga_buffer = nullptr;
  int64_t stats_pitch = 0, params_pitch = 0;
  // How far ahead of its sums the grouped pair of runs (pair_run) fetches into the L2, bytes.
  int64_t pair_prefetch_bytes = kPrefetchAheadBytes;
  // With sums_write, channels-last rows (lanes_sums) four down each vector, not one at a time.
  bool write_four_rows = false;
  // The coefficients' rule: c1 = mean(g) [normalize_mean], c2 = k mean(g y) [normalize_variance],
  // k = 1 / (1 - epsilon u) with epsilon outside the root; both 0 without statistics terms.
  double inv_n = 1.0, epsilon = 0.0;
  bool normalize_mean = true, normalize_variance = true, epsilon_outside = false, statistics_terms = true;
};
// Where the sums pass adds its sums (null: not wanted). group: sum(g), sum(g y), indexed by the
// statistics element (its offset from stats_base over the compute type's size); param: sum(ga y),
// sum(ga) by the parameter element. A target constant along a run gets the run's sums in its
// double; one that varies along it, each element in its compute-type slot (*_vary), which the
// caller adds into a double every few dozen runs.
struct BackwardSums {
  const char* stats_base = nullptr;
  double* group[2] = {nullptr, nullptr};
  void* group_vary[2] = {nullptr, nullptr};
  const char* params_base = nullptr;
  double* param[2] = {nullptr, nullptr};
  void* param_vary[2] = {nullptr, nullptr};
};

// Groups at one step (their kept dims merged into one), each summed, its c1 and c2 set and its
// grad_input written in one call: layer and RMS norm rows, NCHW batch, instance and group norm.
struct BackwardGroups {
  LoopNest group;                  // the first group's nest of runs (its reduced dims)
  int64_t count = 0;
  int64_t step[kNumOperands] = {};  // bytes from one group to the next
  BackwardSums sums;               // group sums: doubles by statistics element; the block's param sums
  int64_t param_count = 0;         // the param slots to flush every flush_every groups
  int64_t flush_every = 32;
  // Elements of a group summed between flushes of the param slots (0: the whole group): groups
  // whose parameters repeat more than a few dozen times within them.
  int64_t flush_elements = 0;
  bool apply = true;               // write grad_input
};

struct KernelTable {
  const char* name;
  int float_lanes;  // floats in the ISA's vector (its lanes of doubles: half)
  // Bit k set: the unit's loops apply ActKind k inline (every loop); the others are calls, and
  // have no periodic stream and no fused rows (kernels/activations.h).
  uint32_t inline_activations;
  // out = act(fma((in - shift) * mul, scale, bias)) over the flat index range [begin, end) of the nest.
  void (*normalize)(const NormalizeTask& task, int64_t begin, int64_t end);
  // The same over one run of n elements at `pointers` (one per Operand), with the nest's innermost
  // strides. Streaming stores are not fenced: the caller fences once after its last run.
  void (*normalize_run)(const NormalizeTask& task, char* const* pointers, int64_t n);
  void (*row_moments)(const RowMomentsArgs& args);
  void (*col_moments)(const ColMomentsArgs& args);
  // Each run of group g normalized in the loop that sums the same run of group g + 1 (the sums
  // bitwise those row_moments gives), one call a group.
  void (*normalize_group_and_sum)(const NormalizeTask& task, const GroupPairArgs& args);
  void (*normalize_rows_fused)(const NormalizeTask& task, const FusedRowsArgs& args);
  RowsLoop (*rows_loop)(const NormalizeTask& task, const FusedRowsArgs& args);
  // Returns the lanes done: all of them, or those before the first it left.
  int64_t (*normalize_columns_fused)(const NormalizeTask& task, const FusedColumnsArgs& args);
  // Returns how many lanes are slow.
  int64_t (*lane_stats)(const LaneStatsArgs& args);
  // out[c] = 1 / std of var[c] for c = 0, step, 2 step, ... < n.
  void (*inv_std_lanes)(const double* var, double* out, int64_t n, int64_t step, const InvStdRule& rule);
  // Batch norm's folded multiplier: mul[c] = scale[c] * (1 / sqrt(var[c] + epsilon)) for c < n.
  // Returns false when a product of finite, nonzero factors (0 < var[c] + epsilon < inf, scale[c]
  // finite and nonzero) falls outside [min, max] (the compute type's normal range); fits, unless
  // null, gets each lane's verdict (1: its product can stand for scale and 1 / std), and inv_std,
  // unless null, each 1 / sqrt(var[c] + epsilon).
  bool (*scale_over_std_lanes)(const double* var, const double* scale, double* mul, double* inv_std, uint8_t* fits,
                               int64_t n, double epsilon, double min, double max);
  // The same of float32 arrays, mul rounded to float32 (scale null: 1), without inv_std and fits.
  bool (*scale_over_std_f32)(const float* var, const float* scale, float* mul, int64_t n, double epsilon, double min,
                             double max);
  void (*update_running)(const RunningUpdateArgs& args);
  // The backward ops' passes over the flat index range [begin, end) of a nest (kernels/backward.h).
  void (*backward_sums)(const BackwardTask& task, const LoopNest& nest, int64_t begin, int64_t end,
                        const BackwardSums& sums);
  void (*backward_apply)(const BackwardTask& task, const LoopNest& nest, int64_t begin, int64_t end);
  void (*backward_groups)(const BackwardTask& task, const BackwardGroups& groups);
  // c1 and c2 of statistics elements [0, n) from their sums, into the arrays after stats (the mean's).
  void (*backward_coefficients)(const BackwardTask& task, char* stats, const double* sum_g, const double* sum_gy,
                                int64_t n);
  // A few rows (up to 32) of lanes, each lane with statistics and parameters of its own, the nest's
  // rows by lanes, every operand contiguous along the lanes: each lane's sums, coefficients and
  // grad_input in one sweep; param_sums gets each lane's sum(ga y), and `pitch` after its sum(ga)
  // (pitch at least the lanes rounded up to a vector).
  void (*backward_columns)(const BackwardTask& task, const LoopNest& nest, double* param_sums, int64_t pitch);
};

namespace baseline { extern const KernelTable kernel_table; }
namespace avx2 { extern const KernelTable kernel_table; }
namespace avx512 { extern const KernelTable kernel_table; }
namespace avx512bf16 { extern const KernelTable kernel_table; }

}  // namespace simdnorm
