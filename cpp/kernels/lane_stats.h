// How first-pass sums become a group's statistics: the formulas, shared by ops/mvn.cpp (one group
// at a time, compiled without ISA flags) and the kernels (many lanes at a time, once per ISA); and,
// lane by lane, batch norm's folded multiplier.
// Included inside an anonymous namespace by both, so no copy compiled with AVX flags can be merged
// with the baseline one. Compiled with FMA, `sum_sq * inv_n - m1 * m1` may become one fused
// operation (the avx2 and avx512 units' loops do): a lane's variance can then differ in its last
// bit from the baseline's, as the normalize kernels' results already do between ISAs.

// Written once for a double (D = double) and for a vector of doubles (D a GCC vector type, a
// group per lane: kernels/fused_rows.h finishes rows two at a time).

// The mean of d = (x - pivot) * scale and the variance, in scaled units, from the sums of n values
// (inv_n = 1 / n).
template <class D>
struct FirstMomentsOf {
  D m1, var;
};
using FirstMoments = FirstMomentsOf<double>;
template <class D>
static inline FirstMomentsOf<D> first_moments(D sum, D sum_sq, double inv_n) {
  const D m1 = sum * inv_n;
  const D excess = sum_sq * inv_n - m1 * m1;
  return {m1, excess > 0.0 ? excess : D{}};  // rounding can make it negative
}

// The pivot was so far from the mean that the variance lost digits to cancellation: the group is
// summed again around the mean found. kPivotReach: how many standard deviations from the mean a
// pivot may lie (the digits lost grow with its square).
constexpr double kPivotReach = 8.0;
template <class D>
static inline auto pivot_too_far(const FirstMomentsOf<D>& m) {
  return m.m1 * m.m1 > kPivotReach * kPivotReach * m.var;
}

// Two groups' doubles, one per lane.
typedef double double2 __attribute__((vector_size(16)));
static inline double dsqrt(double v) { return std::sqrt(v); }
static inline double2 dsqrt(double2 v) {
#if defined(__SSE2__)
  return __builtin_ia32_sqrtpd(v);
#else
  return double2{std::sqrt(v[0]), std::sqrt(v[1])};
#endif
}
template <class D>
static inline D inv_std_of(D var, const InvStdRule& rule) {
  if (!rule.normalize_variance) return D{} + 1.0;
  return rule.epsilon_outside ? 1.0 / (dsqrt(var) + rule.epsilon) : 1.0 / dsqrt(var + rule.epsilon);
}

// 1 / std from a variance in units of scale^2 (ops/mvn.cpp: a double group's variance past
// double's range, whose 1 / std is within it). epsilon * scale * scale, in that order: scale^2
// itself may overflow (2^1200). The products stay in range where it matters: ops/mvn.cpp scales a
// double group up only where epsilon is below 2^-840 (inside), or 2^-390 (outside).
static inline double inv_std_scaled(double var, double scale, const InvStdRule& rule) {
  if (!rule.normalize_variance) return 1.0;
  return rule.epsilon_outside ? scale / (dsqrt(var) + rule.epsilon * scale)
                              : scale / dsqrt(var + rule.epsilon * scale * scale);
}

static constexpr double kMaxFinite = 1.7976931348623157e308;  // the largest double
static constexpr double kMinNormal = 2.2250738585072014e-308;  // the smallest normal double

// The first pass's squares may have underflowed (UnderflowRule): the group is summed again, scaled
// up. Each bound compared on its own so that D may be a vector.
template <class D>
static inline auto squares_may_underflow(D pivot, D sum_sq, const UnderflowRule& u) {
  return (sum_sq < u.sum_sq_below) & (pivot <= u.max_pivot) & (pivot >= -u.max_pivot);
}

