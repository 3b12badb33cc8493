// Accuracy harness for cpp/simd/vmath.h and cpp/kernels/activations.h (standalone: not part of the
// Python build). Includes the headers exactly as a kernel unit does (cpp/kernels/isa_unit.cpp) and
// compares every function and activation (float lanes) against a float64 <cmath> reference, over a
// sweep of float32 bit patterns plus dense windows around every edge (overflow/underflow thresholds,
// algorithm switch points, +-0, +-inf, NaNs). Reports, per function: max error in ulps of the float
// result (subnormal ulp 2^-149; inf counts as 2^128), max absolute error where |result| <= 1, max
// relative error over normal results, the fraction of results off by more than 1 ulp, and the number
// of NaN/inf mismatches.
// float64: the vectors of doubles (vd, what the kernels run on float64 data: vmath.h's own double
// algorithms) are measured in ulps of the double result (subnormal ulp 2^-1074, inf counts as 2^1024) against a
// long double <cmath> reference (64-bit mantissa on x86-64), every function and every activation,
// over two sweeps of double bit patterns (all of them with a stride, and |x| <= 1024 densely, both
// signs) plus 4096 consecutive patterns on each side of every edge, of both signs, and NaN payloads.
//
// Build and run, from the repository root (one binary per ISA; -ffp-contract=off as the kernels):
//   g++ -O2 -ffp-contract=off -std=c++17 -pthread -I cpp/include -I cpp -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c tests/cpp/vmath_accuracy.cpp -o /tmp/vmacc_avx512 && /tmp/vmacc_avx512
//   g++ -O2 -ffp-contract=off -std=c++17 -pthread -I cpp/include -I cpp -mavx2 -mfma -mf16c tests/cpp/vmath_accuracy.cpp -o /tmp/vmacc_avx2 && /tmp/vmacc_avx2
//   g++ -O2 -ffp-contract=off -std=c++17 -pthread -I cpp/include -I cpp tests/cpp/vmath_accuracy.cpp -o /tmp/vmacc_baseline && /tmp/vmacc_baseline
// Options: --math-stride N  sweep every N-th bit pattern for the vmath functions (default 97)
//          --act-stride N   the same for the activations (default 997)
//          --stride N       both; N = 1 is exhaustive (all 2^32 inputs; ~4 min per function on 2 cores)
//          --d-count N      float64 (vd) functions: N inputs in each of the two double sweeps, each
//                           sign (default 2^20)
//          --dact-count N   the same for the float64 activations (default 2^17)
//          --threads T      (default: hardware threads)    --only NAME  (substring filter)
// docs/ACCURACY.md was produced with --math-stride 1 --act-stride 61 (float32) and --only "(vd"
// --d-count 16777216 --dact-count 2097152 (float64). The default run takes < 1 min (15-20 s).
// Exit status 1 if any NaN/inf mismatch or an error above its bound.
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "simdnorm/types.h"

namespace simdnorm {
namespace acc {
namespace {
#include "simd/vec.h"
#include "simd/vmath.h"
#include "kernels/activations.h"
}  // namespace
}  // namespace acc
}  // namespace simdnorm

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace simdnorm;
using acc::vf;
using acc::kWidth;

static float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
static uint32_t to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
static const double kInf = std::numeric_limits<double>::infinity();
static const double kNaN = std::numeric_limits<double>::quiet_NaN();

