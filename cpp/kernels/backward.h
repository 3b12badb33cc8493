// The backward ops' two passes over a nest of runs (ops/backward.cpp plans them). Included inside
// an ISA namespace after simd/vec.h, simd/vmath.h and kernels/iterate.h.
//
// Every element recomputes, in the compute type,
//   y   = (x - mean) * u                       (u = 1 / std; mean 0 or u 1 where not normalized)
//   pre = fma(y, scale, bias) [+ fused_add]     (only with an activation)
//   ga  = dy * act'(pre),  g = ga * scale
// The sums pass adds up sum(g), sum(g y) per statistics element and sum(ga y), sum(ga) per
// parameter element; the apply pass writes dx = u ((g - c1) - y c2) (as grad_input), with c1, c2 per statistics
// element. A target constant along a run is summed in vector lanes, element e of the run in lane
// e mod W, and the lanes are added in a fixed tree every kSumFlush elements into its double; a
// target that varies along the run gets each element added to its own compute-type slot, which the
// op adds into its double every few dozen runs. Both depend only on the run's values, never on its
// address; the runs are fixed by the plan, not by the threads.

// dy * act'(pre) for the activations the backward ops take.
template <class V> struct DerivIdentity {
  explicit DerivIdentity(const Activation&) {}
  static constexpr bool kUsesPre = false;
  V operator()(V, V dy) const { return dy; }
};

// relu' = (pre > 0), leaky_relu' = (pre > 0 ? 1 : alpha): at 0 the left slope, as PyTorch takes it;
// a NaN pre takes the left branch too. relu multiplies nothing by its 0, so an infinite dy gives 0:
// the left branch is alpha dy masked to +0 (no branch: the functor runs inline).
template <class V> struct DerivPiecewise {
  using Bits = decltype(vbits(V{}));
  V alpha;
  Bits left_kept;  // all ones for leaky_relu, zero for relu
  static constexpr bool kUsesPre = true;
  explicit DerivPiecewise(const Activation& a)
      : alpha(splat<V>(a.p0)), left_kept(vbits(splat<V>(0.0)) - (a.kind == ActKind::leaky_relu ? 1 : 0)) {}
  V operator()(V pre, V dy) const {
    return vselect(pre > splat<V>(0.0), dy, vfrom_bits(vbits(alpha * dy) & left_kept));
  }
};

// silu' = s (1 + p (1 - s)), s = sigmoid(p) (vmath.h); gelu' = Phi(p) + p phi(p), p clamped in
// float64 where it has reached its limit (0 or 1) so that the limits of +-inf come out, not inf * 0.
template <class V> V gelu_derivative(V p) {
  if constexpr (std::is_same<V, vf>::value) {
    return vgelu_derivative(p);  // (one exp for both terms, x < 0 without cancellation)
  } else {  // Phi(p) = gelu(p) / p below -1, where 1 + erf would cancel
    p = vmin(splat<V>(40.0), vmax(splat<V>(-40.0), p));
    const V erf_cdf = splat<V>(0.5) * (splat<V>(1.0) + verf(p * splat<V>(0.70710678118654752440)));
    const V cdf = vselect(p < splat<V>(-1.0), vgelu(p) / p, erf_cdf);
    const V pdf = vexp(splat<V>(-0.5) * p * p) * splat<V>(0.39894228040143267794);
    return vfma(p, pdf, cdf);
  }
}
template <class V> struct DerivSmooth {
  ActKind kind;
  static constexpr bool kUsesPre = true;
  explicit DerivSmooth(const Activation& a) : kind(a.kind) {}
  V operator()(V pre, V dy) const {
    return dy * (kind == ActKind::gelu ? gelu_derivative(pre) : vsilu_derivative(pre));
  }
};

// Every activation but identity, relu and leaky_relu runs out of line, a call a vector: the
// backward's loops are compiled three times, not once per activation (the build has a time budget:
// .ci/run); only sums_run and apply_run of runs with constant statistics and parameters take
// silu' and gelu' inline as well (BackwardKernel::run_derivative). The x86 fallback unit
// (kFewInline) takes identity alone inline.
template <class V> struct DerivOutOfLine {
  V (*apply)(const void* deriv, V pre, V dy);
  const void* deriv;  // the functor, alive for the call that visits it
  static constexpr bool kUsesPre = true;
  V operator()(V pre, V dy) const { return apply(deriv, pre, dy); }
};
template <class Deriv, class V> __attribute__((noinline)) V apply_derivative(const void* d, V pre, V dy) {
  return (*static_cast<const Deriv*>(d))(pre, dy);
}

// Whether this unit's loops take the derivative of `kind` inline.
constexpr bool derivative_inline(ActKind kind) {
  return kind == ActKind::identity || (!kFewInline && (kind == ActKind::relu || kind == ActKind::leaky_relu));
}

// Calls fn(functor): DerivIdentity, DerivPiecewise (relu, leaky_relu) or DerivOutOfLine.
template <class V, class Fn> void visit_derivative(const Activation& act, Fn&& fn) {
  auto out_of_line = [&](const auto& functor) {
    using Deriv = std::decay_t<decltype(functor)>;
    V (*apply)(const void*, V, V) = &apply_derivative<Deriv, V>;
    __asm__("" : "+r"(apply));  // opaque: no clone of the loops per activation
    fn(DerivOutOfLine<V>{apply, &functor});
  };
  switch (act.kind) {
    case ActKind::relu:
    case ActKind::leaky_relu:
      if constexpr (derivative_inline(ActKind::relu)) return fn(DerivPiecewise<V>(act));
      else return out_of_line(DerivPiecewise<V>(act));
    case ActKind::silu:
    case ActKind::gelu: return out_of_line(DerivSmooth<V>(act));
    default: return fn(DerivIdentity<V>(act));
  }
}

// Calls fn(functor) with the derivatives this unit runs inline (DerivIdentity, DerivPiecewise), for
// loops compiled for those alone; their callers have checked derivative_inline.
template <class V, class Fn> void visit_inline_derivative(const Activation& act, Fn&& fn) {
  visit_derivative<V>(act, [&](const auto& deriv) {
    if constexpr (std::is_same<std::decay_t<decltype(deriv)>, DerivOutOfLine<V>>::value) {
      check_failed("an out-of-line derivative reached a loop compiled for the inline ones", __FILE__, __LINE__);
    } else {
      fn(deriv);
    }
  });
}

// How a run reads its operands: kUnit, every array along the run (data contiguous, coefficient
// arrays each constant (kConst) or contiguous (kUnit)); kAny, anything (gathered a vector at a time).
enum BackwardStep : int { kConst = 0, kUnit = 1, kAny = 2 };
constexpr int64_t kSumFlush = 1024;  // elements a target's vector lanes sum before their tree
constexpr int64_t kOneRowBlockBytes = 512;  // rows_stream: rows from memory this long go one a block
constexpr int64_t kL1SetBytes = 4096;  // rows_stream: addresses this far apart share an L1 set
constexpr int64_t kRowsBlockL1Bytes = 16 << 10;  // rows_stream: four rows a block within this (half an L1)

// The task's rule for c1 and c2, copied: read through the task, its fields cost a load per group
// (the kernels' stores through char pointers may alias them).
struct CoefficientRule {
  double inv_n, epsilon;
  int64_t pitch;
  bool terms, normalize_mean, normalize_variance, epsilon_outside;
  explicit CoefficientRule(const BackwardTask& t)
      : inv_n(t.inv_n), epsilon(t.epsilon), pitch(t.stats_pitch), terms(t.statistics_terms),
        normalize_mean(t.normalize_mean), normalize_variance(t.normalize_variance),
        epsilon_outside(t.epsilon_outside) {}
  // 1 - epsilon u at or below this is a constant group's (its k-term 0), for compute type C.
  template <class C>
  static constexpr double kMinDen = sizeof(C) == 8 ? 1e-14 : 1e-6;
  // c1 and c2 (in double) of a statistics element with 1 / std u, from its sums (with terms), by
  // the rule's flags (given: constants where a loop over many elements passes them).
  template <class C>
  SIMDNORM_CURSOR_METHOD std::pair<double, double> terms_of(C u, double sum_g, double sum_gy, bool outside,
                                                            bool mean, bool variance) const {
    double k = 1.0;
    if (outside) {
      // 1 - epsilon u = std / (std + epsilon): 0 for a constant group, whose k-term is 0.
      const double den = 1.0 - epsilon * static_cast<double>(u);
      k = den > kMinDen<C> ? 1.0 / den : 0.0;
    }
    return {mean ? sum_g * inv_n : 0.0, variance ? k * sum_gy * inv_n : 0.0};
  }
  // c1 and c2 of statistics element i (at stats + i * sizeof(C)) from its sums: stored beside its
  // mean and u, and returned.
  template <class C>
  SIMDNORM_CURSOR_METHOD std::pair<C, C> set(char* stats, int64_t i, double sum_g, double sum_gy) const {
    double c1 = 0.0, c2 = 0.0;
    if (terms) {
      C u;
      std::memcpy(&u, stats + pitch + i * sizeof(C), sizeof u);
      const std::pair<double, double> c =
          terms_of(u, sum_g, sum_gy, epsilon_outside, normalize_mean, normalize_variance);
      c1 = c.first, c2 = c.second;
    }
    const C v1 = static_cast<C>(c1), v2 = static_cast<C>(c2);
    std::memcpy(stats + 2 * pitch + i * sizeof(C), &v1, sizeof v1);
    std::memcpy(stats + 3 * pitch + i * sizeof(C), &v2, sizeof v2);
    return {v1, v2};
  }
};
template <class C>
static void set_coefficients(const BackwardTask& t, char* stats, int64_t i, double sum_g, double sum_gy) {
  CoefficientRule(t).set<C>(stats, i, sum_g, sum_gy);
}

template <class T>
struct BackwardKernel {
  using L = Lanes<T>;
  using V = typename L::V;
  using C = typename ComputeOf<T>::type;
  using LC = Lanes<C>;
  static constexpr int W = L::W;

  static V zero() { return splat<V>(0.0); }
  // Whether loops with derivative D save or read a group's ga (BackwardTask::ga_buffer): the
  // transcendental ones' (silu', gelu'), out of line or inline.
  template <class D>
  static constexpr bool saves_ga_with() {
    return std::is_same<D, DerivOutOfLine<V>>::value || std::is_same<D, DerivSmooth<V>>::value;
  }
  // Calls fn(derivative) for a run of layout (SS, PS): silu' and gelu' inline (DerivSmooth) where
  // the run's statistics and parameters are constant along it (NCHW planes: group, instance and
  // batch norm), its ga saved as the call's is; else `deriv`. The same arithmetic either way (no
  // FMA is contracted), so the same bits; inline, the derivative's exp and division overlap the
  // run's loads and stores instead of waiting on a call a vector.
  template <int SS, int PS, class D, class Fn>
  static void run_derivative(const BackwardTask& t, const D& deriv, Fn&& fn) {
    if constexpr (SS == kConst && PS == kConst && !kFewInline && std::is_same<D, DerivOutOfLine<V>>::value) {
      if (t.act.kind == ActKind::silu || t.act.kind == ActKind::gelu) return fn(DerivSmooth<V>(t.act));
    }
    fn(deriv);
  }

  // With streaming stores (t.stream_stores), the elements of a run at p before its first
  // vector-aligned one, at most n; -1 where its elements are not aligned to their size, or where
  // a vector is not a whole 64-byte line (16-bit data, AVX2): half lines streamed from rows side
  // by side, or next to a plain store, reach memory as partial writes, slower than plain stores.
  static int64_t stream_head(const char* p, int64_t n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (L::kVectorBytes != 64 || a % sizeof(T) != 0) return -1;
    const int64_t head = static_cast<int64_t>((L::kVectorBytes - a % L::kVectorBytes) % L::kVectorBytes / sizeof(T));
    return head < n ? head : n;
  }
  // Where a run of n elements written at p starts its whole streamed vectors (its first ones one
  // partial vector, streamed too), stream set; 0, stream false, where ok is false or p cannot stream.
  static int64_t streamed_from(bool ok, const char* p, int64_t n, bool& stream) {
    const int64_t head = ok ? stream_head(p, n) : -1;
    stream = head >= 0;
    return stream ? head : 0;
  }

  // Calls at(e, m) over a run of n elements: its first `head` as one piece (a streamed run's
  // partial first vector; none where head is 0), then whole vectors, then the last m < W.
  template <class At>
  SIMDNORM_CURSOR_METHOD static void vectors_from(int64_t head, int64_t n, At&& at) {
    int64_t e = head;
    if (e > 0) at(0, static_cast<int>(e));
    for (; e + W <= n; e += W) at(e, W);
    if (e < n) at(e, static_cast<int>(n - e));
  }

  // A vector of m elements of type E at p with byte stride s, gathered in the compute type.
  template <class E>
  static V gather(const char* p, int64_t s, int m) {
    C b[W];
    for (int k = 0; k < m; ++k) b[k] = static_cast<C>(Lanes<E>::load_one(reinterpret_cast<const E*>(p + k * s)));
    return LC::load_partial(b, m);
  }
  template <int Step, class E>
  static V load(const char* p, int64_t s, int m) {
    if constexpr (Step == kConst) return splat<V>(Lanes<E>::load_one(reinterpret_cast<const E*>(p)));
    else if constexpr (Step == kUnit) {
      return load_up_to<Lanes<E>>(reinterpret_cast<const E*>(p), m);
    } else {
      return s == 0 ? splat<V>(Lanes<E>::load_one(reinterpret_cast<const E*>(p))) : gather<E>(p, s, m);
    }
  }