// A group's mean and variance from the sums around its pivot (pivot 0 and plain sums when not
// centered), and whether its first pass leaves it unsettled: sums that overflowed or are NaN, a
// pivot too far from the mean, or squares that may have underflowed. Each bound compared on its own
// so that D may be a vector (x <= max and x >= -max is |x| <= max, NaN included). MayUnderflow
// false leaves the last test out, for float data (whose squares never underflow the double sums).
template <bool MayUnderflow = true, class D>
static inline auto lane_stats_of(D pivot, D sum, D sum_sq, double inv_n, bool centered, const UnderflowRule& u) {
  const FirstMomentsOf<D> m = first_moments(sum, sum_sq, inv_n);
  const auto finite = (sum <= kMaxFinite) & (sum >= -kMaxFinite) & (sum_sq <= kMaxFinite) & (sum_sq >= -kMaxFinite);
  using Mask = decltype(finite);
  struct Stats {
    D mean, var;
    Mask slow;
  };
  auto slow = (finite == Mask{}) | (centered ? Mask(pivot_too_far(m)) : Mask{});
  if constexpr (MayUnderflow) slow |= Mask(squares_may_underflow(pivot, sum_sq, u));
  return Stats{centered ? pivot + m.m1 : D{}, centered ? m.var : sum_sq * inv_n, slow};
}

// Stores a statistic in the compute type C (float or double).
template <class C>
static inline void store_as(char* p, double v) {
  const C x = static_cast<C>(v);
  std::memcpy(p, &x, sizeof x);
}

// The kernels' loops over lanes (kernel_table.h: lane_stats, inv_std_lanes). Written as plain loops
// for the compiler to vectorize: no call, no branch on the data but the blend of `slow`.
// The arrays as restrict parameters (GCC ignores restrict on locals copied from a struct's members,
// and 12 run-time alias checks are past what it versions a loop for: the loop stayed scalar).
// `centered` a constant of each loop: GCC 12 does not vectorize a select on a run-time flag (the
// kernels are compiled without loop unswitching), and the loop stayed scalar.
// lane_stats_loop is the exception, written with vectors of the ISA's register of doubles: as a
// plain loop, GCC stepped 64 lanes at a time for the slow bytes (its registers spilled to the
// stack), or, without them, combined each vector's tests in general registers. A vector wider than
// the register is worse: GCC 12 takes its compares and selects one element at a time. Its slow
// flags are stored by a second loop, run only where a lane is slow.
template <bool Centered>
static int64_t lane_stats_loop(int64_t n, double inv_n, UnderflowRule u, const double* __restrict pivot,
                               const double* __restrict sum, const double* __restrict sum_sq,
                               double* __restrict mean, double* __restrict var, unsigned char* __restrict slow) {
#if defined(__AVX512F__)  // (vec.h's kWidthD, which ops/ include this header without)
  constexpr int64_t WD = 8;
#elif defined(__AVX__)
  constexpr int64_t WD = 4;
#else
  constexpr int64_t WD = 2;
#endif
  typedef double vdouble __attribute__((vector_size(WD * sizeof(double))));
  int64_t c = 0;
  using Mask = decltype(lane_stats_of(vdouble{}, vdouble{}, vdouble{}, inv_n, Centered, u).slow);
  auto slow_lanes = Mask{};  // -1 a slow lane
  for (; c + WD <= n; c += WD) {
    vdouble p, s1, s2;
    std::memcpy(&p, pivot + c, sizeof p);
    std::memcpy(&s1, sum + c, sizeof s1);
    std::memcpy(&s2, sum_sq + c, sizeof s2);
    const auto s = lane_stats_of(p, s1, s2, inv_n, Centered, u);
    std::memcpy(mean + c, &s.mean, sizeof s.mean);
    std::memcpy(var + c, &s.var, sizeof s.var);
    slow_lanes += s.slow;
  }
  int64_t count = 0;
  for (int64_t i = 0; i < WD; ++i) count -= slow_lanes[i];
  for (; c < n; ++c) {
    const auto s = lane_stats_of(pivot[c], sum[c], sum_sq[c], inv_n, Centered, u);
    mean[c] = s.mean;
    var[c] = s.var;
    count += s.slow;
  }
  if (count > 0)
    for (int64_t c = 0; c < n; ++c)
      slow[c] = static_cast<unsigned char>(lane_stats_of(pivot[c], sum[c], sum_sq[c], inv_n, Centered, u).slow);
  return count;
}

