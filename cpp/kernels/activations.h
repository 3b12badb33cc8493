// Fused activations as small functors on the compute type V (vf or vd), applied in registers
// before the single rounding to the output type. Included inside an ISA namespace after simd/vec.h
// and simd/vmath.h (see vec.h): internal linkage only.
//
// Semantics are DirectML's, comparison directions included (leaky_relu/elu: x >= 0,
// scaled_elu: x > 0). NaN in gives NaN out for every activation: vmax/vmin return their SECOND
// operand on NaN, so the data always goes second; selects are written so a NaN lane takes a branch
// that computes from x. Infinite inputs give the formula's limit (silu/gelu/hard_swish(-inf) = 0,
// softsign(+-inf) = +-1), never inf * 0. Parameters come from Activation::p0 / p1 (doubles) and are
// rounded once to the compute type here. Accuracy per activation: docs/ACCURACY.md.

template <class V> struct ActIdentity {
  explicit ActIdentity(const Activation&) {}
  V operator()(V x) const { return x; }
};

template <class V> struct ActRelu {
  explicit ActRelu(const Activation&) {}
  V operator()(V x) const { return vmax(splat<V>(0.0), x); }
};

// thresholded_relu(p0 = alpha): x > alpha ? x : 0 (written as x <= alpha ? 0 : x so NaN keeps x)
template <class V> struct ActThresholdedRelu {
  V alpha;
  explicit ActThresholdedRelu(const Activation& a) : alpha(splat<V>(a.p0)) {}
  V operator()(V x) const { return vselect(x <= alpha, splat<V>(0.0), x); }
};

// elu(p0 = alpha): x >= 0 ? x : alpha * (exp(x) - 1)
template <class V> struct ActElu {
  V alpha;
  explicit ActElu(const Activation& a) : alpha(splat<V>(a.p0)) {}
  V operator()(V x) const { return vselect(x >= splat<V>(0.0), x, alpha * vexpm1(x)); }
};

// celu(p0 = alpha): max(0, x) + min(0, alpha * (exp(x / alpha) - 1))
template <class V> struct ActCelu {
  V alpha;
  explicit ActCelu(const Activation& a) : alpha(splat<V>(a.p0)) {}
  V operator()(V x) const {
    return vmax(splat<V>(0.0), x) + vmin(splat<V>(0.0), alpha * vexpm1(x / alpha));
  }
};

// scaled_elu(p0 = alpha, p1 = gamma): gamma * (x > 0 ? x : alpha * (exp(x) - 1)); gamma * alpha is
// rounded once (in double) rather than twice.
template <class V> struct ActScaledElu {
  V gamma, gamma_alpha;
  explicit ActScaledElu(const Activation& a) : gamma(splat<V>(a.p1)), gamma_alpha(splat<V>(a.p1 * a.p0)) {}
  V operator()(V x) const { return vselect(x > splat<V>(0.0), gamma * x, gamma_alpha * vexpm1(x)); }
};

template <class V> struct ActSigmoid {
  explicit ActSigmoid(const Activation&) {}
  V operator()(V x) const { return vsigmoid(x); }
};

template <class V> struct ActTanh {
  explicit ActTanh(const Activation&) {}
  V operator()(V x) const { return vtanh(x); }
};

// scaled_tanh(p0 = alpha, p1 = beta): alpha * tanh(beta * x)
template <class V> struct ActScaledTanh {
  V alpha, beta;
  explicit ActScaledTanh(const Activation& a) : alpha(splat<V>(a.p0)), beta(splat<V>(a.p1)) {}
  V operator()(V x) const { return alpha * vtanh(beta * x); }
};

// p * x as hi + lo for the softplus family: lo = the rounding error of the float product z = p_hi x
// plus the part of p lost in rounding it to float (p_lo). float64 lanes (vd) take the rounding error
// of the double product (a parameter is exact in double: p_lo unused).
static inline vf act_product_lo(vf p_hi, vf p_lo, vf x, vf z) { return vfma(p_lo, x, vprod_err(p_hi, x, z)); }
static inline vd act_product_lo(vd p_hi, vd, vd x, vd z) { return vprod_err(p_hi, x, z); }

