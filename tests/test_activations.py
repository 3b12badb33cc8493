"""Fused activations (SPEC §5) through batch_normalization: every activation with its DirectML
defaults and with non-default parameters, every dtype, every ISA, over a range of pre-activation
values that reaches the saturated and overflowing regions of exp/tanh/erf; the reference itself
against hand-derived values."""

from __future__ import annotations

import math

import numpy as np
import pytest

import simdnorm
from cases import DT, act_arg, bits, bn_param_1d, make_input, make_out, odd_sizes
from reference import (
    ACTIVATION_NAMES,
    ACTIVATIONS,
    BF16,
    F16,
    F32,
    NONDEFAULT_PARAMS,
    act_tolerance_f32,
    apply_activation,
    check_bn,
    check_close,
    dtype_id,
)

bn = simdnorm.batch_normalization
ACT = pytest.mark.parametrize("name", ACTIVATION_NAMES)


# ----------------------------------------------------------------------------------------------
# the reference on hand-derived values
# ----------------------------------------------------------------------------------------------

LN2, LN3 = math.log(2.0), math.log(3.0)
HAND = [
    ("identity", {}, [-2.5, 3.0], [-2.5, 3.0]),
    ("linear", {"alpha": 2.0, "beta": 1.0}, [3.0, -1.0], [7.0, -1.0]),
    ("linear", {}, [3.0], [3.0]),
    ("relu", {}, [-2.0, 3.0], [0.0, 3.0]),
    ("leaky_relu", {"alpha": 0.1}, [-2.0, 3.0], [-0.2, 3.0]),
    ("leaky_relu", {}, [-2.0], [-0.02]),
    ("thresholded_relu", {"alpha": 1.0}, [1.0, 1.5, -3.0], [0.0, 1.5, 0.0]),
    ("thresholded_relu", {"alpha": -0.5}, [-0.25, -1.0], [-0.25, 0.0]),
    ("elu", {"alpha": 2.0}, [-LN2, 1.5], [-1.0, 1.5]),
    ("celu", {"alpha": 2.0}, [-2.0 * LN2, 1.5], [-1.0, 1.5]),
    ("scaled_elu", {"alpha": 2.0, "gamma": 3.0}, [-LN2, 1.0], [-3.0, 3.0]),
    ("scaled_elu", {}, [1.0], [1.0507]),
    ("sigmoid", {}, [0.0, LN3, -LN3], [0.5, 0.75, 0.25]),
    ("hard_sigmoid", {}, [1.0, 10.0, -10.0], [0.7, 1.0, 0.0]),
    ("hard_sigmoid", {"alpha": 0.5, "beta": 0.25}, [1.0], [0.75]),
    ("tanh", {}, [math.atanh(0.5)], [0.5]),
    ("scaled_tanh", {"alpha": 2.0, "beta": 0.5}, [2.0 * math.atanh(0.5)], [1.0]),
    ("scaled_tanh", {}, [2.0 * math.atanh(0.5)], [0.5]),
    ("softplus", {"steepness": 2.0}, [LN3 / 2.0], [LN2]),
    ("softplus", {}, [0.0], [LN2]),
    ("parametric_softplus", {"alpha": 2.0, "beta": 1.0}, [0.0], [2.0 * LN2]),
    ("parametric_softplus", {"alpha": 1.0, "beta": 0.5}, [2.0 * LN3], [2.0 * LN2]),
    ("softsign", {}, [3.0, -1.0], [0.75, -0.5]),
    ("shrink", {"bias": 0.25, "threshold": 0.5}, [1.0, -1.0, 0.4, -0.4], [0.75, -0.75, 0.0, 0.0]),
    ("shrink", {}, [0.75, -0.25], [0.75, 0.0]),
    ("gelu", {}, [0.0, 1.0, -1.0], [0.0, 0.8413447460685429, -0.15865525393145707]),
    ("clip", {"min": -1.0, "max": 2.0}, [3.0, -3.0, 0.5], [2.0, -1.0, 0.5]),
    ("clip", {}, [1e30, -1e30], [1e30, -1e30]),
    ("silu", {}, [LN3, 0.0], [0.75 * LN3, 0.0]),
    ("hard_swish", {}, [3.0, -3.0, 1.5, 0.0], [3.0, 0.0, 1.125, 0.0]),
]


@pytest.mark.parametrize("name,params,x,want", HAND, ids=[f"{h[0]}-{i}" for i, h in enumerate(HAND)])
def test_reference_activation_values(name, params, x, want):
    np.testing.assert_allclose(apply_activation(np.array(x), name, params), want, rtol=1e-12, atol=1e-15)


