// Vectorized transcendentals on vf, accurate over the whole float32 range, and on vd (float64 data),
// accurate over the whole double range (measured max errors and the command that measures them:
// docs/ACCURACY.md, tests/cpp/vmath_accuracy.cpp).
//
// Included after simd/vec.h inside an ISA namespace (see vec.h): no includes, internal linkage only,
// no intrinsics (the math is written with vec.h's helpers and the vector operators, once for every
// width), on vf and on vd, so activations templated on the compute type V compile for both.
//
// Public:   vexp vexpm1 vlog1p vtanh verf      (the functions themselves)
//           vsigmoid vsilu vgelu vlog1p_exp_negabs  (activations that need care at the edges)
//           vsilu_derivative vgelu_derivative  (the backward's silu' and gelu'; gelu' float only)
//           vprod_err                          (rounding error of a product, for callers' arguments)
// Contract: NaN in -> NaN out; +-inf and overflow/underflow give the limits (exp(+big) = inf,
//           exp(-big) = 0 through the subnormals, tanh/erf/sigmoid saturate exactly to +-1 / 0 / 1).
//
// Shared building block: exp(x) = 2^n * (1 + q), with n = round(x / ln2), r = x - n*ln2 in
// [-ln2/2, ln2/2] (Cody-Waite: ln2 = C1 + C2, C1 with 9 significant bits so n*C1 is exact even
// without FMA) and q = expm1(r) from a minimax polynomial. Keeping q (not 1 + q) gives expm1 its
// relative accuracy near 0, and keeping 2^n apart lets sigmoid/silu/gelu fold their other factors in
// before one final power-of-two scaling, the only rounding that lands in the subnormals.
// The polynomial coefficients were fitted for this file (Lawson-weighted least squares against
// mpmath, i.e. near-minimax in relative error), then rounded to float.

// c0 x^n + c1 x^(n-1) + ... + cn by Horner's rule, one FMA a step, the coefficients given highest
// degree first and rounded to V's element type (float literals for vf, so that nothing rounds twice).
template <class V, class... C>
static inline __attribute__((always_inline)) V vhorner(V x, double c0, C... rest) {
  V acc = splat<V>(c0);
  ((acc = vfma(acc, x, splat<V>(rest))), ...);
  return acc;
}

// 2^n as a float, for -126 <= n <= 127 (n = -127 gives 0, which expm1 relies on).
// Unsigned lane arithmetic: lanes of NaN inputs carry INT_MIN here, and signed overflow or a left
// shift of a negative value would be undefined behaviour (UBSan reports it) although the lane's
// result is discarded.
static inline vf vm_pow2i(vi n) { return vfrom_bits((vi)(((vu)n + 127u) << 23)); }

// v * 2^n for -173 <= n <= 128 in two exact-until-the-last steps: v * 2^(n>>1) stays normal for the
// v the callers pass (|v| >= ~2^-4), so only the second multiplication rounds.
static inline vf vm_scale(vf v, vi n) {
  const vi h = n >> 1;
  return v * vm_pow2i(h) * vm_pow2i(n - h);
}

// q = expm1(r) with r = hi + lo - n*ln2, |r| <= ~0.347; n returned. hi must be in [-120, 89]
// (callers clamp; NaN passes through to q). lo is a small correction (|lo| << 1) carrying the bits
// of an argument that does not fit one float (erf's -a^2, softplus's s*x); kLo=false skips it.
template <bool kLo>
static inline vf vm_expm1_core(vf hi, vf lo, vi& n) {
  const vf k = vround((kLo ? hi + lo : hi) * vbroadcast(1.44269504088896341f));
  n = vto_int(k);
  vf r = vfma(k, vbroadcast(-0.693359375f), hi);  // exact (Sterbenz, and k*C1 has <= 17 bits)
  if (kLo) r = r + lo;
  r = vfma(k, vbroadcast(2.12194440e-4f), r);  // ln2 = 0.693359375 - 2.12194440e-4
  // expm1(r) = r + r^2 * P(r): fitted relative error 2.4e-10 (0.004 ulp) on |r| <= 0.3476.
  const vf p = vhorner(r, 0.000198459005f, 0.00139409222f, 0.00833338965f, 0.0416663587f, 0.166666657f,
                       0.5f);
  return vfma(r * r, p, r);
}

// 2^n * (1 + q) with one rounding before the final scaling.
static inline vf vm_exp_finish(vf q, vi n) {
  const vi h = n >> 1;
  const vf s = vm_pow2i(h);
  return vfma(q, s, s) * vm_pow2i(n - h);
}

// x OR the sign bit of s (x must be non-negative or NaN).
static inline vf vm_with_sign_of(vf x, vf s) {
  return vfrom_bits(vbits(x) | (vbits(s) & INT32_MIN));  // (not vbroadcast(-0.0f): that is +0)
}

// ---------------------------------------------------------------------------------------------
// exp: x > 88.72 -> inf, x < -103.97 -> 0, subnormal results rounded once.
static inline vf vexp(vf x) {
  vi n;
  const vf xc = vmin(vbroadcast(89.0f), vmax(vbroadcast(-120.0f), x));  // NaN survives (2nd operand)
  const vf q = vm_expm1_core<false>(xc, vf{}, n);  // sets n: keep apart from the use below
  return vm_exp_finish(q, n);
}

// expm1 = 2^n q + (2^n - 1), with 2^n - 1 exact for the n near 0 where relative accuracy needs it;
// below x = -88 the result is -1 (2^-127 -> 0 in vm_pow2i); n = 128 (x in (88.38, 88.72]) scales
// 2^127 by 2 at the end.
static inline vf vexpm1(vf x) {
  vi n;
  const vf xc = vmin(vbroadcast(89.0f), vmax(vbroadcast(-88.0f), x));
  const vf q = vm_expm1_core<false>(xc, vf{}, n);
  const vi big = n > 127;
  const vf s = vm_pow2i(big ? (vi)((vu)n - 1u) : n);
  // 2^n - 1 is exact only for -24 <= n <= 24; beyond, s (1 + q) - 1 rounds better (at n = -25,
  // 2^n - 1 is a rounding tie that would make expm1 reach -1 at x = -16.98 instead of -17.33).
  const vi far = (n < -24) | (n > 24);
  const vf r = vselect(far, vfma(s, q, s) - vbroadcast(1.0f), vfma(s, q, s - vbroadcast(1.0f)));
  return r * vselect(big, vbroadcast(2.0f), vbroadcast(1.0f));
}

