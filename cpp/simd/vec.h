// The thin vector layer: the only file that names intrinsics.
//
// Included once per instruction set, inside `namespace simdnorm::<isa> { namespace { ... } }` of a
// translation unit compiled with that ISA's flags (see cpp/kernels/isa_unit.cpp). Everything here has
// internal linkage, so no AVX-compiled copy of a function can be picked by the linker for baseline
// code. The width follows the flags the unit is compiled with:
//   AVX-512 F/BW/DQ/VL: 16 float lanes, masked loads and stores for heads and tails;
//   AVX2 + FMA + F16C:  8 float lanes;
//   baseline:           4 float lanes of the compiler's generic vectors (SSE2 on x86-64, NEON on arm64).
// Arithmetic uses GCC/Clang vector extensions (the operators), intrinsics only where the generic
// form would be slow or unavailable: FMA, half-precision conversion, masked memory access, rounding.
//
// Compute types: `vf` (float lanes) for float32/float16/bfloat16 data, `vd` (double lanes, half as
// many) for float64 data. Every helper below has both overloads, so kernels and activations are
// written once as templates on the compute type.

#if defined(__AVX512BF16__)
constexpr int kWidth = 16;
constexpr const char* kIsaName = "avx512bf16";
#elif defined(__AVX512F__)
constexpr int kWidth = 16;
constexpr const char* kIsaName = "avx512";
#elif defined(__AVX2__)
constexpr int kWidth = 8;
constexpr const char* kIsaName = "avx2";
#else
constexpr int kWidth = 4;
constexpr const char* kIsaName = "baseline";
#endif
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;  // (AVX2, SSE2; NEON has 32, counted low)
#endif

typedef float vf __attribute__((vector_size(kWidth * 4)));
typedef int32_t vi __attribute__((vector_size(kWidth * 4)));
typedef uint32_t vu __attribute__((vector_size(kWidth * 4)));
typedef uint16_t vh __attribute__((vector_size(kWidth * 2)));
constexpr int kWidthD = kWidth / 2;  // double lanes
typedef double vd __attribute__((vector_size(kWidth * 4)));
typedef int64_t vl __attribute__((vector_size(kWidth * 4)));
typedef uint64_t vul __attribute__((vector_size(kWidth * 4)));

// Storage tags for the 16-bit formats (the bits, as numpy holds them).
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

// Calls fn(Storage<T>{}) for the storage type T of `dtype`: the kernels' entry points switch on a
// tensor's dtype here, and only here.
template <class T>
struct Storage {
  using type = T;
};
template <class Fn>
static inline void with_storage_type(DType dtype, Fn&& fn) {
#if defined(SIMDNORM_DELEGATE_NS)
  // A unit of bfloat16's kernels only (kernels/isa_unit.cpp): its table hands it nothing else.
  SIMDNORM_CHECK(dtype == DType::bf16);
  return fn(Storage<bf16_t>{});
#else
  switch (dtype) {
    case DType::f32: return fn(Storage<float>{});
    case DType::f16: return fn(Storage<f16_t>{});
    case DType::bf16: return fn(Storage<bf16_t>{});
    case DType::f64: return fn(Storage<double>{});
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Arithmetic on vf and vd (the same names, so templates serve both).
// (Not `vf{} + x`: that adds +0.0, which turns -0.0 into +0.0.)
static inline vf vbroadcast(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX2__)
  return (vf)_mm256_set1_ps(x);
#else
  return (vf){x, x, x, x};
#endif
}
static inline vd vbroadcast_vd(double x) {
#if defined(__AVX512F__)
  return (vd)_mm512_set1_pd(x);
#elif defined(__AVX2__)
  return (vd)_mm256_set1_pd(x);
#else
  return (vd){x, x};
#endif
}

static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
static inline vd vfma(vd a, vd b, vd c) {
#if defined(__AVX512F__)
  return (vd)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__AVX2__)
  return (vd)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
  return vd{std::fma(a[0], b[0], c[0]), std::fma(a[1], b[1], c[1])};  // fused: vmath.h relies on it
#endif
}

// min/max with x86 semantics: when either operand is NaN the SECOND operand is returned. Callers put
// the data second (vmax(zero, x)) so that NaN propagates.
static inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}
static inline vf vmin(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX2__)
  return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#else
  return a < b ? a : b;
#endif
}
static inline vd vmax(vd a, vd b) {
#if defined(__AVX512F__)
  return (vd)_mm512_max_pd((__m512d)a, (__m512d)b);
#elif defined(__AVX2__)
  return (vd)_mm256_max_pd((__m256d)a, (__m256d)b);
#else
  return a > b ? a : b;
#endif
}
static inline vd vmin(vd a, vd b) {
#if defined(__AVX512F__)
  return (vd)_mm512_min_pd((__m512d)a, (__m512d)b);
#elif defined(__AVX2__)
  return (vd)_mm256_min_pd((__m256d)a, (__m256d)b);
#else
  return a < b ? a : b;
#endif
}

