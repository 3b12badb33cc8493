// Fused activations as small functors on the compute type V (vf or vd), applied in registers
// before the single rounding to the output type. Included inside an ISA namespace after simd/vec.h
// and simd/vmath.h (see vec.h): internal linkage only.
//
// Semantics are DirectML's (SPEC §5), comparison directions included (leaky_relu/elu: x >= 0,
// scaled_elu: x > 0). NaN in gives NaN out for every activation: vmax/vmin return their SECOND
// operand on NaN, so the data always goes second; selects are written so a NaN lane takes a branch
// that computes from x. Infinite inputs give the formula's limit (silu/gelu/hard_swish(-inf) = 0,
// softsign(+-inf) = +-1), never inf * 0. Parameters come from Activation::p0 / p1 (doubles) and are
// rounded once to the compute type here. Accuracy per activation: docs/ACCURACY.md.

template <class V> struct ActIdentity {
  explicit ActIdentity(const Activation&) {}
  V operator()(V x) const { return x; }
};

// linear(p0 = alpha, p1 = beta): alpha * x + beta
template <class V> struct ActLinear {
  V alpha, beta;
  explicit ActLinear(const Activation& a) : alpha(splat<V>(a.p0)), beta(splat<V>(a.p1)) {}
  V operator()(V x) const { return vfma(alpha, x, beta); }
};

template <class V> struct ActRelu {
  explicit ActRelu(const Activation&) {}
  V operator()(V x) const { return vmax(splat<V>(0.0), x); }
};

// leaky_relu(p0 = alpha): x >= 0 ? x : alpha * x
template <class V> struct ActLeakyRelu {
  V alpha;
  explicit ActLeakyRelu(const Activation& a) : alpha(splat<V>(a.p0)) {}
  V operator()(V x) const { return vselect(x >= splat<V>(0.0), x, alpha * x); }
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

// hard_sigmoid(p0 = alpha, p1 = beta): max(0, min(alpha * x + beta, 1))
template <class V> struct ActHardSigmoid {
  V alpha, beta;
  explicit ActHardSigmoid(const Activation& a) : alpha(splat<V>(a.p0)), beta(splat<V>(a.p1)) {}
  V operator()(V x) const {
    return vmax(splat<V>(0.0), vmin(splat<V>(1.0), vfma(alpha, x, beta)));
  }
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

// softplus(p0 = steepness s > 0): log(1 + exp(s x)) / s = max(x, 0) + log1p(exp(-|s x|)) / s.
// max(s x, 0) / s is taken as max(x, 0) exactly, so s x overflowing to inf cannot give inf.
template <class V> struct ActSoftplus {
  V s, s_lo;
  explicit ActSoftplus(const Activation& a)
      : s(splat<V>(a.p0)), s_lo(splat<V>(a.p0 - (double)(float)a.p0)) {}
  V operator()(V x) const {
    const V z = s * x;
    return vmax(splat<V>(0.0), x) + vlog1p_exp_negabs(z, act_product_lo(s, s_lo, x, z)) / s;
  }
};

// parametric_softplus(p0 = alpha, p1 = beta): alpha * log(1 + exp(beta x))
//   = (beta x > 0 ? (alpha beta) x : 0) + alpha log1p(exp(-|beta x|)), any signs of alpha and beta;
// alpha beta is rounded once, so beta x overflowing does not overflow the result. NaN: second term.
template <class V> struct ActParametricSoftplus {
  V alpha, beta, beta_lo, alpha_beta;
  explicit ActParametricSoftplus(const Activation& a)
      : alpha(splat<V>(a.p0)), beta(splat<V>(a.p1)), beta_lo(splat<V>(a.p1 - (double)(float)a.p1)),
        alpha_beta(splat<V>(a.p0 * a.p1)) {}
  V operator()(V x) const {
    const V z = beta * x;
    return vselect(z > splat<V>(0.0), alpha_beta * x, splat<V>(0.0)) +
           alpha * vlog1p_exp_negabs(z, act_product_lo(beta, beta_lo, x, z));
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

// clip(p0 = min, p1 = max): min(max(x, lo), hi)
template <class V> struct ActClip {
  V lo, hi;
  explicit ActClip(const Activation& a) : lo(splat<V>(a.p0)), hi(splat<V>(a.p1)) {}
  V operator()(V x) const { return vmin(hi, vmax(lo, x)); }
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

// Calls fn(functor) with the functor type of act.kind, so that the kernel is instantiated once per
// activation and the activation inlines into the inner loop.
template <class V, class Fn> void visit_activation(const Activation& act, Fn&& fn) {
  switch (act.kind) {
    case ActKind::identity: fn(ActIdentity<V>(act)); return;
    case ActKind::linear: fn(ActLinear<V>(act)); return;
    case ActKind::relu: fn(ActRelu<V>(act)); return;
    case ActKind::leaky_relu: fn(ActLeakyRelu<V>(act)); return;
    case ActKind::thresholded_relu: fn(ActThresholdedRelu<V>(act)); return;
    case ActKind::elu: fn(ActElu<V>(act)); return;
    case ActKind::celu: fn(ActCelu<V>(act)); return;
    case ActKind::scaled_elu: fn(ActScaledElu<V>(act)); return;
    case ActKind::sigmoid: fn(ActSigmoid<V>(act)); return;
    case ActKind::hard_sigmoid: fn(ActHardSigmoid<V>(act)); return;
    case ActKind::tanh: fn(ActTanh<V>(act)); return;
    case ActKind::scaled_tanh: fn(ActScaledTanh<V>(act)); return;
    case ActKind::softplus: fn(ActSoftplus<V>(act)); return;
    case ActKind::parametric_softplus: fn(ActParametricSoftplus<V>(act)); return;
    case ActKind::softsign: fn(ActSoftsign<V>(act)); return;
    case ActKind::shrink: fn(ActShrink<V>(act)); return;
    case ActKind::gelu: fn(ActGelu<V>(act)); return;
    case ActKind::clip: fn(ActClip<V>(act)); return;
    case ActKind::silu: fn(ActSilu<V>(act)); return;
    case ActKind::hard_swish: fn(ActHardSwish<V>(act)); return;
  }
  fn(ActIdentity<V>(act));  // unreachable for a valid kind
}