// log1p (fdlibm/musl method): u = 1 + x = 2^k m with m in [sqrt2/2, sqrt2), f = m - 1 (exact),
// s = f / (2 + f), log(1+f) = f - f^2/2 + s (f^2/2 + R(s^2)), plus c/u, the rounding error of 1 + x
// relative to u, so the result is log(1 + x) and not log(u).
static inline vf vlog1p(vf x) {
  const vf one = vbroadcast(1.0f);
  const vf u = one + x;
  const vi iu = (vi)((vu)vbits(u) + (0x3f800000u - 0x3f3504f3u));  // unsigned: NaN bits would overflow
  const vi k = (iu >> 23) - 127;
  const vf f = vfrom_bits((iu & 0x007fffff) + 0x3f3504f3) - one;
  const vf kf = vto_float(k);
  // c = (1 + x) - u exactly (computed the way that is exact for each range of u), divided by u.
  const vf c = vselect(k >= 2, one - (u - x), x - (u - one)) / u;
  const vf s = f / (vbroadcast(2.0f) + f);
  const vf z = s * s;
  // R(z) = z (Lg1 + Lg2 z + Lg3 z^2 + Lg4 z^3): fitted abs error 1e-11 on |s| <= 0.1716.
  const vf R = vhorner(z, 0.235991806f, 0.285364598f, 0.400003463f, 0.666666627f) * z;
  const vf hfsq = vbroadcast(0.5f) * f * f;
  // ln2 = ln2_hi + ln2_lo, ln2_hi with its 7 low bits zero.
  vf r = vfma(s, hfsq + R, vfma(kf, vbroadcast(9.05800061e-6f), c)) - hfsq + f;
  r = vfma(kf, vbroadcast(0.693138123f), r);
  const vf ax = vabs(x);
  r = vselect(ax < vbroadcast(5.96046448e-8f), x, r);  // |x| < 2^-24: x itself (keeps -0)
  r = vselect(x == vbroadcast(-1.0f), vbroadcast(-__builtin_inff()), r);
  r = vselect(x < vbroadcast(-1.0f), vbroadcast(__builtin_nanf("")), r);
  return vselect(x == vbroadcast(__builtin_inff()), x, r);
}

// tanh: |x| < 0.625: x + x^3 P(x^2), P fitted to relative error 4.6e-11 (0.003 ulp); above,
// 1 - 2 / (e + 2) with e = expm1(2|x|) (not e / (e + 2): once e > 2^25, e + 2 rounds to e and that
// form reaches 1 at 8.66 instead of 9.01). |x| > 9.1 is exactly +-1, which also avoids inf.
static inline vf vtanh(vf x) {
  const vf a = vabs(x);
  const vf z = x * x;
  const vf p = vhorner(z, 0.00213626493f, -0.00817029178f, 0.0216979198f, -0.0539462715f, 0.133332029f,
                       -0.333333313f);
  const vf small = vfma(x * z, p, x);
  const vf e = vexpm1(a + a);
  const vf big = vselect(a > vbroadcast(9.1f), vbroadcast(1.0f),
                         vbroadcast(1.0f) - vbroadcast(2.0f) / (e + vbroadcast(2.0f)));
  return vselect(a < vbroadcast(0.625f), small, vm_with_sign_of(big, x));
}

// ---------------------------------------------------------------------------------------------
// erf / erfc pieces.
// Small |x| < 0.921875: erf(x) = x + x P(x^2), P fitted to relative error 7e-10 (0.007 ulp).
static inline vf vm_erf_small(vf x) {
  const vf z = x * x;
  const vf p = vhorner(z, 8.35700412e-05f, -0.000813960913f, 0.00520075951f, -0.026859289f,
                       0.112836935f, -0.376126349f, 0.128379166f);
  return vfma(x, p, x);
}

// Tail 0.5 <= a <= 10.3: erfc(a) = t H(t) exp(-a^2), t = 1 / (1 + 0.75 a), H fitted to relative
// error 1.4e-9 (0.024 ulp). The rounding of t enters erfc amplified by d ln(tH)/d ln t (1.1 to 1.5
// here; up to 2.1 with the classic t = 1 / (1 + a/2)), hence 0.75. a^2 = sq_hi + sq_lo must come
// split (sq_hi exact): a^2 reaches 106, and one rounding of it would cost up to 106 * 2^-24 relative
// in erfc. Returns m with erfc = m * 2^n (see vm_scale).
static inline vf vm_erfc_th(vf a) {  // t H(t): erfc(a) = t H(t) exp(-a^2)
  const vf t = vbroadcast(1.0f) / vfma(a, vbroadcast(0.75f), vbroadcast(1.0f));
  const vf h = vhorner(t, -0.40212515f, 1.70234048f, -2.87010598f, 2.19611526f, -0.403201848f,
                       -0.273148119f, -0.159116626f, 0.0573047288f, 0.305344343f, 0.423056483f,
                       0.423144668f);
  return t * h;
}
static inline vf vm_erfc_tail(vf a, vf sq_hi, vf sq_lo, vi& n) {
  const vf th = vm_erfc_th(a);
  const vf q = vm_expm1_core<true>(vbroadcast(0.0f) - sq_hi, vbroadcast(0.0f) - sq_lo, n);
  return vfma(q, th, th);
}

// v = hi + lo with hi holding the top 12 significant bits, so hi * hi is exact in float.
static inline vf vm_hi12(vf v) { return vfrom_bits(vbits(v) & (int32_t)0xfffff000); }

// erf: |x| >= 0.921875 is 1 - erfc (no cancellation: erfc <= 0.19); |x| > 4 rounds to exactly +-1.
static inline vf verf(vf x) {
  const vf a = vabs(x);
  const vf at = vmin(vbroadcast(4.0f), a);  // NaN survives
  const vf ah = vm_hi12(at), al = at - ah;
  vi n;
  const vf m = vm_erfc_tail(at, ah * ah, al * (ah + ah + al), n);
  const vf big = vbroadcast(1.0f) - vm_scale(m, n);
  return vselect(a < vbroadcast(0.921875f), vm_erf_small(x), vm_with_sign_of(big, x));
}

// a * b - p exactly, for p = a * b rounded: the rounding error of a product. One FMA where vfma is
// fused (vec.h: AVX2 / AVX-512); else Dekker's product on 12-bit halves (every partial product exact).
static inline vf vprod_err(vf a, vf b, vf p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return vfma(a, b, -p);
#else
  const vf ah = vm_hi12(a), al = a - ah, bh = vm_hi12(b), bl = b - bh;
  return ((ah * bh - p) + ah * bl + al * bh) + al * bl;
#endif
}