// ------------------------------------------------------------------------------------------------
// Error measures
struct Stats {
  double max_ulp = 0, max_abs = 0, max_rel = 0;
  float at_ulp = 0, at_abs = 0, at_rel = 0;
  uint64_t n = 0, nan_bad = 0, inf_bad = 0, over1ulp = 0;
  float at_bad = 0;
  void merge(const Stats& o) {
    if (o.max_ulp > max_ulp) { max_ulp = o.max_ulp; at_ulp = o.at_ulp; }
    if (o.max_abs > max_abs) { max_abs = o.max_abs; at_abs = o.at_abs; }
    if (o.max_rel > max_rel) { max_rel = o.max_rel; at_rel = o.at_rel; }
    if (!nan_bad && !inf_bad && (o.nan_bad || o.inf_bad)) at_bad = o.at_bad;
    n += o.n; nan_bad += o.nan_bad; inf_bad += o.inf_bad; over1ulp += o.over1ulp;
  }
  void add(float x, float got, double ref) {
    ++n;
    if (std::isnan(ref) || std::isnan(got)) {
      if (std::isnan(ref) != std::isnan(got)) { if (!nan_bad && !inf_bad) at_bad = x; ++nan_bad; }
      return;
    }
    const float rf = (float)ref;  // the correctly rounded result (double rounding is immaterial here)
    if (std::isinf(ref) || std::isinf(got) || std::isinf(rf)) {
      if (got == rf) return;
      if (std::isinf(ref) || got == -rf) { if (!nan_bad && !inf_bad) at_bad = x; ++inf_bad; return; }
    }
    const double g = std::isinf(got) ? std::copysign(0x1p128, got) : (double)got;
    int e;
    std::frexp(ref, &e);
    const int ex = std::min(std::max(e - 1, -126), 127);
    const double err = std::fabs(g - ref);
    const double ulp = err / std::ldexp(1.0, ex - 23);
    if (ulp > max_ulp) { max_ulp = ulp; at_ulp = x; }
    if (ulp > 1.0) ++over1ulp;
    if (std::fabs(ref) <= 1.0 && err > max_abs) { max_abs = err; at_abs = x; }
    if (std::fabs(ref) >= 0x1p-126 && !std::isinf(got)) {
      const double rel = err / std::fabs(ref);
      if (rel > max_rel) { max_rel = rel; at_rel = x; }
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Inputs: a strided sweep of all bit patterns, plus windows of consecutive patterns around edges.
static const float kEdges[] = {
    0.0f, 1.0f, 0x1p-126f, 0x1p-24f, 0.5f, 2.0f, 16.0f, 0x1p24f, 3.40282347e38f,
    88.7228394f, 88.3762589f, 89.0f, 87.3365479f, 103.972084f, 103.278931f, 104.0f, 120.0f,  // exp
    0.346573591f, 0.693147181f, 17.3286800f, 88.0f, 86.6433868f,                             // expm1
    0.292893219f, 0.414213562f, 0.70710678f, 1.41421356f, 0.5f,                              // log1p
    9.01091385f, 9.1f, 0.625f, 8.66434002f, 16.6355324f,                                    // tanh, sigmoid
    0.921875f, 3.9200000f, 3.83f, 4.0f, 10.3f, 10.0f,                                        // erf
    0.707106769f, 1.30373204f, 14.1f, 14.5f, 5.5f,                                           // gelu
    0.01f, 0.2f, 2.5f, 3.0f, 6.0f, 0.9f, 0.4f, 1.25f, 1.67326f, 0.66f,                       // params
};
static const uint32_t kWindow = 1u << 12;
static const uint32_t kNaNs[] = {0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0xffc00000u, 0xff800001u,
                                 0x7fa00000u, 0xfff00000u};

static void make_edges(std::vector<uint32_t>& edges) {
  for (float e : kEdges) {
    for (float s : {e, -e}) {
      const uint32_t b = to_bits(s);
      for (uint32_t d = 0; d < 2 * kWindow; ++d) edges.push_back(b - kWindow + d);
    }
  }
  for (uint32_t b = 0x7f800000u - kWindow; b <= 0x7f800000u; ++b) { edges.push_back(b); edges.push_back(b | 0x80000000u); }
  for (uint32_t b : kNaNs) edges.push_back(b);
}

// Runs f (vf -> vf) over the sweep (every stride-th pattern) and the edge list, comparing with ref.
static Stats run(vf (*f)(vf, const void*), const void* ctx,
                 double (*ref)(double, const void*), uint64_t stride, int threads,
                 const std::vector<uint32_t>& edges) {
  std::vector<Stats> part(threads);
  const uint64_t total = (1ull << 32) / stride + 1;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Stats st;
      auto do_block = [&](const uint32_t* bits, int cnt) {
        alignas(64) float in[kWidth] = {}, out[kWidth];
        for (int j = 0; j < cnt; ++j) in[j] = from_bits(bits[j]);
        vf v;
        std::memcpy(&v, in, sizeof v);
        const vf r = f(v, ctx);
        std::memcpy(out, &r, sizeof r);
        for (int j = 0; j < cnt; ++j) st.add(in[j], out[j], ref((double)in[j], ctx));
      };
      const uint64_t lo = total * t / threads, hi = total * (t + 1) / threads;
      uint32_t bits[kWidth];
      for (uint64_t i = lo; i < hi; i += kWidth) {
        int cnt = 0;
        for (uint64_t k = i; k < std::min(hi, i + kWidth); ++k) {
          const uint64_t b = k * stride;
          if (b > 0xffffffffull) break;
          bits[cnt++] = (uint32_t)b;
        }
        if (cnt) do_block(bits, cnt);
      }
      const size_t elo = edges.size() * t / threads, ehi = edges.size() * (t + 1) / threads;
      for (size_t i = elo; i < ehi; i += kWidth) do_block(&edges[i], (int)std::min<size_t>(kWidth, ehi - i));
      part[t] = st;
    });
  }
  for (auto& th : pool) th.join();
  Stats all;
  for (auto& p : part) all.merge(p);
  return all;
}

