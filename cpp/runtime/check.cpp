#include "simdnorm/check.h"

#include <cstdio>
#include <cstdlib>

namespace simdnorm {

void check_failed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "simdnorm: internal check failed: %s (%s:%d); please report this with the call that made it\n",
               condition, file, line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace simdnorm