// log1p(exp(-|z|)), the softplus term, for z = zh + zl given unevaluated (zl a small correction: the
// rounding error of the product that made zh). exp's condition number is |z|, so without zl the
// rounding of zh alone would cost up to |z| / 2 ulp for z << 0.
static inline vf vlog1p_exp_negabs(vf zh, vf zl) {
  const vf az = vabs(zh);
  const vf lo = vselect(az < vbroadcast(120.0f), vselect(zh < vbroadcast(0.0f), zl, -zl), vf{});
  vi n;
  const vf q = vm_expm1_core<true>(vmax(vbroadcast(-120.0f), -az), lo, n);
  return vlog1p(vm_exp_finish(q, n));
}

// exp(-|z| + L) for z = zh + zl (as vlog1p_exp_negabs takes it) and L = lh + ll given as two floats:
// the softplus family's term c * log1p(exp(-|z|)) where exp(-|z|) leaves float's normal range
// (|z| >= 80, where log1p(e) = e): c e = exp(-|z| + log c) in one exp, so that a result in float's
// range keeps its bits where e alone would be subnormal or 0. The sum's rounding error (two-sum)
// joins the correction term; past exp's domain the argument is clamped and its correction dropped.
static inline vf vm_exp_negabs_plus(vf zh, vf zl, vf lh, vf ll) {
  const vf a = vbroadcast(0.0f) - vabs(zh);
  const vf sum = a + lh;
  const vf bp = sum - a;
  const vf err = (a - (sum - bp)) + (lh - bp);
  const vf hi = vmin(vbroadcast(89.0f), vmax(vbroadcast(-120.0f), sum));  // (NaN survives)
  const vf lo = vselect(sum == hi, vselect(zh < vbroadcast(0.0f), zl, vbroadcast(0.0f) - zl) + ll + err, vf{});
  vi n;
  const vf q = vm_expm1_core<true>(hi, lo, n);
  return vm_exp_finish(q, n);
}

// exp(-x) for |x| <= 80 (x clamped there), a normal float: one power of two, no final scaling step.
// sigmoid, silu and silu' take their values there from it, and lanes past 80 from their tails.
static inline vf vm_exp_neg_near(vf x) {
  vi n;
  const vf q = vm_expm1_core<false>(vmin(vbroadcast(80.0f), vmax(vbroadcast(-80.0f), vbroadcast(0.0f) - x)), vf{}, n);
  const vf pow2 = vm_pow2i(n);
  return vfma(q, pow2, pow2);
}

// sigmoid: for |x| < 80, 1 / (1 + e) with e = exp(-x) a normal float (vm_exp_neg_near). Past 80
// (lane by lane) without overflow: e = exp(-|x|); x >= 0: 1 / (1 + e); x < 0: e / (1 + e), with e's
// 2^n applied last so that results down to the subnormals (x > -103.9) keep their precision.
static inline vf vsigmoid(vf x) {
  const vf one = vbroadcast(1.0f), edge = vbroadcast(80.0f);
  const vf near = one / (one + vm_exp_neg_near(x));
  if (__builtin_expect(!vany_ge(vabs(x), edge), 1)) return near;
  vi n;
  const vf q = vm_expm1_core<false>(vmax(vbroadcast(-120.0f), vbroadcast(0.0f) - vabs(x)), vf{}, n);
  const vf rd = one / (one + vm_exp_finish(q, n));
  return vselect(vabs(x) >= edge, vselect(x < vbroadcast(0.0f), vm_scale(vfma(q, rd, rd), n), rd), near);
}

// silu = x * sigmoid(x). For |x| < 80, x / (1 + e) with e = exp(-x) a normal float: one exp, one
// division. Past 80 (lane by lane: a result does not depend on its vector's other lanes) the
// sigmoid's scheme, 2^n applied last for x < 0; x < -120 computes as -120 (result 0 either way), so
// that -inf gives the limit -0 instead of -inf * 0.
static inline vf vsilu(vf x) {
  const vf one = vbroadcast(1.0f), edge = vbroadcast(80.0f);
  const vf near = x / (one + vm_exp_neg_near(x));
  if (__builtin_expect(!vany_ge(vabs(x), edge), 1)) return near;
  vi nt;
  const vf xn = vmax(vbroadcast(-120.0f), x);
  const vf qt = vm_expm1_core<false>(vmax(vbroadcast(-120.0f), vbroadcast(0.0f) - vabs(x)), vf{}, nt);
  const vf rd = one / (one + vm_exp_finish(qt, nt));
  const vf far = vselect(x < vbroadcast(0.0f), vm_scale(xn * vfma(qt, rd, rd), nt), x * rd);
  return vselect(vabs(x) >= edge, far, near);
}

// gelu = x Phi(x) = 0.5 x (1 + erf(x / sqrt2)). For x < 0 this is 0.5 x erfc(|x| / sqrt2), taken from
// the tail directly (1 + erf would cancel: relative accuracy is kept down to the subnormals, x > -14.1);
// x^2/2 is split from x itself, so the rounding of x / sqrt2 does not enter exp. x = -inf gives -0.
static inline vf vgelu(vf x) {
  const vf half = vbroadcast(0.5f), one = vbroadcast(1.0f);
  const vf xt = vmin(vbroadcast(14.5f), vmax(vbroadcast(-14.5f), x));  // tail argument; NaN survives
  const vf at = vabs(xt) * vbroadcast(0.707106781f);
  const vf xh = vm_hi12(xt), xl = xt - xh;
  vi n;
  const vf m = vm_erfc_tail(at, half * (xh * xh), xl * vfma(xl, half, xh), n);
  const vf es = vm_erf_small(x * vbroadcast(0.707106781f));
  const vf a = vabs(x) * vbroadcast(0.707106781f);
  const vi neg = x < vbroadcast(0.0f);
  // Phi * 2: x >= 0: 1 + erf (small) or 2 - erfc; x < 0: 1 + erf (small, |y| < 0.5) or erfc.
  const vf pos2 = vselect(a < vbroadcast(0.921875f), one + es, vbroadcast(2.0f) - vm_scale(m, n));
  const vf neg_small = half * x * (one + es);
  const vf neg_tail = vm_scale(half * xt * m, n);
  return vselect(neg, vselect(a < half, neg_small, neg_tail), half * x * pos2);
}

