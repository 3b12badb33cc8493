"""float64 numpy reference implementations of every op and activation of SPEC §2-§5, and the
comparison helpers the tests share.

Nothing here imports simdnorm: the references follow the SPEC text (and DirectML's operator pages
it cites) directly, so that a test compares the package against an independent statement of the
math. Every reference computes in float64 from the exact values of its inputs (float16, bfloat16
and float32 convert to float64 exactly).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# erfc in float64, element by element (numpy has none, and scipy is not a test dependency)
_erfc = np.vectorize(math.erfc, otypes=[np.float64])

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = (F32, F16, BF16, F64)
DTYPE_IDS = {F32: "f32", F16: "f16", BF16: "bf16", F64: "f64"}


def dtype_id(dt) -> str:
    return DTYPE_IDS[np.dtype(dt)]


def compute_dtype(dt) -> np.dtype:
    """SPEC §1: computation in float32, float64 for float64 input."""
    return F64 if np.dtype(dt) == F64 else F32


def f64(a) -> np.ndarray:
    """Exact float64 copy of an array of any of the four element types."""
    return np.asarray(a).astype(np.float64)


# --------------------------------------------------------------------------------------------
# Activations (SPEC §5). Each entry: (defaults, function of float64 z and the parameters).
# Formulas are DirectML's operator definitions; clip, silu and hard_swish are ONNX's.
# --------------------------------------------------------------------------------------------


def _sigmoid(z):
    # stable for both signs; exp of a large positive argument never overflows here
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _silu(z):
    # z sigmoid(z); below -700, exp(z) is subnormal or 0 where z exp(z) is still representable
    # (silu(-747) = -2.8e-322): there z exp(z + 64) e^-64 / (1 + exp(z)), rounded once into the
    # subnormals (z + 64 is exact: the same binade)
    z = np.asarray(z, dtype=np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        out = z * _sigmoid(z)
        tail = np.isfinite(z) & (z < -700.0)
        if np.any(tail):
            zt = z[tail] if out.ndim else z
            v = zt * np.exp(zt + 64.0) * math.exp(-64.0) / (1.0 + np.exp(zt))
            if out.ndim:
                out[tail] = v
            else:
                out = v
    return out


def _softplus_base(t):
    return np.logaddexp(0.0, t)


ACTIVATIONS = {
    "identity": ({}, lambda z: z),
    "linear": ({"alpha": 1.0, "beta": 0.0}, lambda z, alpha, beta: alpha * z + beta),
    "relu": ({}, lambda z: np.maximum(z, 0.0)),
    "leaky_relu": ({"alpha": 0.01}, lambda z, alpha: np.where(z >= 0, z, alpha * z)),
    # written so that NaN stays NaN, as every activation keeps it (docs/ACCURACY.md)
    "thresholded_relu": ({"alpha": 1.0}, lambda z, alpha: np.where(z <= alpha, 0.0, z)),
    "elu": ({"alpha": 1.0}, lambda z, alpha: np.where(z > 0, z, alpha * np.expm1(np.minimum(z, 0.0)))),
    "celu": (
        {"alpha": 1.0},
        lambda z, alpha: np.maximum(z, 0.0) + np.minimum(0.0, alpha * np.expm1(np.minimum(z, 0.0) / alpha)),
    ),
    "scaled_elu": (
        {"alpha": 1.67326, "gamma": 1.0507},
        lambda z, alpha, gamma: gamma * np.where(z > 0, z, alpha * np.expm1(np.minimum(z, 0.0))),
    ),
    "sigmoid": ({}, _sigmoid),
    "hard_sigmoid": ({"alpha": 0.2, "beta": 0.5}, lambda z, alpha, beta: np.clip(alpha * z + beta, 0.0, 1.0)),
    "tanh": ({}, np.tanh),
    "scaled_tanh": ({"alpha": 1.0, "beta": 0.5}, lambda z, alpha, beta: alpha * np.tanh(beta * z)),
    "softplus": ({"steepness": 1.0}, lambda z, steepness: _softplus_base(steepness * z) / steepness),
    "parametric_softplus": ({"alpha": 1.0, "beta": 1.0}, lambda z, alpha, beta: alpha * _softplus_base(beta * z)),
    "softsign": ({}, lambda z: z / (1.0 + np.abs(z))),
    "shrink": (
        {"bias": 0.0, "threshold": 0.5},
        lambda z, bias, threshold: np.where(np.abs(z) <= threshold, 0.0, np.where(z > 0, z - bias, z + bias)),
    ),
    # 0.5 z (1 + erf(z / sqrt2)) written with erfc, which keeps its relative accuracy for large
    # negative z, where 1 + erf cancels
    "gelu": ({}, lambda z: 0.5 * z * _erfc(-z / math.sqrt(2.0))),
    "clip": ({"min": -math.inf, "max": math.inf}, lambda z, min, max: np.minimum(np.maximum(z, min), max)),
    "silu": ({}, _silu),
    "hard_swish": ({}, lambda z: z * np.clip(z / 6.0 + 0.5, 0.0, 1.0)),
}

ACTIVATION_NAMES = tuple(ACTIVATIONS)

# Non-default parameters for every activation that has any (chosen so that each parameter
# changes the result on data in [-8, 8], and none equals its default).
NONDEFAULT_PARAMS = {
    "linear": {"alpha": -1.75, "beta": 0.625},
    "leaky_relu": {"alpha": 0.3},
    "thresholded_relu": {"alpha": -0.4},
    "elu": {"alpha": 0.55},
    "celu": {"alpha": 2.5},
    "scaled_elu": {"alpha": 1.3, "gamma": 0.8},
    "hard_sigmoid": {"alpha": 0.35, "beta": 0.4},
    "scaled_tanh": {"alpha": 1.7, "beta": 0.66},
    "softplus": {"steepness": 3.0},
    "parametric_softplus": {"alpha": 0.75, "beta": 2.0},
    "shrink": {"bias": 0.25, "threshold": 0.9},
    "clip": {"min": -0.5, "max": 1.25},
}

# docs/ACCURACY.md's tolerances for an activation evaluated in float32 on a float32 value z, against
# the float64 formula with the same (double) parameters: |got - ref| <= rtol |ref| + atol. They
# keep a margin of at least 1.2x over its measured maximum errors (exp 0.99 ulp, expm1 1.44, log1p
# 0.83, tanh 1.33, erf 1.32, gelu's erfc tail up to 5.9). name: rtol; atol is FLT_MIN wherever a
# rounding can make the result subnormal (there a correctly rounded result can be far off
# relatively), plus ACT_COEF_ATOL_F32 (|alpha z| + |beta|) for linear and hard_sigmoid, where
# alpha z + beta may cancel. identity, relu, thresholded_relu and clip are exact: 0 and 0.
FLT_MIN = 1.2e-38
ACT_COEF_ATOL_F32 = 1.2e-7
ACT_RTOL_F32 = {name: 0.0 for name in ACTIVATION_NAMES}
ACT_RTOL_F32.update({"leaky_relu": 1.2e-7, "shrink": 1.2e-7, "scaled_tanh": 4e-7, "gelu": 6e-7})
for _n in ("elu", "celu", "scaled_elu", "sigmoid", "tanh", "softsign", "softplus", "parametric_softplus",
           "silu", "hard_swish"):
    ACT_RTOL_F32[_n] = 3e-7
ACT_EXACT = frozenset({"identity", "relu", "thresholded_relu", "clip"})

# Extra relative error allowed for the float32 path of each activation, on top of the op's own
# tolerance (which covers the float32 rounding of the normalize step before the activation): the
# rtol above for the activations built on the vectorized exp / expm1 / log1p / tanh / erf. The
# others (a multiply, a division or a selection) stay at 0: the op's tolerance covers them.
ACT_EXTRA_RTOL_F32 = {name: 0.0 for name in ACTIVATION_NAMES}
for _n in ("elu", "celu", "scaled_elu", "sigmoid", "tanh", "scaled_tanh", "softplus",
           "parametric_softplus", "gelu", "silu"):
    ACT_EXTRA_RTOL_F32[_n] = ACT_RTOL_F32[_n]


def activation_params(name: str, params: dict | None = None) -> dict:
    defaults, _ = ACTIVATIONS[name]
    p = dict(defaults)
    if params:
        unknown = set(params) - set(defaults)
        if unknown:
            raise KeyError(f"unknown parameters {unknown} for {name}")
        p.update(params)
    return p


def act_tolerance_f32(name: str, params: dict | None, z) -> tuple[float, np.ndarray]:
    """(rtol, atol per element) of the tolerances above for activation `name` on the float32
    values z."""
    z = np.asarray(z, dtype=np.float64)
    p = activation_params(name, params)
    if name in ACT_EXACT or (name == "shrink" and p["bias"] == 0.0):  # a selection, no arithmetic
        return 0.0, np.zeros(z.shape)
    atol = np.full(z.shape, FLT_MIN)
    if name in ("linear", "hard_sigmoid"):
        atol += ACT_COEF_ATOL_F32 * (np.abs(p["alpha"] * z) + abs(p["beta"]))
    return ACT_RTOL_F32[name], atol


def apply_activation(z, name: str | None = None, params: dict | None = None) -> np.ndarray:
    """float64 activation of z; name None means identity."""
    z = np.asarray(z, dtype=np.float64)
    if name is None:
        return z
    _, fn = ACTIVATIONS[name]
    kw = activation_params(name, params)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.asarray(fn(z, **kw), dtype=np.float64)
        # At z = +-inf the activation takes its limit (softsign(inf) = 1, gelu(-inf) = 0, ...), where
        # the formulas above give inf/inf or inf*0; the limit is the value far out on that side.
        limit_needed = np.isinf(z) & np.isnan(y)
        if limit_needed.any():
            far = np.asarray(fn(np.where(z > 0, 1e300, -1e300), **kw), dtype=np.float64)
            y = np.where(limit_needed, far, y)
    return y


# --------------------------------------------------------------------------------------------
# Batch normalization (SPEC §2)
# --------------------------------------------------------------------------------------------


def bn_param(p, x_shape, channel_axis=1, default=None):
    """Broadcast a batch-norm parameter to x_shape (float64) by SPEC §2's two rules.

    Returns None for p None (caller applies the default)."""
    if p is None:
        return None
    p = f64(p)
    nd = len(x_shape)
    if p.ndim == nd and all(s == d or s == 1 for s, d in zip(p.shape, x_shape)):
        return np.broadcast_to(p, x_shape)
    if nd > 1 and p.ndim == 1:
        ax = channel_axis % nd
        if p.shape[0] == x_shape[ax]:
            shape = [1] * nd
            shape[ax] = p.shape[0]
            return np.broadcast_to(p.reshape(shape), x_shape)
    raise ValueError(f"parameter of shape {p.shape} does not fit input {tuple(x_shape)}")


def batch_norm_terms(x, mean, variance, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1):
    """Return (z, zscale): the float64 pre-activation value and, per element, the magnitude of the
    terms a float32 evaluation adds up (|x*A| + |mean*A| + |bias| with A = scale/sqrt(var+eps)),
    which bounds its rounding error in units of the compute epsilon."""
    xs = f64(x)
    shp = xs.shape
    m = bn_param(mean, shp, channel_axis)
    v = bn_param(variance, shp, channel_axis)
    s = bn_param(scale, shp, channel_axis)
    b = bn_param(bias, shp, channel_axis)
    s = np.ones(shp) if s is None else s
    b = np.zeros(shp) if b is None else b
    # Divided before scaled, so that no factor overflows where the result does not (scale 1e300
    # over a standard deviation of 1e-150, say).
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        std = np.sqrt(v + epsilon)
        z = (xs - m) / std * s + b
        zscale = (np.abs(xs) + np.abs(m)) / std * np.abs(s) + np.abs(b)
    return z, zscale


def batch_norm_ref(x, mean, variance, scale=None, bias=None, *, epsilon=1e-5, activation=None,
                   act_params=None, channel_axis=1):
    z, _ = batch_norm_terms(x, mean, variance, scale, bias, epsilon=epsilon, channel_axis=channel_axis)
    return apply_activation(z, activation, act_params)


# --------------------------------------------------------------------------------------------
# Mean-variance normalization (SPEC §3) and the conveniences (SPEC §4)
# --------------------------------------------------------------------------------------------


def normalize_axes(axes, ndim):
    if isinstance(axes, (int, np.integer)):
        axes = (int(axes),)
    out = tuple(sorted(int(a) % ndim for a in axes))
    assert len(set(out)) == len(out)
    return out


def mvn_param(p, x_shape):
    """numpy broadcasting without enlarging x (SPEC §3)."""
    if p is None:
        return None
    p = f64(p)
    if p.ndim > len(x_shape) or np.broadcast_shapes(p.shape, tuple(x_shape)) != tuple(x_shape):
        raise ValueError(f"parameter of shape {p.shape} does not fit input {tuple(x_shape)}")
    return np.broadcast_to(p, x_shape)


def mvn_terms(x, axes, scale=None, bias=None, *, normalize_mean=True, normalize_variance=True,
              epsilon=1e-5, epsilon_mode="inside"):
    """Return (z, zscale, mean, inv_std): float64 pre-activation, the per-element magnitude that
    bounds a float32 evaluation's error (|x|*|inv_std*scale| + |bias|), and the statistics with the
    reduced dims kept (mean None without normalize_mean, inv_std None without normalize_variance)."""
    xs = f64(x)
    axes = normalize_axes(axes, xs.ndim)
    s = mvn_param(scale, xs.shape)
    b = mvn_param(bias, xs.shape)
    s = np.ones(xs.shape) if s is None else s
    b = np.zeros(xs.shape) if b is None else b
    # The statistics in extended precision (80-bit on x86), so that the reference's own rounding
    # (a mean of identical float64 values that is not exactly that value) does not show up as a
    # variance of 1e-33 and move inv_std by 1e-11 relative where epsilon is tiny.
    xl = xs.astype(np.longdouble)
    if normalize_mean:
        mean_l = xl.mean(axis=axes, keepdims=True)
        mean = mean_l.astype(np.float64)
        centered = xs - mean
        centered_l = xl - mean_l
    else:
        mean = None
        centered = xs
        centered_l = xl
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if normalize_variance:
            m2 = np.mean(centered_l * centered_l, axis=axes, keepdims=True).astype(np.float64)
            if epsilon_mode == "inside":
                inv = 1.0 / np.sqrt(m2 + epsilon)
            elif epsilon_mode == "outside":
                inv = 1.0 / (np.sqrt(m2) + epsilon)
            else:
                raise ValueError(epsilon_mode)
            k = inv * s
        else:
            inv = None
            k = s
        z = centered * k + b
        # error sources of a float32 evaluation: x itself, the mean (~eps*(|mean| + std)), the
        # second moment (~eps relative, scaling the centered value)
        spread = np.abs(xs) + (np.abs(mean) if mean is not None else 0.0)
        if normalize_variance:
            spread = spread + np.sqrt(m2)
        zscale = spread * np.abs(k) + np.abs(b)
    return z, zscale, mean, inv


def mvn_ref(x, axes, scale=None, bias=None, *, normalize_mean=True, normalize_variance=True,
            epsilon=1e-5, epsilon_mode="inside", activation=None, act_params=None):
    z, _, mean, inv = mvn_terms(x, axes, scale, bias, normalize_mean=normalize_mean,
                                normalize_variance=normalize_variance, epsilon=epsilon,
                                epsilon_mode=epsilon_mode)
    return apply_activation(z, activation, act_params), mean, inv


def layer_norm_axes(ndim, axis=-1):
    return tuple(range(axis % ndim, ndim))


def instance_norm_axes(ndim, channel_axis=1):
    c = channel_axis % ndim
    return tuple(a for a in range(1, ndim) if a != c) if c != 0 else tuple(range(1, ndim))


def channel_param(p, ndim, channel_axis):
    """(C,) parameter of instance/group norm reshaped to broadcast along channel_axis."""
    if p is None:
        return None
    p = f64(p)
    shape = [1] * ndim
    shape[channel_axis % ndim] = p.shape[0]
    return p.reshape(shape)


def group_norm_ref(x, num_groups, scale=None, bias=None, *, epsilon=1e-5, channel_axis=1):
    """ONNX GroupNormalization-21; returns (out, mean (N, G), inv_std (N, G))."""
    xs = f64(x)
    nd = xs.ndim
    c_ax = channel_axis % nd
    C = xs.shape[c_ax]
    G = num_groups
    # move channels to axis 1, split into (G, C/G), normalize over everything but N and G
    xm = np.moveaxis(xs, c_ax, 1)
    n = xm.shape[0]
    xg = xm.reshape((n, G, C // G) + xm.shape[2:])
    red = tuple(range(2, xg.ndim))
    mean = xg.mean(axis=red, keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=red, keepdims=True)
    inv = 1.0 / np.sqrt(var + epsilon)
    y = ((xg - mean) * inv).reshape(xm.shape)
    y = np.moveaxis(y, 1, c_ax)
    s = channel_param(scale, nd, c_ax)
    b = channel_param(bias, nd, c_ax)
    if s is not None:
        y = y * s
    if b is not None:
        y = y + b
    return y, mean.reshape(n, G), inv.reshape(n, G)


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

# relative error of the arithmetic before the activation (compute type), and of the result
# after its single rounding to the output type (about one ulp of the output type)
COMPUTE_RTOL = {F32: 1e-5, F16: 1e-5, BF16: 1e-5, F64: 1e-12}
OUTPUT_RTOL = {F32: 1e-5, F16: 1e-3, BF16: 8e-3, F64: 1e-12}


def round_to(a, dtype) -> np.ndarray:
    """float64 value of a rounded once to dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(a, dtype=np.float64).astype(dtype).astype(np.float64)


