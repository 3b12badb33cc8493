// What a layer-norm row can cost at best on this CPU, next to two copies of the same bytes: the
// floors that docs/BENCHMARKS.md compares simdnorm's kernel against. Not part of the package or of
// `python -m simdnorm bench`; build and run by hand (AVX-512 CPUs):
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c bench/native/layer_norm_floor.cpp -o /tmp/lnf
//   /tmp/lnf 4096 768     # rows, elements per row
//
// Prints ns per row (medians of 15 samples of 20 passes over all rows) for, in float16 and float32:
//   memcpy       glibc's memcpy of the rows (np.copyto's path: below glibc's non-temporal
//                threshold it stores through the cache);
//   nt-copy      a copy with 64-byte non-temporal stores (the floor of an op that streams its
//                output to memory, as simdnorm does when input + output exceed half the L3);
//   ln-fused     the same instructions interleaved as simdnorm's kernel runs them (row r
//                normalized while row r + 2 is summed, the normalization as two FMAs): with the
//                rows in L1 it is what the arithmetic costs; ln-floor's sums loop, two
//                accumulators deep, waits on the FMA latency (4 cycles), so it is no floor.
//                (float16 is the case it is for: float32 rows of this size stream from memory,
//                where the kernel's non-temporal stores are not modeled here.)
//   ln-floor     layer norm's instructions with the statistics held constant: per row a sums
//                loop (convert, subtract the pivot, add, square-add; float16 rows also kept as a
//                float32 copy, as simdnorm's kernel does) and a normalize loop ((x - mean) * inv_std
//                * scale + bias, convert, plain stores). No division, square root or reduction waits: what
//                the arithmetic and the memory traffic alone cost.
// The rows start on a 64-byte line; simdnorm's kernel also handles rows that do not.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

template <class Fn>
double median_ns_per_row(Fn&& pass, long rows) {
  double t[15];
  for (double& sample : t) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < 20; ++j) pass();
    sample = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20;
  }
  std::sort(t, t + 15);
  return t[7] * 1e9 / rows;
}

// Loads and stores 16 elements of float16 (F16) or float32 as float32 lanes.
template <bool F16>
__m512 load16(const void* p) {
  if constexpr (F16) return _mm512_cvtph_ps(_mm256_load_si256(static_cast<const __m256i*>(p)));
  else return _mm512_load_ps(p);
}
// The float16 conversion stays in a register (the empty asm) and is stored apart: folded into the
// store, as compilers otherwise emit it, vcvtps2ph to memory made the float16 floor 10% slower on
// this CPU (AMD Zen 5: 47-49 against 43-44 ns a row of 768). simdnorm's kernel measured the same
// or slower that way (docs/BENCHMARKS.md), so only the floor, the fastest form of the
// instructions, takes it.
template <bool F16>
void store16(void* p, __m512 v) {
  if constexpr (F16) {
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    asm("" : "+v"(h));
    _mm256_store_si256(static_cast<__m256i*>(p), h);
  } else {
    _mm512_store_ps(static_cast<float*>(p), v);
  }
}

// A row's sums, two accumulators each as in simdnorm's loop: convert, subtract the pivot, add,
// square-add; float16 rows are also kept as a float32 copy, as simdnorm's kernel does.
template <bool F16>
struct RowSums {
  __m512 pivot = _mm512_set1_ps(0.25f), s1a = _mm512_setzero_ps(), s1b = s1a, s2a = s1a, s2b = s1a;
  // Elements [i, i + 32) of the row at xr.
  void step(const char* xr, float* kept, long i) {
    constexpr long es = F16 ? 2 : 4;
    __m512 a = load16<F16>(xr + i * es), b = load16<F16>(xr + (i + 16) * es);
    if constexpr (F16) {
      _mm512_store_ps(kept + i, a);
      _mm512_store_ps(kept + i + 16, b);
    }
    a = _mm512_sub_ps(a, pivot);
    b = _mm512_sub_ps(b, pivot);
    s1a = _mm512_add_ps(s1a, a);
    s1b = _mm512_add_ps(s1b, b);
    s2a = _mm512_fmadd_ps(a, a, s2a);
    s2b = _mm512_fmadd_ps(b, b, s2b);
  }
  void taken() const { asm volatile("" ::"v"(s1a), "v"(s1b), "v"(s2a), "v"(s2b)); }  // taken, not used
};