// The softplus family's term c * log1p(exp(-|z|)), z = zh + zl, given as `near` (computed as the
// caller writes it). Where |z| >= 80 (lane by lane) exp(-|z|) leaves float's normal range while c
// (a large 1 / steepness, alpha) could bring the product back into it: float lanes take it there as
// sign(c) * exp(-|z| + log|c|) (vm_exp_negabs_plus; log|c| in two parts, LogParts).
template <class V>
V act_softplus_far(V zh, V zl, V near, V log_c_hi, V log_c_lo, V sign_c) {
  if constexpr (std::is_same_v<V, vf>) {
    const V edge = splat<V>(80.0);
    if (__builtin_expect(vany_ge(vabs(zh), edge), 0))
      return vselect(vabs(zh) >= edge, sign_c * vm_exp_negabs_plus(zh, zl, log_c_hi, log_c_lo), near);
  }
  return near;
}

// log|c| as a float and the double remainder (c = 0: a log far below exp's domain: a result of 0).
struct LogParts {
  double hi, lo;
  explicit LogParts(double c) {
    const double l = c != 0.0 ? std::log(std::fabs(c)) : -1e4;
    hi = (float)l;
    lo = l - hi;
  }
};

// softplus(p0 = steepness s > 0): log(1 + exp(s x)) / s = max(x, 0) + log1p(exp(-|s x|)) / s.
// max(s x, 0) / s is taken as max(x, 0) exactly, so s x overflowing to inf cannot give inf.
template <class V> struct ActSoftplus {
  V s, s_lo, log_c_hi, log_c_lo;
  explicit ActSoftplus(const Activation& a) : s(splat<V>(a.p0)), s_lo(splat<V>(a.p0 - (double)(float)a.p0)) {
    const LogParts l(1.0 / a.p0);
    log_c_hi = splat<V>(l.hi), log_c_lo = splat<V>(l.lo);
  }
  V operator()(V x) const {
    const V z = s * x;
    const V zl = act_product_lo(s, s_lo, x, z);
    return vmax(splat<V>(0.0), x) +
           act_softplus_far(z, zl, vlog1p_exp_negabs(z, zl) / s, log_c_hi, log_c_lo, splat<V>(1.0));
  }
};

// parametric_softplus(p0 = alpha, p1 = beta): alpha * log(1 + exp(beta x))
//   = (beta x > 0 ? (alpha beta) x : 0) + alpha log1p(exp(-|beta x|)), any signs of alpha and beta;
// alpha beta is rounded once, so beta x overflowing does not overflow the result. NaN: second term.
template <class V> struct ActParametricSoftplus {
  V alpha, beta, beta_lo, alpha_beta, log_c_hi, log_c_lo, sign_alpha;
  explicit ActParametricSoftplus(const Activation& a)
      : alpha(splat<V>(a.p0)), beta(splat<V>(a.p1)), beta_lo(splat<V>(a.p1 - (double)(float)a.p1)),
        alpha_beta(splat<V>(a.p0 * a.p1)), sign_alpha(splat<V>(a.p0 > 0 ? 1.0 : a.p0 < 0 ? -1.0 : 0.0)) {
    const LogParts l(a.p0);
    log_c_hi = splat<V>(l.hi), log_c_lo = splat<V>(l.lo);
  }
  V operator()(V x) const {
    const V z = beta * x;
    const V zl = act_product_lo(beta, beta_lo, x, z);
    return vselect(z > splat<V>(0.0), alpha_beta * x, splat<V>(0.0)) +
           act_softplus_far(z, zl, alpha * vlog1p_exp_negabs(z, zl), log_c_hi, log_c_lo, sign_alpha);
  }
};

// softsign: x / (1 + |x|); x is clamped to +-FLT_MAX first (same result: 1 + |x| rounds to |x| long
// before), so that +-inf gives +-1 and not inf / inf.
template <class V> struct ActSoftsign {
  explicit ActSoftsign(const Activation&) {}
  V operator()(V x) const {
    const V big = splat<V>(3.4028234663852886e38);
    const V xc = vmin(big, vmax(-big, x));
    return xc / (splat<V>(1.0) + vabs(xc));
  }
};

// shrink(p0 = bias, p1 = threshold): x > thr ? x - bias : (x < -thr ? x + bias : 0); NaN -> NaN
template <class V> struct ActShrink {
  V bias, thr, neg_thr;
  explicit ActShrink(const Activation& a)
      : bias(splat<V>(a.p0)), thr(splat<V>(a.p1)), neg_thr(splat<V>(-a.p1)) {}
  V operator()(V x) const {
    const V mid = vselect(x == x, splat<V>(0.0), x);
    return vselect(x > thr, x - bias, vselect(x < neg_thr, x + bias, mid));
  }
};