// ------------------------------------------------------------------------------------------------
// References (float64) and the functions under test.
// (Templates: T = double is the float64 reference of the float32 checks, computed as before; T = long
// double is the reference of the float64 (vd) checks, with the products that can cancel fused.)
template <class T> static T r_sigmoid(T x) { return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x)); }
template <class T> static T r_softplus(T z) { return (z > 0 ? z : T(0)) + std::log1p(std::exp(-std::fabs(z))); }
template <class T> static T r_mul_add(double p, T x, double q) {
  if constexpr (std::is_same<T, double>::value) return p * x + q;
  else return std::fma(T(p), x, T(q));
}

// gelu in long double: 0.5 x erfc(y), y = -x / sqrt2, with erfc's first-order correction for the
// rounding of y (erfc's condition number is 2 y^2: the rounding of y alone would cost up to 0.7 double
// ulp at y = -27).
static long double r_gelu_ld(long double x) {
  if (std::isinf(x)) return x > 0 ? x : -0.0L;  // the limits (-0 from below)
  const long double c = 0.707106781186547524400844362104849039L;  // 1/sqrt2 = c + c_lo (x86-64 long double)
  const long double c_lo = 1.895032558893257079655062e-20L;
  static_assert(std::numeric_limits<long double>::digits == 64, "the long double reference assumes x86's 64-bit mantissa");
  const long double y = -x * c, y_err = std::fma(-x, c, -y) - x * c_lo;
  return 0.5L * x * (std::erfc(y) - 1.128379167095512573896158903121545L * std::exp(-y * y) * y_err);
}

template <class T>
static T ref_act(const Activation& a, T x) {
  const T p0 = a.p0, p1 = a.p1;
  const T inf = std::numeric_limits<T>::infinity();
  if (std::isnan(x)) return std::numeric_limits<T>::quiet_NaN();
  switch (a.kind) {
    case ActKind::identity: return x;
    case ActKind::linear: return r_mul_add(a.p0, x, a.p1);
    case ActKind::relu: return x > 0 ? x : T(0);
    case ActKind::leaky_relu: return x >= 0 ? x : p0 * x;
    case ActKind::thresholded_relu: return x > p0 ? x : T(0);
    case ActKind::elu: return x >= 0 ? x : p0 * std::expm1(x);
    case ActKind::celu: return std::max(T(0), x) + std::min(T(0), p0 * std::expm1(x / p0));
    case ActKind::scaled_elu: return p1 * (x > 0 ? x : p0 * std::expm1(x));
    case ActKind::sigmoid: return r_sigmoid(x);
    case ActKind::hard_sigmoid: return std::max(T(0), std::min(r_mul_add(a.p0, x, a.p1), T(1)));
    case ActKind::tanh: return std::tanh(x);
    case ActKind::scaled_tanh: return p0 * std::tanh(p1 * x);
    case ActKind::softplus: return r_softplus(p0 * x) / p0;
    case ActKind::parametric_softplus: return p0 * r_softplus(p1 * x);
    case ActKind::softsign: return std::isinf(x) ? std::copysign(T(1), x) : x / (T(1) + std::fabs(x));
    case ActKind::shrink: return x > p1 ? x - p0 : (x < -p1 ? x + p0 : T(0));
    case ActKind::gelu:
      if constexpr (std::is_same<T, double>::value) return x == -inf ? T(0) : T(0.5) * x * std::erfc(-x / std::sqrt(T(2)));
      else return r_gelu_ld(x);
    case ActKind::clip: return std::min(std::max(x, p0), p1);
    case ActKind::silu: return x == -inf ? T(0) : x * r_sigmoid(x);
    case ActKind::hard_swish:
      if constexpr (std::is_same<T, double>::value) return x == -inf ? T(0) : x * std::max(T(0), std::min(T(1), x / T(6) + T(0.5)));
      else return x == -inf ? T(0) : x * std::max(T(0), std::min(T(1), (x + T(3)) / T(6)));  // x + 3 exact
  }
  return std::numeric_limits<T>::quiet_NaN();
}

