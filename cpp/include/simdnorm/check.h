// Invariants checked in every build, not only under the sanitizers: a broken one stops the process
// with a message naming it, instead of writing past a fixed-size array.
#pragma once

namespace simdnorm {

[[noreturn]] void check_failed(const char* condition, const char* file, int line);

}  // namespace simdnorm

#define SIMDNORM_CHECK(condition) \
  ((condition) ? static_cast<void>(0) : ::simdnorm::check_failed(#condition, __FILE__, __LINE__))