template <class V> struct ActGelu {
  explicit ActGelu(const Activation&) {}
  V operator()(V x) const { return vgelu(x); }
};

template <class V> struct ActSilu {
  explicit ActSilu(const Activation&) {}
  V operator()(V x) const { return vsilu(x); }
};

// hard_swish: x * max(0, min(1, x / 6 + 0.5)), the clamp computed as (x + 3) * (1/6): x + 3 is exact
// near -3, where x / 6 + 0.5 would cancel. Exactly 0 where the clamp is 0 (so -inf -> 0, not NaN).
template <class V> struct ActHardSwish {
  explicit ActHardSwish(const Activation&) {}
  V operator()(V x) const {
    const V zero = splat<V>(0.0);
    const V h = vmax(zero, vmin(splat<V>(1.0), (x + splat<V>(3.0)) * splat<V>(1.0 / 6.0)));
    return vselect(h == zero, zero, x * h);
  }
};

// The piecewise-linear activations, in one inline functor of four steps, each made exact identity
// where a kind does not use it (a = 1, b = -0: x * 1 + -0 is x, -0 included; s = 1; lo = -inf, hi =
// +inf), so that every vector takes the same six operations and no branch: x -> a x + b, then
// x >= 0 ? x : s x, then max(lo, x), then min(hi, x).
//   linear(p0 = alpha, p1 = beta): alpha * x + beta
//   leaky_relu(p0 = alpha): x >= 0 ? x : alpha * x
//   hard_sigmoid(p0 = alpha, p1 = beta): max(0, min(alpha * x + beta, 1)) (clamped in the other
//     order: the same, since 0 < 1)
//   clip(p0 = min, p1 = max): min(max(x, lo), hi)
template <class V> struct ActPiecewiseLinear {
  V a, b, s, lo, hi;
  explicit ActPiecewiseLinear(const Activation& act) {
    double pa = 1.0, pb = -0.0, ps = 1.0, plo = -HUGE_VAL, phi = HUGE_VAL;
    switch (act.kind) {
      case ActKind::linear: pa = act.p0, pb = act.p1; break;
      case ActKind::leaky_relu: ps = act.p0; break;
      case ActKind::hard_sigmoid: pa = act.p0, pb = act.p1, plo = 0.0, phi = 1.0; break;
      case ActKind::clip: plo = act.p0, phi = act.p1; break;
      default: break;
    }
    a = splat<V>(pa), b = splat<V>(pb), s = splat<V>(ps), lo = splat<V>(plo), hi = splat<V>(phi);
  }
  static constexpr bool covers(ActKind kind) {
    return kind == ActKind::linear || kind == ActKind::leaky_relu || kind == ActKind::hard_sigmoid ||
           kind == ActKind::clip;
  }
  V operator()(V x) const {
    x = vfma(a, x, b);
    x = vselect(x >= splat<V>(0.0), x, s * x);
    return vmin(hi, vmax(lo, x));
  }
};

// Every other activation runs out of line: one call a vector, through a pointer to its functor's
// operator(). The loops are compiled four times instead of once per activation: identity, which
// nearly every call uses, and relu, the one most fused, each inline; the piecewise-linear ones,
// cheap enough that a call a vector would double their time (with 16-bit data in the caches each
// operation a vector shows; relu among their flags was up to 1.3x its own loops' time), inline;
// any other, through the pointer. An activation costs its own small function per ISA, whatever
// the number of loops.
// Contiguous runs (NormalizeKernel::run_contiguous_blocks) call it once for a block of vectors
// instead: inline over the block, the activation's long dependency chains overlap and no call
// spills the loop's registers.
template <class V> struct ActOutOfLine {
  V (*apply)(const void* act, V x);
  void (*apply_block)(const void* act, V* v, int count);
  const void* act;  // the functor, alive for the call that visits it
  V operator()(V x) const { return apply(act, x); }
  void operator()(V* v, int count) const { apply_block(act, v, count); }
};
template <class Act, class V> __attribute__((noinline)) V apply_activation(const void* act, V x) {
  return (*static_cast<const Act*>(act))(x);
}
template <class Act, class V> __attribute__((noinline)) void apply_activation_block(const void* act, V* v, int count) {
  const Act& a = *static_cast<const Act*>(act);
  for (int k = 0; k < count; ++k) v[k] = a(v[k]);
}