def test_reference_covers_every_activation():
    assert set(ACTIVATIONS) == {h[0] for h in HAND}
    assert len(ACTIVATIONS) == 20
    for name, params in NONDEFAULT_PARAMS.items():
        defaults = ACTIVATIONS[name][0]
        assert set(params) == set(defaults), name
        assert all(params[k] != defaults[k] for k in params), name


# ----------------------------------------------------------------------------------------------
# the package against the reference
# ----------------------------------------------------------------------------------------------


def activation_inputs(dtype, params=None):
    """Pre-activation values: a dense grid over [-12, 12], the parameters' breakpoints and their
    neighbours, and large magnitudes that overflow exp (in float32) if handled naively."""
    grid = list(np.linspace(-12.0, 12.0, 193))
    special = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 6.0, -6.0]
    for v in (params or {}).values():
        if np.isfinite(v):
            special += [v, -v, v * 1.01, v * 0.99, -v * 1.01, -v * 0.99]
    large = [20.0, -20.0, 30.0, -30.0, 45.0, -45.0, 88.0, -88.0, 90.0, -90.0, 100.0, -100.0,
             1000.0, -1000.0, 1e4, -1e4]
    if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64), BF16):
        large += [1e6, -1e6, 1e20, -1e20]
    v = np.array(grid + special + large, dtype=np.float64)
    return v.astype(dtype)


def run_identity_bn(x, activation, out=None):
    """batch_normalization with mean 0, variance 1, epsilon 0: the pre-activation value is x
    exactly, so the activation is tested directly."""
    c = x.shape[1]
    return bn(x, np.zeros(c, x.dtype), np.ones(c, x.dtype), epsilon=0.0, activation=activation, out=out)


ACT_VARIANTS = [(n, "default") for n in ACTIVATION_NAMES] + [(n, "nondefault") for n in NONDEFAULT_PARAMS]


@DT
@pytest.mark.parametrize("name,params_kind", ACT_VARIANTS, ids=[f"{n}-{k}" for n, k in ACT_VARIANTS])
def test_activation_exact_inputs(isa, dtype, name, params_kind):
    params = NONDEFAULT_PARAMS.get(name) if params_kind == "nondefault" else None
    v = activation_inputs(dtype, params)
    x = v.reshape(1, 1, -1)
    y = run_identity_bn(x, act_arg(name, params))
    assert y.dtype == x.dtype and y.shape == x.shape
    z = x.astype(np.float64)
    check_close(y, z, np.abs(z), name, params, dtype=dtype, context=f"isa={isa}")


@pytest.mark.parametrize("name,params_kind", ACT_VARIANTS, ids=[f"{n}-{k}" for n, k in ACT_VARIANTS])
def test_activation_float32_within_documented_bounds(isa, name, params_kind):
    """float32, pre-activation value exact (z = x): the result differs from the float64 formula by the
    activation's own error only, which must stay within docs/ACCURACY.md's tolerance for it
    (reference.act_tolerance_f32), on the grid above, a dense sweep and magnitudes 1e-6 .. 1e4."""
    params = NONDEFAULT_PARAMS.get(name) if params_kind == "nondefault" else None
    mags = np.geomspace(1e-6, 1e4, 401)
    v = np.concatenate([activation_inputs(F32, params), np.linspace(-20.0, 20.0, 4001).astype(F32),
                        mags.astype(F32), -mags.astype(F32)])
    x = v.reshape(1, 1, -1)
    got = run_identity_bn(x, act_arg(name, params)).astype(np.float64).ravel()
    z = v.astype(np.float64)
    ref = apply_activation(z, name, params)
    rtol, atol = act_tolerance_f32(name, params, z)
    with np.errstate(invalid="ignore"):
        ok = np.where(np.isfinite(ref), np.abs(got - ref) <= rtol * np.abs(ref) + atol, got == ref)
    bad = np.flatnonzero(~ok)
    lines = [f"  z={z[i]!r} ({z[i].hex()}): got {got[i]!r} ref {ref[i]!r} rel.err "
             f"{abs(got[i] - ref[i]) / abs(ref[i]) if ref[i] else math.inf:.3g}" for i in bad[:8]]
    assert not bad.size, (f"{bad.size} of {z.size} outside rtol {rtol:g} + atol (isa={isa}, {name} "
                          f"{params or ''})\n" + "\n".join(lines))


