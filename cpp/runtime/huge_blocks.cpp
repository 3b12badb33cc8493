#include "runtime/huge_blocks.h"

#include <pthread.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

namespace simdnorm {
namespace {

size_t rounded(size_t bytes) { return (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1); }

struct Cache {
  std::mutex mutex;
  std::vector<std::pair<void*, size_t>> blocks;  // (block, rounded bytes), the latest given last
  size_t bytes = 0;
};

// Never destroyed: a tensor may die after the library's static objects (at interpreter exit).
// Held across fork() so that a child never inherits it locked by another thread.
Cache& cache() {
  static Cache* c = [] {
    auto* made = new Cache;
    pthread_atfork([] { cache().mutex.lock(); }, [] { cache().mutex.unlock(); }, [] { cache().mutex.unlock(); });
    return made;
  }();
  return *c;
}

void* map_aligned(size_t n) {
  void* p = mmap(nullptr, n + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~uintptr_t{kHugePageBytes - 1};
  const size_t head = aligned - start, tail = kHugePageBytes - head;
  if (head != 0) munmap(p, head);
  if (tail != 0) munmap(reinterpret_cast<void*>(aligned + n), tail);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(aligned), n, MADV_HUGEPAGE);  // (advice: its failure changes nothing)
#endif
  return reinterpret_cast<void*>(aligned);
}

struct CacheSetting {
  size_t bytes;
  bool ignored;  // set, but not a bound: the default instead
};

// SIMDNORM_TORCH_CACHE_MB in decimal digits only: strtoull took "-1" as 2^64 - 1 (no bound), a
// value past size_t's bytes wrapped (to 0: no cache), and "64MB" or "1e3" fell back unsaid.
const CacheSetting& cache_setting() {
  static const CacheSetting setting = [] {
    constexpr size_t kDefault = size_t{1024} << 20, kMaxMb = SIZE_MAX >> 20;
    const char* env = std::getenv("SIMDNORM_TORCH_CACHE_MB");
    if (env == nullptr || *env == '\0') return CacheSetting{kDefault, false};
    size_t mb = 0;
    for (const char* p = env; *p != '\0'; ++p) {
      if (*p < '0' || *p > '9') return CacheSetting{kDefault, true};
      const size_t digit = static_cast<size_t>(*p - '0');
      if (mb > (kMaxMb - digit) / 10) return CacheSetting{kDefault, true};
      mb = mb * 10 + digit;
    }
    return CacheSetting{mb << 20, false};
  }();
  return setting;
}

}  // namespace

size_t huge_cache_limit() { return cache_setting().bytes; }
bool huge_cache_setting_ignored() { return cache_setting().ignored; }

void* take_huge_block(size_t bytes) {
  const size_t n = rounded(bytes);
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    for (size_t i = c.blocks.size(); i-- > 0;) {
      if (c.blocks[i].second != n) continue;
      void* block = c.blocks[i].first;
      c.blocks.erase(c.blocks.begin() + static_cast<std::ptrdiff_t>(i));
      c.bytes -= n;
      return block;
    }
  }
  return map_aligned(n);
}

// The oldest kept blocks make room for the latest (the sizes a loop still asks for); a block past
// the whole bound is unmapped at once.
void give_huge_block(void* block, size_t bytes) {
  const size_t n = rounded(bytes), limit = huge_cache_limit();
  std::vector<std::pair<void*, size_t>> evicted;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (n <= limit) {
      size_t oldest = 0;
      while (c.bytes + n > limit) {
        evicted.push_back(c.blocks[oldest]);
        c.bytes -= c.blocks[oldest++].second;
      }
      c.blocks.erase(c.blocks.begin(), c.blocks.begin() + static_cast<std::ptrdiff_t>(oldest));
      c.blocks.emplace_back(block, n);
      c.bytes += n;
    } else {
      evicted.emplace_back(block, n);
    }
  }
  for (const auto& [b, size] : evicted) munmap(b, size);  // (outside the lock)
}

size_t release_huge_blocks() {
  std::vector<std::pair<void*, size_t>> blocks;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    blocks.swap(c.blocks);
    c.bytes = 0;
  }
  size_t released = 0;
  for (const auto& [block, n] : blocks) {
    munmap(block, n);
    released += n;
  }
  return released;
}

size_t cached_huge_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.bytes;
}

}  // namespace simdnorm