static inline vf vabs(vf a) { return (vf)((vu)a & 0x7fffffffu); }
static inline vd vabs(vd a) { return (vd)((vul)a & 0x7fffffffffffffffull); }

static inline vf vsqrt(vf a) {
#if defined(__AVX512F__)
  return (vf)_mm512_sqrt_ps((__m512)a);
#elif defined(__AVX2__)
  return (vf)_mm256_sqrt_ps((__m256)a);
#else
  vf r;
  for (int i = 0; i < kWidth; ++i) r[i] = std::sqrt(a[i]);
  return r;
#endif
}
static inline vd vsqrt(vd a) {
#if defined(__AVX512F__)
  return (vd)_mm512_sqrt_pd((__m512d)a);
#elif defined(__AVX2__)
  return (vd)_mm256_sqrt_pd((__m256d)a);
#else
  return vd{std::sqrt(a[0]), std::sqrt(a[1])};
#endif
}

// 1 / sqrt(v) within a few units of 2^-53 of it (relative), not the bits of 1.0 / sqrt(v): for
// callers that round it to float where no rounding boundary lies that close (kernels/lane_stats.h).
// NaN for v outside [2^-120, 2^120], where the steps' squares could leave double's normal range
// (and AVX2's estimate float's). The hardware's estimate (AVX-512's 14 bits, AVX2's float 12) takes
// Newton steps in double; the baseline has none and takes the division.
#if defined(__AVX512F__) || defined(__AVX2__)
constexpr bool kInvSqrtNearIsFast = true;
#else
constexpr bool kInvSqrtNearIsFast = false;
#endif
static inline vd vinv_sqrt_near(vd v) {
#if defined(__AVX512F__)
  vd y = (vd)_mm512_rsqrt14_pd((__m512d)v);
  constexpr int kSteps = 2;
#elif defined(__AVX2__)
  vd y = (vd)_mm256_cvtps_pd(_mm_rsqrt_ps(_mm256_cvtpd_ps((__m256d)v)));
  constexpr int kSteps = 3;
#else
  vd y = 1.0 / vsqrt(v);
  constexpr int kSteps = 0;
#endif
  y = (v >= 0x1p-120) & (v <= 0x1p120) ? y : vbroadcast_vd(__builtin_nan(""));
  const vd minus_half_v = v * -0.5, three_halves = vbroadcast_vd(1.5);
  for (int i = 0; i < kSteps; ++i) y = y * vfma(minus_half_v, y * y, three_halves);
  return y;
}