@DT
@ACT
def test_activation_after_batch_norm(isa, rng, dtype, name):
    params = NONDEFAULT_PARAMS.get(name)
    shape = (2, 3, 29)
    x = make_input(rng, shape, dtype, scale=3.0)
    p = {n: bn_param_1d(rng, n, shape, 1, dtype) for n in ("mean", "variance", "scale", "bias")}
    out = make_out(shape, dtype)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation=act_arg(name, params), out=out)
    assert r is out
    check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params,
             context=f"isa={isa}")
    # channels-last too (vector coefficients)
    xl = make_input(rng, (2, 29, 3), dtype, scale=3.0)
    y = bn(xl, p["mean"], p["variance"], p["scale"], p["bias"], activation=act_arg(name, params), channel_axis=-1)
    check_bn(y, xl, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params,
             channel_axis=-1, context=f"isa={isa}")


# silu where exp(z) is subnormal or 0 but z exp(z) is not (float64): z / (1 + exp(-z)) to 50
# digits (mpmath), rounded to double
SILU_F64_TAIL = [(-700.5, -4.189127381107174e-302), (-720.3, -1.0844214511701e-310), (-744.0, -5.706e-321),
                 (-746.9964956915102, -2.87e-322), (-750.0, -1.5e-323), (-760.0, -0.0)]


def test_silu_float64_tail_where_exp_underflows(isa):
    """The kernels' float64 silu and the reference's down to the subnormals (the reference once
    gave -0.0 at -747, where silu is -2.87e-322: a fuzzer's false failure)."""
    z = np.array([t[0] for t in SILU_F64_TAIL])
    want = np.array([t[1] for t in SILU_F64_TAIL])
    np.testing.assert_array_max_ulp(apply_activation(z, "silu", {}), want, maxulp=2)
    ones = np.ones(z.size)
    got = bn(z[None, :], np.zeros(z.size), ones, ones, np.zeros(z.size), epsilon=0.0, activation="silu")
    np.testing.assert_array_max_ulp(got[0], want, maxulp=2)


@ACT
def test_name_and_object_agree(rng, name):
    x = make_input(rng, (2, 3, 40), F32)
    y1 = run_identity_bn(x, name)
    y2 = run_identity_bn(x, simdnorm.Activation(name))
    np.testing.assert_array_equal(bits(y1), bits(y2))
    # explicit defaults equal the implicit ones
    defaults = ACTIVATIONS[name][0]
    if defaults and all(np.isfinite(list(defaults.values()))):
        y3 = run_identity_bn(x, simdnorm.Activation(name, **defaults))
        np.testing.assert_array_equal(bits(y1), bits(y3))


def test_none_and_identity_agree_with_plain(rng):
    x = make_input(rng, (2, 3, 40), F32)
    y0 = run_identity_bn(x, None)
    np.testing.assert_array_equal(bits(y0), bits(x))  # mean 0, var 1, eps 0: y = x exactly
    np.testing.assert_array_equal(bits(run_identity_bn(x, "identity")), bits(y0))
    np.testing.assert_array_equal(bits(run_identity_bn(x, simdnorm.Activation("linear"))), bits(y0))


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_activation_odd_sizes(isa, dtype):
    # every activation on every innermost length 1..67: vector bodies and masked tails agree with
    # the reference (each element position sees a different value)
    for name in ACTIVATION_NAMES:
        params = NONDEFAULT_PARAMS.get(name)
        act = act_arg(name, params)
        for n in odd_sizes():
            x = np.linspace(-7.0, 7.0, n).astype(dtype).reshape(1, 1, n)
            y = run_identity_bn(x, act)
            z = x.astype(np.float64)
            check_close(y, z, np.abs(z), name, params, dtype=dtype, context=f"n={n} isa={isa}")


@pytest.mark.parametrize("steepness", [0.25, 1.0, 7.5, 40.0])
def test_softplus_any_positive_steepness(steepness):
    x = activation_inputs(F32).reshape(1, 1, -1)
    y = run_identity_bn(x, simdnorm.Activation("softplus", steepness=steepness))
    z = x.astype(np.float64)
    check_close(y, z, np.abs(z), "softplus", {"steepness": steepness}, dtype=F32)


