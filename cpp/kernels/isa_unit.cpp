// One kernel source, compiled once per instruction set (CMake builds this file with
// -DSIMDNORM_ISA_NS=<isa> and that ISA's flags). Everything it includes lands in an anonymous
// namespace inside simdnorm::<isa>, so no inline or template code compiled here can be merged by the
// linker with a copy compiled for another ISA; only the constant-initialized table is exported
// (no static initializer runs ISA-specific code before the dispatcher has checked the CPU).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "simdnorm/kernel_table.h"
#include "simdnorm/types.h"

namespace simdnorm {
namespace SIMDNORM_ISA_NS {
namespace {
#include "simd/vec.h"
#include "simd/vmath.h"
#include "kernels/activations.h"
#include "kernels/iterate.h"
#include "kernels/normalize.h"
#include "kernels/moments.h"
#include "kernels/lane_stats.h"
#include "kernels/fused_rows.h"
#include "kernels/row_stream.h"
}  // namespace

extern const KernelTable kernel_table;
const KernelTable kernel_table = {kIsaName,        kWidth,            normalize_entry,   normalize_run_entry,
                                   row_moments_entry, col_moments_entry, normalize_group_and_sum_entry,
                                   normalize_rows_fused_entry, lane_stats_entry,
                                   inv_std_lanes_entry, scale_over_std_lanes_entry};

}  // namespace SIMDNORM_ISA_NS
}  // namespace simdnorm