// Round to nearest, ties to even (valid for |x| < 2^22 in the baseline form, which is all the
// range reductions need).
static inline vf vround(vf a) {
#if defined(__AVX512F__)
  return (vf)_mm512_roundscale_ps((__m512)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
  return (vf)_mm256_round_ps((__m256)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf magic = vbroadcast(12582912.0f);  // 1.5 * 2^23
  return (a + magic) - magic;
#endif
}
// The same on double lanes (valid for |x| < 2^51 in the baseline form: SSE2 has no roundpd).
static inline vd vround(vd a) {
#if defined(__AVX512F__)
  return (vd)_mm512_roundscale_pd((__m512d)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
  return (vd)_mm256_round_pd((__m256d)a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vd magic = vbroadcast_vd(6755399441055744.0);  // 1.5 * 2^52
  return (a + magic) - magic;
#endif
}

// Select lanewise: m ? a : b, where m comes from a comparison of vf (a vi of 0 / -1).
static inline vf vselect(vi m, vf a, vf b) { return m ? a : b; }
static inline vd vselect(vl m, vd a, vd b) { return m ? a : b; }

// Whether a >= b in any lane (false for NaN lanes).
static inline bool vany_ge(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GE_OQ) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_GE_OQ)) != 0;
#else
  for (int i = 0; i < kWidth; ++i)
    if (a[i] >= b[i]) return true;
  return false;
#endif
}
static inline bool vany_ge(vd a, vd b) {
#if defined(__AVX512F__)
  return _mm512_cmp_pd_mask((__m512d)a, (__m512d)b, _CMP_GE_OQ) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_pd(_mm256_cmp_pd((__m256d)a, (__m256d)b, _CMP_GE_OQ)) != 0;
#else
  for (int i = 0; i < kWidthD; ++i)
    if (a[i] >= b[i]) return true;
  return false;
#endif
}

// Whether any lane of a comparison's mask (0 / -1 lanes) is set.
static inline bool vany(vl m) {
#if defined(__AVX512F__)
  return _mm512_test_epi64_mask((__m512i)m, (__m512i)m) != 0;
#elif defined(__AVX2__)
  return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
  return (m[0] | m[1]) != 0;
#endif
}

// Lanes [0, m) set, the rest clear (0 <= m <= kWidth), for vselect: masks the unused lanes of a
// partial vector, or the lanes of a vector that belong to one row of two. At AVX-512 a mask
// register, set from (1 << m) - 1 with one kmovw: the compare of a broadcast m against 0..15 takes
// two operations on the vector pipes the arithmetic is bound by.
#if defined(__AVX512F__)
typedef __mmask16 vmask;
typedef __mmask8 vmaskd;
static inline vmask vlanes_below(int m) { return static_cast<vmask>((1u << m) - 1u); }
static inline vmaskd vlanes_below_d(int m) { return static_cast<vmaskd>((1u << m) - 1u); }
static inline vf vselect(vmask m, vf a, vf b) { return (vf)_mm512_mask_blend_ps(m, (__m512)b, (__m512)a); }
static inline vd vselect(vmaskd m, vd a, vd b) { return (vd)_mm512_mask_blend_pd(m, (__m512d)b, (__m512d)a); }
#else
typedef vi vmask;
typedef vl vmaskd;
static inline vmask vlanes_below(int m) {
  vi iota;
  for (int i = 0; i < kWidth; ++i) iota[i] = i;  // folds to a constant
  return iota < m;
}
static inline vmaskd vlanes_below_d(int m) {
  vl iota;
  for (int i = 0; i < kWidthD; ++i) iota[i] = i;
  return iota < m;
}
#endif
// The lanes [0, m) of the compute type V (named by a null pointer to it): a mask for vselect.
static inline vmask lanes_mask(vf*, int m) { return vlanes_below(m); }
static inline vmaskd lanes_mask(vd*, int m) { return vlanes_below_d(m); }

static inline vi vto_int(vf a) { return __builtin_convertvector(a, vi); }  // truncates
static inline vf vto_float(vi a) { return __builtin_convertvector(a, vf); }
static inline vi vbits(vf a) { return (vi)a; }
static inline vf vfrom_bits(vi a) { return (vf)a; }
static inline vl vbits(vd a) { return (vl)a; }
static inline vd vfrom_bits(vl a) { return (vd)a; }
// Integral double lanes (|a| < 2^51) to int64 lanes and back, exact. AVX-512DQ has the instructions;
// elsewhere (AVX2 and SSE2 have no packed int64 <-> double conversion) 1.5 * 2^52 added to such an
// integer holds it, two's complement, in the low mantissa bits. Unsigned lane arithmetic: no signed
// overflow for the lanes of NaN or infinite inputs (whose results callers discard).
static inline vl vto_long(vd a) {
#if defined(__AVX512DQ__)
  return (vl)_mm512_cvtpd_epi64((__m512d)a);  // rounds to nearest: exact for integral a
#else
  const vd magic = vbroadcast_vd(6755399441055744.0);  // 1.5 * 2^52
  return (vl)((vul)(a + magic) - (vul)magic);
#endif
}
static inline vd vto_double(vl a) {
#if defined(__AVX512DQ__)
  return (vd)_mm512_cvtepi64_pd((__m512i)a);
#else
  const vd magic = vbroadcast_vd(6755399441055744.0);
  return (vd)((vul)a + (vul)magic) - magic;
#endif
}

// The low and the high half of a vf's lanes, as doubles (exact): the statistics sum float data in
// double lanes.
static inline vd vwiden_lo(vf a) {
#if defined(__AVX512F__)
  return (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)a));
#elif defined(__AVX2__)
  return (vd)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)a));
#else
  return vd{a[0], a[1]};
#endif
}
static inline vd vwiden_hi(vf a) {
#if defined(__AVX512F__)
  return (vd)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)a), 1)));
#elif defined(__AVX2__)
  return (vd)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)a, 1));
#else
  return vd{a[2], a[3]};
#endif
}

// Both halves at once; of double lanes, the lanes themselves (first).
static inline std::pair<vd, vd> vwiden(vf a) { return {vwiden_lo(a), vwiden_hi(a)}; }
static inline std::pair<vd, vd> vwiden(vd a) { return {a, a}; }
// vwiden undone: a's lanes then b's, each rounded to float (to nearest, as a cast).
static inline vf vnarrow(vd a, vd b) {
#if defined(__AVX512F__)
  const __m256 lo = _mm512_cvtpd_ps((__m512d)a), hi = _mm512_cvtpd_ps((__m512d)b);
  return (vf)_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
#elif defined(__AVX2__)
  return (vf)_mm256_set_m128(_mm256_cvtpd_ps((__m256d)b), _mm256_cvtpd_ps((__m256d)a));
#else
  return vf{(float)a[0], (float)a[1], (float)b[0], (float)b[1]};
#endif
}
// The compute type's lanes of vwiden's halves (templates on V use this): of double lanes, a.
template <class V> static inline V vnarrow_to(vd a, vd b);
template <> inline vf vnarrow_to<vf>(vd a, vd b) { return vnarrow(a, b); }
template <> inline vd vnarrow_to<vd>(vd a, vd) { return a; }