  // One run's pointers and steps, and the quantities every element recomputes. Everything is
  // copied into the cursor, and coefficients constant along the run are loaded once: the stores
  // through char pointers may alias anything, so the compiler would read them again every vector.
  template <int SStep, int PStep, class D>
  struct Element {
    static constexpr int DStep = SStep == kAny || PStep == kAny ? kAny : kUnit;
    const D& deriv;
    const char *x, *dy, *stats, *params, *fused;
    int64_t sx, sdy, ss, sp, sf, stats_pitch, params_pitch, ahead;
    bool fused_is_input;
    V mean_c, u_c, c1_c, c2_c, scale_c, bias_c;  // the constants (kConst)

    Element(const BackwardTask& t, const D& d, char* const* p, const int64_t* s, int64_t prefetch_ahead)
        : deriv(d), x(p[kX]), dy(p[kGradOut]), stats(p[kStats]), params(p[kParams]), fused(p[kFusedAdd]),
          sx(s[kX]), sdy(s[kGradOut]), ss(s[kStats]), sp(s[kParams]), sf(s[kFusedAdd]),
          stats_pitch(t.stats_pitch), params_pitch(t.params_pitch), ahead(prefetch_ahead),
          fused_is_input(t.fused_add_dtype == t.dtype) {
      if constexpr (SStep == kConst) {
        mean_c = splat_at(stats, 0), u_c = splat_at(stats, 1), c1_c = splat_at(stats, 2), c2_c = splat_at(stats, 3);
      }
      if constexpr (PStep == kConst) scale_c = splat_at(params, 0), bias_c = splat_at(params + params_pitch, 0);
    }
    V splat_at(const char* q, int array) const { return splat<V>(load_c(q, array, stats_pitch)); }
    // Statistics array `array` (0 mean, 1 u, 2 c1, 3 c2) at element e.
    SIMDNORM_CURSOR_METHOD V stat(int64_t e, int array, int m) const {
      if constexpr (SStep == kConst) return array == 0 ? mean_c : array == 1 ? u_c : array == 2 ? c1_c : c2_c;
      const int64_t cs = static_cast<int64_t>(sizeof(C));
      return load<SStep, C>(stats + e * (SStep == kUnit ? cs : ss) + array * stats_pitch, ss, m);
    }
    SIMDNORM_CURSOR_METHOD V param(int64_t e, int array, int m) const {
      if constexpr (PStep == kConst) return array == 0 ? scale_c : bias_c;
      const int64_t cs = static_cast<int64_t>(sizeof(C));
      return load<PStep, C>(params + e * (PStep == kUnit ? cs : sp) + array * params_pitch, sp, m);
    }
    // At element e of the run, m of them (m = W but at the end). (Without Prefetch: the caller
    // prefetches, as pair_run does.)
    template <bool Prefetch = true>
    SIMDNORM_CURSOR_METHOD void at(int64_t e, int m, V& y, V& ga, V& g) const {
      V d;
      at_with_d<Prefetch>(e, m, d, y, ga, g);
    }
    // As at(), and d = x - mean.
    template <bool Prefetch = true>
    SIMDNORM_CURSOR_METHOD void at_with_d(int64_t e, int m, V& d, V& y, V& ga, V& g) const {
      const char* px = x + e * sx;
      const char* pdy = dy + e * sdy;
      if (DStep == kUnit && Prefetch) {
        // Rows follow each other in memory (layer norm) or runs are long: what the next rows need
        // arrives while these are computed. Grouped, the apply pass reads its group from the L1
        // and prefetches twice as far as the sums pass, so that requests keep going out. Into the
        // L2 only (prefetcht1): with prefetcht0, channels-last batch norm's passes ran 1.3-1.6x
        // slower at 256-1024 channels on Zen 4 (on Zen 3, neither hint won clearly).
        __builtin_prefetch(px + ahead, 0, 2);
        __builtin_prefetch(pdy + ahead, 0, 2);
      }
      const V xv = load<DStep, T>(px, sx, m);
      const V dyv = load<DStep, T>(pdy, sdy, m);
      const V scale = param(e, 0, m);
      d = xv - stat(e, 0, m);
      y = d * stat(e, 1, m);
      if constexpr (D::kUsesPre) {
        V pre = vfma(y, scale, param(e, 1, m));
        if (fused != nullptr) {  // (runs with a fused_add are planned kAny)
          const char* f = fused + e * sf;
          pre = pre + (fused_is_input ? gather<T>(f, sf, m) : gather<float>(f, sf, m));
        }
        ga = deriv(pre, dyv);
      } else {
        ga = dyv;
      }
      g = ga * scale;
    }
    // d = x - mean at element e (the apply's, where ga comes saved: BackwardTask::ga_buffer).
    SIMDNORM_CURSOR_METHOD V d_at(int64_t e, int m) const { return load<DStep, T>(x + e * sx, sx, m) - stat(e, 0, m); }
    // grad_input at element e from d = x - mean and ga (every path's formula: grad_input()).
    SIMDNORM_CURSOR_METHOD V dx_at(int64_t e, int m, V d, V ga) const {
      const V u = stat(e, 1, m);
      return grad_input(d * u, ga, param(e, 0, m) * u, y_coefficient(u, stat(e, 3, m)), k_coefficient(u, stat(e, 2, m)));
    }
  };

  // m elements of grad_input at out: contiguous (Unit; whole vectors streamed when asked, edges
  // streamed in pieces), else sdx bytes apart.
  template <bool Unit>
  SIMDNORM_CURSOR_METHOD static void store_dx(char* out, int64_t sdx, V dx, int m, bool stream) {
    if constexpr (Unit) {
      if (m == W) L::store_or_stream(reinterpret_cast<T*>(out), dx, stream);
      else if (stream) L::store_partial_stream(reinterpret_cast<T*>(out), dx, m);  // (a plain store would read the line)
      else L::store_partial(reinterpret_cast<T*>(out), dx, m);
    } else {
      T b[W];
      L::store_partial(b, dx, m);
      for (int k = 0; k < m; ++k) std::memcpy(out + k * sdx, &b[k], sizeof(T));
    }
  }

  // Adds the m lanes of v to a target that varies along the run (element k at acc[k * step]).
  template <int Step>
  static void add_varying(C* acc, int64_t step, V v, int m) {
    if constexpr (Step == kUnit) {
      if (m == W) LC::store(acc, LC::load(acc) + v);
      else LC::store_partial(acc, LC::load_partial(acc, m) + v, m);
    } else {
      C b[W];
      LC::store(b, v);
      for (int k = 0; k < m; ++k) acc[k * step] += b[k];
    }
  }

  // A flush of one run's sums of ga y and ga (as vectors) into their doubles: the parameters', and,
  // where the group's target and the parameters are both constant along the run (group != null),
  // the group's: sum(g) = scale sum(ga), sum(g y) = scale sum(ga y), in double (g = ga scale).
  // Every path over such runs takes the group's sums so, whatever else it sums: a group's bits do
  // not depend on the path (alone or in a batch, two passes or grouped).
  SIMDNORM_CURSOR_METHOD static void add_run_sums(V sgay, V sga, double* param0, double* param1, double* group0,
                                                  double* group1, const char* scale) {
    C ra, rb;
    vreduce_add2(sgay, sga, ra, rb);
    const double a = static_cast<double>(ra), b = static_cast<double>(rb);
    if (param0 != nullptr) *param0 += a, *param1 += b;
    if (group0 != nullptr) {
      C sc;
      std::memcpy(&sc, scale, sizeof sc);
      *group0 += static_cast<double>(sc) * b, *group1 += static_cast<double>(sc) * a;
    }
  }

  // A summed run's grad_input where the apply pass writes it next (grouped, not streamed): its lines
  // are fetched for writing while the sums wait on their reads. Else null.
  SIMDNORM_CURSOR_METHOD static char* written_next(const BackwardTask& t, char* dx) {
    return t.grouped && !t.stream_stores ? dx : nullptr;
  }