// Whether a functor type is the out-of-line call.
template <class Act> constexpr bool kRunsOutOfLine = false;
template <class V> constexpr bool kRunsOutOfLine<ActOutOfLine<V>> = true;

// The fallback unit of an x86 build (SIMDNORM_FALLBACK_UNIT: the baseline, for CPUs without AVX2)
// runs relu and the piecewise-linear activations out of line too: its loops compiled once per
// formula rather than three times, for a CPU few run it on.
#if defined(SIMDNORM_FALLBACK_UNIT)
constexpr bool kFewInline = true;
#else
constexpr bool kFewInline = false;
#endif
// Whether this unit's loops take the activation inline: the planners' table (kActInline), or
// identity alone in the fallback unit; the fused rows loops are compiled for these only.
constexpr bool inline_here(ActKind kind) {
  return kind == ActKind::identity || (!kFewInline && kActInline[static_cast<int>(kind)]);
}
// The same, one bit a kind, for the planners (KernelTable::inline_activations).
constexpr uint32_t inline_activation_bits() {
  uint32_t bits = 0;
  for (int k = 0; k < kNumActs; ++k) bits |= inline_here(static_cast<ActKind>(k)) ? 1u << k : 0u;
  return bits;
}
constexpr bool inline_kinds_match_table() {
  for (int k = 0; k < kNumActs; ++k) {
    const ActKind kind = static_cast<ActKind>(k);
    const bool inline_functor =
        kind == ActKind::identity || kind == ActKind::relu || ActPiecewiseLinear<vf>::covers(kind);
    if (inline_functor != kActInline[k]) return false;
  }
  return true;
}
static_assert(inline_kinds_match_table(), "visit_activation takes inline exactly the kinds kActInline lists");

// Calls fn(functor): ActIdentity, ActRelu, ActPiecewiseLinear or ActOutOfLine (inline_here says
// which).
template <class V, class Fn> void visit_activation(const Activation& act, Fn&& fn) {
  auto out_of_line = [&](const auto& functor) {
    using Act = std::decay_t<decltype(functor)>;
    V (*apply)(const void*, V) = &apply_activation<Act, V>;
    void (*apply_block)(const void*, V*, int) = &apply_activation_block<Act, V>;
    // Opaque to the optimizer: a constant pointer could be propagated into clones of the loops,
    // one per activation, which is what this type exists to avoid.
    __asm__("" : "+r"(apply), "+r"(apply_block));
    fn(ActOutOfLine<V>{apply, apply_block, &functor});
  };
  if (ActPiecewiseLinear<V>::covers(act.kind)) {
    if constexpr (kFewInline) return out_of_line(ActPiecewiseLinear<V>(act));
    else return fn(ActPiecewiseLinear<V>(act));
  }
  switch (act.kind) {
    case ActKind::relu:
      if constexpr (kFewInline) return out_of_line(ActRelu<V>(act));
      else return fn(ActRelu<V>(act));
    case ActKind::thresholded_relu: return out_of_line(ActThresholdedRelu<V>(act));
    case ActKind::elu: return out_of_line(ActElu<V>(act));
    case ActKind::celu: return out_of_line(ActCelu<V>(act));
    case ActKind::scaled_elu: return out_of_line(ActScaledElu<V>(act));
    case ActKind::sigmoid: return out_of_line(ActSigmoid<V>(act));
    case ActKind::tanh: return out_of_line(ActTanh<V>(act));
    case ActKind::scaled_tanh: return out_of_line(ActScaledTanh<V>(act));
    case ActKind::softplus: return out_of_line(ActSoftplus<V>(act));
    case ActKind::parametric_softplus: return out_of_line(ActParametricSoftplus<V>(act));
    case ActKind::softsign: return out_of_line(ActSoftsign<V>(act));
    case ActKind::shrink: return out_of_line(ActShrink<V>(act));
    case ActKind::gelu: return out_of_line(ActGelu<V>(act));
    case ActKind::silu: return out_of_line(ActSilu<V>(act));
    case ActKind::hard_swish: return out_of_line(ActHardSwish<V>(act));
    default: return fn(ActIdentity<V>(act));  // identity (the piecewise-linear kinds returned above)
  }
}