// kWidthD floats from p, as doubles: vwiden_lo of a load, without loading the other half (widening
// the high half of a loaded vector takes an extract more).
static inline vd vload_widened(const float* p) {
#if defined(__AVX512F__)
  return (vd)_mm512_cvtps_pd(_mm256_loadu_ps(p));
#elif defined(__AVX2__)
  return (vd)_mm256_cvtps_pd(_mm_loadu_ps(p));
#else
  float two[2];
  std::memcpy(two, p, sizeof two);  // (p may be misaligned: float32 data at any byte offset)
  return vd{two[0], two[1]};
#endif
}

// Sum of the lanes in a fixed order (the result must not depend on anything but the lanes).
static inline float vreduce_add(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)a);
#elif defined(__AVX2__)
  // A tree, as AVX-512's: the halves, then their halves (6 instructions, not 15 for the lanes in
  // order, and half the latency: the backward sums a row's two of these per row).
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.0f;
  for (int i = 0; i < kWidth; ++i) s += a[i];
  return s;
#endif
}
// vreduce_add(a) and vreduce_add(b), each lane tree as vreduce_add's (the same bits), their
// shuffles shared: the backward reduces two sums a run, a tree each per run on short runs.
static inline void vreduce_add2(vf a, vf b, float& ra, float& rb) {
#if defined(__AVX512F__)
  const __m512 h = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xEE),
                                 _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x44));  // a's 8 | b's 8
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(h, h, 0xF5), h);  // 128-bit lanes 0 and 2: 4 each
  const __m512 p = _mm512_add_ps(q, _mm512_shuffle_ps(q, q, 0x4E));     // lanes 0, 1 of each: 2 each
  const __m512 s = _mm512_add_ps(p, _mm512_movehdup_ps(p));             // lanes 0 and 8
  ra = _mm512_cvtss_f32(s);
  rb = _mm512_cvtss_f32(_mm512_shuffle_f32x4(s, s, 0x02));
#elif defined(__AVX2__)
  const __m256 h = _mm256_add_ps(_mm256_permute2f128_ps((__m256)a, (__m256)b, 0x20),
                                 _mm256_permute2f128_ps((__m256)a, (__m256)b, 0x31));  // a's 4 | b's 4
  const __m256 p = _mm256_add_ps(h, _mm256_permute_ps(h, 0xEE));
  const __m256 s = _mm256_add_ps(p, _mm256_movehdup_ps(p));  // lanes 0 and 4
  ra = _mm256_cvtss_f32(s);
  rb = _mm_cvtss_f32(_mm256_extractf128_ps(s, 1));
#else
  ra = vreduce_add(a), rb = vreduce_add(b);
#endif
}
static inline double vreduce_add(vd a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_pd((__m512d)a);
#else
  double s = 0.0;
  for (int i = 0; i < kWidthD; ++i) s += a[i];
  return s;
#endif
}
static inline void vreduce_add2(vd a, vd b, double& ra, double& rb) { ra = vreduce_add(a), rb = vreduce_add(b); }

#include "simd/half.h"

// Copies `bytes` from src to dst with non-temporal stores: 4-byte ones up to a 16-byte boundary,
// then 16-byte ones, then 4-byte ones. Writing a partial line this way (a row's head or tail,
// whose other part the next or previous row writes the same way) keeps the line out of the cache
// like the rest of a streamed output: a plain store to it costs a read of the line from memory
// (not every loop gains by it: see ContiguousRun).
// A dst that is not 4-byte aligned (2-byte elements at an odd phase) and a 2-byte rest take plain
// stores. Out of line: it runs once or twice a row, and inlined it grew the loops that call it.
__attribute__((noinline)) static void stream_bytes(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(d) % 4 == 0) {
    auto stream4 = [&] {
      int v;
      std::memcpy(&v, s, 4);
      _mm_stream_si32(reinterpret_cast<int*>(d), v);
      d += 4, s += 4, bytes -= 4;
    };
    while (bytes >= 4 && reinterpret_cast<uintptr_t>(d) % 16 != 0) stream4();
    for (; bytes >= 16; d += 16, s += 16, bytes -= 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    while (bytes >= 4) stream4();
  }
#endif
  std::memcpy(d, s, static_cast<size_t>(bytes));
}

// ---------------------------------------------------------------------------------------------
// Loads and stores: full vectors at any alignment, and partial vectors of n < kWidth lanes (lanes
// past n read as zero and are not written). All go through the same conversions, so an element
// computes to the same bits whichever path it takes.
template <class T> struct Lanes;

#if defined(__AVX512F__)
static inline __mmask16 tail_mask(int n) { return (__mmask16)((1u << n) - 1u); }
static inline __mmask16 span_mask(int lo, int hi) { return (__mmask16)((1u << hi) - (1u << lo)); }  // lo <= hi
static inline __mmask8 tail_mask_d(int n) { return (__mmask8)((1u << n) - 1u); }
#endif