template <bool F16>
void run(long rows, long len) {
  constexpr long es = F16 ? 2 : 4;
  const size_t bytes = static_cast<size_t>(rows * len * es + 63) / 64 * 64;
  char* x = static_cast<char*>(std::aligned_alloc(64, bytes));
  char* y = static_cast<char*>(std::aligned_alloc(64, bytes));
  float* scale = static_cast<float*>(std::aligned_alloc(64, len * 4));
  float* bias = static_cast<float*>(std::aligned_alloc(64, len * 4));
  float* ring = static_cast<float*>(std::aligned_alloc(64, 3 * len * 4));  // float16 rows' float32 copies
  for (long i = 0; i < rows * len; ++i) {  // normal values in [-2, 2): no subnormal operands
    const float v = static_cast<float>(i * 7919 % 4001) / 1000.0f - 2.0f;
    if constexpr (F16) {
      const unsigned short h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
      std::memcpy(x + i * es, &h, 2);
    } else {
      std::memcpy(x + i * es, &v, 4);
    }
  }
  std::memset(y, 0, bytes);
  for (long i = 0; i < len; ++i) {
    scale[i] = 1.0f + i * 1e-3f;
    bias[i] = 0.5f;
  }
  const double copy = median_ns_per_row([&] { std::memcpy(y, x, bytes); asm volatile("" ::: "memory"); }, rows);
  const double nt = median_ns_per_row([&] {
    for (size_t i = 0; i < bytes; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(y + i), _mm512_load_si512(x + i));
    _mm_sfence();
  }, rows);
  const double floor = median_ns_per_row([&] {
    const __m512 mean = _mm512_set1_ps(0.01f), inv_std = _mm512_set1_ps(1.1f);
    for (long r = 0; r < rows; ++r) {
      const char* xr = x + r * len * es;
      char* yr = y + r * len * es;
      float* kept = ring + (r % 3) * len;
      RowSums<F16> sums;
      for (long i = 0; i + 32 <= len; i += 32) sums.step(xr, kept, i);
      sums.taken();
      for (long i = 0; i + 32 <= len; i += 32) {
        for (long h = i; h < i + 32; h += 16) {
          const __m512 v = F16 ? _mm512_load_ps(kept + h) : load16<F16>(xr + h * es);
          const __m512 n = _mm512_mul_ps(_mm512_sub_ps(v, mean), inv_std);
          store16<F16>(yr + h * es, _mm512_fmadd_ps(n, _mm512_load_ps(scale + h), _mm512_load_ps(bias + h)));
        }
      }
    }
    asm volatile("" ::: "memory");
  }, rows);
  // The two loops in one, as simdnorm's kernel runs them: row r normalized (from its float32 copy,
  // for float16) while row r + 2 is summed, and the normalization in its two-FMA form.
  const double fused = median_ns_per_row([&] {
    const __m512 neg_mean_x_inv = _mm512_set1_ps(-0.011f), inv_std = _mm512_set1_ps(1.1f);
    for (long r = 0; r < rows; ++r) {
      const long next = r + 2 < rows ? r + 2 : r;  // the last two rows sum themselves again
      const char* xn = x + next * len * es;
      const char* xr = x + r * len * es;
      char* yr = y + r * len * es;
      float* kept_next = ring + (next % 3) * len;
      const float* kept = ring + (r % 3) * len;
      RowSums<F16> sums;
      for (long i = 0; i + 32 <= len; i += 32) {
        for (long h = i; h < i + 32; h += 16) {
          const __m512 v = F16 ? _mm512_load_ps(kept + h) : load16<F16>(xr + h * es);
          const __m512 n = _mm512_fmadd_ps(v, inv_std, neg_mean_x_inv);
          store16<F16>(yr + h * es, _mm512_fmadd_ps(n, _mm512_load_ps(scale + h), _mm512_load_ps(bias + h)));
        }
        sums.step(xn, kept_next, i);
      }
      sums.taken();
    }
    asm volatile("" ::: "memory");
  }, rows);
  std::printf("%s rows of %ld: memcpy %.1f  nt-copy %.1f  ln-floor %.1f  ln-fused %.1f ns/row  (ln-floor / memcpy %.2f, "
              "ln-fused / memcpy %.2f)\n",
              F16 ? "float16" : "float32", len, copy, nt, floor, fused, floor / copy, fused / copy);
  std::free(x);
  std::free(y);
  std::free(scale);
  std::free(bias);
  std::free(ring);
}

}  // namespace

int main(int argc, char** argv) {
  const long rows = argc > 1 ? std::atol(argv[1]) : 4096, len = argc > 2 ? std::atol(argv[2]) : 768;
  if (rows < 1 || len < 32 || len % 32 != 0) {
    std::fprintf(stderr, "usage: %s [rows >= 1] [elements per row: a multiple of 32]\n", argv[0]);
    return 2;
  }
  run<true>(rows, len);
  run<false>(rows, len);
}
