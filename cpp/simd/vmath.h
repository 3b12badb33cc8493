// Vectorized transcendentals on vf, accurate over the whole float32 range (measured max errors and
// the command that measures them: docs/ACCURACY.md, tests/cpp/vmath_accuracy.cpp).
//
// Included after simd/vec.h inside an ISA namespace (see vec.h): no includes, internal linkage only,
// no intrinsics (the math is written with vec.h's helpers and the vector operators, once for every
// width). Each function also has a `double` overload forwarding to <cmath>, and a `vd` one that
// applies it lane by lane, so activations and kernels templated on the compute type V compile for
// all three.
//
// Public:   vexp vexpm1 vlog1p vtanh verf      (the functions themselves)
//           vsigmoid vsilu vgelu vlog1p_exp_negabs  (activations that need care at the edges)
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
  vf p = vbroadcast(0.000198459005f);
  p = vfma(p, r, vbroadcast(0.00139409222f));
  p = vfma(p, r, vbroadcast(0.00833338965f));
  p = vfma(p, r, vbroadcast(0.0416663587f));
  p = vfma(p, r, vbroadcast(0.166666657f));
  p = vfma(p, r, vbroadcast(0.5f));
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
  vf R = vbroadcast(0.235991806f);
  R = vfma(R, z, vbroadcast(0.285364598f));
  R = vfma(R, z, vbroadcast(0.400003463f));
  R = vfma(R, z, vbroadcast(0.666666627f));
  R = R * z;
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
  vf p = vbroadcast(0.00213626493f);
  p = vfma(p, z, vbroadcast(-0.00817029178f));
  p = vfma(p, z, vbroadcast(0.0216979198f));
  p = vfma(p, z, vbroadcast(-0.0539462715f));
  p = vfma(p, z, vbroadcast(0.133332029f));
  p = vfma(p, z, vbroadcast(-0.333333313f));
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
  vf p = vbroadcast(8.35700412e-05f);
  p = vfma(p, z, vbroadcast(-0.000813960913f));
  p = vfma(p, z, vbroadcast(0.00520075951f));
  p = vfma(p, z, vbroadcast(-0.026859289f));
  p = vfma(p, z, vbroadcast(0.112836935f));
  p = vfma(p, z, vbroadcast(-0.376126349f));
  p = vfma(p, z, vbroadcast(0.128379166f));
  return vfma(x, p, x);
}