// The full-precision lanes, float in vf and double in vd: the instructions that differ by element
// type, then one Lanes for both.
static inline void stream_vector(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX2__)
  _mm256_stream_ps(p, (__m256)v);
#elif defined(__SSE2__)
  _mm_stream_ps(p, (__m128)v);
#else
  std::memcpy(p, &v, sizeof v);
#endif
}
static inline void stream_vector(double* p, vd v) {
#if defined(__AVX512F__)
  _mm512_stream_pd(p, (__m512d)v);
#elif defined(__AVX2__)
  _mm256_stream_pd(p, (__m256d)v);
#elif defined(__SSE2__)
  _mm_stream_pd(p, (__m128d)v);
#else
  std::memcpy(p, &v, sizeof v);
#endif
}
// Partial vectors (heads, tails) by masked loads and stores, except under ASan, which does not see
// those: there element copies, which it checks, keep its bounds checks on every head and tail.
// (tests/test_guard_pages.py covers the masked instructions, every array flush against a page
// that faults.)
#if (defined(__AVX512F__) || defined(__AVX2__)) && !defined(__SANITIZE_ADDRESS__)
#define SIMDNORM_MASKED_PARTIALS 1
#else
#define SIMDNORM_MASKED_PARTIALS 0
#endif
#if defined(__AVX512F__)
static inline vf masked_load(const float* p, int n) { return (vf)_mm512_maskz_loadu_ps(tail_mask(n), p); }
static inline vd masked_load(const double* p, int n) { return (vd)_mm512_maskz_loadu_pd(tail_mask_d(n), p); }
static inline void masked_store(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, tail_mask(n), (__m512)v); }
static inline void masked_store(double* p, vd v, int n) { _mm512_mask_storeu_pd(p, tail_mask_d(n), (__m512d)v); }
#elif defined(__AVX2__)
// vmaskmov touches only lanes [0, n) (no fault past them): a memcpy of a variable length would
// call the library and send the vector through the stack, a stalled store-to-load forward each.
static inline vf masked_load(const float* p, int n) { return (vf)_mm256_maskload_ps(p, (__m256i)vlanes_below(n)); }
static inline vd masked_load(const double* p, int n) { return (vd)_mm256_maskload_pd(p, (__m256i)vlanes_below_d(n)); }
static inline void masked_store(float* p, vf v, int n) { _mm256_maskstore_ps(p, (__m256i)vlanes_below(n), (__m256)v); }
static inline void masked_store(double* p, vd v, int n) {
  _mm256_maskstore_pd(p, (__m256i)vlanes_below_d(n), (__m256d)v);
}
#endif

template <class E, class Vec>
struct FullLanes {
  using V = Vec;
  static constexpr int W = sizeof(Vec) / sizeof(E);
  static V load(const E* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(E* p, V v) { std::memcpy(p, &v, sizeof v); }
  static void store2(E* p, V v0, V v1) {
    store(p, v0);
    store(p + W, v1);
  }
  // Non-temporal stores of two consecutive vectors to a 64-byte aligned address (bypasses the
  // cache: no read-for-ownership of the destination lines). The caller fences with stream_fence().
  static void store2_stream(E* p, V v0, V v1) {
    stream_vector(p, v0);
    stream_vector(p + W, v1);
  }
  // One vector, non-temporally (stream: to an address aligned to kVectorBytes; the caller
  // fences) or not.
  static constexpr int kVectorBytes = sizeof(Vec);
  static void store_or_stream(E* p, V v, bool stream) {
    if (stream) stream_vector(p, v);
    else store(p, v);
  }
  static V load_partial(const E* p, int n) {
#if SIMDNORM_MASKED_PARTIALS
    return masked_load(p, n);
#else
    V v = {};
    std::memcpy(&v, p, sizeof(E) * n);
    return v;
#endif
  }
  static void store_partial(E* p, V v, int n) {
#if SIMDNORM_MASKED_PARTIALS
    masked_store(p, v, n);
#else
    std::memcpy(p, &v, sizeof(E) * n);
#endif
  }
  static void store_partial_stream(E* p, V v, int n) { stream_bytes(p, &v, sizeof(E) * n); }
  static E load_one(const E* p) { E x; std::memcpy(&x, p, sizeof x); return x; }
  static void store_one(E* p, E x) { std::memcpy(p, &x, sizeof x); }
};
template <> struct Lanes<float> : FullLanes<float, vf> {};
// float64 data computes in double lanes.
template <> struct Lanes<double> : FullLanes<double, vd> {};

// Packs the low 16 bits of each lane.
static inline vh narrow16(vu a) { return __builtin_convertvector(a, vh); }
#if defined(__AVX2__) && !defined(__AVX512F__)
// Two vectors of lanes already under 2^16 as one 32-byte vector of 16-bit lanes, lo's first: a
// saturating pack keeps them as they are, with no mask to clear their high halves first (the
// generic conversion's vpand).
static inline __m256i narrow16_pair_fits(vu lo, vu hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)lo, (__m256i)hi), 0xd8);
}
#endif
// narrow16 for lanes already under 2^16.
static inline vh narrow16_fits(vu a) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return (vh)_mm256_castsi256_si128(narrow16_pair_fits(a, a));
#else
  return narrow16(a);
