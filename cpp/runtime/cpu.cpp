// The dispatcher: the best ISA unit this CPU runs (runtime/x86_features.h), or the one forced.
// Compiled without ISA flags.
#include "runtime/cpu.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "runtime/x86_features.h"

namespace simdnorm {
namespace {

struct Candidate {
  const char* name;
  const KernelTable* table;
  bool (*supported)();
};

#if defined(__x86_64__) || defined(__i386__)
const X86Features& features() {
  static const X86Features f = detect_x86_features();
  return f;
}
#endif

bool always() { return true; }

const std::vector<Candidate>& candidates() {
  static const std::vector<Candidate> list = {
#if defined(SIMDNORM_HAVE_AVX512BF16)
      {"avx512bf16", &avx512bf16::kernel_table, [] { return features().avx512_bf16; }},
#endif
#if defined(SIMDNORM_HAVE_AVX512)
      {"avx512", &avx512::kernel_table, [] { return features().avx512; }},
#endif
#if defined(SIMDNORM_HAVE_AVX2)
      {"avx2", &avx2::kernel_table, [] { return features().avx2_fma_f16c; }},
#endif
      {"baseline", &baseline::kernel_table, always},
  };
  return list;
}

const Candidate& best() {
  for (const Candidate& c : candidates())
    if (c.supported()) return c;
  return candidates().back();
}

std::atomic<const Candidate*>& active() {
  static std::atomic<const Candidate*> a{&best()};
  return a;
}

}  // namespace

const std::vector<std::string>& available_isas() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const Candidate& c : candidates())
      if (c.supported()) v.emplace_back(c.name);
    return v;
  }();
  return names;
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> v;
#if defined(__x86_64__) || defined(__i386__)
  if (features().avx512_bf16) v.emplace_back("avx512bf16");
  if (features().avx512) v.emplace_back("avx512");
  if (features().avx2_fma_f16c) v.emplace_back("avx2");
#endif
  v.emplace_back("baseline");
  return v;
}

const KernelTable& kernels() { return *active().load(std::memory_order_acquire)->table; }

std::string active_isa() { return active().load(std::memory_order_acquire)->name; }

void set_isa(const std::string& name) {
  std::string known, usable;
  for (const Candidate& c : candidates()) {
    if (name == c.name && c.supported()) {
      active().store(&c, std::memory_order_release);
      return;
    }
    known += known.empty() ? "" : ", ";
    known += c.name;
  }
  for (const std::string& n : available_isas()) usable += (usable.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown or unavailable ISA '" + name + "': this CPU runs " + usable +
                              " (built: " + known + ")");
}

namespace {
// The caches sysfs lists for cpu0, as fn(level, type, bytes), until fn returns true.
template <class Fn>
void each_cache(Fn&& fn) {
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    int level = 0;
    long long kib = 0;
    char unit = 0, type[16] = {};
    FILE* f = std::fopen((dir + "level").c_str(), "r");
    if (f == nullptr) return;
    const bool got_level = std::fscanf(f, "%d", &level) == 1;
    std::fclose(f);
    f = std::fopen((dir + "size").c_str(), "r");
    if (f == nullptr) continue;
    const bool got_size = std::fscanf(f, "%lld%c", &kib, &unit) == 2 && unit == 'K';
    std::fclose(f);
    f = std::fopen((dir + "type").c_str(), "r");
    if (f == nullptr) continue;
    const bool got_type = std::fscanf(f, "%15s", type) == 1;
    std::fclose(f);
    if (got_level && got_size && got_type && kib > 0 && fn(level, std::string(type), static_cast<int64_t>(kib) << 10))
      return;
  }
}
}  // namespace

int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int best_level = 0;
    int64_t best_size = int64_t(8) << 20;
    each_cache([&](int level, const std::string&, int64_t size) {
      if (level > best_level) best_level = level, best_size = size;
      return false;
    });
    return best_size;
  }();
  return bytes;
}

int64_t l1_data_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t size = kMinL1DataBytes;
    each_cache([&](int level, const std::string& type, int64_t found) {
      if (level != 1 || type != "Data") return false;
      if (found > size) size = found;
      return true;
    });
    return size;
  }();
  return bytes;
}

// 6 KB ahead with a 1 MB L2 (Zen 4): NCHW instance and group norm's backward took 0.82-0.88x the
// time of 1 KB ahead; with a 512 KB L2 (Zen 3), where the two groups in flight, each read twice,
// crowd the L2, 1 KB won on groups of 100 KB and more. An unreadable L2 counts as small.
int64_t pair_prefetch_bytes() {
  static const int64_t bytes = [] {
    int64_t l2 = 0;
    each_cache([&](int level, const std::string& type, int64_t found) {
      if (level != 2 || type == "Instruction") return false;
      l2 = found;
      return true;
    });
    return l2 >= (int64_t(1) << 20) ? kPrefetchAheadBytes : int64_t(1024);
  }();
  return bytes;
}

// On AMD (Zen 4, 8 x 56 x 56 x 256 float32 channels last, given statistics) four rows took
// 0.59-0.82x the time of one, whose slot store each vector the next row loads back behind the
// streamed stores; on an Intel Xeon four rows, four interleaved streams of writes, took 1.28x.
bool backward_writes_four_rows() {
#if defined(__x86_64__) || defined(__i386__)
  return features().amd;
#else
  return false;
#endif
}

// The cap: a server's large L3 is far from any one core, and streaming wins there on outputs far
// smaller than half of it. 16 MB is half a 32 MB L3, on which streaming smaller outputs loses.
int64_t stream_threshold_bytes() {
  const int64_t half = last_level_cache_bytes() / 2;
  return half < kStreamCapBytes ? half : kStreamCapBytes;
}

}  // namespace simdnorm
