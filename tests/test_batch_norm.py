"""batch_normalization (SPEC §2, §6) against the float64 reference: every dtype, 1-8 dims, both
parameter-shape rules, mixed parameter dtypes, optional scale/bias, epsilon, out=, in place,
overlap, zero-size dims and the NaN/inf rules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import simdnorm
from cases import (
    DT,
    PARAM_NAMES,
    bits,
    bn_param_1d,
    bn_param_same_rank,
    broadcast_masks,
    make_input,
    make_out,
    param_values,
    rand_values,
)
from reference import (
    BF16,
    F16,
    F32,
    F64,
    assert_like_empty_like,
    batch_norm_ref,
    check_bn,
    dtype_id,
)

bn = simdnorm.batch_normalization


def random_shape(rng, ndim, max_elems=4096, lo=1, hi=7):
    shape = [int(rng.integers(lo, hi + 1)) for _ in range(ndim)]
    while int(np.prod(shape)) > max_elems:
        i = int(np.argmax(shape))
        shape[i] = max(1, shape[i] // 2)
    return tuple(shape)


def params_1d(rng, shape, channel_axis, dtype, names=PARAM_NAMES):
    return {n: bn_param_1d(rng, n, shape, channel_axis, dtype) for n in names}


# ----------------------------------------------------------------------------------------------
# the reference itself, on hand-derived cases
# ----------------------------------------------------------------------------------------------


def test_reference_hand_derived():
    # N=1, C=2: var+eps = 4 and 9, so the normalized values are (5-1)/2 = 2 and (11-2)/3 = 3
    x = np.array([[5.0, 11.0]])
    got = batch_norm_ref(x, np.array([1.0, 2.0]), np.array([3.0, 8.0]), np.array([0.5, -1.0]),
                         np.array([1.0, 1.0]), epsilon=1.0)
    np.testing.assert_array_equal(got, [[2.0, -2.0]])
    # channels last, same numbers: channel_axis=-1 on a (1, 1, 2) input
    got = batch_norm_ref(x.reshape(1, 1, 2), np.array([1.0, 2.0]), np.array([3.0, 8.0]),
                         epsilon=1.0, channel_axis=-1)
    np.testing.assert_array_equal(got, [[[2.0, 3.0]]])
    # same-rank rule, (1, 2, 1) parameters on a (1, 2, 2) input; relu on top
    x = np.array([[[5.0, -3.0], [11.0, 2.0]]])
    got = batch_norm_ref(x, np.array([1.0, 2.0]).reshape(1, 2, 1), np.array([3.0, 8.0]).reshape(1, 2, 1),
                         epsilon=1.0, activation="relu")
    np.testing.assert_array_equal(got, [[[2.0, 0.0], [3.0, 0.0]]])
    # 1-D input: the same-rank rule applies (elementwise parameters)
    got = batch_norm_ref(np.array([3.0, 4.0]), np.array([1.0, 0.0]), np.array([0.0, 3.0]), epsilon=1.0)
    np.testing.assert_array_equal(got, [2.0, 2.0])


# ----------------------------------------------------------------------------------------------
# dtypes x ranks, 1-D parameters along channel_axis=1
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("ndim", range(1, 9))
def test_dtypes_and_ranks(rng, dtype, ndim):
    shape = random_shape(rng, ndim, max_elems=3000, hi=6 if ndim < 6 else 3)
    x = make_input(rng, shape, dtype)
    if ndim == 1:
        # a 1-D input takes same-rank (elementwise) parameters
        p = {n: param_values(rng, n, shape, dtype) for n in PARAM_NAMES}
    else:
        p = params_1d(rng, shape, 1, dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=1e-3)
    assert_like_empty_like(y, x)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=1e-3)
    # the same through out=: returns out, fills every element
    out = make_out(shape, dtype)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=1e-3, out=out)
    assert r is out
    np.testing.assert_array_equal(bits(out), bits(y))


@DT
def test_one_dim_input_broadcast_parameter(rng, dtype):
    # 1-D input, parameters of shape (1,) (same-rank rule, broadcast) and mixed with shape (n,)
    x = make_input(rng, (37,), dtype)
    mean = param_values(rng, "mean", (1,), dtype)
    var = param_values(rng, "variance", (37,), dtype)
    scale = param_values(rng, "scale", (1,), dtype)
    bias = param_values(rng, "bias", (37,), dtype)
    y = bn(x, mean, var, scale, bias)
    check_bn(y, x, mean, var, scale, bias)


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
@pytest.mark.parametrize("channel_axis", [0, 1, 2, 3, -1, -2, -3, -4])
def test_channel_axis_1d_params(rng, dtype, channel_axis):
    shape = (3, 4, 5, 6)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, channel_axis, dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=channel_axis)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=channel_axis)


@pytest.mark.parametrize("channel_axis", [0, 1, 2, -1])
def test_channel_axis_on_a_cube(rng, channel_axis):
    # every dim has the same size: only the channel_axis tells where the 1-D parameters go
    x = make_input(rng, (6, 6, 6), F32)
    p = params_1d(rng, x.shape, channel_axis, F32)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=channel_axis)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=channel_axis)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("ndim", [2, 3, 5])
def test_channels_last_axis(rng, dtype, ndim):
    shape = random_shape(rng, ndim, max_elems=2000, lo=2)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, -1, dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)
    # channel_axis = ndim - 1 is the same thing
    y2 = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ndim - 1)
    np.testing.assert_array_equal(bits(y2), bits(y))


# ----------------------------------------------------------------------------------------------
# same-rank parameters (DirectML's rule): each parameter broadcast differently
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("ndim", [2, 3, 4, 6, 8])
def test_same_rank_broadcast(rng, dtype, ndim):
    shape = random_shape(rng, ndim, max_elems=2500, lo=2, hi=5)
    x = make_input(rng, shape, dtype)
    for _ in range(3):
        masks = broadcast_masks(ndim, rng)
        p = {n: bn_param_same_rank(rng, n, shape, m, dtype) for n, m in zip(PARAM_NAMES, masks)}
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
        check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"],
                 context=f"masks={masks} shapes={[v.shape for v in p.values()]}")


@DT
def test_params_as_large_as_input(rng, dtype):
    shape = (2, 3, 4, 5)
    x = make_input(rng, shape, dtype)
    p = {n: param_values(rng, n, shape, dtype) for n in PARAM_NAMES}
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="tanh")
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="tanh")


def test_full_size_param_with_1d_params_mixed(rng):
    # one parameter full size, one per channel 1-D, one same-rank (1, C, 1, 1), one scalar-like
    shape = (2, 3, 4, 5)
    x = make_input(rng, shape, F32)
    mean = param_values(rng, "mean", shape, F32)
    var = param_values(rng, "variance", (3,), F32)
    scale = param_values(rng, "scale", (1, 3, 1, 1), F32)
    bias = param_values(rng, "bias", (1, 1, 1, 1), F32)
    y = bn(x, mean, var, scale, bias)
    check_bn(y, x, mean, var, scale, bias)


def test_two_dim_input_with_1d_params_per_column(rng):
    # (N, C) input, channel_axis=1: the oneDNN/PyTorch BatchNorm1d case
    x = make_input(rng, (17, 9), F32)
    p = params_1d(rng, (17, 9), 1, F32)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"])


# ----------------------------------------------------------------------------------------------
# parameter dtypes, optional scale / bias, epsilon
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16, F64, F32], ids=dtype_id)
def test_param_dtypes_each_independent(rng, dtype):
    shape = (2, 5, 3, 7)
    x = make_input(rng, shape, dtype)
    for combo in itertools.product([dtype, F32], repeat=4):
        p = {n: bn_param_1d(rng, n, shape, 1, dt) for n, dt in zip(PARAM_NAMES, combo)}
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
        assert y.dtype == dtype
        check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"],
                 context=f"param dtypes {[dtype_id(c) for c in combo]}")
    # and with the same-rank rule
    for combo in [(F32, dtype, F32, dtype), (dtype, F32, dtype, F32)]:
        p = {n: bn_param_same_rank(rng, n, shape, (False, True, True, False), dt)
             for n, dt in zip(PARAM_NAMES, combo)}
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
        check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"])


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bfloat16_output_rounds_to_nearest_even(isa, rng, layout):
    # mul exactly 1 (var + epsilon == 1): out = float32(x + bias), rounded once more to bfloat16;
    # numpy adds float32 correctly rounded and ml_dtypes rounds to nearest even. The bias's low 16
    # bits are drawn at random and as exact ties (0x8000, with x = 0), both parities of the kept bit.
    shape = (3, 5, 37, 11)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, shape)
    x[rng.random(shape) < 0.2] = 0
    x = x.astype(BF16)
    x.reshape(-1)[:4] = [np.inf, -np.inf, np.nan, BF16.type(3.3895e38)]
    bias_bits = rng.integers(0x3E000000, 0x42000000, 5, dtype=np.uint64).astype(np.uint32)
    bias_bits[:2] = (bias_bits[:2] & 0xFFFF0000) | 0x8000
    bias_bits[0] |= 0x10000  # an odd kept bit: the tie rounds up; bias 1 keeps an even one (down)
    bias_bits[1] &= ~np.uint32(0x10000)
    bias = bias_bits.view(np.float32)
    epsilon = 2.0**-20
    mean = np.zeros(5, np.float32)
    var = np.full(5, 1 - epsilon, np.float32)
    if layout == "nhwc":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    y = bn(x, mean, var, None, bias, epsilon=epsilon)
    expect = (x.astype(np.float32) + bias.reshape(1, 5, 1, 1)).astype(BF16)
    nan = np.isnan(expect.astype(np.float32))
    assert np.array_equal(np.isnan(y.astype(np.float32)), nan)
    assert np.array_equal(y.view(np.uint16)[~nan], expect.view(np.uint16)[~nan])


def test_float32_params_keep_their_precision(rng):
    # float32 parameters with a float16 input must not be rounded to float16 first: a mean that
    # float16 cannot represent gives a visibly different result
    x = np.full((1, 1, 8), 1000.0, dtype=F16)
    mean = np.array([999.7], dtype=F32)  # float16 would round it to 999.5 or 1000.0
    var = np.array([1e-2 - 1e-5], dtype=F32)
    y = bn(x, mean, var)
    check_bn(y, x, mean, var)
    assert abs(float(y[0, 0, 0]) - 3.0) < 0.01


@DT
@pytest.mark.parametrize("which", ["none", "scale", "bias"])
def test_scale_bias_optional(rng, dtype, which):
    shape = (3, 4, 11)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, 1, dtype)
    scale = p["scale"] if which == "scale" else None
    bias = p["bias"] if which == "bias" else None
    if which == "bias":
        y = bn(x, p["mean"], p["variance"], bias=bias)
    else:
        y = bn(x, p["mean"], p["variance"], scale)
    check_bn(y, x, p["mean"], p["variance"], scale, bias)
    # None is the same as passing 1 and 0 explicitly
    ones = np.ones(4, dtype)
    zeros = np.zeros(4, dtype)
    y2 = bn(x, p["mean"], p["variance"], ones if scale is None else scale, zeros if bias is None else bias)
    np.testing.assert_allclose(y2.astype(np.float64), y.astype(np.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("epsilon", [0.0, 1e-7, 1e-3, 0.5, 10.0])
def test_epsilon(rng, dtype, epsilon):
    shape = (2, 3, 13)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, 1, dtype)
    p["variance"] = np.array([0.01, 1.0, 3.0], dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=epsilon)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], epsilon=epsilon)


def test_negative_variance_made_positive_by_epsilon(rng):
    # variance -0.5 with epsilon 1: variance + epsilon = 0.5 > 0, a valid (finite) result
    x = make_input(rng, (2, 2, 9), F32)
    mean = np.array([0.5, -0.5], F32)
    var = np.array([-0.5, 0.25], F32)
    y = bn(x, mean, var, epsilon=1.0)
    assert np.isfinite(y).all()
    check_bn(y, x, mean, var, epsilon=1.0)


# ----------------------------------------------------------------------------------------------
# out=, in place, overlap
# ----------------------------------------------------------------------------------------------


@DT
def test_out_returns_out_and_writes_everything(rng, dtype):
    shape = (3, 5, 7, 2)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, 1, dtype)
    out = make_out(shape, dtype)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], out=out)
    assert r is out
    assert not np.isnan(out.astype(np.float64)).any()
    check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"])


@DT
def test_in_place(rng, dtype):
    shape = (2, 4, 6, 5)
    x = make_input(rng, shape, dtype)
    x0 = x.copy()
    p = params_1d(rng, shape, 1, dtype)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="relu", out=x)
    assert r is x
    check_bn(x, x0, p["mean"], p["variance"], p["scale"], p["bias"], activation="relu")


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
def test_in_place_strided_view(rng, dtype):
    base = make_input(rng, (4, 6, 10), dtype)
    x = base[::-1, :, 1::2]  # negative and strided, written in place
    x0 = x.copy()
    untouched = base[:, :, 0::2].copy()
    p = params_1d(rng, x.shape, 1, dtype)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], out=x)
    assert r is x
    check_bn(x, x0, p["mean"], p["variance"], p["scale"], p["bias"])
    np.testing.assert_array_equal(bits(base[:, :, 0::2]), bits(untouched))


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("shift", [1, -1, 7, -16, 33])
def test_overlap_out_shifted_from_input(rng, dtype, shift):
    shape = (2, 3, 40)
    n = int(np.prod(shape))
    buf = rand_values(rng, (n + abs(shift),), dtype)
    if shift > 0:
        x = buf[shift:].reshape(shape)
        out = buf[:n].reshape(shape)
    else:
        x = buf[:n].reshape(shape)
        out = buf[-shift:].reshape(shape)
    x0 = x.copy()
    p = params_1d(rng, shape, 1, dtype)
    want = bn(x0, p["mean"], p["variance"], p["scale"], p["bias"], activation="sigmoid")
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="sigmoid", out=out)
    assert r is out
    check_bn(out, x0, p["mean"], p["variance"], p["scale"], p["bias"], activation="sigmoid",
             context=f"shift={shift}")
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64),
                               rtol=2e-3 if dtype == F16 else 1e-6)


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_overlap_out_reversed_input(rng, dtype):
    # out is the input read backwards: every element is written where another one is read
    x = make_input(rng, (64,), dtype)
    x0 = x.copy()
    mean = param_values(rng, "mean", (1,), dtype)
    var = param_values(rng, "variance", (1,), dtype)
    bn(x, mean, var, out=x[::-1])
    check_bn(x[::-1], x0, mean, var)


@pytest.mark.parametrize("which", PARAM_NAMES)
@pytest.mark.parametrize("full", [False, True], ids=["per_channel", "full_size"])
def test_overlap_out_with_parameter(rng, which, full):
    dtype = F32
    shape = (2, 4, 16)
    n = int(np.prod(shape))
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, 1, dtype) if not full else {
        k: param_values(rng, k, shape, dtype) for k in PARAM_NAMES}
    p0 = {k: v.copy() for k, v in p.items()}
    # the chosen parameter lives in the same buffer as out, shifted by 3 elements
    psize = p[which].size
    buf = np.empty(n + psize + 3, dtype)
    out = buf[:n].reshape(shape)
    pv = buf[3:3 + psize].reshape(p[which].shape)
    pv[...] = p[which]
    out[...] = np.nan
    pv[...] = p[which]
    args = dict(p)
    args[which] = pv
    r = bn(x, args["mean"], args["variance"], args["scale"], args["bias"], out=out)
    assert r is out
    check_bn(out, x, p0["mean"], p0["variance"], p0["scale"], p0["bias"], context=f"{which} overlaps out")


def test_out_same_buffer_different_strides(rng):
    # out and x are two different views of one buffer (transpose of a square): full overlap
    a = make_input(rng, (1, 24, 24), F32)
    x0 = a.copy()
    mean = param_values(rng, "mean", (1,), F32)
    var = param_values(rng, "variance", (1,), F32)
    out = a.transpose(0, 2, 1)
    bn(a, mean, var, channel_axis=0, out=out)
    check_bn(out, x0, mean, var, channel_axis=0)


# ----------------------------------------------------------------------------------------------
# zero-size dims
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 3, 0), (0,), (2, 3, 0, 5), (0, 0, 0, 0, 1, 2, 0, 1)])
def test_zero_size(dtype, shape):
    x = np.empty(shape, dtype)
    nd = len(shape)
    if nd == 1:
        mean = var = np.empty((0,), dtype)
    else:
        mean = np.zeros((shape[1],), dtype)
        var = np.ones((shape[1],), dtype)
    y = bn(x, mean, var)
    assert y.shape == shape and y.dtype == dtype and y.size == 0
    out = np.empty(shape, dtype)
    assert bn(x, mean, var, out=out) is out
    # same-rank parameters of a zero-size input
    m = np.zeros((1,) * nd, dtype)
    y = bn(x, m, m + 1, m + 1, m, activation="gelu")
    assert y.shape == shape and y.size == 0


def test_zero_size_channel_axis(rng):
    # C = 0: 1-D parameters of length 0
    x = np.empty((3, 0, 5), F32)
    e = np.empty((0,), F32)
    y = bn(x, e, e, e, e)
    assert y.shape == (3, 0, 5)
    x = np.empty((3, 5, 0), F32)
    y = bn(x, e, e, channel_axis=-1)
    assert y.shape == (3, 5, 0)


# ----------------------------------------------------------------------------------------------
# NaN / inf (SPEC §2)
# ----------------------------------------------------------------------------------------------


@DT
def test_variance_plus_epsilon_negative_or_zero(rng, dtype):
    shape = (3, 4, 21)
    x = make_input(rng, shape, dtype)
    mean = np.array([0.5, -0.25, 0.125, 1.0], dtype)
    # channel 0: var+eps < 0; channel 1: var+eps == 0; channels 2, 3: valid
    var = np.array([-1.0, 0.0, 2.0, 0.5], dtype)
    scale = np.array([1.0, -2.0, 1.5, 0.75], dtype)
    bias = np.array([0.5, 0.5, -1.0, 2.0], dtype)
    y = bn(x, mean, var, scale, bias, epsilon=0.0).astype(np.float64)
    assert np.isnan(y[:, 0]).all(), "variance + epsilon < 0 must give NaN"
    assert not np.isfinite(y[:, 1]).any(), "variance + epsilon == 0 must give inf or NaN"
    check_bn(y[:, 2:].astype(dtype), x[:, 2:], mean[2:], var[2:], scale[2:], bias[2:], epsilon=0.0)
    # x == mean exactly where variance is zero: 0 * inf is NaN, still never finite
    x2 = np.array(x)
    x2[:, 1] = mean[1]
    y = bn(x2, mean, var, scale, bias, epsilon=0.0).astype(np.float64)
    assert not np.isfinite(y[:, 1]).any()


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
def test_negative_sum_with_nonzero_epsilon(dtype):
    x = np.ones((2, 2, 5), dtype)
    var = np.array([-0.5, -1e-3], dtype)
    y = bn(x, np.zeros(2, dtype), var, epsilon=1e-4).astype(np.float64)
    assert np.isnan(y).all()


@DT
def test_nan_and_inf_input_propagate(rng, dtype):
    shape = (2, 3, 17)
    x = np.array(make_input(rng, shape, dtype))
    x[0, 0, 3] = np.nan
    x[1, 2, 5] = np.inf
    x[1, 1, 16] = -np.inf
    p = params_1d(rng, shape, 1, dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"])
    assert np.isnan(y[0, 0, 3].astype(np.float64))
    assert np.isinf(y[1, 2, 5].astype(np.float64)) and np.isinf(y[1, 1, 16].astype(np.float64))


# ----------------------------------------------------------------------------------------------
# output type and order (SPEC §6), no copy of the input, input not modified
# ----------------------------------------------------------------------------------------------


@DT
def test_input_and_params_not_modified(rng, dtype):
    shape = (2, 3, 9)
    x = make_input(rng, shape, dtype)
    p = params_1d(rng, shape, 1, dtype)
    before = [bits(a).copy() for a in (x, *p.values())]
    bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="elu")
    after = [bits(a) for a in (x, *p.values())]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


@DT
def test_result_is_a_new_array(rng, dtype):
    x = make_input(rng, (2, 3, 4), dtype)
    p = params_1d(rng, x.shape, 1, dtype)
    y = bn(x, p["mean"], p["variance"])
    assert not np.shares_memory(y, x)
    assert y.flags.writeable


# ----------------------------------------------------------------------------------------------
# the tolerance itself: a float32 simulation of a correct implementation passes, small errors fail
# ----------------------------------------------------------------------------------------------


def _simulated_bn(x, mean, var, scale, bias, eps, act, params, channel_axis=1):
    """What a correct implementation computes: fold in the compute type, one multiply-add, the
    activation in the compute type, one rounding to the output type."""
    from reference import apply_activation, bn_param, compute_dtype

    ct = compute_dtype(x.dtype)
    shp = x.shape
    m, v, s, b = (bn_param(p, shp, channel_axis).astype(ct) for p in (mean, var, scale, bias))
    a = (s / np.sqrt(v + ct.type(eps))).astype(ct)
    bb = (b - m * a).astype(ct)
    z = (x.astype(ct) * a + bb).astype(ct)
    return apply_activation(z, act, params).astype(ct).astype(x.dtype)


@DT
@pytest.mark.parametrize("act", ["none", "sigmoid", "thresholded_relu", "shrink", "softplus", "gelu"])
def test_checker_accepts_correct_and_rejects_wrong(rng, dtype, act):
    from reference import NONDEFAULT_PARAMS

    name = None if act == "none" else act
    params = NONDEFAULT_PARAMS.get(act)
    shape = (4, 6, 50)
    x = make_input(rng, shape, dtype, scale=3.0)
    p = params_1d(rng, shape, 1, dtype)
    y = _simulated_bn(x, p["mean"], p["variance"], p["scale"], p["bias"], 1e-5, name, params)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params)
    # one unwritten (NaN) element fails
    bad = y.copy()
    bad[1, 2, 3] = np.nan
    with pytest.raises(AssertionError):
        check_bn(bad, x, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params)
    # a wrong epsilon (0.25 instead of 1e-5 on variances in [0.25, 4]) fails
    wrong = _simulated_bn(x, p["mean"], p["variance"], p["scale"], p["bias"], 0.25, name, params)
    with pytest.raises(AssertionError):
        check_bn(wrong, x, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params)
    # channel parameters applied along the wrong axis fail
    xt = make_input(rng, (6, 6, 50), dtype, scale=3.0)
    yt = _simulated_bn(xt, p["mean"], p["variance"], p["scale"], p["bias"], 1e-5, name, params, channel_axis=0)
    with pytest.raises(AssertionError):
        check_bn(yt, xt, p["mean"], p["variance"], p["scale"], p["bias"], activation=name, act_params=params)
    # a relative error a few times the tolerance on a single element fails
    off = y.astype(np.float64)
    i = np.unravel_index(np.argmax(np.abs(off)), off.shape)
    off[i] *= 1 + 40 * {F32: 1e-5, F16: 1e-3, BF16: 8e-3, F64: 1e-12}[np.dtype(dtype)]
    with pytest.raises(AssertionError):
        check_bn(off.astype(dtype), x, p["mean"], p["variance"], p["scale"], p["bias"], activation=name,
                 act_params=params)


@DT
@pytest.mark.parametrize("which", ["both", "scale", "bias", "neither"])
def test_many_channels_compact_parameters_as_strided(rng, dtype, which):
    """(N, C) with thousands of channels: compact float32 parameters take one float32 fold (shift and
    bias copied, the multiplier in the unit's loop); the same values as strided views take the
    general fold. Bitwise the same, and within the reference's tolerance, with absent parameters, a
    few channels whose scale / std leaves float32's range (the four-array form) and NaN / inf
    statistics among ordinary ones."""
    n, c = 3, 2053
    x = rand_values(rng, (n, c), dtype)
    pdt = F64 if dtype == F64 else F32
    mean = rand_values(rng, (c,), pdt)
    var = np.abs(rand_values(rng, (c,), pdt)) + np.asarray(0.25, pdt)
    scale = rand_values(rng, (c,), pdt) if which in ("both", "scale") else None
    bias = rand_values(rng, (c,), pdt) if which in ("both", "bias") else None
    if scale is not None:
        scale[7], var[7] = 1e30, 1e-20  # (scale / std past float32: every channel takes the four arrays)
    mean[11], var[12] = np.nan, np.inf
    strided = [None if a is None else np.repeat(a, 2)[::2] for a in (mean, var, scale, bias)]
    assert strided[0].strides == (2 * mean.itemsize,)
    got = bn(x, mean, var, scale, bias)
    np.testing.assert_array_equal(bits(got), bits(bn(x, *strided)))
    ok = np.ones(c, bool)
    ok[[11, 12]] = False
    ok[7] = dtype not in (F16, BF16)  # (its outputs, ~1e33, overflow 16-bit floats)
    check_bn(got[:, ok], x[:, ok], mean[ok], var[ok], None if scale is None else scale[ok],
             None if bias is None else bias[ok])
    assert np.isnan(got[:, 11]).all() and (got[:, 12] == np.asarray(0 if bias is None else bias[12], dtype)).all()