// Tail 0.5 <= a <= 10.3: erfc(a) = t H(t) exp(-a^2), t = 1 / (1 + 0.75 a), H fitted to relative
// error 1.4e-9 (0.024 ulp). The rounding of t enters erfc amplified by d ln(tH)/d ln t (1.1 to 1.5
// here; up to 2.1 with the classic t = 1 / (1 + a/2)), hence 0.75. a^2 = sq_hi + sq_lo must come
// split (sq_hi exact): a^2 reaches 106, and one rounding of it would cost up to 106 * 2^-24 relative
// in erfc. Returns m with erfc = m * 2^n (see vm_scale).
static inline vf vm_erfc_tail(vf a, vf sq_hi, vf sq_lo, vi& n) {
  const vf t = vbroadcast(1.0f) / vfma(a, vbroadcast(0.75f), vbroadcast(1.0f));
  vf h = vbroadcast(-0.40212515f);
  h = vfma(h, t, vbroadcast(1.70234048f));
  h = vfma(h, t, vbroadcast(-2.87010598f));
  h = vfma(h, t, vbroadcast(2.19611526f));
  h = vfma(h, t, vbroadcast(-0.403201848f));
  h = vfma(h, t, vbroadcast(-0.273148119f));
  h = vfma(h, t, vbroadcast(-0.159116626f));
  h = vfma(h, t, vbroadcast(0.0573047288f));
  h = vfma(h, t, vbroadcast(0.305344343f));
  h = vfma(h, t, vbroadcast(0.423056483f));
  h = vfma(h, t, vbroadcast(0.423144668f));
  const vf th = t * h;
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

// sigmoid without overflow: e = exp(-|x|); x >= 0: 1 / (1 + e); x < 0: e / (1 + e), with e's
// 2^n applied last so that results down to the subnormals (x > -103.9) keep their precision.
static inline vf vsigmoid(vf x) {
  vi n;
  const vf q = vm_expm1_core<false>(vmax(vbroadcast(-120.0f), vbroadcast(0.0f) - vabs(x)), vf{}, n);
  const vf rd = vbroadcast(1.0f) / (vbroadcast(1.0f) + vm_exp_finish(q, n));
  return vselect(x < vbroadcast(0.0f), vm_scale(vfma(q, rd, rd), n), rd);
}

// silu = x * sigmoid(x), same scheme; x < -120 computes as -120 (result 0 either way), so that
// -inf gives the limit -0 instead of -inf * 0.
static inline vf vsilu(vf x) {
  vi n;
  const vf xn = vmax(vbroadcast(-120.0f), x);
  const vf q = vm_expm1_core<false>(vmax(vbroadcast(-120.0f), vbroadcast(0.0f) - vabs(x)), vf{}, n);
  const vf rd = vbroadcast(1.0f) / (vbroadcast(1.0f) + vm_exp_finish(q, n));
  return vselect(x < vbroadcast(0.0f), vm_scale(xn * vfma(q, rd, rd), n), x * rd);
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

// ---------------------------------------------------------------------------------------------
// double (float64 data): the C library, with the same edge behaviour as above.
static inline double vexp(double x) { return std::exp(x); }
static inline double vexpm1(double x) { return std::expm1(x); }
static inline double vlog1p(double x) { return std::log1p(x); }
static inline double vtanh(double x) { return std::tanh(x); }
static inline double verf(double x) { return std::erf(x); }
static inline double vprod_err(double, double, double) { return 0.0; }  // float64 needs none here
static inline double vlog1p_exp_negabs(double zh, double zl) {
  return std::log1p(std::exp(-std::fabs(zh + zl)));
}
static inline double vsigmoid(double x) {
  const double e = std::exp(-std::fabs(x));
  return x < 0 ? e / (1.0 + e) : 1.0 / (1.0 + e);
}
static inline double vsilu(double x) { return x == -__builtin_inf() ? -0.0 : x * vsigmoid(x); }
static inline double vgelu(double x) {
  return x == -__builtin_inf() ? -0.0 : 0.5 * x * std::erfc(-x * 0.70710678118654752440);
}

// Vectors of doubles (float64 data): the same C library formulas, lane by lane, so that a float64
// activation is the one above whichever lane computes it.
template <class Fn, class... Args>
static inline vd lanewise(Fn fn, Args... args) {
  vd r;
  for (int i = 0; i < kWidthD; ++i) r[i] = fn(args[i]...);
  return r;
}
static inline vd vexp(vd x) { return lanewise([](double v) { return vexp(v); }, x); }
static inline vd vexpm1(vd x) { return lanewise([](double v) { return vexpm1(v); }, x); }
static inline vd vlog1p(vd x) { return lanewise([](double v) { return vlog1p(v); }, x); }
static inline vd vtanh(vd x) { return lanewise([](double v) { return vtanh(v); }, x); }
static inline vd verf(vd x) { return lanewise([](double v) { return verf(v); }, x); }
static inline vd vprod_err(vd, vd, vd) { return vd{}; }
static inline vd vlog1p_exp_negabs(vd zh, vd zl) {
  return lanewise([](double h, double l) { return vlog1p_exp_negabs(h, l); }, zh, zl);
}
static inline vd vsigmoid(vd x) { return lanewise([](double v) { return vsigmoid(v); }, x); }
static inline vd vsilu(vd x) { return lanewise([](double v) { return vsilu(v); }, x); }
static inline vd vgelu(vd x) { return lanewise([](double v) { return vgelu(v); }, x); }
