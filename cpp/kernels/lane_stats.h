// How first-pass sums become a group's statistics: the formulas, shared by ops/mvn.cpp (one group
// at a time, compiled without ISA flags) and the kernels (many lanes at a time, once per ISA).
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
// summed again around the mean found.
template <class D>
static inline auto pivot_too_far(const FirstMomentsOf<D>& m) { return m.m1 * m.m1 > 64.0 * m.var; }

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

static constexpr double kMaxFinite = 1.7976931348623157e308;  // the largest double

// The kernels' loops over lanes (kernel_table.h: lane_stats, inv_std_lanes). Written as plain loops
// for the compiler to vectorize: no call, no branch on the data but the blend of `slow`.
// The arrays as restrict parameters (GCC ignores restrict on locals copied from a struct's members,
// and 12 run-time alias checks are past what it versions a loop for: the loop stayed scalar).
static int64_t lane_stats_loop(int64_t n, double inv_n, bool centered, const double* __restrict pivot,
                               const double* __restrict sum, const double* __restrict sum_sq,
                               double* __restrict mean, double* __restrict var, unsigned char* __restrict slow) {
  int64_t count = 0;
  for (int64_t c = 0; c < n; ++c) {
    const FirstMoments m = first_moments(sum[c], sum_sq[c], inv_n);
    mean[c] = centered ? pivot[c] + m.m1 : 0.0;
    var[c] = centered ? m.var : sum_sq[c] * inv_n;
    const bool finite = (std::fabs(sum[c]) <= kMaxFinite) & (std::fabs(sum_sq[c]) <= kMaxFinite);
    const bool s = (!finite) | (centered & pivot_too_far(m));  // no branches: the loop vectorizes
    slow[c] = static_cast<unsigned char>(s);
    count += s;
  }
  return count;
}

static int64_t lane_stats_entry(const LaneStatsArgs& a) {
  return lane_stats_loop(a.n, a.inv_n, a.centered, a.pivot, a.sum, a.sum_sq, a.mean, a.var, a.slow);
}

static void inv_std_lanes_entry(const double* __restrict var, double* __restrict out, int64_t n, int64_t step,
                                const InvStdRule& r) {
  // The rule's branches are loop-invariant (unswitched out of the loop); one lane after another
  // (step 1, the common case) is its own loop so that it vectorizes.
  const InvStdRule rule = r;
  if (step == 1) {
    for (int64_t c = 0; c < n; ++c) out[c] = inv_std_of(var[c], rule);
  } else {
    for (int64_t c = 0; c < n; c += step) out[c] = inv_std_of(var[c], rule);
  }
}