struct MathFn {
  const char* name;
  vf (*f)(vf);
  double (*ref)(double);
  double bound;  // max ulp accepted (regression guard; docs/ACCURACY.md has the measured values)
};
static const MathFn kMath[] = {
    {"exp", [](vf x) { return acc::vexp(x); }, [](double x) { return std::exp(x); }, 2.0},
    {"expm1", [](vf x) { return acc::vexpm1(x); }, [](double x) { return std::expm1(x); }, 2.0},
    {"log1p", [](vf x) { return acc::vlog1p(x); }, [](double x) { return std::log1p(x); }, 2.0},
    {"tanh", [](vf x) { return acc::vtanh(x); }, [](double x) { return std::tanh(x); }, 3.0},
    {"erf", [](vf x) { return acc::verf(x); }, [](double x) { return std::erf(x); }, 3.0},
    {"erfc_tail(gelu)", [](vf x) { return acc::vgelu(x); },
     [](double x) { return x == -kInf ? 0.0 : 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }, 6.0},
};

struct ActCase {
  const char* name;
  Activation a;
  double bound;     // max ulp accepted (0: must be exact; < 0: report only, the error is the parameters')
  double bound_vd;  // the same for the float64 lanes (vd), in double ulps (parameters are exact there)
};
static Activation mk(ActKind k, double p0 = 0, double p1 = 0) { Activation a; a.kind = k; a.p0 = p0; a.p1 = p1; return a; }
static const double kI = std::numeric_limits<double>::infinity();
// DirectML defaults (SPEC §5), then the non-default set of tests/reference.py (NONDEFAULT_PARAMS).
static const ActCase kActs[] = {
    {"identity", mk(ActKind::identity), 0.0, 0},
    {"linear(1,0)", mk(ActKind::linear, 1.0, 0.0), 0.0, 0},
    {"linear(-1.75,0.625)", mk(ActKind::linear, -1.75, 0.625), -1, 0.51},
    {"relu", mk(ActKind::relu), 0.0, 0},
    {"leaky_relu(0.01)", mk(ActKind::leaky_relu, 0.01), 1.0, 0.51},
    {"leaky_relu(0.3)", mk(ActKind::leaky_relu, 0.3), 1.0, 0.51},
    {"thresholded_relu(1)", mk(ActKind::thresholded_relu, 1.0), 0.0, 0},
    {"thresholded_relu(-0.4)", mk(ActKind::thresholded_relu, -0.4), 0.0, 0},
    {"elu(1)", mk(ActKind::elu, 1.0), 2.0, 1},
    {"elu(0.55)", mk(ActKind::elu, 0.55), 3.0, 1.5},
    {"celu(1)", mk(ActKind::celu, 1.0), 3.0, 1},
    {"celu(2.5)", mk(ActKind::celu, 2.5), 4.0, 2.5},
    {"scaled_elu(1.67326,1.0507)", mk(ActKind::scaled_elu, 1.67326, 1.0507), 4.0, 2.5},
    {"scaled_elu(1.3,0.8)", mk(ActKind::scaled_elu, 1.3, 0.8), 4.0, 2.5},
    {"sigmoid", mk(ActKind::sigmoid), 3.0, 1},
    {"hard_sigmoid(0.2,0.5)", mk(ActKind::hard_sigmoid, 0.2, 0.5), -1, 0.51},
    {"hard_sigmoid(0.35,0.4)", mk(ActKind::hard_sigmoid, 0.35, 0.4), -1, 0.51},
    {"tanh", mk(ActKind::tanh), 3.0, 1},
    {"scaled_tanh(1,0.5)", mk(ActKind::scaled_tanh, 1.0, 0.5), 4.0, 1},
    {"scaled_tanh(1.7,0.66)", mk(ActKind::scaled_tanh, 1.7, 0.66), 5.0, 3},  // mostly parameter rounding
    {"softplus(1)", mk(ActKind::softplus, 1.0), 4.0, 1.5},
    {"softplus(3)", mk(ActKind::softplus, 3.0), 3.0, 2},
    {"softplus(0.1)", mk(ActKind::softplus, 0.1), 8.0, 6},  // max at results ~2e-38 / ~1e-311 (ACCURACY.md)
    {"parametric_softplus(1,1)", mk(ActKind::parametric_softplus, 1.0, 1.0), 4.0, 1.5},
    {"parametric_softplus(0.75,2)", mk(ActKind::parametric_softplus, 0.75, 2.0), 3.0, 2},
    {"softsign", mk(ActKind::softsign), 2.0, 2},
    {"shrink(0,0.5)", mk(ActKind::shrink, 0.0, 0.5), 0.0, 0},
    {"shrink(0.25,0.9)", mk(ActKind::shrink, 0.25, 0.9), 0.5, 0.51},
    {"gelu", mk(ActKind::gelu), 6.0, 2},
    {"clip(-inf,inf)", mk(ActKind::clip, -kI, kI), 0.0, 0},
    {"clip(-0.5,1.25)", mk(ActKind::clip, -0.5, 1.25), 0.0, 0},
    {"silu", mk(ActKind::silu), 4.0, 1},
    {"hard_swish", mk(ActKind::hard_swish), 3.0, 3},
};