# Where the activations that are not monotonic take their minimum (no parameters move it).
ACTIVATION_MINIMA = {"gelu": (-0.7517915485,), "silu": (-1.2784645428,), "hard_swish": (-1.5,)}


def jump_sides(name, params=None):
    """The points just past each jump of an activation, on its linear piece's side: over a window
    across a jump, the piece's values run to its end there, which neither end of the window nor
    its middle gives (thresholded_relu with alpha < 0: the window's z - d gives 0, its values run
    down to alpha)."""
    if name == "thresholded_relu":
        return (np.nextafter(activation_params(name, params)["alpha"], np.inf),)
    if name == "shrink":
        t = activation_params(name, params)["threshold"]
        return (np.nextafter(t, np.inf), np.nextafter(-t, -np.inf))
    return ()


def allowed_interval(z, zscale, dtype, activation=None, act_params=None, *, extra_rtol=0.0,
                     scale_floor=None):
    """Per element, the interval [lo, hi] a correct result may take.

    The pre-activation value may be off by d = COMPUTE_RTOL * zscale; the interval covers the
    activation over [z - d, z + d] (evaluated at both ends and the middle, so jumps and kinks are
    covered, at the minimum of gelu, silu and hard_swish and just past a jump where those lie inside), widened by OUTPUT_RTOL (rounding to the output type) relative to each value, plus an
    absolute floor OUTPUT_RTOL * max|ref| (the "output scale")."""
    dt = np.dtype(dtype)
    z = np.asarray(z, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        d = COMPUTE_RTOL[dt] * np.asarray(zscale, np.float64)
        d = np.where(np.isfinite(d), d, 0.0)
        ref = apply_activation(z, activation, act_params)
        f_lo = apply_activation(z - d, activation, act_params)
        f_hi = apply_activation(z + d, activation, act_params)
        lo = np.minimum(np.minimum(f_lo, f_hi), ref)
        hi = np.maximum(np.maximum(f_lo, f_hi), ref)
        # the non-monotonic activations' minima inside [z - d, z + d] (clipped there otherwise)
        for zc in ACTIVATION_MINIMA.get(activation, ()) + jump_sides(activation, act_params):
            f_c = apply_activation(np.clip(zc, z - d, z + d), activation, act_params)
            lo = np.minimum(lo, f_c)
            hi = np.maximum(hi, f_c)
    rt = OUTPUT_RTOL[dt]
    if dt != F64 and activation is not None:
        rt += ACT_EXTRA_RTOL_F32.get(activation, 0.0)
    rt += extra_rtol
    finite = np.isfinite(ref)
    if scale_floor is None:
        scale_floor = float(np.max(np.abs(ref[finite]), initial=0.0))
    atol = rt * scale_floor
    lo = round_to(lo, dt)
    hi = round_to(hi, dt)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = lo - rt * np.abs(lo) - atol
        hi = hi + rt * np.abs(hi) + atol
    return ref, lo, hi


def check_close(got, z, zscale, activation=None, act_params=None, *, dtype=None, extra_rtol=0.0,
                scale_floor=None, context=""):
    """Assert that got (any float dtype) matches activation(z) within the tolerances above.

    Where the reference is NaN the result must be NaN; where it is +-inf, equal."""
    got = np.asarray(got)
    dt = np.dtype(dtype if dtype is not None else got.dtype)
    g = f64(got)
    assert g.shape == np.shape(z), f"shape {g.shape} != reference {np.shape(z)} {context}"
    ref, lo, hi = allowed_interval(z, zscale, dt, activation, act_params, extra_rtol=extra_rtol,
                                   scale_floor=scale_floor)
    nan_ref = np.isnan(ref)
    inf_ref = np.isinf(ref)
    fin = ~nan_ref & ~inf_ref
    with np.errstate(invalid="ignore"):
        ok = np.where(fin, (g >= lo) & (g <= hi), False)
    ok |= nan_ref & np.isnan(g)
    ok |= inf_ref & (g == ref)
    if not ok.all():
        bad = np.argwhere(~ok)
        n_bad = len(bad)
        lines = []
        for idx in bad[:8]:
            t = tuple(int(i) for i in idx)
            lines.append(f"  at {t}: got {g[t]!r} ref {ref[t]!r} allowed [{lo[t]!r}, {hi[t]!r}] z={np.asarray(z)[t]!r}")
        raise AssertionError(
            f"{n_bad} of {g.size} elements out of tolerance ({dtype_id(dt)}, activation={activation}"
            f" {act_params or ''}) {context}\n" + "\n".join(lines))


def assert_like_empty_like(out, x):
    """SPEC §6: dtype, shape and memory order of np.empty_like(x) (strides compared on dims of
    size > 1, where they mean something)."""
    x = np.asarray(x)
    want = np.empty_like(x)
    assert isinstance(out, np.ndarray), type(out)
    assert out.dtype == x.dtype, (out.dtype, x.dtype)
    assert out.shape == x.shape, (out.shape, x.shape)
    if out.size:
        for d, (so, sw) in enumerate(zip(out.strides, want.strides)):
            if out.shape[d] > 1:
                assert so == sw, f"strides {out.strides} != empty_like's {want.strides} (shape {out.shape})"


def check_bn(got, x, mean, variance, scale=None, bias=None, *, epsilon=1e-5, activation=None,
             act_params=None, channel_axis=1, context=""):
    """Assert that got is batch_normalization of these arguments (SPEC §2) within tolerance."""
    z, zs = batch_norm_terms(x, mean, variance, scale, bias, epsilon=epsilon, channel_axis=channel_axis)
    check_close(got, z, zs, activation, act_params, dtype=np.asarray(x).dtype, context=context)


def check_mvn(got, x, axes, scale=None, bias=None, *, normalize_mean=True, normalize_variance=True,
              epsilon=1e-5, epsilon_mode="inside", activation=None, act_params=None, stats=None,
              extra_rtol=0.0, stat_rtol=None, inv_rtol=None, context=""):
    """Assert that got is mean_variance_normalization of these arguments (SPEC §3); with stats =
    (mean, inv_std) as returned by return_stats=True, check those too (dtype, kept dims, values)."""
    x = np.asarray(x)
    z, zs, mean, inv = mvn_terms(x, axes, scale, bias, normalize_mean=normalize_mean,
                                 normalize_variance=normalize_variance, epsilon=epsilon,
                                 epsilon_mode=epsilon_mode)
    check_close(got, z, zs, activation, act_params, dtype=x.dtype, extra_rtol=extra_rtol, context=context)
    if stats is not None:
        check_stats(stats, x, axes, mean, inv, stat_rtol=stat_rtol, inv_rtol=inv_rtol, context=context)


def check_stats(stats, x, axes, mean, inv, *, stat_rtol=None, inv_rtol=None, context=""):
    """mean within stat_rtol * (|mean| + std); inv_std within inv_rtol relative (default 4 *
    stat_rtol); both of the compute dtype, shaped like x with the reduced dims kept as 1."""
    got_mean, got_inv = stats
    x = np.asarray(x)
    ct = compute_dtype(x.dtype)
    rt = COMPUTE_RTOL[ct] if stat_rtol is None else stat_rtol
    irt = 4 * rt if inv_rtol is None else inv_rtol
    ax = normalize_axes(axes, x.ndim)
    kept = tuple(1 if d in ax else s for d, s in enumerate(x.shape))
    xs = f64(x)
    if _stat_returned(got_mean, mean, "mean", "normalize_mean", ct, kept, context) and xs.size:
        std = np.sqrt(np.mean((xs - mean) ** 2, axis=ax, keepdims=True))
        err = np.abs(f64(got_mean) - mean)
        tol = rt * (np.abs(mean) + std) + 1e-300
        assert (err <= tol).all(), (
            f"mean off by up to {np.max(err / tol):.3g} x tolerance {context}\n got {got_mean.ravel()[:6]}"
            f" want {mean.ravel()[:6]}")
    if _stat_returned(got_inv, inv, "inv_std", "normalize_variance", ct, kept, context) and xs.size:
        g = f64(got_inv)
        with np.errstate(invalid="ignore"):
            rel = np.abs(g - inv) / np.abs(inv)
            ok = (rel <= irt) | (np.isinf(inv) & (g == inv))
        assert ok.all(), f"inv_std relative error up to {np.nanmax(rel):.3g} {context}"


def _stat_returned(got, want, name, flag, ct, kept, context):
    """Whether a statistic is returned as it must be: None where the reference has none (its flag
    off), else an array of the compute dtype ct and shape kept. True where the values are to be
    compared."""
    if want is None:
        assert got is None, f"{name} must be None without {flag} {context}"
        return False
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == ct, f"{name} dtype {got.dtype}, want {ct} {context}"
    assert got.shape == kept, (got.shape, kept)
    return True
