// Blocks of whole 2 MB pages for large outputs that leave the library as another library's
// tensors (simdnorm.torch's): mapped 2 MB-aligned and advised for huge pages, so that the kernels'
// streams over them miss the TLB once a 2 MB page, not once a 4 KB one; given back when their
// tensor dies and kept for the next output of the same rounded size, up to a bound (the oldest
// kept blocks unmapped first).
#pragma once

#include <cstddef>
#include <cstdint>

namespace simdnorm {

constexpr size_t kHugePageBytes = size_t{2} << 20;
// The outputs given to torch on such blocks: those of this many elements or more (4 MB of float32).
constexpr int64_t kHugeBlockMinElements = int64_t{1} << 20;

// A block of at least `bytes` (rounded up to whole 2 MB pages), nullptr where the system has none.
void* take_huge_block(size_t bytes);
// Back to the cache, the oldest kept ones unmapped past the bound; from any thread, without the GIL.
void give_huge_block(void* block, size_t bytes);
// The cached blocks unmapped; returns the bytes released.
size_t release_huge_blocks();
size_t cached_huge_bytes();
// The cache's bound: SIMDNORM_TORCH_CACHE_MB (whole megabytes) if set, else 1024 MB; and whether
// it was set to something else, ignored (simdnorm.torch warns at import).
size_t huge_cache_limit();
bool huge_cache_setting_ignored();

}  // namespace simdnorm