template <class V>
static V apply(const Activation& a, V x) {
  V out{};
  acc::visit_activation<V>(a, [&](const auto& fn) { out = fn(x); });
  return out;
}

static void print_row(const char* name, const Stats& s, double bound, bool& fail) {
  const bool over = bound >= 0 && s.max_ulp > bound;
  const bool bad = s.nan_bad || s.inf_bad;
  std::printf("%-28s %8.3f @ %-15a %9.3g @ %-15a %9.3g @ %-15a %6.2e %s%s\n", name, s.max_ulp,
              (double)s.at_ulp, s.max_abs, (double)s.at_abs, s.max_rel, (double)s.at_rel,
              s.n ? (double)s.over1ulp / (double)s.n : 0.0, bad ? "NaN/INF MISMATCH " : "",
              over ? "ABOVE BOUND" : "");
  if (bad) std::printf("    nan mismatches %llu, inf mismatches %llu, first at %a\n",
                       (unsigned long long)s.nan_bad, (unsigned long long)s.inf_bad, (double)s.at_bad);
  fail |= bad || over;
}

// ------------------------------------------------------------------------------------------------
// float64 lanes (vd): errors in ulps of the double result against a long double reference.
using acc::vd;
using acc::kWidthD;
typedef long double LD;
static double from_bits64(uint64_t b) { double d; std::memcpy(&d, &b, 8); return d; }
static uint64_t to_bits64(double d) { uint64_t b; std::memcpy(&b, &d, 8); return b; }