// silu'(x) = s (1 + x (1 - s)), s = sigmoid(x) (the backward's derivative). For |x| < 80, e = exp(-x)
// is a normal float, s = 1 / (1 + e) and 1 - s = e s (no cancellation): one exp, one division.
// Past 80 (lane by lane, so that a result does not depend on its vector's other lanes) the limit 1,
// and below -80 exp(x) (1 + x) (s = exp(x) to float's precision there) with its 2^n applied last,
// so that the results in the subnormals are rounded once.
static inline vf vsilu_derivative(vf x) {
  const vf one = vbroadcast(1.0f), edge = vbroadcast(80.0f);
  const vf e = vm_exp_neg_near(x);
  const vf s = one / (one + e);
  const vf near = s * vfma(x, e * s, one);
  if (__builtin_expect(!vany_ge(vabs(x), edge), 1)) return near;
  const vf xt = vmin(vbroadcast(-80.0f), vmax(vbroadcast(-120.0f), x));  // (x < -120: 0 either way)
  vi nt;
  const vf qt = vm_expm1_core<false>(xt, vf{}, nt);
  const vf t = one + xt;
  const vf left = vm_scale(vfma(qt, t, t), nt);
  return vselect(vabs(x) >= edge, vselect(x > vbroadcast(0.0f), one, left), near);
}

// gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi) (the backward's derivative).
// Phi as vgelu takes it (1 + erf for small |x|, else from the erfc tail, which keeps x < 0's
// relative accuracy), and x phi from the same tail's exp(-x^2/2) = 2^n (1 + q): one exp for both.
// Past |x| = 14.5 the limits, 1 and 0 (x phi and Phi are below float's smallest there).
static inline vf vgelu_derivative(vf x) {
  const vf half = vbroadcast(0.5f), one = vbroadcast(1.0f);
  const vf xt = vmin(vbroadcast(14.5f), vmax(vbroadcast(-14.5f), x));  // NaN survives
  const vf at = vabs(xt) * vbroadcast(0.707106781f);
  const vf xh = vm_hi12(xt), xl = xt - xh;
  vi n;
  const vf q = vm_expm1_core<true>(vbroadcast(0.0f) - half * (xh * xh), vbroadcast(0.0f) - xl * vfma(xl, half, xh), n);
  const vf th = vm_erfc_th(at);
  const vf half_erfc = vm_scale(half * vfma(q, th, th), n);  // erfc(at) / 2
  const vf small = half * (one + vm_erf_small(xt * vbroadcast(0.707106781f)));
  const vi neg = x < vbroadcast(0.0f);
  const vf cdf = vselect(neg, vselect(at < half, small, half_erfc),
                         vselect(at < vbroadcast(0.921875f), small, one - half_erfc));
  const vf x_pdf = vm_scale(vfma(q, xt, xt) * vbroadcast(0.398942280f), n);
  return vselect(vabs(x) > vbroadcast(14.5f), vselect(neg, vf{}, one), cdf + x_pdf);
}

// ---------------------------------------------------------------------------------------------
// Vectors of doubles (float64 data): exp, expm1, log1p, tanh, erf, sigmoid, silu, gelu and the
// softplus term vectorized in double precision, the same structure as the float functions above with
// the extra care double needs (measured max errors 0.52-0.9 ulp over the whole double range on every
// ISA: docs/ACCURACY.md), and <cmath>'s special values. Every vd lane is computed alike (no branches).
// vfma on vd is fused on every ISA (vec.h; the baseline calls std::fma), which the exact products
// below (a * b - p as one vfma) rely on.

// 2^n as a double for -1022 <= n <= 1023 (unsigned lane arithmetic, as vm_pow2i on vf).
static inline vd vm_pow2d(vl n) { return vfrom_bits((vl)(((vul)n + 1023u) << 52)); }
static inline vd vm_pow2d(vd k) { return vm_pow2d(vto_long(k)); }  // k integral

// x OR the sign bit of s (x must be non-negative or NaN; or carry the sign of s already).
static inline vd vm_with_sign_of(vd x, vd s) {
  return vfrom_bits((vl)((vul)vbits(x) | ((vul)vbits(s) & 0x8000000000000000ull)));
}

// Reduction: x + lo = k ln2 + r + rlo, k = round((x + lo) / ln2) (an integral double), |r| <= ~0.3466,
// rlo the rounding error of r (and of lo, |lo| << 1, a correction carried beside x). ln2 = ln2_hi +
// ln2_lo as in fdlibm's e_exp.c: ln2_hi has 32 significant bits, so k ln2_hi (|k| <= 1100) and
// x - k ln2_hi are exact.
template <bool kLo>
static inline vd vm_exp_reduce(vd x, vd lo, vd& k, vd& rlo) {
  k = vround((kLo ? x + lo : x) * splat<vd>(1.4426950408889634074));
  const vd rh = vfma(k, splat<vd>(-6.93147180369123816490e-01), x);
  const vd ln2_lo = splat<vd>(1.90821492927058770002e-10);
  const vd p = kLo ? vfma(k, ln2_lo, -lo) : k * ln2_lo;
  const vd r = rh - p;
  rlo = (rh - r) - p;
  return r;
}

// expm1(r + rlo) = qh + ql for |r| <= 0.347: r + r^2/2 + r^3 Q(r) + rlo (1 + r), with r^2 = r2 + r2l
// exact and r + r^2/2 summed exactly into qh + its error, so the only rounding left of any size is
// the final one of whoever adds ql. P(r) = 1/2 + r Q(r) ~ (expm1(r) - r) / r^2: coefficients fitted
// for this file (Lawson-weighted least squares against mpmath on |r| <= 0.347, near-minimax in
// relative error; rounded to double one at a time, the rest refitted), relative error 3.0e-18
// (2^-58.2) with the double coefficients.
static inline vd vm_expm1_dd(vd r, vd rlo, vd& ql) {
  const vd q = vhorner(r, 2.0918112025030626e-09, 2.5105460561288464e-08, 2.7557258495183673e-07,
                       2.755725461892094e-06, 2.48015873454674e-05, 0.000198412698756576,
                       0.001388888888887495, 0.008333333333325811, 0.04166666666666668,
                       0.1666666666666667);
  const vd r2 = r * r;
  const vd r2l = vfma(r, r, -r2);
  const vd hh = r2 * splat<vd>(0.5);
  const vd qh = r + hh;  // |hh| <= |r|: Fast2Sum below
  ql = ((r - qh) + hh) + vfma(r2 * r, q, vfma(r2l, splat<vd>(0.5), vfma(r, rlo, rlo)));
  return qh;
}

// exp(x + lo) = 2^k (t + tl), t + tl in [0.7, 1.42] (not normalized: |tl| reaches 0.01 t). x must
// be clamped by the caller to [-1100 ln2, 1024 ln2] (NaN passes).
template <bool kLo>
static inline vd vm_exp_parts(vd x, vd lo, vd& k, vd& tl) {
  vd rlo, ql;
  const vd r = vm_exp_reduce<kLo>(x, lo, k, rlo);
  const vd qh = vm_expm1_dd(r, rlo, ql);
  const vd one = splat<vd>(1.0);
  const vd t = one + qh;  // |qh| < 1: Fast2Sum
  tl = ((one - t) + qh) + ql;
  return t;
}

