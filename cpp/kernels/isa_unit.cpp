// One kernel source, compiled once per instruction set (CMake builds this file with
// -DSIMDNORM_ISA_NS=<isa> and that ISA's flags), in three parts that compile side by side (one
// unit was most of the build's time on two cores): the backward kernels (-DSIMDNORM_BACKWARD_PART),
// the fused rows loops of layer norm and group norm (-DSIMDNORM_FUSED_PART), and the rest with the
// table, which points at the other parts' entries. A part calls another's entries, never its
// templates: each template is compiled in one part only.
// Everything each part includes lands in an anonymous
// namespace inside simdnorm::<isa>, so no inline or template code compiled here can be merged by the
// linker with a copy compiled for another ISA; only the constant-initialized table is exported
// (no static initializer runs ISA-specific code before the dispatcher has checked the CPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "simdnorm/check.h"
#include "simdnorm/kernel_table.h"
#include "simdnorm/types.h"

namespace simdnorm {
namespace SIMDNORM_ISA_NS {
// The backward part's entries (in a unit that delegates, SIMDNORM_DELEGATE_NS, bfloat16's only;
// the coefficients, which do not depend on the dtype, are its base's).
void backward_sums_kernel(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e, const BackwardSums& s);
void backward_apply_kernel(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e);
void backward_groups_kernel(const BackwardTask& t, const BackwardGroups& g);
void backward_columns_kernel(const BackwardTask& t, const LoopNest& n, double* param_sums, int64_t pitch);
#if !defined(SIMDNORM_DELEGATE_NS)
void backward_coefficients_kernel(const BackwardTask& t, char* st, const double* g, const double* gy, int64_t n);
#endif
// The fused part's entries, and the two of the forward part's that the fused loops call for rows
// they do not fuse.
void normalize_rows_fused_kernel(const NormalizeTask& t, const FusedRowsArgs& a);
RowsLoop rows_loop_kernel(const NormalizeTask& t, const FusedRowsArgs& a);
void normalize_group_and_sum_kernel(const NormalizeTask& t, const GroupPairArgs& a);
void normalize_run_kernel(const NormalizeTask& t, char* const* p, int64_t n);
void row_moments_kernel(const RowMomentsArgs& a);

namespace {
#include "simd/vec.h"
#include "simd/vmath.h"
#include "kernels/activations.h"
#include "kernels/iterate.h"
#if defined(SIMDNORM_BACKWARD_PART)
#include "kernels/backward.h"
#elif defined(SIMDNORM_FUSED_PART)
#include "kernels/normalize.h"
#include "kernels/moments.h"
#include "kernels/lane_stats.h"
#include "kernels/fused_rows.h"
#include "kernels/row_stream.h"
#else
#include "kernels/normalize.h"
#include "kernels/moments.h"
#include "kernels/lane_stats.h"
#include "kernels/fused_columns.h"
#endif
}  // namespace

#if defined(SIMDNORM_BACKWARD_PART)
void backward_sums_kernel(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e, const BackwardSums& s) {
  backward_sums_entry(t, n, b, e, s);
}
void backward_apply_kernel(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e) {
  backward_apply_entry(t, n, b, e);
}
void backward_groups_kernel(const BackwardTask& t, const BackwardGroups& g) { backward_groups_entry(t, g); }
void backward_columns_kernel(const BackwardTask& t, const LoopNest& n, double* param_sums, int64_t pitch) {
  backward_columns_entry(t, n, param_sums, pitch);
}
#if !defined(SIMDNORM_DELEGATE_NS)
void backward_coefficients_kernel(const BackwardTask& t, char* st, const double* g, const double* gy, int64_t n) {
  backward_coefficients_entry(t, st, g, gy, n);
}
#endif
#elif defined(SIMDNORM_FUSED_PART)
#if defined(SIMDNORM_DELEGATE_NS)
// (A unit that delegates fuses only bfloat16's rows: see the forward part below.)
namespace base = ::simdnorm::SIMDNORM_DELEGATE_NS;
void normalize_rows_fused_kernel(const NormalizeTask& t, const FusedRowsArgs& a) {
  if (t.dtype == DType::bf16) normalize_rows_fused_entry(t, a);
  else base::kernel_table.normalize_rows_fused(t, a);
}
RowsLoop rows_loop_kernel(const NormalizeTask& t, const FusedRowsArgs& a) {
  return t.dtype == DType::bf16 ? rows_loop_entry(t, a) : base::kernel_table.rows_loop(t, a);
}
void normalize_group_and_sum_kernel(const NormalizeTask& t, const GroupPairArgs& a) {
  if (t.dtype == DType::bf16) normalize_group_and_sum_entry(t, a);
  else base::kernel_table.normalize_group_and_sum(t, a);
}
#else
void normalize_rows_fused_kernel(const NormalizeTask& t, const FusedRowsArgs& a) { normalize_rows_fused_entry(t, a); }
RowsLoop rows_loop_kernel(const NormalizeTask& t, const FusedRowsArgs& a) { return rows_loop_entry(t, a); }
void normalize_group_and_sum_kernel(const NormalizeTask& t, const GroupPairArgs& a) {
  normalize_group_and_sum_entry(t, a);
}
#endif
#else
extern const KernelTable kernel_table;
#if defined(SIMDNORM_DELEGATE_NS)
// A unit whose flags change only bfloat16's output conversion (avx512bf16) holds only bfloat16's
// normalize and backward kernels (the integer rounding to bfloat16 was a fifth of the backward's
// work); every other kernel is the unit it extends (SIMDNORM_DELEGATE_NS, whose flags it has too):
// the rest of its code would be that unit's again.
void normalize_run_kernel(const NormalizeTask& t, char* const* p, int64_t n) {
  if (t.dtype == DType::bf16) normalize_run_entry(t, p, n);
  else SIMDNORM_DELEGATE_NS::kernel_table.normalize_run(t, p, n);
}
void row_moments_kernel(const RowMomentsArgs& a) { SIMDNORM_DELEGATE_NS::kernel_table.row_moments(a); }
namespace {
namespace base = ::simdnorm::SIMDNORM_DELEGATE_NS;
void normalize_bf16(const NormalizeTask& t, int64_t begin, int64_t end) {
  if (t.dtype == DType::bf16) normalize_entry(t, begin, end);
  else base::kernel_table.normalize(t, begin, end);
}
int64_t normalize_columns_fused_bf16(const NormalizeTask& t, const FusedColumnsArgs& a) {
  if (t.dtype == DType::bf16) return normalize_columns_fused_entry(t, a);
  return base::kernel_table.normalize_columns_fused(t, a);
}
void col_moments_base(const ColMomentsArgs& a) { base::kernel_table.col_moments(a); }
int64_t lane_stats_base(const LaneStatsArgs& a) { return base::kernel_table.lane_stats(a); }
void inv_std_lanes_base(const double* var, double* out, int64_t n, int64_t step, const InvStdRule& rule) {
  base::kernel_table.inv_std_lanes(var, out, n, step, rule);
}
bool scale_over_std_lanes_base(const double* var, const double* scale, double* mul, double* inv_std, uint8_t* fits,
                               int64_t n, double epsilon, double min, double max) {
  return base::kernel_table.scale_over_std_lanes(var, scale, mul, inv_std, fits, n, epsilon, min, max);
}
bool scale_over_std_f32_base(const float* var, const float* scale, float* mul, int64_t n, double epsilon, double min,
                             double max) {
  return base::kernel_table.scale_over_std_f32(var, scale, mul, n, epsilon, min, max);
}
void update_running_base(const RunningUpdateArgs& a) { base::kernel_table.update_running(a); }
void backward_sums_bf16(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e, const BackwardSums& s) {
  if (t.dtype == DType::bf16) backward_sums_kernel(t, n, b, e, s);
  else base::kernel_table.backward_sums(t, n, b, e, s);
}
void backward_apply_bf16(const BackwardTask& t, const LoopNest& n, int64_t b, int64_t e) {
  if (t.dtype == DType::bf16) backward_apply_kernel(t, n, b, e);
  else base::kernel_table.backward_apply(t, n, b, e);
}
void backward_groups_bf16(const BackwardTask& t, const BackwardGroups& g) {
  if (t.dtype == DType::bf16) backward_groups_kernel(t, g);
  else base::kernel_table.backward_groups(t, g);
}
void backward_coefficients_base(const BackwardTask& t, char* st, const double* g, const double* gy, int64_t n) {
  base::kernel_table.backward_coefficients(t, st, g, gy, n);
}
void backward_columns_bf16(const BackwardTask& t, const LoopNest& n, double* param_sums, int64_t pitch) {
  if (t.dtype == DType::bf16) backward_columns_kernel(t, n, param_sums, pitch);
  else base::kernel_table.backward_columns(t, n, param_sums, pitch);
}
}  // namespace
const KernelTable kernel_table = {kIsaName,          kWidth,           inline_activation_bits(), normalize_bf16,
                                  normalize_run_kernel, row_moments_kernel, col_moments_base,
                                  normalize_group_and_sum_kernel, normalize_rows_fused_kernel, rows_loop_kernel,
                                  normalize_columns_fused_bf16, lane_stats_base,
                                  inv_std_lanes_base, scale_over_std_lanes_base, scale_over_std_f32_base,
                                  update_running_base, backward_sums_bf16, backward_apply_bf16,
                                  backward_groups_bf16, backward_coefficients_base, backward_columns_bf16};
#else
void normalize_run_kernel(const NormalizeTask& t, char* const* p, int64_t n) { normalize_run_entry(t, p, n); }
void row_moments_kernel(const RowMomentsArgs& a) { row_moments_entry(a); }
const KernelTable kernel_table = {kIsaName,        kWidth,            inline_activation_bits(), normalize_entry, normalize_run_kernel,
                                   row_moments_kernel, col_moments_entry, normalize_group_and_sum_kernel,
                                   normalize_rows_fused_kernel, rows_loop_kernel, normalize_columns_fused_entry,
                                   lane_stats_entry,
                                   inv_std_lanes_entry, scale_over_std_lanes_entry, scale_over_std_f32_entry,
                                   update_running_entry, backward_sums_kernel,
                                   backward_apply_kernel, backward_groups_kernel, backward_coefficients_kernel,
                                   backward_columns_kernel};
#endif
#endif  // the parts

}  // namespace SIMDNORM_ISA_NS
}  // namespace simdnorm