struct StatsD {
  double max_ulp = 0, at_ulp = 0, at_bad = 0;
  uint64_t n = 0, nan_bad = 0, inf_bad = 0, over_half = 0, over1ulp = 0;
  void merge(const StatsD& o) {
    if (o.max_ulp > max_ulp) { max_ulp = o.max_ulp; at_ulp = o.at_ulp; }
    if (!nan_bad && !inf_bad && (o.nan_bad || o.inf_bad)) at_bad = o.at_bad;
    n += o.n; nan_bad += o.nan_bad; inf_bad += o.inf_bad; over_half += o.over_half; over1ulp += o.over1ulp;
  }
  bool zero_sign = false;  // a zero of the wrong sign counts as a mismatch (the functions, not the activations)
  void add(double x, double got, LD ref) {
    ++n;
    if (std::isnan(ref) || std::isnan(got)) {
      if (std::isnan(ref) != std::isnan(got)) { if (!nan_bad && !inf_bad) at_bad = x; ++nan_bad; }
      return;
    }
    const double rd = (double)ref;  // the correctly rounded result (double rounding is immaterial here)
    if (std::isinf(ref) || std::isinf(got) || std::isinf(rd)) {
      if (got == rd) return;
      if (std::isinf(ref) || got == -rd) { if (!nan_bad && !inf_bad) at_bad = x; ++inf_bad; return; }
    }
    if (zero_sign && got == 0 && ref == 0 && std::signbit(got) != std::signbit(ref)) {  // -0 for +0 or back
      if (!nan_bad && !inf_bad) at_bad = x;
      ++nan_bad;
      return;
    }
    const LD g = std::isinf(got) ? std::copysign(std::ldexp(LD(1), 1024), (LD)got) : (LD)got;
    int e;
    std::frexp(ref, &e);
    const int ex = std::min(std::max(e - 1, -1022), 1023);
    const double ulp = (double)(std::fabs(g - ref) / std::ldexp(LD(1), ex - 52));
    if (ulp > max_ulp) { max_ulp = ulp; at_ulp = x; }
    if (ulp > 0.5) ++over_half;
    if (ulp > 1.0) ++over1ulp;
  }
};

// Inputs: sweep 1 steps through all 2^64 bit patterns (both signs, NaNs and infinities included);
// sweep 2 through the patterns of 0 <= x <= 1024, each also negated; then the edge windows.
static const double kEdgesD[] = {
    0.0, 1.0, 0x1p-1022, 0x1p-54, 0x1p-29, 0.5, 2.0, 0x1p52, 0x1p53, 1.7976931348623157e308,
    709.782712893384, 709.43613930310402, 710.0, 708.39641853226411, 708.74299212254408,   // exp
    744.44007192138126, 745.13321910194122, 746.0, 0.34657359027997264, 1.0397207708399179,
    37.429947750237047, 40.0, 37.083374159957074, 36.736800569677101, 36.3902,             // expm1
    0.41421356237309503, 0.29289321881345248, 1.8284271247461903, 3.0, 0.7, 1e300,          // log1p
    20.0, 19.061547465398496, 0.54930614433405485, 0.1,                                     // tanh
    693.14718055994531, 760.0, 751.75563041352377,                                          // sigmoid, silu
    0.84375, 1.25, 2.857142857142857, 6.0, 5.9215871957945073, 28.0,                         // erf
    1.193242693252299, 1.7677669529663689, 4.040610178208843, 37.615868313955992,            // gelu
    38.580140223782359,
    0.01, 0.2, 2.5, 6.0, 0.9, 0.4, 1.25, 1.67326, 0.66, 1.75, 0.625, 0.55, 1.3, 0.8, 1.0507,  // params
};
static const uint64_t kWindowD = 4096;
static const uint64_t kNaNsD[] = {0x7ff0000000000001ull, 0x7ff8000000000000ull, 0x7fffffffffffffffull,
                                  0xfff8000000000000ull, 0xfff0000000000001ull, 0x7ff4000000000000ull,
                                  0xffffffffffffffffull, 0x7ff8000000000123ull};

static void make_edges_d(std::vector<uint64_t>& edges) {
  for (double e : kEdgesD) {
    for (double s : {e, -e}) {
      const uint64_t b = to_bits64(s);
      for (uint64_t d = 0; d < 2 * kWindowD; ++d) edges.push_back(b - kWindowD + d);
    }
  }
  for (uint64_t b = 0x7ff0000000000000ull - kWindowD; b <= 0x7ff0000000000000ull; ++b) {
    edges.push_back(b);
    edges.push_back(b | 0x8000000000000000ull);
  }
  for (uint64_t b : kNaNsD) edges.push_back(b);
}

// The i-th input of the two sweeps of `count` inputs each (4 * count in all).
static uint64_t sweep_bits(uint64_t i, uint64_t count) {
  const uint64_t which = i / count, j = i % count;
  if (which < 2) {  // all patterns: an odd step, starting on either side of 2^63 (both signs)
    const uint64_t step = (~0ull / (2 * count)) | 1u;
    return j * step + (which ? 0x8000000000000000ull : 0) + 0x123456789ull;
  }
  const uint64_t top = 0x4090000000000000ull;  // 1024.0
  const uint64_t step = std::max<uint64_t>(1, top / count) | 1u;
  return std::min<uint64_t>(top, j * step + (i * 0x9e3779b97f4a7c15ull >> 52)) | (which == 3 ? 0x8000000000000000ull : 0);
}