// 2^k (hi + lo) for hi >= 0 (or NaN), |lo| small beside hi, k integral in [-1100, 1024], rounded once
// also when the result is subnormal (which it may be only where k <= 1). kLowOut: *low_out = the part
// of 2^k (hi + lo) below the result (exact for normal results; tiny or 0 below 2^-1022).
template <bool kLowOut = false>
static inline vd vm_exp_finish(vd hi, vd lo, vd k, vd* low_out = nullptr) {
  const vd k1 = vround(k * splat<vd>(0.5));
  const vd p1 = vm_pow2d(k1), p2 = vm_pow2d(k - k1);  // two factors: 2^k itself may be out of range
  const vd m = hi + lo;
  const vd normal = (m * p1) * p2;  // exact unless it over- or underflows
  if (kLowOut) *low_out = (((hi - m) + lo) * p1) * p2;
  // Below 2^-1022, y = (hi + lo) 2^(k + 1022) < 1 and 1 + y rounds y to a multiple of 2^-52, which
  // is the subnormal spacing 2^-1074 scaled by 2^1022: one rounding, where the multiplication
  // above rounded m and then the product (ARM optimized-routines' exp specialcase does the same).
  // (k + 1022 clamped to 1023: beyond, the exponent field would wrap around, and lanes that do not
  // use sub (k > 1) would compute it from tiny numbers; a subnormal operand or result costs a
  // microcode assist.)
  const vd sc = vm_pow2d(vmin(splat<vd>(1023.0), k + splat<vd>(1022.0)));
  const vd yh = hi * sc, yl = lo * sc;
  const vd one = splat<vd>(1.0);
  const vd v = one + yh;
  const vd w = ((one - v) + yh) + yl;
  const vd sub = ((v + w) - one) * splat<vd>(0x1p-1022);
  return vselect(normal < splat<vd>(0x1p-1022), sub, normal);
}

// exp: x > 709.78 -> inf, x < -745.13 -> 0, subnormal results rounded once.
static inline vd vexp(vd x) {
  const vd xc = vmin(splat<vd>(710.0), vmax(splat<vd>(-746.0), x));  // NaN survives (2nd operand)
  vd k, tl;
  const vd t = vm_exp_parts<false>(xc, vd{}, k, tl);
  return vm_exp_finish(t, tl, k);
}

// expm1(x) = 2^k (1 + q) - 1 = (s - 1) + s qh + s ql with s = 2^k, for x clamped to [-40, 710]
// (expm1 = -1 exactly below -37.43). s - 1 = A + Aerr exactly: A exact for |k| <= 53; above, A = s
// and Aerr = -1; below, A = -1 and Aerr = s. A + s qh is summed exactly (Fast2Sum: |A| >= |s qh|,
// or A = 0). Returns the result unrounded, hi + tail; k = 1024 computes 2^-1 of it (big).
static inline vd vm_expm1_parts(vd x, vd& tail, vl& big) {
  const vd xc = vmin(splat<vd>(710.0), vmax(splat<vd>(-40.0), x));
  vd k, rlo, ql;
  const vd r = vm_exp_reduce<false>(xc, vd{}, k, rlo);
  const vd qh = vm_expm1_dd(r, rlo, ql);
  big = k > splat<vd>(1023.0);
  const vd s = vm_pow2d(vmin(splat<vd>(1023.0), k));
  const vd one = splat<vd>(1.0);
  const vd A = s - one;
  const vd Aerr = (s - (A + one)) + ((s - A) - one);
  const vd B = s * qh;
  const vd hi = A + B;
  tail = ((A - hi) + B) + vfma(s, ql, Aerr);
  return hi;
}

static inline vd vexpm1(vd x) {
  vd tail;
  vl big;
  const vd hi = vm_expm1_parts(x, tail, big);
  const vd r = hi + tail;
  return vm_with_sign_of(vselect(big, r * splat<vd>(2.0), r), x);  // the sign: keeps -0
}

// log1p (fdlibm's s_log1p.c method and its coefficients Lp1..Lp7, |error| <= 2^-58.45 on
// 0 <= s <= 0.1716): u = 1 + x = 2^k m, m in [sqrt2/2, sqrt2), f = m - 1 (exact), s = f / (2 + f),
// z = s^2, log(1+f) = f - (hfsq - s (hfsq + z R(z))), hfsq = f^2 / 2, R(z) = Lp1 + Lp2 z + ... +
// Lp7 z^6; plus c/u, c = (1 + x) - u exactly (plus lo, a correction carried beside x), so the result
// is log(1 + x + lo) and not log(u). c/u takes 1/(1 + f) as 1 - f + f^2 - f^3 (relative error
// <= f^4 < 3%; c/u is at most 2^-53 of the result, so this costs far below an ulp).
template <bool kLo>
static inline vd vm_log1p(vd x, vd lo) {
  const vd one = splat<vd>(1.0);
  const vd u = one + x;
  const vul iu = (vul)vbits(u) + (0x3ff0000000000000ull - 0x3fe6a09e667f3bcdull);
  const vd k = vto_double((vl)(iu >> 52) - 1023);
  const vd f = vfrom_bits((vl)((iu & 0x000fffffffffffffull) + 0x3fe6a09e667f3bcdull)) - one;
  // c = (1 + x) - u, computed the way that is exact for each range of u.
  vd c = vselect(k >= splat<vd>(2.0), one - (u - x), x - (u - one));
  if (kLo) c = c + lo;
  const vd inv_m = vfma(vfma(f, one - f, -one), f, one);
  c = c * inv_m * vm_pow2d(vmax(splat<vd>(-1022.0), splat<vd>(0.0) - k));
  const vd s = f / (splat<vd>(2.0) + f);
  const vd z = s * s;
  const vd R = vhorner(z, 1.479819860511658591e-01, 1.531383769920937332e-01, 1.818357216161805012e-01,
                       2.222219843214978396e-01, 2.857142874366239149e-01, 3.999999999940941908e-01,
                       6.666666666666735130e-01);
  // fdlibm sums k ln2_hi - ((hfsq - (s (hfsq + z R) + (k ln2_lo + c))) - f), k ln2_hi exact (ln2 split
  // as in vm_exp_reduce). Here k ln2_hi + f, hfsq = f^2 / 2, hfsq - T and their sum are kept exact
  // (f^2 as two doubles; Fast2Sums: |f| < ln2_hi, |T| < hfsq, |hfsq - T| < |k ln2_hi + f|), which
  // leaves one rounding of size, the last: fdlibm's order measured 0.82 ulp at worst, this 0.6.
  const vd f2 = f * f;
  const vd hfsq = splat<vd>(0.5) * f2, hfsq_lo = splat<vd>(0.5) * vfma(f, f, -f2);
  const vd T = vfma(s, vfma(R, z, hfsq), vfma(k, splat<vd>(1.90821492927058770002e-10), c));
  const vd kl = k * splat<vd>(6.93147180369123816490e-01);
  const vd hi = kl + f;
  const vd d = hfsq - T;
  const vd h2 = hi - d;
  vd r = h2 + ((((hi - h2) - d) + ((kl - hi) + f)) - (hfsq_lo + ((hfsq - d) - T)));
  // |x| < 2^-29 (as fdlibm): x - x^2/2 (+ lo), rounded once. Above, log(1 + c/u) = c/u (c/u is below
  // 2^-53 while the result is above 2^-30); below, where f and c/u are both near x, their separate
  // roundings would add up to 1 ulp.
  r = vselect(vabs(x) < splat<vd>(0x1p-29), x + vfma(x * splat<vd>(-0.5), x, lo), r);
  if (!kLo) {  // (the softplus term passes x in [0, 1])
    r = vselect(x == splat<vd>(-1.0), splat<vd>(-__builtin_inf()), r);
    r = vselect(x < splat<vd>(-1.0), splat<vd>(__builtin_nan("")), r);
    r = vselect(x == splat<vd>(__builtin_inf()), x, r);
  }
  return vm_with_sign_of(r, x);  // log1p has the sign of x: keeps -0
}
static inline vd vlog1p(vd x) { return vm_log1p<false>(x, vd{}); }

