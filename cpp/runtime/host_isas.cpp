// Not part of the module: CMake compiles and runs this on the build machine (SIMDNORM_ISAS=host,
// the default) and builds the ISA units it prints, a CMake list: those the dispatcher would find
// this CPU runs (x86_features.h), the baseline always.
#include <cstdio>

#include "runtime/x86_features.h"

int main() {
  std::printf("baseline");
#if defined(__x86_64__) || defined(__i386__)
  const simdnorm::X86Features f = simdnorm::detect_x86_features();
  if (f.avx2_fma_f16c) std::printf(";avx2");
  if (f.avx512) std::printf(";avx512");
  if (f.avx512_bf16) std::printf(";avx512bf16");
#endif
  return 0;
}
