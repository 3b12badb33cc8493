"""IEEE semantics (SPEC §2, §3): NaN and Inf stay inside their normalization group, in every
reduction layout the MVN planner has (rows, columns/lanes, several lane blocks, few large groups
split over threads, multi-axis); batch norm confines a NaN/Inf of the input to its element and of a
parameter to the elements that parameter reaches; where variance + epsilon is zero the output is
inf or NaN, never a finite number; a negative variance gives NaN, not an error.

(tests/test_batch_norm.py and tests/test_mvn.py hold the single-layout basics; this file sweeps the
layouts, dtypes, statistics outputs and conveniences.)"""

from __future__ import annotations

import numpy as np
import pytest

import simdnorm
from reference import (
    ACTIVATION_NAMES,
    BF16,
    DTYPES,
    F32,
    F64,
    apply_activation,
    batch_norm_terms,
    check_close,
    compute_dtype,
    dtype_id,
    f64,
    mvn_terms as _mvn_terms,
    normalize_axes,
)

bn = simdnorm.batch_normalization
mvn = simdnorm.mean_variance_normalization
DT = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
BAD = {"nan": np.nan, "inf": np.inf}


def mvn_terms(*args, **kw):
    """reference.mvn_terms with numpy's warnings about inf - inf silenced (they are the point here)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return _mvn_terms(*args, **kw)


def data(rng, shape, dtype, loc=1.5, scale=2.0):
    return rng.normal(loc, scale, size=shape).astype(dtype)


def group_mask(shape, axes, index):
    """True for every element in the same normalization group as `index` (equal kept coordinates)."""
    grids = np.indices(shape, sparse=True)
    m = np.ones(shape, bool)
    for d in range(len(shape)):
        if d not in axes:
            m &= grids[d] == index[d]
    return m


def stats_close(got, want, spread, rtol, what):
    """Statistics of the unaffected groups: within rtol * spread (per element)."""
    g, w = f64(got), np.asarray(want, np.float64)
    bad = ~(np.abs(g - w) <= rtol * spread)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off; got {g[bad][:4]} want {w[bad][:4]}"


# ----------------------------------------------------------------------------------------------
# MVN: a NaN / Inf stays inside its group, whatever the reduction layout
# ----------------------------------------------------------------------------------------------

# name: (shape, axes, index of the bad element, threads). The planner picks, from shape and axes:
MVN_LAYOUTS = {
    "rows": ((6, 37), (1,), (2, 11), 1),                  # groups along contiguous runs
    "columns": ((40, 33), (0,), (17, 5), 1),              # innermost kept dim: statistics per lane
    "columns_wide": ((20, 300), (0,), (3, 270), 1),       # more lanes than one kernel block (256)
    "columns_3d": ((3, 17, 24), (1,), (1, 9, 0), 1),      # kept outer dim + lanes
    "channels_last": ((2, 9, 9, 16), (1, 2), (1, 4, 8, 15), 1),  # instance norm on NHWC
    "multi_axis": ((4, 5, 6, 7), (0, 2), (3, 1, 0, 6), 1),
    "few_large_groups": ((2, 3 * 32768 + 5), (1,), (1, 70000), 2),  # blocks of each group on 2 threads
    "many_groups_threads": ((600, 130), (1,), (433, 7), 2),  # whole groups per thread
    "columns_threads": ((300, 520), (0,), (150, 300), 2),
}


@DT
@pytest.mark.parametrize("layout", list(MVN_LAYOUTS))
@pytest.mark.parametrize("bad", list(BAD))
def test_mvn_nonfinite_stays_in_its_group(rng, threads, dtype, layout, bad):
    shape, axes, index, nthreads = MVN_LAYOUTS[layout]
    threads(nthreads)
    x = data(rng, shape, dtype)
    x[index] = BAD[bad]
    y, mean, inv = mvn(x, axes, return_stats=True)
    z, zs, rmean, rinv = mvn_terms(x, axes)
    inside = group_mask(shape, axes, index)
    ctx = f"{layout} {dtype_id(dtype)} {bad}"
    # every other group: exactly as if the bad value were not there
    check_close(y[~inside], z[~inside], zs[~inside], dtype=dtype, context=f"outside the group: {ctx}")
    # its own group: NaN wherever the float64 reference is NaN (here: all of it)
    g = f64(y[inside])
    assert np.isnan(g[np.isnan(z[inside])]).all(), f"the bad group must be NaN: {ctx}"
    # the statistics of the other groups are untouched too
    ax = normalize_axes(axes, len(shape))
    kept_index = tuple(0 if d in ax else i for d, i in enumerate(index))
    other = np.ones(mean.shape, bool)
    other[kept_index] = False
    xs = f64(x)
    with np.errstate(invalid="ignore"):
        std = np.sqrt(np.mean((xs - rmean) ** 2, axis=ax, keepdims=True))
    rt = 4e-5 if compute_dtype(dtype) == F32 else 1e-11
    stats_close(mean[other], rmean[other], (np.abs(rmean) + std)[other], rt, f"mean {ctx}")
    stats_close(inv[other], rinv[other], np.abs(rinv[other]), 4 * rt, f"inv_std {ctx}")
    assert not np.isfinite(f64(inv[kept_index])), f"inv_std of the bad group is finite: {ctx}"


@pytest.mark.parametrize("layout", ["rows", "columns", "columns_wide", "channels_last", "columns_threads"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_mvn_overflow_rescue_stays_in_its_group(rng, threads, dtype, layout):
    # one group with values whose squares overflow float32 (the planner re-sums it scaled by 2^-100);
    # the other groups must not be re-summed at that scale (their squares would underflow to 0)
    shape, axes, index, nthreads = MVN_LAYOUTS[layout]
    threads(nthreads)
    x = data(rng, shape, F32)
    inside = group_mask(shape, axes, index)
    x = np.where(inside, x * 1e30, x).astype(dtype)
    y = mvn(x, axes)
    z, zs, _, _ = mvn_terms(x, axes)
    check_close(y, z, zs, dtype=dtype, context=f"{layout} {dtype_id(dtype)}")


@pytest.mark.parametrize("bad", list(BAD))
def test_conveniences_confine_nonfinite(rng, bad):
    x = data(rng, (3, 8, 5, 6), F32)
    x[1, 3, 2, 4] = BAD[bad]
    # layer_norm over (2, 3): group (n=1, c=3)
    y = simdnorm.layer_norm(x, axis=2)
    z, zs, _, _ = mvn_terms(x, (2, 3))
    m = group_mask(x.shape, (2, 3), (1, 3, 2, 4))
    check_close(y[~m], z[~m], zs[~m], dtype=F32, context="layer_norm")
    assert np.isnan(y[m]).all()
    # instance_norm channels-last (lanes path): group (n=1, c=4 of the last axis)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # (3, 5, 6, 8), C = 8 innermost
    y = simdnorm.instance_norm(xl, channel_axis=-1)
    z, zs, _, _ = mvn_terms(xl, (1, 2))
    m = group_mask(xl.shape, (1, 2), (1, 2, 4, 3))
    check_close(y[~m], z[~m], zs[~m], dtype=F32, context="instance_norm NHWC")
    assert np.isnan(y[m]).all()
    # group_norm, 4 groups of 2 channels, channels-last: channels 2 and 3 of sample 1 are one group
    y = simdnorm.group_norm(xl, 4, channel_axis=-1)
    m = np.zeros(xl.shape, bool)
    m[1, :, :, 2:4] = True
    assert np.isnan(y[m]).all()
    assert np.isfinite(y[~m]).all(), "group_norm: NaN left its group"
    # rms_norm: the sample's last-axis row
    y = simdnorm.rms_norm(x)
    m = group_mask(x.shape, (3,), (1, 3, 2, 4))
    z, zs, _, _ = mvn_terms(x, (3,), normalize_mean=False)
    check_close(y[~m], z[~m], zs[~m], dtype=F32, context="rms_norm")
    assert np.isnan(y[m][np.isnan(z[m])]).all()


# ----------------------------------------------------------------------------------------------
# batch norm: a bad input element stays in that element; a bad parameter in what it reaches
# ----------------------------------------------------------------------------------------------

def _layout(x, layout):
    if layout == "contiguous":
        return x
    if layout == "channels_last":
        return np.ascontiguousarray(np.moveaxis(x, 1, -1)).transpose(0, 3, 1, 2)
    if layout == "negative":
        buf = np.empty(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)[:, ::-1, :, ::-2]
        buf[...] = x
        return buf
    if layout == "unaligned":  # at an odd byte address
        raw = np.empty(x.nbytes + 1, np.uint8)[1:]
        a = np.ndarray(x.shape, x.dtype, buffer=raw)
        a[...] = x
        return a
    raise ValueError(layout)


BN_SHAPES = {"small": (2, 5, 7, 9), "threaded": (4, 6, 70, 97)}


@DT
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "negative", "unaligned"])
@pytest.mark.parametrize("size", list(BN_SHAPES))
def test_bn_nonfinite_input_stays_in_its_element(rng, threads, dtype, layout, size):
    threads(2)
    shape = BN_SHAPES[size]
    c = shape[1]
    x = data(rng, shape, dtype)
    spots = {(0, 1, 2, 3): np.nan, (1, 4, 6, 8): np.inf, (shape[0] - 1, c - 1, shape[2] - 1, 0): -np.inf}
    for i, v in spots.items():
        x[i] = v
    x = _layout(x, layout)
    mean = data(rng, c, dtype, 0.0, 1.0)
    var = rng.uniform(0.5, 2.0, c).astype(dtype)
    scale = data(rng, c, dtype, 0.0, 1.0)
    bias = data(rng, c, dtype, 0.0, 1.0)
    y = bn(x, mean, var, scale, bias)
    z, zs = batch_norm_terms(x, mean, var, scale, bias)
    m = np.zeros(shape, bool)
    for i in spots:
        m[i] = True
    check_close(y[~m], z[~m], zs[~m], dtype=dtype, context=f"{layout} {size}")
    g = f64(y)
    assert np.isnan(g[0, 1, 2, 3])
    for i in list(spots)[1:]:
        assert np.isinf(g[i]) and np.sign(g[i]) == np.sign(z[i]), (i, g[i], z[i])


@DT
@pytest.mark.parametrize("which", ["mean", "variance", "scale", "bias"])
@pytest.mark.parametrize("rule", ["per_channel", "full_size", "channels_last"])
def test_bn_nan_parameter_reaches_only_its_elements(rng, dtype, which, rule):
    shape = (3, 6, 5, 11)
    ca = -1 if rule == "channels_last" else 1
    c = shape[ca]
    x = data(rng, shape, dtype)
    pshape = shape if rule == "full_size" else (c,)
    p = {"mean": data(rng, pshape, dtype, 0.0, 1.0), "variance": rng.uniform(0.5, 2.0, pshape).astype(dtype),
         "scale": data(rng, pshape, dtype, 0.0, 1.0), "bias": data(rng, pshape, dtype, 0.0, 1.0)}
    m = np.zeros(shape, bool)
    if rule == "full_size":
        p[which][1, 2, 3, 4] = np.nan
        m[1, 2, 3, 4] = True
    else:
        p[which][2] = np.nan
        m[(slice(None),) * (ca % 4) + (2,)] = True
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca)
    z, zs = batch_norm_terms(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca)
    assert np.isnan(f64(y[m])).all(), f"NaN {which} must give NaN where it applies"
    check_close(y[~m], z[~m], zs[~m], dtype=dtype, context=f"NaN {which} {rule}")


# ----------------------------------------------------------------------------------------------
# variance + epsilon == 0 -> inf or NaN; < 0 -> NaN (never an error, never finite)
# ----------------------------------------------------------------------------------------------

@DT
@pytest.mark.parametrize("pdtype", ["same", "float32"])
@pytest.mark.parametrize("activation", [None, "identity", "linear"])
def test_bn_zero_and_negative_variance_full_size(rng, dtype, pdtype, activation):
    shape = (2, 3, 4, 13)
    pdt = dtype if pdtype == "same" else F32
    x = data(rng, shape, dtype)
    mean = data(rng, shape, pdt, 0.0, 1.0)
    var = rng.uniform(0.5, 2.0, shape).astype(pdt)
    zero = rng.random(shape) < 0.2
    neg = ~zero & (rng.random(shape) < 0.2)
    var[zero] = 0.0
    var[neg] = -rng.uniform(0.01, 3.0, neg.sum()).astype(pdt)
    var[0, 0, 0, 0] = -0.0  # negative zero is zero
    zero[0, 0, 0, 0], neg[0, 0, 0, 0] = True, False
    x[0, 0, 0, 1] = mean[0, 0, 0, 1]  # x == mean where var is 0: 0 * inf, NaN, still not finite
    var[0, 0, 0, 1] = 0.0
    zero[0, 0, 0, 1], neg[0, 0, 0, 1] = True, False
    y = f64(bn(x, mean, var, epsilon=0.0, activation=activation))
    assert not np.isfinite(y[zero]).any(), "variance + epsilon == 0 gave a finite number"
    assert np.isnan(y[neg]).all(), "variance + epsilon < 0 must give NaN"
    ok = ~zero & ~neg
    z, zs = batch_norm_terms(x, mean, var, epsilon=0.0)
    check_close(y[ok].astype(dtype), z[ok], zs[ok], dtype=dtype)


@DT
def test_bn_variance_cancelling_epsilon(dtype):
    # epsilon and -epsilon exactly representable: their sum is exactly zero
    x = np.linspace(-2, 2, 2 * 3 * 8).reshape(2, 3, 8).astype(dtype)
    var = np.array([-0.25, -0.25 - 2.0 ** -8, 1.0], dtype)
    y = f64(bn(x, np.zeros(3, dtype), var, epsilon=0.25))
    assert not np.isfinite(y[:, 0]).any()
    assert np.isnan(y[:, 1]).all()
    assert np.isfinite(y[:, 2]).all()
    # the tiniest negative variance with epsilon 0: NaN (float32/float64 subnormal)
    tiny = np.array([-np.finfo(np.float32).smallest_subnormal] * 3, F32)
    assert np.isnan(f64(bn(x, np.zeros(3, F32), tiny, epsilon=0.0))).all()


@DT
@pytest.mark.parametrize("layout", ["rows", "columns", "columns_wide", "multi_axis", "few_large_groups"])
@pytest.mark.parametrize("mode", ["inside", "outside", "rms"])
def test_mvn_constant_group_with_zero_epsilon_is_not_finite(rng, threads, dtype, layout, mode):
    shape, axes, index, nthreads = MVN_LAYOUTS[layout]
    threads(nthreads)
    x = data(rng, shape, dtype)
    inside = group_mask(shape, axes, index)
    const = 0.0 if mode == "rms" else 3.375  # rms: the second moment of zeros is zero
    x[inside] = const
    kw = dict(epsilon=0.0, epsilon_mode="outside" if mode == "outside" else "inside",
              normalize_mean=mode != "rms")
    y, _, inv = mvn(x, axes, return_stats=True, **kw)
    assert not np.isfinite(f64(y[inside])).any(), f"variance + epsilon == 0 gave finite output ({mode})"
    ax = normalize_axes(axes, len(shape))
    kept = tuple(0 if d in ax else i for d, i in enumerate(index))
    assert np.isinf(f64(inv[kept])), "1/sqrt(0) must be inf"
    z, zs, _, _ = mvn_terms(x, axes, **kw)
    check_close(y[~inside], z[~inside], zs[~inside], dtype=dtype, context=f"{layout} {mode}")
    # without variance normalization nothing is divided: finite (x - mean, or x)
    y2 = mvn(x, axes, normalize_variance=False, **{k: v for k, v in kw.items() if k != "epsilon_mode"})
    assert np.isfinite(f64(y2)).all()



# ----------------------------------------------------------------------------------------------
# every fused activation on NaN, +-inf and the edges of its vector math, on every ISA
# ----------------------------------------------------------------------------------------------

EDGE_VALUES = [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e30, -1e30, 120.0, -120.0, 104.0, -104.0, 89.0, -89.0,
               88.7, -88.7, 20.0, -20.0, 9.1, -9.1, 0.0, -0.0, 1e-45, -1e-45, 1e-38, 1.0, -1.0]


@pytest.mark.parametrize("act", ACTIVATION_NAMES)
def test_reference_activations_keep_nan(act):
    # The fuzz tests check groups made NaN by a NaN or inf input against this reference: a formula
    # that selects 0 for NaN (z > alpha ? z : 0) would fail the kernels' NaN there.
    assert np.isnan(apply_activation(np.array([np.nan, -np.nan]), act)).all()


@pytest.mark.parametrize("act", ACTIVATION_NAMES)
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_activation_of_nonfinite_and_extreme_values(isa, act, dtype):
    # x = z exactly (mean 0, variance 1, epsilon 0): the activation sees NaN, +-inf, values that
    # overflow exp, and signed zeros / subnormals. NaN must stay NaN; every other value must be the
    # activation's value there (its limit at +-inf). Under the sanitizer build this also checks the
    # vector math for undefined behaviour (integer overflow on NaN lanes, shifts ...).
    v = np.array(EDGE_VALUES * 3, np.float64)  # 78 values: full vectors, heads and tails
    if dtype == F32:
        v = v.astype(F32)
    x = v.reshape(1, 1, -1)
    y = f64(bn(x, np.zeros(1, dtype), np.ones(1, dtype), epsilon=0.0, activation=act)).ravel()
    z = f64(v)
    nan = np.isnan(z)
    assert np.isnan(y[nan]).all(), f"{act}: NaN in, not NaN out (isa={isa})"
    fin = np.isfinite(z)
    with np.errstate(invalid="ignore", over="ignore"):
        zs = np.abs(z)
    check_close(y[fin], z[fin], zs[fin], act, dtype=dtype, scale_floor=1.0, context=f"isa={isa}")
    # at +-inf the limit: the reference evaluated at +-1e300 (inf/inf and -inf*0 are NaN in numpy)
    for sign in (1.0, -1.0):
        i = np.flatnonzero(z == sign * np.inf)
        want = apply_activation(np.array([sign * 1e300]), act)[0]
        got = y[i]
        if abs(want) > 1e200:
            assert (got == np.sign(want) * np.inf).all(), f"{act}({sign * np.inf}) = {got[:1]}, want {want:+.0e} -> inf"
        else:
            assert np.allclose(got, want, rtol=1e-6, atol=1e-30), \
                f"{act}({sign * np.inf}) = {got[:1]}, want the limit {want} (isa={isa})"