static int64_t lane_stats_entry(const LaneStatsArgs& a) {
  return a.centered ? lane_stats_loop<true>(a.n, a.inv_n, a.underflow, a.pivot, a.sum, a.sum_sq, a.mean, a.var, a.slow)
                    : lane_stats_loop<false>(a.n, a.inv_n, a.underflow, a.pivot, a.sum, a.sum_sq, a.mean, a.var, a.slow);
}

// The rule's flags constants of each loop (as lane_stats_loop's); one lane after another (step 1,
// the common case) is its own loop so that it vectorizes.
template <bool NormalizeVariance, bool EpsilonOutside>
static void inv_std_lanes_loop(const double* __restrict var, double* __restrict out, int64_t n, int64_t step,
                               double epsilon) {
  const InvStdRule rule{NormalizeVariance, EpsilonOutside, epsilon};
  if (step == 1) {
    for (int64_t c = 0; c < n; ++c) out[c] = inv_std_of(var[c], rule);
  } else {
    for (int64_t c = 0; c < n; c += step) out[c] = inv_std_of(var[c], rule);
  }
}

static void inv_std_lanes_entry(const double* var, double* out, int64_t n, int64_t step, const InvStdRule& r) {
  if (!r.normalize_variance) inv_std_lanes_loop<false, false>(var, out, n, step, r.epsilon);
  else if (r.epsilon_outside) inv_std_lanes_loop<true, true>(var, out, n, step, r.epsilon);
  else inv_std_lanes_loop<true, false>(var, out, n, step, r.epsilon);
}

// Whether scale s times 1 / sqrt(v), m, falls outside [min, max] where both factors are finite and
// nonzero (only those can make a product that does not fit; 1/sqrt(v) is one exactly when 0 < v <
// inf). (& not &&: no branches, so that the loops vectorize.)
static inline int64_t product_out_of_range(double v, double s, double m, double min, double max) {
  s = std::fabs(s), m = std::fabs(m);
  const int64_t factors_ordinary = (v > 0.0) & (v <= kMaxFinite) & (s <= kMaxFinite) & (s != 0.0);
  const int64_t in_range = (m >= min) & (m <= max);
  return factors_ordinary & (in_range ^ 1);
}

// Batch norm's folded multiplier (ops/batch_norm.cpp; kernel_table.h: scale_over_std_lanes). Here,
// not in the op: compiled with the ISA's flags both loops vectorize (vectors of 8 doubles at
// AVX-512), the range test included; in the baseline unit the test's compares stay scalar, with
// or without branches. Square roots and divisions round the same in every ISA: the coefficients
// do not depend on it.
// inv_std (unless null) takes each 1 / sqrt(var + eps) as well: inv_std_of's, with epsilon inside.
static bool scale_over_std_lanes_entry(const double* __restrict var, const double* __restrict scale,
                                       double* __restrict mul, double* __restrict inv_std, uint8_t* __restrict fits,
                                       int64_t n, double epsilon, double min, double max) {
  if (inv_std == nullptr) {
    for (int64_t c = 0; c < n; ++c) mul[c] = scale[c] * (1.0 / dsqrt(var[c] + epsilon));  // var < 0 -> NaN
  } else {
    for (int64_t c = 0; c < n; ++c) {
      const double inv = 1.0 / dsqrt(var[c] + epsilon);
      inv_std[c] = inv;
      mul[c] = scale[c] * inv;
    }
  }
  auto out_of_range = [&](int64_t c) { return product_out_of_range(var[c] + epsilon, scale[c], mul[c], min, max); };
  int64_t any = 0;  // (a bool accumulated with &= kept the loop scalar)
  if (fits == nullptr) {
    for (int64_t c = 0; c < n; ++c) any |= out_of_range(c);
  } else {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t out = out_of_range(c);
      fits[c] = static_cast<uint8_t>(out ^ 1);
      any |= out;
    }
  }
  return any == 0;
}

