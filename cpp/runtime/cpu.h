// Instruction-set detection and the active kernel table.
#pragma once
#include <string>
#include <vector>

#include "simdnorm/kernel_table.h"

namespace simdnorm {

// Names of the ISAs this CPU and OS can run, best first ("avx512", "avx2", "baseline").
const std::vector<std::string>& available_isas();
// The active table (the best available until set_isa is called).
const KernelTable& kernels();
std::string active_isa();
// Throws std::invalid_argument naming the valid choices when name is unknown or unavailable.
void set_isa(const std::string& name);

}  // namespace simdnorm