  // The sums pass over one run of n elements. Write (BackwardTask::sums_write): grad_input too, in
  // the same loop, as apply_run writes it (streamed where the run's grad_input starts aligned).
  template <int SStep, int PStep, class D, bool Write = false>
  static void sums_run(const BackwardTask& t, const D& deriv, char* const* p, const int64_t* s, int64_t n,
                       const BackwardSums& acc, C* ga_out = nullptr) {
    const Element<SStep, PStep, D> el(t, deriv, p, s, kPrefetchAheadBytes);
    constexpr bool unit = SStep != kAny && PStep != kAny;
    char* const dx_base = p[kGradIn];
    const bool stream = Write && unit && t.stream_stores && stream_head(dx_base, n) == 0;
    const int64_t cs = static_cast<int64_t>(sizeof(C));
    char* const own_out = SStep != kAny && PStep != kAny ? written_next(t, p[kGradIn]) : nullptr;
    const bool want_group = acc.group[0] != nullptr, want_param = acc.param[0] != nullptr;
    // Element steps of the targets (runtime for kAny: 0 sums in lanes like kConst).
    const int64_t sstep = SStep == kConst ? 0 : SStep == kUnit ? 1 : s[kStats] / cs;
    const int64_t pstep = PStep == kConst ? 0 : PStep == kUnit ? 1 : s[kParams] / cs;
    const int64_t gi = (p[kStats] - acc.stats_base) / cs, pi = (p[kParams] - acc.params_base) / cs;
    double* const ga0 = want_group ? acc.group[0] + gi : nullptr;
    double* const ga1 = want_group ? acc.group[1] + gi : nullptr;
    double* const pa0 = want_param ? acc.param[0] + pi : nullptr;
    double* const pa1 = want_param ? acc.param[1] + pi : nullptr;
    // (no float slots where the caller's groups never vary along a run: grouped)
    C* const gv0 = want_group && acc.group_vary[0] != nullptr ? static_cast<C*>(acc.group_vary[0]) + gi : nullptr;
    C* const gv1 = want_group && acc.group_vary[1] != nullptr ? static_cast<C*>(acc.group_vary[1]) + gi : nullptr;
    C* const pv0 = want_param ? static_cast<C*>(acc.param_vary[0]) + pi : nullptr;
    C* const pv1 = want_param ? static_cast<C*>(acc.param_vary[1]) + pi : nullptr;
    // The group's sums from the parameters' (add_run_sums) where both are constant along the run.
    const bool derive = want_group && sstep == 0 && pstep == 0;
    for (int64_t e0 = 0; e0 < n; e0 += kSumFlush) {
      const int64_t e1 = n - e0 < kSumFlush ? n : e0 + kSumFlush;
      V sg = zero(), sgy = zero(), sgay = zero(), sga = zero();
      // m elements from e (W: whole vectors, in a loop of their own without the masks).
      auto step = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
        V d, y, ga, g;
        if (own_out != nullptr) __builtin_prefetch(own_out + e * static_cast<int64_t>(sizeof(T)), 1);
        el.at_with_d(e, m, d, y, ga, g);
        if constexpr (saves_ga_with<D>()) if (ga_out != nullptr) store_up_to<LC>(ga_out + e, ga, m);
        if constexpr (Write) {
          char* const out = dx_base + e * s[kGradIn];
          if (unit && !stream) __builtin_prefetch(out + kPrefetchAheadBytes, 1);
          store_dx<unit>(out, s[kGradIn], el.dx_at(e, m, d, ga), m, stream);
        }
        if (m < W) {
          const auto own = lanes_mask(static_cast<V*>(nullptr), m);
          y = vselect(own, y, zero());
          ga = vselect(own, ga, zero());
          g = vselect(own, g, zero());
        }
        if (!Write && want_group && !derive) {  // (writing, there are no group sums)
          if (SStep == kConst || (SStep == kAny && sstep == 0)) {
            sg = sg + g;
            sgy = vfma(g, y, sgy);
          } else {
            add_varying<SStep>(gv0 + e * sstep, sstep, g, m);
            add_varying<SStep>(gv1 + e * sstep, sstep, g * y, m);
          }
        }
        if (want_param || derive) {
          if (PStep == kConst || (PStep == kAny && pstep == 0)) {
            sgay = vfma(ga, y, sgay);
            sga = sga + ga;
          } else {
            add_varying<PStep>(pv0 + e * pstep, pstep, ga * y, m);
            add_varying<PStep>(pv1 + e * pstep, pstep, ga, m);
          }
        }
      };
      int64_t e = e0;
      for (; e + W <= e1; e += W) step(e, W);
      if (e < e1) step(e, static_cast<int>(e1 - e));
      if (want_group && sstep == 0 && !derive) {
        C a, b;
        vreduce_add2(sg, sgy, a, b);
        *ga0 += static_cast<double>(a), *ga1 += static_cast<double>(b);
      }
      if ((want_param || derive) && pstep == 0)
        add_run_sums(sgay, sga, pa0, pa1, derive ? ga0 : nullptr, ga1, p[kParams]);
    }
  }

  // Layer and RMS norm rows: one run each, contiguous, the statistics constant along a row, the
  // parameters contiguous and shared by all rows. R rows make a block: one loop sums the block
  // (each parameter slot read and written once for R rows, the rows ahead fetched into the L2),
  // then one writes its grad_input, reading the block again from the L1. With 32 registers, blocks
  // of two 16-bit rows (or of rows with parameters of their own) are written in the loop that sums
  // the next block (on AVX2 that loop held both blocks' state and spilled it: two loops took
  // 0.83-0.93x its time on rows in the L3).
  // Apply: dx = y (-u c2) + ga (scale u) - u c1, y = (x - mean) u. Each row's gradient
  // is written in whole vectors from `head` (streamed: its first aligned one; the arithmetic is
  // the same per element whatever the grid), its edges after.
  struct RowState {
    const char *x, *dy;
    char* dx;
    const C* scale;  // the row's parameters and their sums' slots (rows with their own only)
    C *pv0, *pv1;
    int64_t stat;  // the row's statistics element
    V mean, u, a, b;  // a, b: sum(g), sum(g y) while summed; then -u c2 and -u c1
  };
  static constexpr int kMaxBlockRows = 4;
  template <int R, bool OwnParams, class D, class AfterBlock>
  static void rows_stream(const BackwardTask& t, const D& deriv, char* const* first, const int64_t* step, int64_t n,
                          int64_t blocks, const BackwardSums& acc, AfterBlock&& after_block) {
    if (blocks == 0) return;
    constexpr int64_t es = static_cast<int64_t>(sizeof(T)), cs = static_cast<int64_t>(sizeof(C));
    char* p[kNumOperands];  // the block's first row (the caller moves its own pointers on after)
    for (int op = 0; op < kNumOperands; ++op) p[op] = first[op];
    char* const stats = const_cast<char*>(acc.stats_base);
    const CoefficientRule rule(t);
    auto stat_of = [&](int64_t i, int array) { return load_c(stats + i * cs, array, t.stats_pitch); };
    const C* const scale = reinterpret_cast<const C*>(p[kParams]);
    const C* const bias = reinterpret_cast<const C*>(p[kParams] + t.params_pitch);
    const int64_t bias_at = t.params_pitch / cs;
    // OwnParams: rows with parameters of their own (group norm of (N, C) data: a group's
    // channels), each row's loaded and summed by itself; else a block's rows share each load and
    // sum. (A template argument: tested in the loops it cost the shared rows 10-15%.)
    const bool want_param = acc.param[0] != nullptr;
    const int64_t pi = (p[kParams] - acc.params_base) / cs;
    C* const pv0 = want_param ? static_cast<C*>(acc.param_vary[0]) + pi : nullptr;
    C* const pv1 = want_param ? static_cast<C*>(acc.param_vary[1]) + pi : nullptr;
    // The rows summed are fetched into the L2 this many rows ahead: kPrefetchAheadBytes or more, in
    // whole blocks (twice as far measured slower).
    const int64_t ahead = R * ((prefetch_units_ahead(n * es) + R - 1) / R);
    const int64_t ahead_x = ahead * step[kX], ahead_dy = ahead * step[kGradOut];
    constexpr int64_t kPerLine = kLineBytes / es >= W ? kLineBytes / es : W;  // elements a line holds
    auto load_t = [](const char* q, int m) SIMDNORM_INLINE_LAMBDA { return load_up_to<L>(reinterpret_cast<const T*>(q), m); };
    auto load_c = [](const C* q, int m) SIMDNORM_INLINE_LAMBDA { return load_up_to<LC>(q, m); };
    // ga at element e of row r; d = x - mean, y = d u.
    auto grad_at = [&](const RowState& r, int64_t e, int m, V s, V b, V& d, V& y) SIMDNORM_INLINE_LAMBDA {
      d = load_t(r.x + e * es, m) - r.mean;
      y = d * r.u;
      const V dyv = load_t(r.dy + e * es, m);
      if constexpr (D::kUsesPre) return deriv(vfma(y, s, b), dyv);
      else return dyv;
    };
    static_assert(R <= kMaxBlockRows, "a block's rows of saved ga");
    using Rows = RowsOf<RowState, R>;
    // (a block's R rows of ga saved at once; only out-of-line derivatives)
    constexpr bool kSaves = saves_ga_with<D>();
    const bool saves_ga = kSaves && t.ga_buffer != nullptr;
    C* const saved_ga = static_cast<C*>(t.ga_buffer);  // (row j of the block's at j n)
    using Yes = std::true_type;
    using No = std::false_type;
    // Every row streams alike when the rows' step keeps their alignment.
    bool stream;
    const int64_t head = streamed_from(t.stream_stores && step[kGradIn] % L::kVectorBytes == 0, p[kGradIn], n, stream);
    // Row pointers and element indices move on by a block's rows at each block (per row, their
    // multiplications were an eighth of a row of 16 floats' instructions).
    int64_t stat0 = (p[kStats] - acc.stats_base) / cs, param0 = 0;
    const int64_t stat_step = step[kStats] / cs, param_step = step[kParams] / cs;
    auto open = [&](Rows& rows) SIMDNORM_INLINE_LAMBDA {
      rows.each([&](RowState& r, int j) SIMDNORM_INLINE_LAMBDA {
        r.x = p[kX] + j * step[kX], r.dy = p[kGradOut] + j * step[kGradOut], r.dx = p[kGradIn] + j * step[kGradIn];
        r.stat = stat0 + j * stat_step;
        if constexpr (OwnParams) {
          const int64_t at = param0 + j * param_step;
          r.scale = scale + at;
          r.pv0 = want_param ? pv0 + at : nullptr;
          r.pv1 = want_param ? pv1 + at : nullptr;
        }
        r.mean = splat<V>(stat_of(r.stat, 0)), r.u = splat<V>(stat_of(r.stat, 1));
        r.a = zero(), r.b = zero();
      });
    };
    // One vector of each row summed at element e (m of them).
    auto sum_at = [&](Rows& rows, int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      V s = zero(), b = zero(), p0 = zero(), p1 = zero();
      if constexpr (!OwnParams) {
        s = load_c(scale + e, m), b = D::kUsesPre ? load_c(bias + e, m) : zero();
        if (want_param) p0 = load_c(pv0 + e, m), p1 = load_c(pv1 + e, m);
      }
      rows.each([&](RowState& r, int j) SIMDNORM_INLINE_LAMBDA {
        if constexpr (OwnParams) {
          s = load_c(r.scale + e, m), b = D::kUsesPre ? load_c(r.scale + bias_at + e, m) : zero();
          if (want_param) p0 = load_c(r.pv0 + e, m), p1 = load_c(r.pv1 + e, m);
        }
        if (e % kPerLine == 0) {  // (a line's worth of each row a step: one request a line)
          __builtin_prefetch(r.x + ahead_x + e * es, 0, 2);
          __builtin_prefetch(r.dy + ahead_dy + e * es, 0, 2);
          if (!stream) __builtin_prefetch(r.dx + e * es, 1);  // written next: fetched while the reads wait
        }
        V d, y;
        V ga = grad_at(r, e, m, s, b, d, y);
        if constexpr (kSaves) if (saves_ga) store_up_to<LC>(saved_ga + j * n + e, ga, m);
        if (m < W) {
          const auto own = lanes_mask(static_cast<V*>(nullptr), m);
          y = vselect(own, y, zero()), ga = vselect(own, ga, zero());
        }
        const V g = ga * s;
        r.a = r.a + g, r.b = vfma(g, y, r.b);
        p0 = vfma(ga, y, p0), p1 = p1 + ga;
        if constexpr (OwnParams)
          if (want_param) store_up_to<LC>(r.pv0 + e, p0, m), store_up_to<LC>(r.pv1 + e, p1, m);
      });
      if (want_param && !OwnParams) {
        if (m == W) LC::store(pv0 + e, p0), LC::store(pv1 + e, p1);
        else LC::store_partial(pv0 + e, p0, m), LC::store_partial(pv1 + e, p1, m);
      }
    };
    // m elements of each row written from e (full: a whole vector, streamed when asked; else m < W).
    // (y_term: every row's y coefficient nonzero, grad_input_with_y's case)
    auto write_at = [&](Rows& rows, auto full, auto y_term, int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      V s = zero(), b = zero();
      if constexpr (!OwnParams) s = load_c(scale + e, m), b = D::kUsesPre ? load_c(bias + e, m) : zero();
      rows.each([&](RowState& r, int j) SIMDNORM_INLINE_LAMBDA {
        if constexpr (OwnParams)
          s = load_c(r.scale + e, m), b = D::kUsesPre ? load_c(r.scale + bias_at + e, m) : zero();
        V d, y;
        V ga;
        if (kSaves && saves_ga) d = load_t(r.x + e * es, m) - r.mean, ga = load_c(saved_ga + j * n + e, m);
        else ga = grad_at(r, e, m, s, b, d, y);
        const V dx = decltype(y_term)::value ? grad_input_with_y(d * r.u, ga, s * r.u, r.a, r.b)
                                             : grad_input(d * r.u, ga, s * r.u, r.a, r.b);
        T* const q = reinterpret_cast<T*>(r.dx + e * es);
        if constexpr (decltype(full)::value) L::store_or_stream(q, dx, stream);
        else if (stream) L::store_partial_stream(q, dx, m);  // (a plain store would read the line)
        else L::store_partial(q, dx, m);
      });
    };
    // The lanes' sums into their doubles: every kSumFlush elements of the row, and at its end.
    auto flush_sums = [&](Rows& rows) SIMDNORM_INLINE_LAMBDA {
      rows.each([&](RowState& r, int) SIMDNORM_INLINE_LAMBDA {
        C a, b;
        vreduce_add2(r.a, r.b, a, b);
        acc.group[0][r.stat] += static_cast<double>(a), acc.group[1][r.stat] += static_cast<double>(b);
        r.a = zero(), r.b = zero();
      });
    };
    // One whole vector of each row summed at e, and the lanes flushed where a kSumFlush ends.
    auto sum_vector = [&](Rows& rows, int64_t e) SIMDNORM_INLINE_LAMBDA {
      sum_at(rows, e, W);
      if ((e + W) % kSumFlush == 0) flush_sums(rows);
    };
    // The block's sums from element e (a multiple of W) on.
    auto sum_rest = [&](Rows& rows, int64_t e) SIMDNORM_INLINE_LAMBDA {
      for (; e + W <= n; e += W) sum_vector(rows, e);
      if (e < n) sum_at(rows, e, static_cast<int>(n - e));
      if (n % kSumFlush != 0) flush_sums(rows);
    };
    // The block's gradients from e (head + a multiple of W) on: whole vectors, then the edges
    // [0, head) and the last m < W.
    auto write_rest = [&](Rows& rows, auto y_term, int64_t e) SIMDNORM_INLINE_LAMBDA {
      for (; e + W <= n; e += W) write_at(rows, Yes{}, y_term, e, W);
#pragma GCC unroll 1
      for (int side = 0; side < 2; ++side) {  // (one copy of the edges' code)
        const int m = static_cast<int>(side == 0 ? head : n - e);
        if (m > 0) write_at(rows, No{}, No{}, side == 0 ? 0 : e, m);
      }
    };
    // The block's coefficients from its sums; whether every row has a y term.
    auto settle = [&](Rows& rows) SIMDNORM_INLINE_LAMBDA {
      bool y_term = true;
      rows.each([&](RowState& r, int) SIMDNORM_INLINE_LAMBDA {
        const auto c = rule.template set<C>(stats, r.stat, acc.group[0][r.stat], acc.group[1][r.stat]);
        const C u = stat_of(r.stat, 1);
        r.a = y_coefficient(splat<V>(u), splat<V>(c.second)), r.b = k_coefficient(splat<V>(u), splat<V>(c.first));
        y_term = y_term && -u * c.second != C(0);  // (r.a's lanes, as y_coefficient rounds them)
      });
      return y_term;
    };
    auto write_block = [&](Rows& rows, bool y_term) SIMDNORM_INLINE_LAMBDA {
      if (y_term) write_rest(rows, Yes{}, head);
      else write_rest(rows, No{}, head);
    };
    auto next_block = [&]() SIMDNORM_INLINE_LAMBDA {
      p[kX] += R * step[kX], p[kGradOut] += R * step[kGradOut], p[kGradIn] += R * step[kGradIn];  // (the rest: read at entry)
      stat0 += R * stat_step, param0 += R * param_step;
    };
    // With 32 registers, two rows' block k is written while block k + 1 is summed, vector by
    // vector: block k + 1's reads from memory then overlap block k's arithmetic (one pass after
    // the other left the memory idle while it wrote). Not float32 and float64 rows sharing their
    // parameters, which their loads bound, not their arithmetic: the two loops apart measured
    // faster there. Where saved ga is read (a buffer per block) or a row has no y term, the block
    // is written by itself.
    constexpr bool kInterleaves = kVectorRegisters >= 32 && R == 2 && !kSaves && (OwnParams || sizeof(T) == 2);
    if constexpr (!kInterleaves) {
      Rows rows;
      for (int64_t k = 0; k < blocks; ++k) {
        open(rows);
        sum_rest(rows, 0);
        write_block(rows, settle(rows));
        after_block(k);
        next_block();
      }
      return;
    }
    Rows written, summed;
    bool y_term = false;
    for (int64_t k = 0; k <= blocks; ++k) {  // block k summed, block k - 1 written
      const bool more = k < blocks;
      int64_t e = 0;  // (summed's elements before e: summed beside the writes)
      if (k > 0 && more && y_term) {
        open(summed);
        for (; head + e + W <= n; e += W) {
          sum_vector(summed, e);
          write_at(written, Yes{}, Yes{}, head + e, W);
        }
        write_rest(written, Yes{}, head + e);
      } else {
        if (k > 0) write_block(written, y_term);
        if (!more) break;
        open(summed);
      }
      sum_rest(summed, e);
      y_term = settle(summed);
      after_block(k);
      next_block();
      written = summed;
    }
  }

  // dx = u ((g - c1) - y c2) = y (-u c2) + ga (scale u) - u c1, y = (x - mean) u: every path's one
  // formula (rows_stream's), its three coefficients constant where u, c1, c2 and the scale are.
  // Two FMAs an element, not five operations (pair_run was bound by their count). Not through
  // u^2 (d (-u^2 c2)): u^2 leaves float's range where the data's spread passes 1e19 or, with
  // epsilon 0, stays below 1e-19, which the forward normalizes well. Where y_coef is 0 (no y term:
  // batch norm with given statistics, MVN without normalize_variance) y takes no part, so that an
  // infinite or NaN input gives the formula's value there, not inf * 0.
  SIMDNORM_CURSOR_METHOD static V grad_input(V y, V ga, V scale_u, V y_coef, V k_coef) {
    const V rest = vfma(ga, scale_u, k_coef);
    return vselect(y_coef != zero(), vfma(y, y_coef, rest), rest);
  }
  // grad_input where every lane's y_coef is nonzero (or NaN): the same bits, without the select
  // (rows_stream's rows in the caches are bound by their operations).
  SIMDNORM_CURSOR_METHOD static V grad_input_with_y(V y, V ga, V scale_u, V y_coef, V k_coef) {
    return vfma(y, y_coef, vfma(ga, scale_u, k_coef));
  }
  SIMDNORM_CURSOR_METHOD static V y_coefficient(V u, V c2) { return -u * c2; }
  SIMDNORM_CURSOR_METHOD static V k_coefficient(V u, V c1) { return -u * c1; }

  // The apply pass over one run: dx = u ((g - c1) - y c2) (grad_input). Streamed, the first step takes the
  // elements before the first aligned vector (streamed in pieces, as the last step's).
  template <int SStep, int PStep, class D>
  static void apply_run(const BackwardTask& t, const D& deriv, char* const* p, const int64_t* s, int64_t n,
                        const C* ga_in = nullptr) {
    // Grouped, the sums pass has just read the group: its data are in the L1.
    const bool grouped = t.grouped, write_ga = t.write_ga;
    const Element<SStep, PStep, D> el(t, deriv, p, s, (grouped ? 2 : 1) * kPrefetchAheadBytes);
    char* const dx_base = p[kGradIn];
    const int64_t sdx = s[kGradIn];
    constexpr bool unit = SStep != kAny && PStep != kAny;
    bool stream;
    const int64_t head = streamed_from(unit && t.stream_stores && !write_ga, dx_base, n, stream);
    int m = 0;
    for (int64_t e = 0; e < n; e += m) {
      m = static_cast<int>(e == 0 && head > 0 ? head : n - e < W ? n - e : W);
      V d, y, ga, g;
      char* out = dx_base + e * sdx;
      if (unit && !grouped && !stream) __builtin_prefetch(out + kPrefetchAheadBytes, 1);
      if (saves_ga_with<D>() && ga_in != nullptr) d = el.d_at(e, m), ga = load_up_to<LC>(ga_in + e, m);
      else el.at_with_d(e, m, d, y, ga, g);
      if (write_ga) {  // in the compute type (the storage type's for float32 and float64 data)
        if constexpr (std::is_same<T, C>::value) {
          store_dx<unit>(out, sdx, ga, m, false);
        } else {
          C b[W];
          LC::store_partial(b, ga, m);
          for (int k = 0; k < m; ++k) std::memcpy(out + k * sdx, &b[k], sizeof(C));
        }
        continue;
      }
      store_dx<unit>(out, sdx, el.dx_at(e, m, d, ga), m, stream);
    }
  }

  // Grouped, statistics and parameters constant along the runs, data contiguous (batch, instance
  // and group norm of NCHW data): a run of group k (pa) written in the loop that sums the same run
  // of group k + 1 (ps), so that the reads from memory and the writes overlap as in np.add; group
  // k is read again from the L2. Per element the arithmetic is apply_run's and sums_run's, and the
  // sums reach their targets in sums_run's order: the bits are those of the two passes apart. The
  // summed lines are fetched t.pair_prefetch_bytes ahead into the L2 only (prefetcht1): fetched
  // into the L1 (prefetcht0), the pair ran slower than the two passes apart; with grad_input fetched
  // for writing too, slower on groups of 100 KB and more. How far ahead depends on the L2
  // (runtime/cpu.cpp: pair_prefetch_bytes).
  template <class D>
  static void pair_run(const BackwardTask& t, const D& deriv, char* const* pa, char* const* ps, const int64_t* s,
                       int64_t n, const BackwardSums& acc) {
    constexpr int64_t cs = static_cast<int64_t>(sizeof(C));
    const Element<kConst, kConst, D> wr(t, deriv, pa, s, 0), su(t, deriv, ps, s, 0);
    bool stream;
    const int64_t head = streamed_from(t.stream_stores, pa[kGradIn], n, stream);
    // The summed run from its start; the written one from head, its whole vectors [0, written).
    const T* const sx = reinterpret_cast<const T*>(ps[kX]);
    const T* const sdy = reinterpret_cast<const T*>(ps[kGradOut]);
    const T* const wx = reinterpret_cast<const T*>(pa[kX]) + head;
    const T* const wdy = reinterpret_cast<const T*>(pa[kGradOut]) + head;
    T* const dx = reinterpret_cast<T*>(pa[kGradIn]) + head;
    const int64_t written = (n - head) / W * W;
    const V mean = wr.mean_c, scale_u = wr.scale_c * wr.u_c;
    const V y_coef = y_coefficient(wr.u_c, wr.c2_c), k_coef = k_coefficient(wr.u_c, wr.c1_c);
    const V su_mean = su.mean_c, su_u = su.u_c;
    const int64_t ahead = t.pair_prefetch_bytes;
    const bool want_group = acc.group[0] != nullptr, want_param = acc.param[0] != nullptr;
    const int64_t gi = (ps[kStats] - acc.stats_base) / cs, pi = (ps[kParams] - acc.params_base) / cs;
    // Element e of the summed run into the lanes (sgay, sga); element e of the written one.
    // (pre and ga as Element::at_with_d computes them: the same bits.)
    auto sum = [&](int64_t e, V& sgay, V& sga) SIMDNORM_INLINE_LAMBDA {
      __builtin_prefetch(reinterpret_cast<const char*>(sx + e) + ahead, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(sdy + e) + ahead, 0, 2);
      const V y = (L::load(sx + e) - su_mean) * su_u;
      V ga = L::load(sdy + e);
      if constexpr (D::kUsesPre) ga = deriv(vfma(y, su.scale_c, su.bias_c), ga);
      sgay = vfma(ga, y, sgay), sga = sga + ga;
    };
    auto write = [&](int64_t e) SIMDNORM_INLINE_LAMBDA {
      const V d = L::load(wx + e) - mean;
      V ga = L::load(wdy + e);
      if constexpr (D::kUsesPre) ga = deriv(vfma(d * wr.u_c, wr.scale_c, wr.bias_c), ga);
      L::store_or_stream(dx + e, grad_input(d * wr.u_c, ga, scale_u, y_coef, k_coef), stream);
    };
    auto flush = [&](V sgay, V sga) SIMDNORM_INLINE_LAMBDA {
      add_run_sums(sgay, sga, want_param ? acc.param[0] + pi : nullptr, want_param ? acc.param[1] + pi : nullptr,
                   want_group ? acc.group[0] + gi : nullptr, want_group ? acc.group[1] + gi : nullptr, ps[kParams]);
    };
    // Two whole flushes' elements side by side, each into lanes of its own: the adds of one flush
    // wait on each other (a chain of FMA latencies, which bound the loop), those of two do not.
    // Each flush's lanes take its elements in order and reach the doubles in order: the same bits.
    int64_t e0 = 0;
    for (; e0 + 2 * kSumFlush <= written; e0 += 2 * kSumFlush) {
      V sgay0 = zero(), sga0 = zero(), sgay1 = zero(), sga1 = zero();
      for (int64_t e = e0; e < e0 + kSumFlush; e += W) {
        sum(e, sgay0, sga0);
        sum(e + kSumFlush, sgay1, sga1);
        write(e);
        write(e + kSumFlush);
      }
      flush(sgay0, sga0);
      flush(sgay1, sga1);
    }
    for (; e0 < n; e0 += kSumFlush) {
      const int64_t e1 = n - e0 < kSumFlush ? n : e0 + kSumFlush;
      const int64_t whole = e0 + (e1 - e0) / W * W, paired = std::min(whole, written);
      V sgay = zero(), sga = zero();
      int64_t e = e0;
      for (; e < paired; e += W) {
        sum(e, sgay, sga);
        write(e);
      }
      for (; e < whole; e += W) sum(e, sgay, sga);
      if (e < e1) {  // the summed run's last elements (the written run's are apply_run's, below)
        const int m = static_cast<int>(e1 - e);
        V y, ga, g;
        su.template at<false>(e, m, y, ga, g);
        const auto own = lanes_mask(static_cast<V*>(nullptr), m);
        y = vselect(own, y, zero()), ga = vselect(own, ga, zero());
        sgay = vfma(ga, y, sgay), sga = sga + ga;
      }
      flush(sgay, sga);
    }
    // The written run's edges, [0, head) and what is left after its last whole vector, by apply_run.
    const int64_t end = head + written;
    if (head > 0) apply_run<kConst, kConst>(t, deriv, pa, s, head);
    if (end < n) {
      char* q[kNumOperands];
      for (int op = 0; op < kNumOperands; ++op) q[op] = pa[op] + end * s[op];
      apply_run<kConst, kConst>(t, deriv, q, s, n - end);
    }
  }

  // Whether pair_run takes the runs of `group`: pair_run's layout, no fused_add, grad_input written,
  // an activation whose derivative runs inline (relu's backward is as common as the plain one;
  // the others' derivatives bound their loops by themselves).
  static bool pairs(const BackwardTask& t, const LoopNest& group) {
    const int in = group.ndim - 1;
    const int64_t es = static_cast<int64_t>(sizeof(T));
    return derivative_inline(t.act.kind) && !t.write_ga && !t.has_fused_add && group.strides[kX][in] == es &&
           group.strides[kGradOut][in] == es && group.strides[kGradIn][in] == es && group.strides[kStats][in] == 0 &&
           group.strides[kParams][in] == 0;
  }

  // Group `written` (its coefficients set) written while group `summed` is summed into acc, run by
  // run.
  static void pair_groups(const BackwardTask& t, const LoopNest& written, const LoopNest& summed,
                          const BackwardSums& acc) {
    const int in = written.ndim - 1;
    int64_t runs = 1;
    for (int d = 0; d < in; ++d) runs *= written.sizes[d];
    int64_t steps[kNumOperands];
    for (int op = 0; op < kNumOperands; ++op) steps[op] = written.strides[op][in];
    visit_inline_derivative<V>(t.act, [&](const auto& deriv) {
      RunOdometer at(written, 0, in);
      for (int64_t j = 0; j < runs; ++j, at.advance()) {
        char *pa[kNumOperands], *ps[kNumOperands];
        for (int op = 0; op < kNumOperands; ++op) {
          pa[op] = written.data[op] + at.off[op];
          ps[op] = summed.data[op] + at.off[op];
        }
        pair_run(t, deriv, pa, ps, steps, written.sizes[in], acc);
      }
    });
  }

  // Groups of runs each with its statistics and parameters constant (batch, group and instance
  // norm of NCHW data): pair_run (or sums_run and apply_run) per run pay their setup and edges on a
  // few vectors of a small plane. Here one loop sums the group's runs, a tree into the doubles
  // every kSumFlush elements of a run as sums_run flushes, and one writes them from the L1 or L2,
  // the coefficients loaded once a group: the arithmetic and the order of the adds are sums_run's
  // and apply_run's, so the bits are theirs. A group that is one block of memory (instance norm,
  // NCHW group norm) goes so at any length: from memory its two tight loops ran faster than
  // pair_run's overlap. A group of runs apart (batch norm: a channel's run in each sample) keeps
  // pair_run from memory past kShortRun, where its reads of one group beside the writes of the
  // last pay for its setup.
  static constexpr int64_t kShortRun = 64;
  static bool short_runs(const BackwardTask& t, const LoopNest& group) {
    const int in = group.ndim - 1;
    if (t.act.kind != ActKind::identity || group.ndim < 1 || !pairs(t, group)) return false;
    if (group.sizes[in] <= (t.from_memory ? kShortRun : kSumFlush)) return true;
    int64_t dense = group.sizes[in] * static_cast<int64_t>(sizeof(T));  // (pairs: the runs are unit-stride)
    for (int d = in - 1; d >= 0; --d) {
      for (int op : {kX, kGradOut, kGradIn})
        if (group.sizes[d] > 1 && group.strides[op][d] != dense) return false;
      dense *= group.sizes[d];
    }
    return true;
  }

  // fn(pointers) for each run of g, in order.
  template <class Fn>
  SIMDNORM_CURSOR_METHOD static void for_runs(const LoopNest& g, Fn&& fn) {
    const int in = g.ndim - 1;
    char* p[kNumOperands];
    if (in <= 1) {  // (the common cases, one run or a row of them: no odometer)
      int64_t step[kNumOperands];
      for (int op = 0; op < kNumOperands; ++op) p[op] = g.data[op], step[op] = in == 1 ? g.strides[op][0] : 0;
      for (int64_t j = 0; j < (in == 1 ? g.sizes[0] : 1); ++j) {
        fn(p);
        for (int op = 0; op < kNumOperands; ++op) p[op] += step[op];
      }
      return;
    }
    int64_t runs = 1;
    for (int d = 0; d < in; ++d) runs *= g.sizes[d];
    RunOdometer at(g, 0, in);
    for (int64_t j = 0; j < runs; ++j, at.advance()) {
      for (int op = 0; op < kNumOperands; ++op) p[op] = g.data[op] + at.off[op];
      fn(p);
    }
  }

  // One run's sum(ga y) and sum(ga) as vectors, its statistics and scale constant along it and no
  // activation: sums_run's arithmetic and lanes. `out` (or null): the run's grad_input, fetched for
  // writing while the reads wait.
  SIMDNORM_CURSOR_METHOD static void const_run_sums(const T* x, const T* dy, int64_t n, V mean, V u, const char* out,
                                                    V& sgay, V& sga) {
    sgay = zero(), sga = zero();
    auto at = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      if (out != nullptr) __builtin_prefetch(out + e * static_cast<int64_t>(sizeof(T)), 1);
      V y = (load_up_to<L>(x + e, m) - mean) * u, ga = load_up_to<L>(dy + e, m);
      if (m < W) {
        const auto own = lanes_mask(static_cast<V*>(nullptr), m);
        y = vselect(own, y, zero()), ga = vselect(own, ga, zero());
      }
      sgay = vfma(ga, y, sgay), sga = sga + ga;
    };
    int64_t e = 0;
    for (; e + W <= n; e += W) at(e, W);
    if (e < n) at(e, static_cast<int>(n - e));
  }

  // grad_input of such a run: apply_run's arithmetic. stream_ok: streaming stores from dx's first
  // whole line (streamed_from), its partial first and last vectors streamed too.
  SIMDNORM_CURSOR_METHOD static void const_run_apply(const T* x, const T* dy, T* dx, int64_t n, V mean, V u, V scale,
                                                     V c1, V c2, bool stream_ok = false) {
    const V scale_u = scale * u, y_coef = y_coefficient(u, c2), k_coef = k_coefficient(u, c1);
    auto value = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      return grad_input((load_up_to<L>(x + e, m) - mean) * u, load_up_to<L>(dy + e, m), scale_u, y_coef, k_coef);
    };
    bool stream;
    const int64_t head = streamed_from(stream_ok, reinterpret_cast<const char*>(dx), n, stream);
    if (stream) {
      vectors_from(head, n, [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
        if (m == W) L::store_or_stream(dx + e, value(e, m), true);
        else L::store_partial_stream(dx + e, value(e, m), m);
      });
      return;
    }
    auto at = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      const V v = value(e, m);
      if (m == W) L::store(dx + e, v);
      else L::store_partial(dx + e, v, m);
    };
    int64_t e = 0;
    for (; e + W <= n; e += W) at(e, W);
    // The last m < W: the run's last whole vector written again where grad_output is not being
    // overwritten (its elements get the same values; a masked store costs several plain ones).
    if (e < n) {
      if (n >= W && static_cast<const void*>(dx) != static_cast<const void*>(dy)) at(n - W, W);
      else at(e, static_cast<int>(n - e));
    }
  }

  // The sums of such a group into acc.
  static void short_runs_sums(const BackwardTask& t, const LoopNest& g, const BackwardSums& acc, bool prefetch_out) {
    constexpr int64_t cs = static_cast<int64_t>(sizeof(C));
    const int64_t n = g.sizes[g.ndim - 1];
    const int64_t gi = (g.data[kStats] - acc.stats_base) / cs;
    const V mean = splat<V>(load_c(g.data[kStats], 0, t.stats_pitch)), u = splat<V>(load_c(g.data[kStats], 1, t.stats_pitch));
    const bool want_group = acc.group[0] != nullptr, want_param = acc.param[0] != nullptr;
    if (!want_group && !want_param) return;
    // Run from e0, m of its elements, one tree into the doubles.
    auto flush = [&](char* const* p, int64_t e0, int64_t m) SIMDNORM_INLINE_LAMBDA {
      V sgay, sga;
      const_run_sums(reinterpret_cast<const T*>(p[kX]) + e0, reinterpret_cast<const T*>(p[kGradOut]) + e0, m, mean, u,
                     prefetch_out ? p[kGradIn] + e0 * static_cast<int64_t>(sizeof(T)) : nullptr, sgay, sga);
      const int64_t pi = (p[kParams] - acc.params_base) / cs;
      add_run_sums(sgay, sga, want_param ? acc.param[0] + pi : nullptr, want_param ? acc.param[1] + pi : nullptr,
                   want_group ? acc.group[0] + gi : nullptr, want_group ? acc.group[1] + gi : nullptr, p[kParams]);
    };
    if (n <= kSumFlush) return for_runs(g, [&](char* const* p) SIMDNORM_INLINE_LAMBDA { flush(p, 0, n); });
    // (past kSumFlush: a tree every kSumFlush elements, as sums_run flushes its lanes)
    for_runs(g, [&](char* const* p) SIMDNORM_INLINE_LAMBDA {
      for (int64_t e0 = 0; e0 < n; e0 += kSumFlush) flush(p, e0, std::min(kSumFlush, n - e0));
    });
  }

  // grad_input of such a group, its coefficients set.
  static void short_runs_apply(const BackwardTask& t, const LoopNest& g) {
    const int64_t n = g.sizes[g.ndim - 1];
    const char* const stats = g.data[kStats];
    const V mean = splat<V>(load_c(stats, 0, t.stats_pitch)), u = splat<V>(load_c(stats, 1, t.stats_pitch));
    const V c1 = splat<V>(load_c(stats, 2, t.stats_pitch)), c2 = splat<V>(load_c(stats, 3, t.stats_pitch));
    const bool stream = t.stream_stores && n > kShortRun;  // (as pair_run's writes, past a few lines)
    for_runs(g, [&](char* const* p) SIMDNORM_INLINE_LAMBDA {
      const_run_apply(reinterpret_cast<const T*>(p[kX]), reinterpret_cast<const T*>(p[kGradOut]),
                      reinterpret_cast<T*>(p[kGradIn]), n, mean, u, splat<V>(load_c(p[kParams], 0, t.params_pitch)),
                      c1, c2, stream);
    });
  }

  // The two passes' rows of runs whose statistics and parameters are constant along them, no
  // activation, data contiguous (batch norm's small NCHW planes, in memory order): sums_run's and
  // apply_run's arithmetic per run, the same bits, in one loop a block without their cursors.
  static bool const_rows(const BackwardTask& t, const LoopNest& nest, bool writes) {
    const int in = nest.ndim - 1;
    const int64_t es = static_cast<int64_t>(sizeof(T));
    return in >= 0 && t.act.kind == ActKind::identity && !t.write_ga && nest.sizes[in] <= kSumFlush &&
           nest.strides[kX][in] == es && nest.strides[kGradOut][in] == es && (!writes || nest.strides[kGradIn][in] == es) &&
           nest.strides[kStats][in] == 0 && nest.strides[kParams][in] == 0;
  }
  // (Two passes only: nothing here is written next, so no grad_input is prefetched, and no
  // vector tests for it. Each row's slots are indices stepped with the rows.)
  static void const_rows_sums(const BackwardTask& t, char* const* first, const int64_t* rs, int64_t rows, int64_t n,
                              const BackwardSums& acc) {
    constexpr int64_t cs = static_cast<int64_t>(sizeof(C));
    const bool want_group = acc.group[0] != nullptr, want_param = acc.param[0] != nullptr;
    if (!want_group && !want_param) return;
    const int64_t sx = rs[kX], sdy = rs[kGradOut], ss = rs[kStats], sp = rs[kParams], pitch = t.stats_pitch;
    const char *x = first[kX], *dy = first[kGradOut], *stats = first[kStats], *params = first[kParams];
    int64_t pi = (params - acc.params_base) / cs, gi = (stats - acc.stats_base) / cs;
    for (int64_t r = 0; r < rows; ++r, x += sx, dy += sdy, stats += ss, params += sp, pi += sp / cs, gi += ss / cs) {
      V sgay, sga;
      const_run_sums(reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(dy), n,
                     splat<V>(load_c(stats, 0, pitch)), splat<V>(load_c(stats, 1, pitch)), nullptr, sgay, sga);
      add_run_sums(sgay, sga, want_param ? acc.param[0] + pi : nullptr, want_param ? acc.param[1] + pi : nullptr,
                   want_group ? acc.group[0] + gi : nullptr, want_group ? acc.group[1] + gi : nullptr, params);
    }
  }
  // const_rows_sums with sums_write: a few rows at a time (kWriteRowsBytes of x and dy) summed,
  // then written while in the L2, by const_rows_apply's loops (streamed: apply_run's, row by row).
  static constexpr int64_t kWriteRowsBytes = 256 << 10;
  static void const_rows_sums_write(const BackwardTask& t, char* const* first, const int64_t* rs, int64_t rows,
                                    int64_t n, const BackwardSums& acc) {
    const int64_t es = static_cast<int64_t>(sizeof(T));
    const int64_t per = std::max<int64_t>(1, kWriteRowsBytes / (2 * n * es));
    int64_t steps[kNumOperands] = {};  // (along a row: the data's elements; the coefficients constant)
    steps[kX] = steps[kGradOut] = steps[kGradIn] = es;
    const DerivIdentity<V> deriv(t.act);
    char* q[kNumOperands];
    for (int op = 0; op < kNumOperands; ++op) q[op] = first[op];
    for (int64_t r = 0; r < rows; r += per) {
      const int64_t k = std::min(per, rows - r);
      const_rows_sums(t, q, rs, k, n, acc);
      if (!t.stream_stores) {
        const_rows_apply(t, q, rs, k, n);
      } else {
        char* row[kNumOperands];
        for (int op = 0; op < kNumOperands; ++op) row[op] = q[op];
        for (int64_t j = 0; j < k; ++j) {
          apply_run<kConst, kConst>(t, deriv, row, steps, n);
          for (int op = 0; op < kNumOperands; ++op) row[op] += rs[op];
        }
      }
      for (int op = 0; op < kNumOperands; ++op) q[op] += k * rs[op];
    }
  }
  static void const_rows_apply(const BackwardTask& t, char* const* first, const int64_t* rs, int64_t rows, int64_t n) {
    const int64_t es = static_cast<int64_t>(sizeof(T));
    if (rows > 1 && n >= W && rs[kX] == n * es && rs[kGradOut] == n * es && rs[kGradIn] == n * es)
      return const_rows_stream(t, first, rs, rows, n);
    const char *x = first[kX], *dy = first[kGradOut], *stats = first[kStats], *params = first[kParams];
    char* dx = first[kGradIn];
    for (int64_t r = 0; r < rows; ++r, x += rs[kX], dy += rs[kGradOut], dx += rs[kGradIn], stats += rs[kStats],
                 params += rs[kParams]) {
      const V u = splat<V>(load_c(stats, 1, t.stats_pitch));
      const_run_apply(reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(dy), reinterpret_cast<T*>(dx), n,
                      splat<V>(load_c(stats, 0, t.stats_pitch)), u, splat<V>(load_c(params, 0, t.params_pitch)),
                      splat<V>(load_c(stats, 2, t.stats_pitch)), splat<V>(load_c(stats, 3, t.stats_pitch)));
    }
  }

  // Such rows of n >= W elements back to back in x, dy and dx (NCHW batch norm's small planes):
  // one stream of rows * n elements in vectors aligned to dx's lines, a vector across two rows
  // taking each lane's coefficients from its row (as the forward's run_row_stream). Run by run,
  // nearly every vector of a 7x7 plane crossed a line and each run ended in a vector written twice.
  static void const_rows_stream(const BackwardTask& t, char* const* first, const int64_t* rs, int64_t rows, int64_t n) {
    struct Coefficients {
      V mean, u, scale_u, y_coef, k_coef;
    };
    const int64_t ss = rs[kStats], sp = rs[kParams], pitch = t.stats_pitch, ppitch = t.params_pitch;
    const char *stats = first[kStats], *params = first[kParams];
    auto coefficients = [&]() SIMDNORM_INLINE_LAMBDA {
      const V u = splat<V>(load_c(stats, 1, pitch));
      return Coefficients{splat<V>(load_c(stats, 0, pitch)), u, splat<V>(load_c(params, 0, ppitch)) * u,
                          y_coefficient(u, splat<V>(load_c(stats, 3, pitch))),
                          k_coefficient(u, splat<V>(load_c(stats, 2, pitch)))};
    };
    const T* const x = reinterpret_cast<const T*>(first[kX]);
    const T* const dy = reinterpret_cast<const T*>(first[kGradOut]);
    T* const dx = reinterpret_cast<T*>(first[kGradIn]);
    // cur: the coefficients of the row ending at row_end, which holds the next vector's first
    // element; next: those of the row after it (the last row's own, past the end).
    Coefficients cur = coefficients(), next = cur;
    int64_t row_end = n, left = rows - 1;  // rows after cur's
    auto load_next = [&]() SIMDNORM_INLINE_LAMBDA {
      if (left > 0) stats += ss, params += sp, next = coefficients();
    };
    auto advance = [&]() SIMDNORM_INLINE_LAMBDA {
      cur = next, row_end += n, --left;
      load_next();
    };
    load_next();
    auto step = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      if (e == row_end) advance();
      const V xv = load_up_to<L>(x + e, m), dyv = load_up_to<L>(dy + e, m);
      V v;
      if (e + m <= row_end) {
        v = grad_input((xv - cur.mean) * cur.u, dyv, cur.scale_u, cur.y_coef, cur.k_coef);
      } else {  // lanes below row_end - e are cur's row, the rest the next one's
        const auto own = lanes_mask(static_cast<V*>(nullptr), static_cast<int>(row_end - e));
        v = grad_input((xv - vselect(own, cur.mean, next.mean)) * vselect(own, cur.u, next.u), dyv,
                       vselect(own, cur.scale_u, next.scale_u), vselect(own, cur.y_coef, next.y_coef),
                       vselect(own, cur.k_coef, next.k_coef));
        advance();
      }
      store_up_to<L>(dx + e, v, m);
    };
    const int64_t total = rows * n;
    int64_t e = 0;
    const uintptr_t a = reinterpret_cast<uintptr_t>(dx);
    if (a % sizeof(T) == 0) {
      const int64_t head = static_cast<int64_t>((kLineBytes - a % kLineBytes) % kLineBytes / sizeof(T));
      const int64_t end = head < total ? head : total;
      while (e < end) {
        const int m = static_cast<int>(end - e < W ? end - e : W);
        step(e, m);
        e += m;
      }
    }
    for (; e + W <= total; e += W) step(e, W);
    if (e < total) step(e, static_cast<int>(total - e));
  }

  // Array `array` of a folded operand's compute-type arrays (`pitch` bytes apart) at q.
  SIMDNORM_CURSOR_METHOD static C load_c(const char* q, int array, int64_t pitch) {
    C v;
    std::memcpy(&v, q + array * pitch, sizeof v);
    return v;
  }

  // Calls fn(integral_constant SStep, integral_constant PStep) for the run's layout.
  template <class Fn>
  static void visit_layout(const BackwardTask& t, const int64_t* s, bool writes, Fn&& fn) {
    const int64_t es = static_cast<int64_t>(sizeof(T)), cs = static_cast<int64_t>(sizeof(C));
    const bool data_unit = s[kX] == es && s[kGradOut] == es && (!writes || s[kGradIn] == es);
    const bool fused = t.has_fused_add && t.act.kind != ActKind::identity;
    const bool coef = (s[kStats] == 0 || s[kStats] == cs) && (s[kParams] == 0 || s[kParams] == cs);
    using K0 = std::integral_constant<int, kConst>;
    using K1 = std::integral_constant<int, kUnit>;
    using KA = std::integral_constant<int, kAny>;
    if (!data_unit || fused || !coef) return fn(KA{}, KA{});
    if (s[kStats] == 0) return s[kParams] == 0 ? fn(K0{}, K0{}) : fn(K0{}, K1{});
    return s[kParams] == 0 ? fn(K1{}, K0{}) : fn(K1{}, K1{});
  }

  // Channels-last rows (batch norm's rows of C channels; instance norm's and, spread, group norm's
  // of a sample): rows of the nest that share their statistics and parameters, every operand
  // contiguous along the run, an activation whose derivative runs inline, no fused_add. Here the
  // general loops' setup per run and their tests per vector cost 1.3-1.9x (8 x 56 x 56 x 256 and
  // x 64, Zen 3), so these rows take lanes_sums and lanes_apply: per element the arithmetic and the
  // order of the adds are sums_run's and apply_run's, and so are the bits.
  static bool lanes_rows(const BackwardTask& t, const LoopNest& nest, bool writes) {
    const int in = nest.ndim - 1, row = nest.ndim - 2;
    const int64_t es = static_cast<int64_t>(sizeof(T)), cs = static_cast<int64_t>(sizeof(C));
    return row >= 0 && derivative_inline(t.act.kind) && !t.has_fused_add && !t.write_ga &&
           nest.strides[kX][in] == es &&
           nest.strides[kGradOut][in] == es && (!writes || nest.strides[kGradIn][in] == es) &&
           nest.strides[kStats][in] == cs && nest.strides[kParams][in] == cs && nest.strides[kStats][row] == 0 &&
           nest.strides[kParams][row] == 0;
  }

  // Rows a step of lanes_sums takes down each vector of lanes: the statistics and slots of those
  // lanes are loaded (and the slots stored) once for all of them; one row at a time, those loads
  // and stores bound the loop in the caches (measured: docs/BENCHMARKS.md).
  static constexpr int kLaneRows = 4;

  // sums_run over a block of such rows: the parameters' sums (sum(ga y), sum(ga)), and the group's
  // where asked for (sum(g), sum(g y): instance norm and channels-last group norm, whose statistics
  // vary along the row; batch norm's are derived from the parameters', ops/backward.cpp). Each
  // slot adds its rows' values one after another in row order, as sums_run's do: the same bits.
  // With t.sums_write (no group sums), each row's grad_input is written as lanes_apply writes it,
  // in the same loop.
  static void lanes_sums(const BackwardTask& t, char* const* p, const int64_t* rs, int64_t rows, int64_t n,
                         const BackwardSums& acc) {
    visit_inline_derivative<V>(t.act, [&](const auto& deriv) {
      if (t.sums_write) return lanes_sums_of<false, true>(t, deriv, p, rs, rows, n, acc);
      if (acc.group[0] != nullptr) return lanes_sums_of<true>(t, deriv, p, rs, rows, n, acc);
      lanes_sums_of<false>(t, deriv, p, rs, rows, n, acc);
    });
  }
  template <bool Group, bool Write = false, class D>
  static void lanes_sums_of(const BackwardTask& t, const D& deriv, char* const* p, const int64_t* rs, int64_t rows,
                            int64_t n, const BackwardSums& acc) {
    static_assert(!(Group && Write), "a write in the sums pass needs none of the group's sums");
    constexpr int64_t cs = static_cast<int64_t>(sizeof(C)), es = static_cast<int64_t>(sizeof(T));
    const C* const mean = reinterpret_cast<const C*>(p[kStats]);
    const C* const u = reinterpret_cast<const C*>(p[kStats] + t.stats_pitch);
    const C* const c1 = reinterpret_cast<const C*>(p[kStats] + 2 * t.stats_pitch);
    const C* const c2 = reinterpret_cast<const C*>(p[kStats] + 3 * t.stats_pitch);
    const C* const scale = reinterpret_cast<const C*>(p[kParams]);
    const C* const bias = reinterpret_cast<const C*>(p[kParams] + t.params_pitch);
    // Streamed where every row's grad_input has the same phase to a vector (and a vector is a whole
    // line): each row's first `head` elements as one partial vector, then whole aligned vectors. (The
    // slots are per lane, so where the vectors start does not change the sums' bits.)
    bool stream;
    const int64_t head =
        streamed_from(Write && t.stream_stores && rs[kGradIn] % L::kVectorBytes == 0, p[kGradIn], n, stream);
    const int64_t pi = (p[kParams] - acc.params_base) / cs, gi = (p[kStats] - acc.stats_base) / cs;
    const bool want_param = acc.param[0] != nullptr;
    C* const sum_gay = want_param ? static_cast<C*>(acc.param_vary[0]) + pi : nullptr;
    C* const sum_ga = want_param ? static_cast<C*>(acc.param_vary[1]) + pi : nullptr;
    C* const sum_g = Group ? static_cast<C*>(acc.group_vary[0]) + gi : nullptr;
    C* const sum_gy = Group ? static_cast<C*>(acc.group_vary[1]) + gi : nullptr;
    // A row at a time where writing (four rows side by side are four interleaved streams of writes
    // in one page), but on AVX-512 where the CPU takes four better (runtime/cpu.cpp:
    // backward_writes_four_rows) and the rows are streamed or in the caches (plain stores from
    // memory, 16-bit rows', took 1.4x the time with four); and on AVX2 for float rows from memory
    // (their reads are then one stream, which the hardware follows): there one row costs less
    // than the slots' loads and stores it saves. 16-bit rows, bound by their conversions, keep the
    // shared loads; so does AVX-512, not measured with one row.
    const bool one_row_reads = kVectorRegisters < 32 && t.from_memory && es >= 4;
    const bool one_row_writes =
        Write && (kVectorRegisters < 32 || !t.write_four_rows || (t.from_memory && !stream));
    const int rows_a_block = one_row_writes || one_row_reads ? 1 : kLaneRows;
    // Rows back to back, a whole block's rows of x and dy are each one run of lines: the runs
    // ahead are prefetched in order, shared out evenly between the vectors' steps. Line by line
    // down the rows (as Element::at), the same lines came in slower (docs/BENCHMARKS.md). Writing
    // a row at a time with plain stores, nothing is prefetched: as in lanes_apply, the hardware
    // follows a row alone better (measured: docs/BENCHMARKS.md); streamed, the prefetches gain.
    const bool prefetch = !Write || stream;
    const int64_t steps = n / W;  // whole vectors of a row
    const bool one_run = prefetch && rs[kX] == n * es && rs[kGradOut] == n * es && steps > 0;
    const int64_t block_bytes = rows_a_block * n * es;
    const int64_t run_ahead = block_bytes * ((kPrefetchAheadBytes + block_bytes - 1) / block_bytes);
    const int64_t run_lines = (block_bytes + kLineBytes - 1) / kLineBytes + 1;  // (+1: a run off its lines)
    const int64_t run_share = one_run ? (run_lines + steps - 1) / steps : 0;  // lines a step
    // R rows from r0, each vector of lanes down all of them.
    auto block = [&](auto count, int64_t r0) SIMDNORM_INLINE_LAMBDA {
      constexpr int R = decltype(count)::value;
      const char* x[R];
      const char* dy[R];
      char* dx[R];
      for (int j = 0; j < R; ++j) {
        x[j] = p[kX] + (r0 + j) * rs[kX], dy[j] = p[kGradOut] + (r0 + j) * rs[kGradOut];
        dx[j] = p[kGradIn] + (r0 + j) * rs[kGradIn];
      }
      // m elements of each row from e (a whole vector, or the rows' last m < W).
      auto at = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
        const V mv = load_up_to<LC>(mean + e, m), uv = load_up_to<LC>(u + e, m);
        V sv = zero(), bv = zero(), s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero(), scale_u = zero(),
          y_coef = zero(), k_coef = zero();
        if constexpr (Group || Write || D::kUsesPre) sv = load_up_to<LC>(scale + e, m);
        if constexpr (D::kUsesPre) bv = load_up_to<LC>(bias + e, m);
        if constexpr (Group) s0 = load_up_to<LC>(sum_g + e, m), s1 = load_up_to<LC>(sum_gy + e, m);
        if constexpr (Write) {  // (lanes_apply's coefficients)
          scale_u = sv * uv;
          y_coef = y_coefficient(uv, load_up_to<LC>(c2 + e, m)), k_coef = k_coefficient(uv, load_up_to<LC>(c1 + e, m));
        }
        if (want_param) s2 = load_up_to<LC>(sum_gay + e, m), s3 = load_up_to<LC>(sum_ga + e, m);
        if (one_run && m == W) {
          for (int64_t b = (e / W) * run_share, end = std::min(run_lines, b + run_share); b < end; ++b) {
            __builtin_prefetch(x[0] + run_ahead + b * kLineBytes, 0, 2);
            __builtin_prefetch(dy[0] + run_ahead + b * kLineBytes, 0, 2);
          }
        }
        for (int j = 0; j < R; ++j) {
          // Otherwise a line of each row a line's step, into the L2 (as Element::at).
          if (prefetch && !one_run && m == W && (e * es) % kLineBytes < W * es) {
            __builtin_prefetch(x[j] + e * es + kPrefetchAheadBytes, 0, 2);
            __builtin_prefetch(dy[j] + e * es + kPrefetchAheadBytes, 0, 2);
          }
          const V d = load_up_to<L>(reinterpret_cast<const T*>(x[j]) + e, m) - mv;
          const V y = d * uv;
          V ga = load_up_to<L>(reinterpret_cast<const T*>(dy[j]) + e, m);
          if constexpr (D::kUsesPre) ga = deriv(vfma(y, sv, bv), ga);  // (Element::at's pre and ga)
          if constexpr (Write) store_dx<true>(dx[j] + e * es, es, grad_input(y, ga, scale_u, y_coef, k_coef), m, stream);
          if constexpr (Group) {  // (sums_run's: g = ga scale; g and g y added to their slots)
            const V g = ga * sv;
            s0 = s0 + g, s1 = s1 + g * y;
          }
          s2 = s2 + ga * y, s3 = s3 + ga;
        }
        if constexpr (Group) store_up_to<LC>(sum_g + e, s0, m), store_up_to<LC>(sum_gy + e, s1, m);
        if (want_param) store_up_to<LC>(sum_gay + e, s2, m), store_up_to<LC>(sum_ga + e, s3, m);
      };
      vectors_from(head, n, at);
    };
    int64_t r = 0;
    if constexpr (!Write || kVectorRegisters >= 32) {  // (no copy of the block's loop for four rows that never run)
      if (rows_a_block == kLaneRows)
        for (; r + kLaneRows <= rows; r += kLaneRows) block(std::integral_constant<int, kLaneRows>{}, r);
    }
    for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
  }

  // apply_run over a block of such rows, one after another. With plain stores not prefetched,
  // unlike apply_run: the hardware follows these rows better alone; streamed, x and dy are
  // prefetched ahead, which gained there (docs/BENCHMARKS.md). Rows side by side (as lanes_sums
  // takes them) are interleaved streams in one page, which it does not follow.
  static void lanes_apply(const BackwardTask& t, char* const* p, const int64_t* rs, int64_t rows, int64_t n) {
    visit_inline_derivative<V>(t.act, [&](const auto& deriv) { lanes_apply_of(t, deriv, p, rs, rows, n); });
  }
  // The coefficient arrays lanes_apply reads by channel: mean, u, c1, c2, scale, bias.
  static constexpr int kLaneCoefficients = 6;
  template <class D>
  static void lanes_apply_of(const BackwardTask& t, const D& deriv, char* const* p, const int64_t* rs, int64_t rows,
                             int64_t n) {
    constexpr int64_t es = static_cast<int64_t>(sizeof(T));
    const C* coefs[kLaneCoefficients];
    for (int a = 0; a < 4; ++a) coefs[a] = reinterpret_cast<const C*>(p[kStats] + a * t.stats_pitch);
    coefs[4] = reinterpret_cast<const C*>(p[kParams]);
    coefs[5] = reinterpret_cast<const C*>(p[kParams] + t.params_pitch);
    const T* x = reinterpret_cast<const T*>(p[kX]);
    const T* dy = reinterpret_cast<const T*>(p[kGradOut]);
    T* dx = reinterpret_cast<T*>(p[kGradIn]);
    // m elements at x, dy, dx from channel c of the arrays k (a whole vector, streamed when asked,
    // or an edge of m < W).
    auto at = [&](const C* const* k, int64_t c, const T* xe, const T* dye, T* dxe, int m, bool stream)
        SIMDNORM_INLINE_LAMBDA {
      if (stream && m == W) {
        __builtin_prefetch(reinterpret_cast<const char*>(xe) + kPrefetchAheadBytes, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(dye) + kPrefetchAheadBytes, 0, 2);
      }
      const V uv = load_up_to<LC>(k[1] + c, m), sv = load_up_to<LC>(k[4] + c, m);
      const V d = load_up_to<L>(xe, m) - load_up_to<LC>(k[0] + c, m);
      V ga = load_up_to<L>(dye, m);
      if constexpr (D::kUsesPre) ga = deriv(vfma(d * uv, sv, load_up_to<LC>(k[5] + c, m)), ga);
      const V v = grad_input(d * uv, ga, sv * uv, y_coefficient(uv, load_up_to<LC>(k[3] + c, m)),
                             k_coefficient(uv, load_up_to<LC>(k[2] + c, m)));
      store_dx<true>(reinterpret_cast<char*>(dxe), sizeof(T), v, m, stream);
    };
    // Rows back to back in x, dy and grad_input whose streamed rows would each start or end in a
    // partial vector (grad_input off a line: numpy's large arrays sit 16 bytes past one) run as
    // one run: its vectors on grad_input's lines, a vector across two rows taking its channels
    // from copies of the arrays extended by W (element c + k is channel (c + k) mod n). Row by
    // row, each row's partial pieces took the apply twice the time of aligned rows. The same
    // elements, the same formula: the same bits.
    const int64_t total = rows * n;
    bool stream_all = false;
    const int64_t head_all = streamed_from(t.stream_stores, reinterpret_cast<const char*>(dx), total, stream_all);
    const bool rows_split = reinterpret_cast<uintptr_t>(dx) % L::kVectorBytes != 0 || (n * es) % L::kVectorBytes != 0;
    if (stream_all && rows_split && rs[kX] == n * es && rs[kGradOut] == n * es && rs[kGradIn] == n * es &&
        rows >= 8) {
      const int64_t len = n + W;
      std::vector<C> extended(static_cast<size_t>(kLaneCoefficients * len));
      const C* k[kLaneCoefficients];
      for (int a = 0; a < kLaneCoefficients; ++a) {
        C* e = extended.data() + a * len;
        std::copy(coefs[a], coefs[a] + n, e);
        for (int64_t c = n; c < len; ++c) e[c] = e[c - n];  // (in order: with n < W, e[c - n] is set)
        k[a] = e;
      }
      int64_t c = 0;  // the channel of element e
      vectors_from(head_all, total, [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
        at(k, c, x + e, dy + e, dx + e, m, stream_all);
        for (c += m; c >= n;) c -= n;
      });
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      bool stream;
      const int64_t head = streamed_from(t.stream_stores, reinterpret_cast<const char*>(dx), n, stream);
      vectors_from(head, n, [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA { at(coefs, e, x + e, dy + e, dx + e, m, stream); });
      x = reinterpret_cast<const T*>(reinterpret_cast<const char*>(x) + rs[kX]);
      dy = reinterpret_cast<const T*>(reinterpret_cast<const char*>(dy) + rs[kGradOut]);
      dx = reinterpret_cast<T*>(reinterpret_cast<char*>(dx) + rs[kGradIn]);
    }
  }

  // A few rows of lanes, each lane with statistics and parameter elements of its own, derived group
  // sums (batch norm of (N, C) data: ops/backward.cpp, run_column_chunks): each vector of lanes
  // summed down the rows, its coefficients set and its rows' grad_input written in one sweep, its
  // data read once, where the two passes went through arrays of every lane between them. The
  // arithmetic, and each lane's order of adds, are lanes_sums', the flush's (rows up to kFlushRuns:
  // one flush), derive_group_sums', set_coefficients_of's and lanes_apply's: the same bits.
  // param_sums: each lane's sum(ga y) as flushed, their sum(ga) `pitch` after (pitch at least the
  // lanes rounded up to a vector: whole vectors are stored).
  static constexpr int64_t kMaxColumnRows = 32;  // (KernelTable::backward_columns)
  static void columns(const BackwardTask& t, const LoopNest& nest, double* param_sums, int64_t pitch) {
    visit_inline_derivative<V>(t.act, [&](const auto& deriv) { columns_of(t, deriv, nest, param_sums, pitch); });
  }
  template <class D>
  static void columns_of(const BackwardTask& t, const D& deriv, const LoopNest& nest, double* param_sums,
                         int64_t pitch) {
    constexpr int64_t es = static_cast<int64_t>(sizeof(T));
    const int64_t rows = nest.sizes[0], n = nest.sizes[1];
    const C* const mean = reinterpret_cast<const C*>(nest.data[kStats]);
    const C* const u = reinterpret_cast<const C*>(nest.data[kStats] + t.stats_pitch);
    const C* const scale = reinterpret_cast<const C*>(nest.data[kParams]);
    const C* const bias = reinterpret_cast<const C*>(nest.data[kParams] + t.params_pitch);
    const CoefficientRule rule(t);
    constexpr int kHalves = sizeof(C) == 4 ? 2 : 1, kHalf = W / kHalves;  // (float lanes: two of doubles)
    // Each row's y and ga of the vector, kept for the write: read again from x and dy, rows a
    // multiple of 4 KB apart ((8, 4096) float32) shared an L1 set and evicted each other; kept here
    // they are a few lines of their own.
    SIMDNORM_CHECK(rows <= kMaxColumnRows);
    alignas(64) C kept[kMaxColumnRows][2][W];
    auto at = [&](int64_t e, int m) SIMDNORM_INLINE_LAMBDA {
      const V mv = load_up_to<LC>(mean + e, m), uv = load_up_to<LC>(u + e, m), sv = load_up_to<LC>(scale + e, m);
      const V bv = D::kUsesPre ? load_up_to<LC>(bias + e, m) : zero();
      auto grad_at = [&](int64_t r, V& y) SIMDNORM_INLINE_LAMBDA {  // (lanes_sums' d, y and ga)
        const V d = load_up_to<L>(reinterpret_cast<const T*>(nest.data[kX] + r * nest.strides[kX][0]) + e, m) - mv;
        y = d * uv;
        V ga = load_up_to<L>(reinterpret_cast<const T*>(nest.data[kGradOut] + r * nest.strides[kGradOut][0]) + e, m);
        if constexpr (D::kUsesPre) ga = deriv(vfma(y, sv, bv), ga);
        return ga;
      };
      V s2 = zero(), s3 = zero();
      for (int64_t r = 0; r < rows; ++r) {
        V y;
        const V ga = grad_at(r, y);
        s2 = s2 + ga * y, s3 = s3 + ga;
        LC::store(kept[r][0], y), LC::store(kept[r][1], ga);
      }
      // Flushed into doubles from +0 (the parameters' sums, which derive_group_sums adds to +0
      // again: the same), the group sums derived from them (scale sum(ga), scale sum(ga y)), the
      // coefficients rounded to the compute type.
      const auto gay = vwiden(s2), ga = vwiden(s3);
      vd c1[2] = {}, c2[2] = {};
      for (int h = 0; h < kHalves; ++h) {
        const vd pay = (h == 0 ? gay.first : gay.second) + 0.0, pga = (h == 0 ? ga.first : ga.second) + 0.0;
        Lanes<double>::store(param_sums + e + h * kHalf, pay);
        Lanes<double>::store(param_sums + pitch + e + h * kHalf, pga);
        if (!rule.terms) continue;
        const auto sd = vwiden(sv);
        const vd scale_d = h == 0 ? sd.first : sd.second;
        const vd sum_g = scale_d * pga, sum_gy = scale_d * pay;
        vd k = splat<vd>(1.0);
        if (rule.epsilon_outside) {  // (CoefficientRule::terms_of)
          const auto ud = vwiden(uv);
          const vd den = 1.0 - rule.epsilon * (h == 0 ? ud.first : ud.second);
          k = vselect(den > splat<vd>(CoefficientRule::kMinDen<C>), 1.0 / den, vd{});
        }
        if (rule.normalize_mean) c1[h] = sum_g * rule.inv_n;
        if (rule.normalize_variance) c2[h] = k * sum_gy * rule.inv_n;
      }
      const V y_coef = y_coefficient(uv, vnarrow_to<V>(c2[0], c2[1]));
      const V k_coef = k_coefficient(uv, vnarrow_to<V>(c1[0], c1[1]));
      const V scale_u = sv * uv;
      for (int64_t r = 0; r < rows; ++r)  // (lanes_apply's formula)
        store_dx<true>(nest.data[kGradIn] + r * nest.strides[kGradIn][0] + e * es, es,
                       grad_input(LC::load(kept[r][0]), LC::load(kept[r][1]), scale_u, y_coef, k_coef), m, false);
    };
    vectors_from(0, n, at);
  }

  // The sums pass over elements [begin, end) of the nest; with t.sums_write, their grad_input too.
  static void sums(const BackwardTask& t, const LoopNest& nest, int64_t begin, int64_t end, const BackwardSums& acc) {
    const bool write = t.sums_write;
    if (const_rows(t, nest, write)) {
      for_each_block(nest, begin, end, [&](int64_t rows, int64_t n, char* const* p, const int64_t*, const int64_t* rs) {
        if (write) return const_rows_sums_write(t, p, rs, rows, n, acc);
        const_rows_sums(t, p, rs, rows, n, acc);
      });
      return;
    }
    if ((acc.group[0] != nullptr || acc.param[0] != nullptr) && lanes_rows(t, nest, write)) {
      for_each_block(nest, begin, end, [&](int64_t rows, int64_t n, char* const* p, const int64_t*, const int64_t* rs) {
        lanes_sums(t, p, rs, rows, n, acc);
      });
      return;
    }
    visit_derivative<V>(t.act, [&](const auto& deriv) {
      using D = std::decay_t<decltype(deriv)>;
      C* ga_out = t.ga_buffer != nullptr ? static_cast<C*>(t.ga_buffer) + begin : nullptr;  // (the next run's)
      for_each_run(nest, begin, end, [&](int64_t len, char* const* p, const int64_t* s) {
        C* const ga_run = ga_out;
        if (ga_out != nullptr) ga_out += len;
        visit_layout(t, s, write, [&](auto ss, auto ps) {
          // Writing, runs with constant coefficients and no activation (NCHW planes past
          // kSumFlush) are written as they are summed; the others are summed, then written from
          // the L1 or L2 (measured as fast or faster there, and no copy of their loops).
          constexpr int SS = decltype(ss)::value, PS = decltype(ps)::value;
          run_derivative<SS, PS>(t, deriv, [&](const auto& run_deriv) {
            using RD = std::decay_t<decltype(run_deriv)>;
            constexpr bool fused = SS == kConst && PS == kConst && std::is_same<RD, DerivIdentity<V>>::value;
            if (fused && write) {
              sums_run<SS, PS, RD, fused>(t, run_deriv, p, s, len, acc);
            } else {
              sums_run<SS, PS, RD>(t, run_deriv, p, s, len, acc, ga_run);
              if (write) apply_run<SS, PS>(t, run_deriv, p, s, len);
            }
          });
        });
      });
    });
  }

  static void apply(const BackwardTask& t, const LoopNest& nest, int64_t begin, int64_t end) {
    if (const_rows(t, nest, true) && !t.stream_stores) {
      for_each_block(nest, begin, end, [&](int64_t rows, int64_t n, char* const* p, const int64_t*, const int64_t* rs) {
        const_rows_apply(t, p, rs, rows, n);
      });
      return;
    }
    if (lanes_rows(t, nest, true)) {
      for_each_block(nest, begin, end, [&](int64_t rows, int64_t n, char* const* p, const int64_t*, const int64_t* rs) {
        lanes_apply(t, p, rs, rows, n);
      });
      return;
    }
    visit_derivative<V>(t.act, [&](const auto& deriv) {
      const C* ga_in = t.ga_buffer != nullptr ? static_cast<const C*>(t.ga_buffer) + begin : nullptr;
      for_each_run(nest, begin, end, [&](int64_t len, char* const* p, const int64_t* s) {
        const C* const ga_run = ga_in;
        if (ga_in != nullptr) ga_in += len;
        visit_layout(t, s, true, [&](auto ss, auto ps) {
          constexpr int SS = decltype(ss)::value, PS = decltype(ps)::value;
          run_derivative<SS, PS>(t, deriv, [&](const auto& run_deriv) {
            apply_run<SS, PS>(t, run_deriv, p, s, len, ga_run);
          });
        });
      });
    });
  }
};