@pytest.mark.parametrize("name,params", [
    ("softplus", {"steepness": 1e-20}), ("softplus", {"steepness": 1e-30}), ("softplus", {"steepness": 3e-3}),
    ("parametric_softplus", {"alpha": 1e30, "beta": 1e-5}), ("parametric_softplus", {"alpha": -1e20, "beta": -3.0}),
], ids=lambda v: str(v))
def test_softplus_family_where_exp_leaves_float32(name, params):
    """c * log1p(exp(z)) with z far below 0 and c large (1 / steepness, alpha): exp(z) is subnormal
    or 0 in float32 where the result is a normal float (softplus(1e-20) of -1.1e22: 1.69e-28, which
    came out 0). Every z from -200 to 30."""
    k = params.get("steepness", params.get("beta"))
    x = (np.linspace(-200.0, 30.0, 2301) / k).astype(F32).reshape(1, 1, -1)
    y = run_identity_bn(x, simdnorm.Activation(name, **params))
    z = x.astype(np.float64)
    check_close(y, z, np.abs(z), name, params, dtype=F32)


F32_MAX = float(np.finfo(np.float32).max)
MIN_DIVISOR = 2.0 ** -128 + 2.0 ** -149  # the smallest float32 whose reciprocal is finite in float32
LIMIT_PARAMS = [
    ("celu", {"alpha": MIN_DIVISOR}), ("celu", {"alpha": -MIN_DIVISOR}),
    ("softplus", {"steepness": MIN_DIVISOR}), ("softplus", {"steepness": F32_MAX}),
    ("scaled_tanh", {"alpha": F32_MAX, "beta": -F32_MAX}), ("hard_sigmoid", {"alpha": F32_MAX, "beta": -F32_MAX}),
    ("shrink", {"bias": F32_MAX, "threshold": F32_MAX}), ("thresholded_relu", {"alpha": -F32_MAX}),
    ("scaled_elu", {"alpha": F32_MAX, "gamma": 1.0}),
]


@pytest.mark.parametrize("dtype", [F32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("name,params", LIMIT_PARAMS, ids=[f"{n}-{list(p.values())}" for n, p in LIMIT_PARAMS])
def test_parameters_at_the_float32_limits(isa, dtype, name, params):
    """The extreme parameters still accepted (SPEC section 5: finite in float32; a divisor with a
    finite reciprocal there) give the float64 formula's values and never NaN (celu's alpha rounding
    to 0, or softplus's steepness to 0 or inf, did); those beyond are refused (test_descriptors)."""
    x = activation_inputs(dtype).reshape(1, 1, -1)
    y = run_identity_bn(x, simdnorm.Activation(name, **params))
    assert not np.isnan(y).any()
    z = x.astype(np.float64)
    check_close(y, z, np.abs(z), name, params, dtype=dtype, context=f"isa={isa}")


def test_clip_one_sided(rng):
    x = make_input(rng, (1, 1, 100), F32, scale=4.0)
    z = x.astype(np.float64)
    for params in ({"min": 0.5}, {"max": -0.25}, {"min": -1.0, "max": -1.0}):
        y = run_identity_bn(x, simdnorm.Activation("clip", **params))
        check_close(y, z, np.abs(z), "clip", params, dtype=F32)


# ----------------------------------------------------------------------------------------------
# rejected activations (SPEC §5): ValueError naming the valid choices
# ----------------------------------------------------------------------------------------------


def test_unknown_activation_name():
    x = np.ones((1, 2, 3), F32)
    with pytest.raises(ValueError, match="relu"):
        bn(x, np.zeros(2, F32), np.ones(2, F32), activation="not_an_activation")
    with pytest.raises(ValueError, match="relu"):
        simdnorm.Activation("reluu")


def test_unknown_or_bad_activation_parameter():
    with pytest.raises(ValueError, match="alpha"):
        simdnorm.Activation("elu", beta=1.0)
    with pytest.raises(ValueError):
        simdnorm.Activation("relu", alpha=0.5)
    for s in (0.0, -1.0):
        with pytest.raises(ValueError):
            simdnorm.Activation("softplus", steepness=s)


@pytest.mark.parametrize("name, params, z, inside", [
    # (fuzz_space seed 3505138873 case 4436: a float32 MVN pre-activation -0.28596 whose window
    # reached below alpha = -0.4; the kernel's -0.28640, inside the window, was refused)
    ("thresholded_relu", {"alpha": -0.4}, -0.28596, -0.2864),
    ("shrink", {"bias": 0.9, "threshold": 0.5}, 0.52, 0.5005 - 0.9),
])
def test_allowed_interval_covers_a_window_across_a_jump(name, params, z, inside):
    from reference import COMPUTE_RTOL, allowed_interval

    zscale = np.array([0.15 / COMPUTE_RTOL[np.dtype(np.float32)]])  # a window of z +- 0.15
    _, lo, hi = allowed_interval(np.array([z]), zscale, np.float32, name, params)
    assert lo[0] <= inside <= hi[0], (lo, hi)