// tanh(a) = E / (E + 2), E = expm1(2a), for a = |x| <= 20 (tanh(20) rounds to 1; no overflow), with
// E and E + 2 carried as two doubles each and the quotient corrected by its remainder: one rounding
// of size at the end. Odd: the sign of x is put back (keeps -0).
static inline vd vtanh(vd x) {
  const vd a = vmin(splat<vd>(20.0), vabs(x));  // NaN survives
  vd tail;
  vl big;
  const vd hi = vm_expm1_parts(a + a, tail, big);  // (big is never set: 2a <= 40)
  const vd E = hi + tail;
  const vd El = (hi - E) + tail;  // |hi| >= |tail|: Fast2Sum
  const vd two = splat<vd>(2.0);
  const vd Dh = two + E;
  const vd Dl = ((vmax(two, E) - Dh) + vmin(two, E)) + El;
  const vd rec = splat<vd>(1.0) / Dh;
  const vd q0 = E * rec;
  const vd rem = vfma(-q0, Dh, E) + (El - q0 * Dl);
  return vm_with_sign_of(vfma(rem, rec, q0), x);
}

// sigmoid and silu: e = exp(-|x|) = 2^k (t + tl) (|x| clamped to 760, where both are 0 or 1),
// D = 1 + e as Dh + Dl, rec = 1 / Dh; 1 / D = rec + cpos and (t + tl) / D = q0 + cneg, each corrected
// by its remainder. 1 + e does not see e < 2^-899, so 2^k is clamped there for D.
struct VmSigmoidParts {
  vd k, rec, cpos, q0, cneg;
};
static inline VmSigmoidParts vm_sigmoid_parts(vd x) {
  VmSigmoidParts p;
  vd tl0;
  const vd t0 = vm_exp_parts<false>(splat<vd>(0.0) - vmin(splat<vd>(760.0), vabs(x)), vd{}, p.k, tl0);
  const vd t = t0 + tl0, tl = (t0 - t) + tl0;  // normalized: the corrections below divide by Dh alone
  const vd s = vm_pow2d(vmax(splat<vd>(-900.0), p.k));  // (s tl stays normal: see vm_exp_finish)
  const vd one = splat<vd>(1.0);
  const vd eh = s * t;
  const vd Dh = one + eh;
  const vd Dl = ((one - Dh) + eh) + s * tl;
  p.rec = one / Dh;
  p.cpos = (vfma(-p.rec, Dh, one) - p.rec * Dl) * p.rec;
  p.q0 = t * p.rec;
  p.cneg = (vfma(-p.q0, Dh, t) + (tl - p.q0 * Dl)) * p.rec;
  return p;
}

// sigmoid: x >= 0: 1 / (1 + e); x < 0: e / (1 + e) with e's 2^k applied last (subnormal results,
// x < -708.4, rounded once).
static inline vd vsigmoid(vd x) {
  const VmSigmoidParts p = vm_sigmoid_parts(x);
  return vselect(x < splat<vd>(0.0), vm_exp_finish(p.q0, p.cneg, p.k), p.rec + p.cpos);
}

// silu'(x) = s (1 + x (1 - s)) (the backward's derivative), s and 1 - s from the same parts: x >= 0:
// (rec + cpos) (1 + x 2^k (q0 + cneg)); x < 0: 2^k (q0 + cneg) (1 + x (rec + cpos)), the 2^k applied
// last so that results below 2^-1022 are rounded once. |x| clamped at 760, where the limits 1 and 0
// are reached (so that +-inf give them, not inf * 0).
static inline vd vsilu_derivative(vd x) {
  const VmSigmoidParts p = vm_sigmoid_parts(x);
  const vd one = splat<vd>(1.0);
  const vd xc = vmin(splat<vd>(760.0), vmax(splat<vd>(-760.0), x));
  const vd f = vfma(xc, p.rec, one) + xc * p.cpos;  // 1 + x (1 - s), x < 0
  const vd fa = vabs(f), hi = p.q0 * fa;
  const vl neg = x < splat<vd>(0.0);
  // 2^k (q0 + cneg) |f| for x < 0, 2^k (q0 + cneg) = 1 - s for x >= 0: one scaling for both
  const vd scaled = vm_exp_finish(vselect(neg, hi, p.q0), vselect(neg, vfma(p.q0, fa, -hi) + p.cneg * fa, p.cneg), p.k);
  return vselect(neg, vm_with_sign_of(scaled, f), (p.rec + p.cpos) * vfma(xc, scaled, one));
}

// silu = x sigmoid(x): x >= 0: x (rec + cpos) with one rounding (cpos times x clamped, so that x = inf
// gives inf and not inf * 0); x < 0: -(|x| (q0 + cneg) 2^k), the product carried as two doubles and
// scaled last; -inf gives -0, the limit.
static inline vd vsilu(vd x) {
  const VmSigmoidParts p = vm_sigmoid_parts(x);
  const vd pos = vfma(x, p.rec, vmin(splat<vd>(1e300), x) * p.cpos);
  const vd a = vmin(splat<vd>(760.0), vabs(x));
  const vd ph = a * p.q0;
  const vd pl = vfma(a, p.q0, -ph) + a * p.cneg;
  const vd neg = vm_with_sign_of(vm_exp_finish(ph, pl, p.k), x);
  return vselect(x < splat<vd>(0.0), neg, pos);
}