#endif
}
// Zero-extends each 16-bit lane. (GCC turns the generic conversion of 16 lanes into two 8-lane
// ones, an extract and an insert, where one instruction does.)
static inline vu widen16(vh a) {
#if defined(__AVX512F__)
  return (vu)_mm512_cvtepu16_epi32((__m256i)a);
#elif defined(__AVX2__)
  return (vu)_mm256_cvtepu16_epi32((__m128i)a);
#else
  return __builtin_convertvector(a, vu);
#endif
}

#if !defined(__AVX2__)
// Without F16C, lane by lane, out of line: inlined at every load and store of every loop, the
// branchy scalar conversions made float16 half of the baseline unit's code.
__attribute__((noinline)) static vf vf_from_f16_lanes(vh h) {
  vf r;
  for (int i = 0; i < kWidth; ++i) r[i] = f16_bits_to_float(h[i]);
  return r;
}
__attribute__((noinline)) static vh f16_from_vf_lanes(vf v) {
  vh r;
  for (int i = 0; i < kWidth; ++i) r[i] = float_to_f16_bits(v[i]);
  return r;
}
#endif
static inline vf vf_from_f16(vh h) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__AVX2__)
  return (vf)_mm256_cvtph_ps((__m128i)h);
#else
  return vf_from_f16_lanes(h);
#endif
}
static inline vh f16_from_vf(vf v) {
#if defined(__AVX512F__)
  return (vh)_mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
  return (vh)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return f16_from_vf_lanes(v);
#endif
}
static inline vf vf_from_bf16(vh h) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Each bfloat16 is a float's high half: one byte shuffle of the 8 lanes in both halves puts
  // them there, the low halves zero (a load folds into the broadcast: one shuffle, not a
  // widening and a shift, both on the two shuffle and shift pipes of AMD Zen).
  const __m256i to_high = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                           -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return (vf)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256((__m128i)h), to_high);
#else
  return (vf)(widen16(h) << 16);
#endif
}
// Each lane's bfloat16 bits, in its low 16: rounded to nearest even, a NaN quieted with its sign
// and payload kept.
static inline vu bf16_lanes_from_vf(vf v) {
  const vu x = (vu)v;
  const vu rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const vu quiet_nan = (x >> 16) | 0x40u;
  return v != v ? quiet_nan : rounded;
}
static inline vh bf16_from_vf(vf v) {
#if defined(__AVX512BF16__)
  // One instruction rounds to nearest even and quiets NaN as the integer code below does, but it
  // reads float32 subnormals as zero; a vector holding one (rare) takes the integer code, so every
  // ISA writes the same bits.
  if (_mm512_fpclass_ps_mask((__m512)v, 0x20) == 0) return (vh)_mm512_cvtneps_pbh((__m512)v);
#endif
  return narrow16_fits(bf16_lanes_from_vf(v));
}
#if defined(__AVX2__) && !defined(__AVX512F__)
// Two vectors' bfloat16 bits as one 32-byte vector, lo's lanes first: one pack for both.
static inline __m256i bf16_pair_from_vf(vf lo, vf hi) {
  return narrow16_pair_fits(bf16_lanes_from_vf(lo), bf16_lanes_from_vf(hi));
}
#endif
#if defined(__AVX512BF16__)
// Two vectors at once, lo's lanes first: the same bits as bf16_from_vf of each, with one
// instruction and one test for subnormals for both.
static inline __m512i bf16_from_vf2(vf lo, vf hi) {
  if ((_mm512_fpclass_ps_mask((__m512)lo, 0x20) | _mm512_fpclass_ps_mask((__m512)hi, 0x20)) == 0)
    return (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
  return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)bf16_from_vf(lo)), (__m256i)bf16_from_vf(hi), 1);
}
#endif

template <class Tag, vf (*ToFloat)(vh), vh (*FromFloat)(vf), float (*OneToFloat)(uint16_t),
          uint16_t (*OneFromFloat)(float)>