static StatsD run_d(vd (*f)(vd, const void*), const void* ctx, LD (*ref)(LD, const void*), uint64_t count,
                    int threads, const std::vector<uint64_t>& edges, bool zero_sign) {
  std::vector<StatsD> part(threads);
  const uint64_t total = 4 * count;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      StatsD st;
      st.zero_sign = zero_sign;
      auto do_block = [&](const uint64_t* bits, int cnt) {
        alignas(64) double in[kWidthD] = {}, out[kWidthD];
        for (int j = 0; j < cnt; ++j) in[j] = from_bits64(bits[j]);
        vd v;
        std::memcpy(&v, in, sizeof v);
        const vd r = f(v, ctx);
        std::memcpy(out, &r, sizeof r);
        for (int j = 0; j < cnt; ++j) st.add(in[j], out[j], ref((LD)in[j], ctx));
      };
      uint64_t bits[kWidthD];
      const uint64_t lo = total * t / threads, hi = total * (t + 1) / threads;
      for (uint64_t i = lo; i < hi; i += kWidthD) {
        int cnt = 0;
        for (uint64_t k = i; k < std::min(hi, i + kWidthD); ++k) bits[cnt++] = sweep_bits(k, count);
        do_block(bits, cnt);
      }
      const size_t elo = edges.size() * t / threads, ehi = edges.size() * (t + 1) / threads;
      for (size_t i = elo; i < ehi; i += kWidthD) do_block(&edges[i], (int)std::min<size_t>(kWidthD, ehi - i));
      part[t] = st;
    });
  }
  for (auto& th : pool) th.join();
  StatsD all;
  for (auto& p : part) all.merge(p);
  return all;
}

static LD rd_sigmoid(LD x) { return r_sigmoid(x); }
struct MathFnD {
  const char* name;
  vd (*f)(vd);
  LD (*ref)(LD);
  double bound;  // max ulp accepted (regression guard; docs/ACCURACY.md has the measured values)
};
static const MathFnD kMathD[] = {
    {"exp (vd)", [](vd x) { return acc::vexp(x); }, [](LD x) { return std::exp(x); }, 1.0},
    {"expm1 (vd)", [](vd x) { return acc::vexpm1(x); }, [](LD x) { return std::expm1(x); }, 1.0},
    {"log1p (vd)", [](vd x) { return acc::vlog1p(x); }, [](LD x) { return std::log1p(x); }, 1.0},
    {"tanh (vd)", [](vd x) { return acc::vtanh(x); }, [](LD x) { return std::tanh(x); }, 1.0},
    {"sigmoid (vd)", [](vd x) { return acc::vsigmoid(x); }, rd_sigmoid, 1.0},
    {"silu (vd)", [](vd x) { return acc::vsilu(x); },
     [](LD x) { return x == -std::numeric_limits<LD>::infinity() ? LD(-0.0) : x * rd_sigmoid(x); }, 1.0},
    {"log1p_exp_negabs (vd)", [](vd x) { return acc::vlog1p_exp_negabs(x, vd{}); },
     [](LD x) { return std::log1p(std::exp(-std::fabs(x))); }, 1.0},
    {"erf (vd)", [](vd x) { return acc::verf(x); }, [](LD x) { return std::erf(x); }, 1.0},
    {"gelu (vd)", [](vd x) { return acc::vgelu(x); }, r_gelu_ld, 2.0},
};

static void print_row_d(const char* name, const StatsD& s, double bound, bool& fail) {
  const bool over = bound >= 0 && s.max_ulp > bound;
  const bool bad = s.nan_bad || s.inf_bad;
  std::printf("%-34s %8.3f @ %-24a %9.2e %9.2e %10llu %s%s\n", name, s.max_ulp, s.at_ulp,
              s.n ? (double)s.over_half / (double)s.n : 0.0, s.n ? (double)s.over1ulp / (double)s.n : 0.0,
              (unsigned long long)s.n, bad ? "NaN/INF MISMATCH " : "", over ? "ABOVE BOUND" : "");
  if (bad) std::printf("    nan/sign-of-zero mismatches %llu, inf mismatches %llu, first at %a\n",
                       (unsigned long long)s.nan_bad, (unsigned long long)s.inf_bad, s.at_bad);
  fail |= bad || over;
}