// One lane of scale_over_std_f32: scale (1 where there is none) times 1 / sqrt(var + epsilon) in
// double, rounded to float32 as the folded parameters' general path does (the same bits); whether
// the product falls outside [min, max].
template <bool HasScale>
static inline int64_t scale_over_std_f32_lane(const float* __restrict var, const float* __restrict scale,
                                              float* __restrict mul, int64_t c, double epsilon, double min,
                                              double max) {
  const double v = static_cast<double>(var[c]) + epsilon, s = HasScale ? static_cast<double>(scale[c]) : 1.0;
  const double m = s * (1.0 / dsqrt(v));
  mul[c] = static_cast<float>(m);
  return product_out_of_range(v, s, m, min, max);
}

// The running statistics' update (kernel_table.h: RunningUpdateArgs), a typed loop of each
// combination of the arrays' types and the convention, for the compiler to vectorize.
template <class R, class S, bool PyTorch>
static void update_running_loop(const RunningUpdateArgs& a) {
  R* __restrict rm = static_cast<R*>(a.running_mean);
  R* __restrict rv = static_cast<R*>(a.running_var);
  const S* __restrict bm = static_cast<const S*>(a.mean);
  const S* __restrict bv = static_cast<const S*>(a.var);
  const double m = a.momentum, unbias = a.unbias;
  for (int64_t i = 0; i < a.n; ++i) {
    if constexpr (PyTorch) {
      rm[i] = static_cast<R>((1.0 - m) * double(rm[i]) + m * double(bm[i]));
      rv[i] = static_cast<R>((1.0 - m) * double(rv[i]) + (m * double(bv[i])) * unbias);
    } else {
      rm[i] = static_cast<R>(m * double(rm[i]) + (1.0 - m) * double(bm[i]));
      rv[i] = static_cast<R>(m * double(rv[i]) + (1.0 - m) * double(bv[i]));
    }
  }
}

template <class R, class S>
static void update_running_typed(const RunningUpdateArgs& a) {
  a.pytorch ? update_running_loop<R, S, true>(a) : update_running_loop<R, S, false>(a);
}

static void update_running_entry(const RunningUpdateArgs& a) {
  if (a.running_f64) a.batch_f64 ? update_running_typed<double, double>(a) : update_running_typed<double, float>(a);
  else a.batch_f64 ? update_running_typed<float, double>(a) : update_running_typed<float, float>(a);
}

#if defined(SIMDNORM_ISA_NS)  // (vec.h's vectors: the kernel units')
typedef float vfd __attribute__((vector_size(kWidthD * sizeof(float))));  // a vd's lanes as floats

// s * (1.0 / sqrt(v)), a vector of double lanes rounded to float, without the square root and the
// division (4-5 cycles a lane at AVX-512, more than normalizing 8 rows of it): s times an estimate
// of 1 / sqrt(v) within a few units of 2^-53 rounds to the float that the exact double rounds to,
// unless a float rounding boundary lies within kNearBoundary double steps of the estimate (about 1
// lane in 250,000 of random data) or the product is outside float's normal range (where float
// keeps fewer bits, or none). Stores the floats and returns true, or returns false for the
// caller's exact lanes where a lane is such, or v is past the estimate's range (NaN). The
// products it keeps lie in [2^-125, 2^127): in float's normal range.
static inline bool store_quotient_near(vd s, vd v, float* out) {
  constexpr uint64_t kNearBoundary = 1024, kDropped = (uint64_t{1} << 29) - 1;  // the mantissa bits float drops
  constexpr uint64_t kMidpoint = (kDropped + 1) / 2, kLowest = 1023 - 125, kExponents = 252;  // [2^-125, 2^127)
  const vd m = s * vinv_sqrt_near(v);
  const vul bits = (vul)m;
  const vl near = ((bits - (kMidpoint - kNearBoundary)) & kDropped) < 2 * kNearBoundary;
  const vl outside = (bits << 1) - (kLowest << 53) >= (kExponents << 53);  // (the sign shifted out; NaN too)
  if (vany(near | outside)) return false;
  const vfd f = __builtin_convertvector(m, vfd);
  std::memcpy(out, &f, sizeof f);
  return true;
}