struct Lanes16 {
  using V = vf;
  static constexpr int W = kWidth;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // The lanes [0, n) as n / 2 pairs (vpmaskmovd, as FullLanes' partial vectors) and an odd last one.
  static __m128i whole_pairs(int n) { return _mm_cmpgt_epi32(_mm_set1_epi32(n >> 1), _mm_setr_epi32(0, 1, 2, 3)); }
#endif
  static vh raw_load_partial(const Tag* p, int n) {
#if SIMDNORM_MASKED_PARTIALS && defined(__AVX512F__)
    return (vh)_mm256_maskz_loadu_epi16(tail_mask(n), p);
#elif SIMDNORM_MASKED_PARTIALS
    __m128i h = _mm_maskload_epi32(reinterpret_cast<const int*>(p), whole_pairs(n));
    if (n & 1) {
      uint16_t last;
      std::memcpy(&last, p + n - 1, 2);
      const __m128i at = _mm_cmpeq_epi16(_mm_set1_epi16(static_cast<short>(n - 1)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
      h = _mm_blendv_epi8(h, _mm_set1_epi16(static_cast<short>(last)), at);
    }
    return (vh)h;
#else
    vh h = {};
    std::memcpy(&h, p, 2 * n);
    return h;
#endif
  }
  static V load(const Tag* p) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    return ToFloat(h);
  }
  static void store(Tag* p, V v) {
    vh h = FromFloat(v);
#if defined(__AVX2__)
    // Keeps the compiler from folding the store into vcvtps2ph's memory form, which costs several
    // times the register form on AMD Zen 4/5.
    __asm__("" : "+x"(h));
#endif
    std::memcpy(p, &h, sizeof h);
  }
#if defined(__AVX512F__)
  // Two vectors as one 64-byte vector of 16-bit values (bfloat16 converts both in one go).
  static __m512i from_float2(V v0, V v1) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same<Tag, bf16_t>::value) return bf16_from_vf2(v0, v1);
#endif
    return _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)FromFloat(v0)), (__m256i)FromFloat(v1), 1);
  }
#endif
  // Two consecutive vectors: one store where one instruction converts both (bfloat16), or one
  // pack joins both (bfloat16 on AVX2), else two (float16's conversion makes one vector's worth;
  // joining two would take an insert more).
  static void store2(Tag* p, V v0, V v1) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same<Tag, bf16_t>::value) {
      _mm512_storeu_si512(p, from_float2(v0, v1));
      return;
    }
#elif defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (std::is_same<Tag, bf16_t>::value) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pair_from_vf(v0, v1));
      return;
    }
#endif
    store(p, v0);
    store(p + W, v1);
  }
  // Two vectors of 16-bit values make one full-width (64-byte on AVX-512) non-temporal store.
  static void store2_stream(Tag* p, V v0, V v1) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), from_float2(v0, v1));
#elif defined(__AVX2__)
    if constexpr (std::is_same<Tag, bf16_t>::value) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_pair_from_vf(v0, v1));
      return;
    }
    const vh h0 = FromFloat(v0), h1 = FromFloat(v1);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_inserti128_si256(_mm256_castsi128_si256((__m128i)h0), (__m128i)h1, 1));
#else
    store2(p, v0, v1);
#endif
  }
  // One vector, non-temporally (stream: to an address aligned to kVectorBytes; the caller
  // fences) or not, converted once either way.
  static constexpr int kVectorBytes = sizeof(vh);
  static void store_or_stream(Tag* p, V v, bool stream) {
    vh h = FromFloat(v);
#if defined(__AVX2__)
    __asm__("" : "+x"(h));  // (as store's)
#endif
#if defined(__AVX512F__)
    if (stream) return _mm256_stream_si256(reinterpret_cast<__m256i*>(p), (__m256i)h);
#elif defined(__AVX2__)
    if (stream) return _mm_stream_si128(reinterpret_cast<__m128i*>(p), (__m128i)h);
#else
    (void)stream;  // (the baseline unit has no streaming stores)
#endif
    std::memcpy(p, &h, sizeof h);
  }
  static V load_partial(const Tag* p, int n) { return ToFloat(raw_load_partial(p, n)); }
  static void store_partial(Tag* p, V v, int n) {
    const vh h = FromFloat(v);
#if SIMDNORM_MASKED_PARTIALS && defined(__AVX512F__)
    _mm256_mask_storeu_epi16(p, tail_mask(n), (__m256i)h);
#elif SIMDNORM_MASKED_PARTIALS
    _mm_maskstore_epi32(reinterpret_cast<int*>(p), whole_pairs(n), (__m128i)h);
    if (n & 1) {
      const uint16_t last = h[n - 1];
      std::memcpy(p + n - 1, &last, 2);
    }
#else
    std::memcpy(p, &h, 2 * n);
#endif
  }
  // Lanes [lo, hi) of the vector at p, in place (the rest read as zero, not written, never
  // touched): the first and last vectors of a stream of rows (fused_rows.h), which start before
  // its first element and end past its last.
  static V load_span(const Tag* p, int lo, int hi) {
#if SIMDNORM_MASKED_PARTIALS && defined(__AVX512F__)
    return ToFloat((vh)_mm256_maskz_loadu_epi16(span_mask(lo, hi), p));
#else
    vh h = {};
    if (hi > lo) std::memcpy(reinterpret_cast<char*>(&h) + 2 * lo, p + lo, 2 * (hi - lo));
    return ToFloat(h);
#endif
  }
  static void store_span(Tag* p, V v, int lo, int hi) {
    const vh h = FromFloat(v);
#if SIMDNORM_MASKED_PARTIALS && defined(__AVX512F__)
    _mm256_mask_storeu_epi16(p, span_mask(lo, hi), (__m256i)h);
#else
    if (hi > lo) std::memcpy(p + lo, reinterpret_cast<const char*>(&h) + 2 * lo, 2 * (hi - lo));
#endif
  }
  static void store_partial_stream(Tag* p, V v, int n) {
    const vh h = FromFloat(v);
    stream_bytes(p, &h, 2 * n);
  }
  static float load_one(const Tag* p) { uint16_t b; std::memcpy(&b, p, 2); return OneToFloat(b); }
  static void store_one(Tag* p, float x) { const uint16_t b = OneFromFloat(x); std::memcpy(p, &b, 2); }
};