// log1p(exp(-|z|)) for z = zh + zl (zl: the rounding error of the product that made zh; exp's
// condition number is |z|): e = exp(-|z|) rounded once, and the part of it below e carried into
// log1p's correction term. |z| > 746 gives 0 (and drops zl, which may be infinite there).
static inline vd vlog1p_exp_negabs(vd zh, vd zl) {
  const vd az = vabs(zh);
  const vd lo = vselect(az < splat<vd>(746.0), vselect(zh < splat<vd>(0.0), zl, -zl), vd{});
  vd k, tl, el;
  const vd t = vm_exp_parts<true>(splat<vd>(0.0) - vmin(splat<vd>(746.0), az), lo, k, tl);
  const vd e = vm_exp_finish<true>(t, tl, k, &el);
  return vm_log1p<true>(e, el);
}

// erf / erfc: fdlibm's s_erf.c method and its published coefficients, by interval of a = |x| (the
// error bounds are fdlibm's, of the rational approximations):
//   A  a < 0.84375:          erf(a) = a + a P(a^2) / Q(a^2)                          (pp, qq: 2^-57.90)
//   B  0.84375 <= a < 1.25:  erf(a) = erx + P(a - 1) / Q(a - 1), erx = (float)0.84506291151
//                                                                                    (pa, qa: 2^-59.06)
//   C  1.25 <= a < 1/0.35:   erfc(a) = exp(-a^2 - 0.5625 + R(1/a^2) / S(1/a^2)) / a  (ra, sa: 2^-62.57)
//   D  1/0.35 <= a:          the same with rb, sb                                    (2^-61.52)
// A lane needs one of A and B and one of C and D: each pair takes one division (its numerator and
// denominator selected per lane), the quotient corrected by its remainder. -a^2
// comes from the caller exactly, as two doubles nsq_h + nsq_l, and goes to exp with its low part.
// kLo: a is a + al, al the rounding error of a (gelu's a = |x| / sqrt2; x^2 / 2 is exact), which
// enters as erfc'(a) al = -2/sqrt(pi) exp(-a^2) al in A and B, and as the divisor a + al in C and D.
// Returns erfc(a) = 2^k (hi + lo) (k = 0 in A and B), and P / Q = q0 + ql of A or B.
struct VmErfcParts {
  vd q0, ql, hi, lo, k;
};
template <bool kLo>
static inline VmErfcParts vm_erfc_parts(vd a, vd al, vd nsq_h, vd nsq_l) {
  VmErfcParts p;
  const vd one = splat<vd>(1.0);
  const vl inA = a < splat<vd>(0.84375), inAB = a < splat<vd>(1.25), inC = a < splat<vd>(2.857142857142857);
  auto pick = [](vl m, double u, double v) SIMDNORM_INLINE_LAMBDA { return vselect(m, splat<vd>(u), splat<vd>(v)); };
  // A, B: P(w) / Q(w), w = a^2 (A) or a - 1 (B). Both polynomials are evaluated for every lane but for
  // their last steps, and the partial sums selected: cheaper than selecting every coefficient
  // (vblendvpd is two uops on Intel's AVX2 cores).
  const vd z = a * a, sb = a - one;
  const vd PA = vhorner(z, -2.37630166566501626084e-05, -5.77027029648944159157e-03,
                        -2.84817495755985104766e-02);
  const vd PB = vhorner(sb, -2.16637559486879084300e-03, 3.54783043256182359371e-02,
                        -1.10894694282396677476e-01, 3.18346619901161753674e-01,
                        -3.72207876035701323847e-01);
  const vd QA = vhorner(z, -3.96022827877536812320e-06, 1.32494738004321644526e-04,
                        5.08130628187576562776e-03, 6.50222499887672944485e-02,
                        3.97917223959155352819e-01);
  const vd QB = vhorner(sb, 1.19844998467991074170e-02, 1.36370839120290507362e-02,
                        1.26171219808761642112e-01, 7.18286544141962662868e-02,
                        5.40397917702171048937e-01, 1.06420880400844228286e-01);
  const vd w = vselect(inA, z, sb), P = vselect(inA, PA, PB), Q = vselect(inA, QA, QB);
  // The last two steps of P and the last of Q in two doubles (their roundings would cost up to 1 ulp
  // of erfc, which is 1 - a (1 + P/Q) in A and cancels against P/Q in B).
  const vd c1 = pick(inA, -3.25042107247001499370e-01, 4.14856118683748331666e-01);
  const vd c0 = pick(inA, 1.28379167095512558561e-01, -2.36211856075265944077e-03);
  const vd p1 = P * w;
  const vd t1h = c1 + p1;  // Fast2Sum: |c1| > |p1|
  const vd t1l = ((c1 - t1h) + p1) + vfma(P, w, -p1);
  const vd p0 = t1h * w;
  const vd Ph = c0 + p0;  // (|c0| < |p0| in much of A and B; the error term is then inexact but tiny)
  const vd Pl = ((c0 - Ph) + p0) + vfma(t1h, w, vfma(t1l, w, -p0));
  const vd q1 = Q * w;
  const vd Qh = one + q1;  // Fast2Sum: |q1| < 1
  const vd Ql = ((one - Qh) + q1) + vfma(Q, w, -q1);
  const vd rQ = one / Qh;
  p.q0 = Ph * rQ;
  p.ql = (vfma(-p.q0, Qh, Ph) + (Pl - p.q0 * Ql)) * rQ;
  // erfc: A: 1 - a - a y (y = P / Q), B: (1 - erx) - P / Q (1 - erx exact), each summed exactly
  // but for the last rounding (Fast2Sums: 1 >= a, 1 - a >= a y, 1 - erx >= |P / Q|).
  const vd y = p.q0 + p.ql;
  const vd t1 = one - a, py = a * y;
  const vd h2 = t1 - py;
  vd loA = (((one - t1) - a) + ((t1 - h2) - py)) - vfma(a, y, -py);
  const vd om_erx = splat<vd>(0.15493708848953247);
  const vd hB = om_erx - p.q0;
  vd loB = ((om_erx - hB) - p.q0) - p.ql;
  // C, D: s = 1/a^2, g = R(s) / S(s), c = g - 0.5625 (Fast2Sum: |g| < 0.23); A and B take c = 0, so
  // that exp below gives exp(-a^2) there (kLo's correction).
  const vd ra = one / a;  // (A lanes with a = 0: inf, unused)
  const vd s = ra * ra;
  // (C and D evaluated apart, then selected, as A and B.)
  const vd RC = vhorner(s, -9.81432934416914548592e+00, -8.12874355063065934246e+01,
                        -1.84605092906711035994e+02, -1.62396669462573470355e+02,
                        -6.23753324503260060396e+01, -1.05586262253232909814e+01,
                        -6.93858572707181764372e-01, -9.86494403484714822705e-03);
  const vd RD = vhorner(s, -4.83519191608651397019e+02, -1.02509513161107724954e+03,
                        -6.37566443368389627722e+02, -1.60636384855821916062e+02,
                        -1.77579549177547519889e+01, -7.99283237680523006574e-01,
                        -9.86494292470009928597e-03);
  const vd SC = vhorner(s, -6.04244152148580987438e-02, 6.57024977031928170135e+00,
                        1.08635005541779435134e+02, 4.29008140027567833386e+02,
                        6.45387271733267880336e+02, 4.34565877475229228821e+02,
                        1.37657754143519042600e+02, 1.96512716674392571292e+01);
  const vd SD = vhorner(s, -2.24409524465858183362e+01, 4.74528541206955367215e+02,
                        2.55305040643316442583e+03, 3.19985821950859553908e+03,
                        1.53672958608443695994e+03, 3.25792512996573918826e+02,
                        3.03380607434824582924e+01);
  const vd R = vselect(inC, RC, RD);
  const vd S = vfma(vselect(inC, SC, SD), s, one);
  const vd rS = one / S;
  const vd g0 = R * rS, gl = vfma(-g0, S, R) * rS;
  const vd m = splat<vd>(-0.5625);
  const vd ch = vselect(inAB, vd{}, m + g0);
  const vd cl = vselect(inAB, vd{}, ((m - (m + g0)) + g0) + gl);
  const vd eh = nsq_h + ch;  // Fast2Sum: a^2 >= 1.5625 > |c| where c != 0
  const vd el = ((nsq_h - eh) + ch) + (cl + nsq_l);
  vd k, tl;
  const vd t = vm_exp_parts<true>(eh, el, k, tl);  // exp(-a^2 + c) = 2^k (t + tl)
  // (t + tl) / (a + al) = d0 + dl
  const vd d0 = t * ra;
  const vd dl = (vfma(-d0, a, t) + (kLo ? vfma(-d0, al, tl) : tl)) * ra;
  if (kLo) {  // erfc(a + al) = erfc(a) - 2/sqrt(pi) exp(-a^2) al in A and B (there k >= -3)
    const vd de = splat<vd>(-1.1283791670955126) * (t * vm_pow2d(vmax(splat<vd>(-60.0), k)));
    loA = vfma(de, al, loA);
    loB = vfma(de, al, loB);
  }
  p.hi = vselect(inA, h2, vselect(inAB, hB, d0));
  p.lo = vselect(inA, loA, vselect(inAB, loB, dl));
  p.k = vselect(inAB, vd{}, k);
  return p;
}

