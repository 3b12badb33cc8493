// Instruction-set detection and the active kernel table.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "simdnorm/kernel_table.h"

namespace simdnorm {

// Names of the built units this CPU and OS run, best first ("avx512", "baseline").
const std::vector<std::string>& available_isas();
// Names of the units this CPU and OS run, best first, whether this module built them or not.
std::vector<std::string> cpu_isas();
// The active table (the best available until set_isa is called).
const KernelTable& kernels();
std::string active_isa();
// Throws std::invalid_argument naming the valid choices when name is unknown or unavailable.
void set_isa(const std::string& name);

// Size of one instance of the largest cache this CPU's cores share (L3 on current x86), in bytes,
// from /sys/devices/system/cpu/cpu0/cache; 8 MiB where that is not readable. (glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE) reports the whole socket on AMD: 384 MiB for twelve 32 MiB L3s.)
int64_t last_level_cache_bytes();

// The L1 data cache of cpu0 (sysfs), bytes; kMinL1DataBytes where that is not readable or less.
int64_t l1_data_cache_bytes();
// How far ahead the backward's grouped pair of runs (pair_run) fetches what it sums, bytes: from
// the L2's size (sysfs), whose room for the two groups in flight sets how far ahead pays.
int64_t pair_prefetch_bytes();
// Whether channels-last backward rows that write grad_input as they are summed take four rows down
// each vector of lanes (AVX-512 units), as the sums alone do, rather than one row at a time.
bool backward_writes_four_rows();

// Input plus output bytes past which an out-of-place op writes with non-temporal stores: half the
// last-level cache (it is shared with other cores and tenants), at most kStreamCapBytes.
constexpr int64_t kStreamCapBytes = int64_t(16) << 20;
int64_t stream_threshold_bytes();
// Inner runs shorter than this are not streamed (the forward's normalize pass): their edges are
// partial lines, which non-temporal stores write to memory piece by piece.
constexpr int64_t kMinStreamRunBytes = 1024;

}  // namespace simdnorm