int main(int argc, char** argv) {
  uint64_t stride_math = 97, stride_act = 997, dcount = 1u << 20, dact_count = 1u << 17;
  int threads = (int)std::max(1u, std::thread::hardware_concurrency());
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--stride" && i + 1 < argc) stride_math = stride_act = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--math-stride" && i + 1 < argc) stride_math = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--act-stride" && i + 1 < argc) stride_act = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--d-count" && i + 1 < argc) dcount = std::strtoull(argv[++i], nullptr, 0);
    else if (a == "--dact-count" && i + 1 < argc) dact_count = std::strtoull(argv[++i], nullptr, 0);
    else if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else { std::fprintf(stderr, "usage: %s [--stride N] [--math-stride N] [--act-stride N] [--d-count N] [--dact-count N] [--threads T] [--only NAME]\n", argv[0]); return 2; }
  }
  if (stride_math < 1 || stride_act < 1 || dcount < 1 || dact_count < 1 || threads < 1) return 2;
  std::vector<uint32_t> edges;
  make_edges(edges);
  std::printf("ISA %s (%d float lanes), %d threads; sweep stride %llu (vmath) / %llu (activations), "
              "plus %zu edge inputs\n", acc::kIsaName, kWidth, threads, (unsigned long long)stride_math,
              (unsigned long long)stride_act, edges.size());
  std::printf("%-28s %8s   %-15s %9s   %-15s %9s   %-15s %8s\n", "function", "max ulp", "at x",
              "abs(|r|<=1)", "at x", "max rel", "at x", ">1ulp");
  bool fail = false;
  for (const MathFn& m : kMath) {
    if (!only.empty() && std::string(m.name).find(only) == std::string::npos) continue;
    const Stats s = run([](vf x, const void* c) { return ((const MathFn*)c)->f(x); }, &m,
                        [](double x, const void* c) { return ((const MathFn*)c)->ref(x); },
                        stride_math, threads, edges);
    print_row(m.name, s, m.bound, fail);
  }
  for (const ActCase& c : kActs) {
    if (!only.empty() && std::string(c.name).find(only) == std::string::npos) continue;
    const Stats s = run([](vf x, const void* p) { return apply<vf>(((const ActCase*)p)->a, x); }, &c,
                        [](double x, const void* p) { return ref_act(((const ActCase*)p)->a, x); },
                        stride_act, threads, edges);
    print_row(c.name, s, c.bound, fail);
  }

  // float64 lanes (vd)
  std::vector<uint64_t> edges_d;
  make_edges_d(edges_d);
  std::printf("\nfloat64 lanes (vd: %d double lanes): errors in double ulps against long double; %llu + %llu "
              "sweep inputs (functions / activations) plus %zu edge inputs\n", kWidthD,
              (unsigned long long)(4 * dcount), (unsigned long long)(4 * dact_count), edges_d.size());
  std::printf("%-34s %8s   %-24s %9s %9s %10s\n", "function", "max ulp", "at x", ">0.5ulp", ">1ulp", "inputs");
  for (const MathFnD& m : kMathD) {
    if (!only.empty() && std::string(m.name).find(only) == std::string::npos) continue;
    const StatsD s = run_d([](vd x, const void* c) { return ((const MathFnD*)c)->f(x); }, &m,
                           [](LD x, const void* c) { return ((const MathFnD*)c)->ref(x); }, dcount, threads, edges_d, true);
    print_row_d(m.name, s, m.bound, fail);
  }
  for (const ActCase& c : kActs) {
    const std::string name = std::string(c.name) + " (vd)";
    if (!only.empty() && name.find(only) == std::string::npos) continue;
    const StatsD s = run_d([](vd x, const void* p) { return apply<vd>(((const ActCase*)p)->a, x); }, &c,
                           [](LD x, const void* p) { return ref_act<LD>(((const ActCase*)p)->a, x); },
                           dact_count, threads, edges_d, false);
    print_row_d(name.c_str(), s, c.bound_vd, fail);
  }
  std::printf("%s\n", fail ? "FAIL" : "OK");
  return fail ? 1 : 0;
}