// erf: A: a + a P/Q; B: erx + P/Q; C, D: 1 - erfc (a clamped to 6, where erf rounds to 1). Odd: the
// sign of x is put back (keeps -0).
static inline vd verf(vd x) {
  const vd one = splat<vd>(1.0);
  const vd a = vmin(splat<vd>(6.0), vabs(x));  // NaN survives
  const vd a2 = a * a;
  const VmErfcParts p = vm_erfc_parts<false>(a, vd{}, -a2, -vfma(a, a, -a2));
  const vd erfA = vfma(a, p.q0 + p.ql, a);
  const vd erx = splat<vd>(8.45062911510467529297e-01);
  const vd bh = erx + p.q0;  // Fast2Sum: erx > |P/Q|
  const vd erfB = bh + (((erx - bh) + p.q0) + p.ql);
  const vd sc = vm_pow2d(vmax(splat<vd>(-60.0), p.k));  // (k >= -57 for a <= 6)
  const vd eh = p.hi * sc, el = p.lo * sc;
  const vd dh = one - eh;
  const vd erfCD = dh + (((one - dh) - eh) - el);
  const vd r = vselect(a < splat<vd>(0.84375), erfA, vselect(a < splat<vd>(1.25), erfB, erfCD));
  return vm_with_sign_of(r, x);
}

static inline vd vprod_err(vd a, vd b, vd p) { return vfma(a, b, -p); }  // exact: vfma on vd is fused

// gelu = x Phi(x) = 0.5 x erfc(-x / sqrt2), from erfc(a), a = |x| / sqrt2 = ah + al (1/sqrt2 as two
// doubles) and -a^2 = -x^2 / 2 exactly: x >= 0: 0.5 x (2 - erfc(a)), 2 - erfc in two doubles and one
// rounding of the product; x < 0: 0.5 |x| erfc(a), the product in two doubles, its 2^(k - 1) applied
// last (subnormal results rounded once), negated. |x| is clamped to 40 (erfc(28.3) is 0): x = inf gives
// inf (the clamped x only times a vanishing term) and -inf gives -0, the limit.
static inline vd vgelu(vd x) {
  const vd xc = vmin(splat<vd>(40.0), vmax(splat<vd>(-40.0), x));  // NaN survives
  const vd ax = vabs(xc);
  const vd rs2 = splat<vd>(0.7071067811865476);
  const vd ah = ax * rs2;
  const vd al = vfma(ax, splat<vd>(-4.833646656726457e-17), vfma(ax, rs2, -ah));
  const vd x2 = xc * xc;
  const vd half = splat<vd>(0.5), two = splat<vd>(2.0);
  const VmErfcParts p = vm_erfc_parts<true>(ah, al, x2 * splat<vd>(-0.5), vfma(xc, xc, -x2) * splat<vd>(-0.5));
  const vd sc = vm_pow2d(vmax(splat<vd>(-900.0), p.k));  // 2 - erfc does not see erfc < 2^-899
  const vd eh = p.hi * sc, el = p.lo * sc;
  const vd dh = two - eh;  // erfc <= 1 here: Fast2Sum
  const vd pos = vfma(x, half * dh, vmin(splat<vd>(1e300), x) * (half * (((two - dh) - eh) - el)));
  const vd ph = ax * p.hi;
  const vd pl = vfma(ax, p.lo, vfma(ax, p.hi, -ph));
  const vd neg = vm_exp_finish(ph, pl, p.k - splat<vd>(1.0));
  return vm_with_sign_of(vselect(x < splat<vd>(0.0), neg, pos), x);  // gelu has the sign of x
}
