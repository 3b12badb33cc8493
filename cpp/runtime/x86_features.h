// The x86 features each ISA unit needs, from CPUID plus XGETBV: a feature counts only when the CPU
// has it AND the OS saves its register state (XCR0), otherwise the first AVX instruction faults.
// Read by the dispatcher (cpu.cpp) and by the build's probe of the units its machine runs
// (host_isas.cpp), so that the two agree. Compiled without ISA flags.
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

#include <cstdint>

namespace simdnorm {

struct X86Features {
  bool avx2_fma_f16c = false;
  bool avx512 = false;  // F, BW, DQ, VL
  bool avx512_bf16 = false;
  bool amd = false;  // vendor "AuthenticAMD" (runtime/cpu.cpp's tunings)
};

inline uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

inline X86Features detect_x86_features() {
  X86Features f;
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d)) f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;            // SSE and AVX state
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;          // plus opmask, ZMM_Hi256, Hi16_ZMM
  if (!ymm_state || __get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  f.avx2_fma_f16c = avx2 && fma && f16c;
  f.avx512 = f.avx2_fma_f16c && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  if (f.avx512 && a >= 1) {  // leaf 7's subleaf count is in EAX of subleaf 0
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = a & (1u << 5);
  }
  return f;
}

}  // namespace simdnorm
#endif