template <> struct Lanes<f16_t>
    : Lanes16<f16_t, vf_from_f16, f16_from_vf, f16_bits_to_float, float_to_f16_bits> {};
template <> struct Lanes<bf16_t>
    : Lanes16<bf16_t, vf_from_bf16, bf16_from_vf, bf16_bits_to_float, float_to_bf16_bits> {};

// For the methods of loop cursors (ContiguousRun, ContiguousSums): their state must stay in
// registers, which it does only when every method is inlined into the loop that drives them.
#define SIMDNORM_CURSOR_METHOD inline __attribute__((always_inline))

// The m <= W elements at p through Lanes L: a whole vector with a plain load or store, fewer with
// a partial one (m is a constant where the caller's loop is inlined: one branch folds away).
template <class L, class E>
SIMDNORM_CURSOR_METHOD typename L::V load_up_to(const E* p, int m) {
  return m == L::W ? L::load(p) : L::load_partial(p, m);
}
template <class L, class E>
SIMDNORM_CURSOR_METHOD void store_up_to(E* p, typename L::V v, int m) {
  if (m == L::W) L::store(p, v);
  else L::store_partial(p, v, m);
}

// For a lambda called inside a hot loop (after its parameter list): GCC inlines lambdas by its
// size heuristics, which change as the unit grows; an outlined per-vector lambda (run_row_stream's
// vector_at) costs a call per vector.
#define SIMDNORM_INLINE_LAMBDA __attribute__((always_inline))

// The per-row state of a cursor that runs one or two rows in step: named members, not an array
// (indexed in a loop, an array kept the whole cursor in memory). each(fn) calls fn(state, row);
// fn is a SIMDNORM_INLINE_LAMBDA.
template <class E, int Rows> struct RowsOf;
template <class E> struct RowsOf<E, 1> {
  E r0;
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) { fn(r0, 0); }
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) const { fn(r0, 0); }
};
template <class E> struct RowsOf<E, 2> {
  E r0, r1;
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) { fn(r0, 0); fn(r1, 1); }
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) const { fn(r0, 0); fn(r1, 1); }
};

template <class E> struct RowsOf<E, 4> {
  E r0, r1, r2, r3;
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) { fn(r0, 0); fn(r1, 1); fn(r2, 2); fn(r3, 3); }
  template <class Fn> SIMDNORM_CURSOR_METHOD void each(Fn&& fn) const { fn(r0, 0); fn(r1, 1); fn(r2, 2); fn(r3, 3); }
};

// Calls fn(std::integral_constant<int, I>) for I = First, ..., Last - 1: loops whose index must be
// a constant (a member chosen by it, a template argument). fn is a SIMDNORM_INLINE_LAMBDA.
template <int First, int Last, class Fn>
SIMDNORM_CURSOR_METHOD void for_constant(Fn&& fn) {
  if constexpr (First < Last) {
    fn(std::integral_constant<int, First>{});
    for_constant<First + 1, Last>(fn);
  }
}

// N vectors of doubles as named members, for the same reason as RowsOf: at<q>() is member q.
template <int N> struct VdSet;
template <> struct VdSet<2> {
  vd v0, v1;
  template <int q> SIMDNORM_CURSOR_METHOD vd& at() { return q == 0 ? v0 : v1; }
  template <int q> SIMDNORM_CURSOR_METHOD const vd& at() const { return q == 0 ? v0 : v1; }
};
template <> struct VdSet<4> {
  vd v0, v1, v2, v3;
  template <int q> SIMDNORM_CURSOR_METHOD vd& at() { return q == 0 ? v0 : q == 1 ? v1 : q == 2 ? v2 : v3; }
  template <int q> SIMDNORM_CURSOR_METHOD const vd& at() const { return q == 0 ? v0 : q == 1 ? v1 : q == 2 ? v2 : v3; }
};

// Orders this thread's non-temporal stores before whatever it does next (e.g. signalling "done").
static inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The compute scalar of a storage type: float for the float formats, double for float64.
template <class T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

// A constant in the compute type (templates on V use this instead of naming vf or vd).
template <class V> static inline V splat(double c);
template <> inline vf splat<vf>(double c) { return vbroadcast((float)c); }
template <> inline vd splat<vd>(double c) { return vbroadcast_vd(c); }