template <class C>
static void flush_vary(double* sums, void* vary, int64_t n) {
  C* v = static_cast<C*>(vary);
  for (int64_t i = 0; i < n; ++i) sums[i] += static_cast<double>(v[i]);
  std::fill(v, v + n, C(0));
}

template <class T>
static void backward_groups_of(const BackwardTask& task, const BackwardGroups& gs) {
  using C = typename ComputeOf<T>::type;
  using K = BackwardKernel<T>;
  constexpr int64_t cs = static_cast<int64_t>(sizeof(C));
  int64_t n = 1;
  for (int d = 0; d < gs.group.ndim; ++d) n *= gs.group.sizes[d];
  BackwardTask t = task;
  std::vector<C> saved_ga;  // (BackwardTask::save_ga: this block's)
  if (t.save_ga && gs.apply) {
    SIMDNORM_CHECK(n <= kMaxSavedGaElements);
    saved_ga.resize(static_cast<size_t>(n * (gs.group.ndim == 1 ? K::kMaxBlockRows : 1)));  // (rows_stream: a block's)
    t.ga_buffer = saved_ga.data();
  }
  const BackwardSums& s = gs.sums;
  const char* stats0 = s.stats_base;
  LoopNest g = gs.group;
  // A scale constant over each group (batch and instance norm): the group's sum(g) and sum(g y) are
  // its scale times sum(ga) and sum(ga y), which the parameters need anyway; only those are summed.
  bool scale_per_group = true;
  for (int d = 0; d < g.ndim; ++d) scale_per_group &= g.strides[kParams][d] == 0;
  double own[2];
  C own_vary[2];
  BackwardSums per_group;
  per_group.param[0] = &own[0], per_group.param[1] = &own[1];
  per_group.param_vary[0] = &own_vary[0], per_group.param_vary[1] = &own_vary[1];
  // Sums the group at `at` by `sum`, then sets its coefficients.
  auto sum_group_at = [&](const LoopNest& at, auto&& sum) SIMDNORM_INLINE_LAMBDA {
    const int64_t i = (at.data[kStats] - stats0) / cs;
    if (!scale_per_group) {
      sum(s);
      set_coefficients<C>(t, const_cast<char*>(stats0), i, s.group[0][i], s.group[1][i]);
      return;
    }
    own[0] = own[1] = 0.0;
    per_group.stats_base = at.data[kStats];
    per_group.params_base = at.data[kParams];  // (the one element the group reads)
    sum(per_group);
    C scale;
    std::memcpy(&scale, at.data[kParams], sizeof scale);
    set_coefficients<C>(t, const_cast<char*>(stats0), i, static_cast<double>(scale) * own[1],
                        static_cast<double>(scale) * own[0]);
    if (s.param[0] != nullptr) {
      const int64_t pi = (at.data[kParams] - s.params_base) / cs;
      s.param[0][pi] += own[0];
      s.param[1][pi] += own[1];
    }
  };
  auto sum_group = [&](auto&& sum) SIMDNORM_INLINE_LAMBDA { sum_group_at(g, sum); };
  // The parameters' float slots into their doubles (kept where they vary along the runs).
  const bool slots = s.param[0] != nullptr && !scale_per_group;
  auto flush_slots = [&] {
    flush_vary<C>(s.param[0], s.param_vary[0], gs.param_count);
    flush_vary<C>(s.param[1], s.param_vary[1], gs.param_count);
  };
  int64_t until_flush = gs.flush_every;  // groups left before the slots' next flush
  auto flush_after = [&](int64_t k) SIMDNORM_INLINE_LAMBDA {  // group k done (k = 0, 1, ... in turn)
    if (slots && (--until_flush == 0 || k == gs.count - 1)) flush_slots(), until_flush = gs.flush_every;
  };
  auto advance = [&](int64_t groups) SIMDNORM_INLINE_LAMBDA {
    for (int op = 0; op < kNumOperands; ++op) g.data[op] += groups * gs.step[op];
  };
  auto finish = [&](int64_t k) SIMDNORM_INLINE_LAMBDA { flush_after(k), advance(1); };
  if (K::short_runs(t, g)) {
    for (int64_t k = 0; k < gs.count; ++k) {
      sum_group([&](const BackwardSums& sums) SIMDNORM_INLINE_LAMBDA {
        K::short_runs_sums(t, g, sums, gs.apply && !t.stream_stores);
      });
      if (gs.apply) K::short_runs_apply(t, g);
      for (int op = 0; op < kNumOperands; ++op) g.data[op] += gs.step[op];  // (no float slots to flush)
    }
    return;
  }
  if (gs.apply && gs.count > 1 && K::pairs(t, g)) {
    // Group k written while group k + 1 is summed. Everything is summed into doubles (constant
    // along the runs): the float slots stay empty, and are not flushed.
    LoopNest next = g;
    for (int op = 0; op < kNumOperands; ++op) next.data[op] += gs.step[op];
    sum_group([&](const BackwardSums& sums) SIMDNORM_INLINE_LAMBDA { K::sums(t, g, 0, n, sums); });
    for (int64_t k = 0; k + 1 < gs.count; ++k) {
      sum_group_at(next, [&](const BackwardSums& sums) SIMDNORM_INLINE_LAMBDA { K::pair_groups(t, g, next, sums); });
      g = next;
      for (int op = 0; op < kNumOperands; ++op) next.data[op] += gs.step[op];
    }
    K::apply(t, g, 0, n);
    return;
  }
  if (g.ndim == 1) {  // one run a group (layer and RMS norm rows): its loop chosen once for all
    int64_t steps[kNumOperands];
    for (int op = 0; op < kNumOperands; ++op) steps[op] = g.strides[op][0];
    visit_derivative<typename K::V>(t.act, [&](const auto& deriv) {
      K::visit_layout(t, steps, gs.apply, [&](auto ss, auto ps) {
        constexpr int SS = decltype(ss)::value, PS = decltype(ps)::value;
        auto one_row = [&](int64_t k) SIMDNORM_INLINE_LAMBDA {
          K::template run_derivative<SS, PS>(t, deriv, [&](const auto& run_deriv) {
            sum_group([&](const BackwardSums& sums) SIMDNORM_INLINE_LAMBDA {
              K::template sums_run<SS, PS>(t, run_deriv, g.data, steps, n, sums, static_cast<C*>(t.ga_buffer));
            });
            if (gs.apply)
              K::template apply_run<SS, PS>(t, run_deriv, g.data, steps, n, static_cast<const C*>(t.ga_buffer));
          });
          finish(k);
        };
        if constexpr (SS == kConst && PS == kUnit) {
          if (!scale_per_group && gs.step[kParams] == 0 && gs.apply) {  // rows sharing their parameters
            // R rows a block share the parameters' loads. A row's state is 4 vectors (mean, u, two
            // sums): with four rows AVX2's 16 registers spill. Four rows a block only where the
            // block (its rows of x and dy, and of dx unless streamed; the parameters' four arrays)
            // stays within kRowsBlockL1Bytes: rows of a multiple of 4 KB fall on the same L1 sets,
            // and past that the block's lines evicted each other. On AVX2, float rows from memory
            // of kOneRowBlockBytes and more go one a block (rows_stream<1>), which measured faster
            // there: its sums read two streams, not four, between the block's writes. Float rows
            // of a multiple of 4 KB go one a block on every ISA, from memory or not: each row's
            // element e falls on the same L1 set, which two blocks of two rows (one summed, one
            // written) and the parameters' lines overflow (docs/BENCHMARKS.md). 16-bit rows,
            // bound by their conversions rather than by memory, keep the shared loads.
            // (One callback for every R: each rows_stream instantiation is a copy of the loops.)
            int64_t first = 0, per_block = 1;
            auto after_block = [&](int64_t b) SIMDNORM_INLINE_LAMBDA {
              for (int64_t r = 0; r < per_block; ++r) flush_after(first + b * per_block + r);
            };
            auto in_blocks = [&](auto rows) SIMDNORM_INLINE_LAMBDA {
              constexpr int R = decltype(rows)::value;
              const int64_t blocks = gs.count / R;
              per_block = R;
              K::template rows_stream<R, false>(t, deriv, g.data, gs.step, n, blocks, s, after_block);
              advance(blocks * R);
              first = blocks * R, per_block = 1;
              K::template rows_stream<1, false>(t, deriv, g.data, gs.step, n, gs.count - first, s, after_block);
            };
            const int64_t es = static_cast<int64_t>(sizeof(T));
            if constexpr (kVectorRegisters >= 32) {
              if (4 * n * es * (t.stream_stores ? 2 : 3) + 4 * n * cs <= kRowsBlockL1Bytes)
                return in_blocks(std::integral_constant<int, 4>{});
            }
            bool rows_share_sets = false;
            for (int op : {kX, kGradOut, kGradIn})
              rows_share_sets |= gs.step[op] != 0 && gs.step[op] % kL1SetBytes == 0;
            if (es >= 4 && (rows_share_sets ||
                            (kVectorRegisters < 32 && t.from_memory && n * es >= kOneRowBlockBytes)))
              return in_blocks(std::integral_constant<int, 1>{});
            return in_blocks(std::integral_constant<int, 2>{});
          }
          // Rows each with parameters of their own, apart (group norm of (N, C) data), without an
          // activation: blocks of R rows, the odd row last alone.
          using Identity = DerivIdentity<typename K::V>;
          if constexpr (std::is_same<std::decay_t<decltype(deriv)>, Identity>::value) {
            if (!scale_per_group && gs.apply && gs.step[kParams] >= n * cs) {
              constexpr int R = 2;
              const int64_t blocks = gs.count / R;
              K::template rows_stream<R, true>(t, deriv, g.data, gs.step, n, blocks, s, [&](int64_t b) SIMDNORM_INLINE_LAMBDA {
                for (int r = 0; r < R; ++r) flush_after(b * R + r);
              });
              advance(blocks * R);
              if (blocks * R < gs.count) one_row(gs.count - 1);
              return;
            }
          }
        }
        for (int64_t k = 0; k < gs.count; ++k) one_row(k);
      });
    });
    return;
  }
  const int64_t chunk = slots && gs.flush_elements > 0 ? gs.flush_elements : n;
  for (int64_t k = 0; k < gs.count; ++k) {
    sum_group([&](const BackwardSums& sums) SIMDNORM_INLINE_LAMBDA {
      for (int64_t b = 0; b < n; b += chunk) {
        K::sums(t, g, b, std::min(n, b + chunk), sums);
        if (chunk < n) flush_slots();
      }
    });
    if (gs.apply) K::apply(t, g, 0, n);
    finish(k);
  }
}

