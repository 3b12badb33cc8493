// Not part of the module: CMake compiles and runs this on the build machine (SIMDNORM_ISAS=host,
// the default) and builds the units it prints, a CMake list: the baseline (the fallback) and the
// unit the dispatcher would pick on this CPU (x86_features.h), with avx512 under avx512bf16, to
// which it delegates. Units this CPU runs but the dispatcher passes over (avx2 on an AVX-512 CPU)
// would double the build for kernels no call reaches.
#include <cstdio>

#include "runtime/x86_features.h"

int main() {
  std::printf("baseline");
#if defined(__x86_64__) || defined(__i386__)
  const simdnorm::X86Features f = simdnorm::detect_x86_features();
  if (f.avx512) {
    std::printf(";avx512");
    if (f.avx512_bf16) std::printf(";avx512bf16");
  } else if (f.avx2_fma_f16c) {
    std::printf(";avx2");
  }
#endif
  return 0;
}