// scale_over_std_f32's lanes a vector at a time (store_quotient_near), a vector with a lane it
// declines by the exact lanes. Returns the lanes done, a whole number of vectors.
template <bool HasScale>
static int64_t scale_over_std_f32_vectors(const float* __restrict var, const float* __restrict scale,
                                          float* __restrict mul, int64_t n, double epsilon, double min, double max,
                                          int64_t& any) {
  int64_t c = 0;
  for (; c + kWidthD <= n; c += kWidthD) {
    const vd s = HasScale ? vload_widened(scale + c) : vbroadcast_vd(1.0);
    if (!store_quotient_near(s, vload_widened(var + c) + epsilon, mul + c))
      for (int64_t j = c; j < c + kWidthD; ++j) any |= scale_over_std_f32_lane<HasScale>(var, scale, mul, j, epsilon, min, max);
  }
  return c;
}

// inv_std_lanes of epsilon inside the square root (batch norm's rule), rounded to float: out[c] =
// float(1.0 / sqrt(var[c] + epsilon)), the same bits, in vectors of store_quotient_near. Returns
// the lanes done, a whole number of vectors (none where the unit has no estimate).
static int64_t inv_std_floats_near(const double* __restrict var, float* __restrict out, int64_t n, double epsilon) {
  if (!kInvSqrtNearIsFast) return 0;
  const vd one = vbroadcast_vd(1.0);
  const InvStdRule inside{true, false, epsilon};
  int64_t c = 0;
  for (; c + kWidthD <= n; c += kWidthD) {
    vd v;
    std::memcpy(&v, var + c, sizeof v);
    if (!store_quotient_near(one, v + epsilon, out + c))
      for (int64_t j = c; j < c + kWidthD; ++j) out[j] = static_cast<float>(inv_std_of(var[j], inside));
  }
  return c;
}
#endif

// scale_over_std_lanes of float32 arrays, each element converted, its product computed in double and
// rounded to float32 as the folded parameters' general path does (the same bits), in one loop:
// thousands of channels a call took a conversion pass an array (ops/batch_norm.cpp,
// FoldedParams::CompactFold). scale null: 1. Returns whether every product fits in [min, max].
static bool scale_over_std_f32_entry(const float* __restrict var, const float* __restrict scale,
                                     float* __restrict mul, int64_t n, double epsilon, double min, double max) {
  int64_t any = 0, c = 0;
#if defined(SIMDNORM_ISA_NS)
  if (kInvSqrtNearIsFast && min <= 0x1p-126 && max >= 0x1.fffffep127)
    c = scale == nullptr ? scale_over_std_f32_vectors<false>(var, scale, mul, n, epsilon, min, max, any)
                         : scale_over_std_f32_vectors<true>(var, scale, mul, n, epsilon, min, max, any);
#endif
  if (scale == nullptr) {
    for (; c < n; ++c) any |= scale_over_std_f32_lane<false>(var, scale, mul, c, epsilon, min, max);
  } else {
    for (; c < n; ++c) any |= scale_over_std_f32_lane<true>(var, scale, mul, c, epsilon, min, max);
  }
  return any == 0;
}