static void backward_groups_entry(const BackwardTask& t, const BackwardGroups& g) {
  with_storage_type(t.dtype, [&](auto st) { backward_groups_of<typename decltype(st)::type>(t, g); });
}

// CoefficientRule::set of n statistics elements in one loop over arrays that alias nothing else,
// its flags constants (a channel each: thousands a call, which element by element through char
// pointers, the flags tested in the loop, cost as much as the data's two passes on (N, C) batch
// norm with few samples).
template <class C>
static void set_coefficients_of(const BackwardTask& t, char* stats, const double* __restrict sum_g,
                                const double* __restrict sum_gy, int64_t n) {
  const CoefficientRule rule(t);
  const C* __restrict u = reinterpret_cast<const C*>(stats + rule.pitch);
  C* __restrict c1 = reinterpret_cast<C*>(stats + 2 * rule.pitch);
  C* __restrict c2 = reinterpret_cast<C*>(stats + 3 * rule.pitch);
  if (!rule.terms) {
    std::fill_n(c1, n, C(0)), std::fill_n(c2, n, C(0));
    return;
  }
  auto each = [&](auto outside, auto mean, auto variance) {
    for (int64_t i = 0; i < n; ++i) {
      const std::pair<double, double> c = rule.terms_of(u[i], sum_g[i], sum_gy[i], outside, mean, variance);
      c1[i] = static_cast<C>(c.first), c2[i] = static_cast<C>(c.second);
    }
  };
  auto as_constant = [](bool v, auto&& fn) {
    if (v) fn(std::true_type{});
    else fn(std::false_type{});
  };
  as_constant(rule.epsilon_outside, [&](auto outside) {
    as_constant(rule.normalize_mean, [&](auto mean) {
      as_constant(rule.normalize_variance, [&](auto variance) { each(outside, mean, variance); });
    });
  });
}

static void backward_coefficients_entry(const BackwardTask& t, char* stats, const double* sum_g, const double* sum_gy,
                                        int64_t n) {
  if (t.dtype == DType::f64) set_coefficients_of<double>(t, stats, sum_g, sum_gy, n);
  else set_coefficients_of<float>(t, stats, sum_g, sum_gy, n);
}

static void backward_columns_entry(const BackwardTask& t, const LoopNest& nest, double* param_sums, int64_t pitch) {
  with_storage_type(t.dtype, [&](auto st) { BackwardKernel<typename decltype(st)::type>::columns(t, nest, param_sums, pitch); });
}

static void backward_sums_entry(const BackwardTask& t, const LoopNest& nest, int64_t begin, int64_t end,
                                const BackwardSums& acc) {
  with_storage_type(t.dtype, [&](auto st) { BackwardKernel<typename decltype(st)::type>::sums(t, nest, begin, end, acc); });
}

static void backward_apply_entry(const BackwardTask& t, const LoopNest& nest, int64_t begin, int64_t end) {
  with_storage_type(t.dtype, [&](auto st) { BackwardKernel<typename decltype(st)::type>::apply(t, nest, begin, end); });
}
