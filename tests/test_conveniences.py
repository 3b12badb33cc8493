"""layer_norm, rms_norm, instance_norm, group_norm (SPEC §4): against the float64 reference (itself
cross-checked with ONNX's reference evaluator when onnx is installed), channels-first and
channels-last, activation / out / return_stats, and agreement with the MVN call they route onto."""

from __future__ import annotations

import numpy as np
import pytest

import simdnorm
from cases import (
    DT,
    act_arg,
    bits,
    channels_last_nhwc,
    make_out,
    offset_input,
    scale_bias_values,
)
from reference import (
    BF16,
    F16,
    F32,
    F64,
    NONDEFAULT_PARAMS,
    assert_like_empty_like,
    channel_param,
    check_close,
    check_mvn,
    check_stats,
    compute_dtype,
    dtype_id,
    group_norm_ref,
    instance_norm_axes,
    layer_norm_axes,
    mvn_ref,
)


# ----------------------------------------------------------------------------------------------
# the references against ONNX's own reference implementation
# ----------------------------------------------------------------------------------------------


def _onnx_run(op, inputs, attrs, opset):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    names = [f"i{k}" for k in range(len(inputs))]
    ttype = TensorProto.DOUBLE if inputs[0].dtype == np.float64 else TensorProto.FLOAT
    node = helper.make_node(op, names, ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, ttype, None) for n in names],
                          [helper.make_tensor_value_info("y", ttype, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(m).run(None, dict(zip(names, inputs)))[0]


def test_references_match_onnx(rng):
    # ONNX's evaluator is float64 numpy too, but not always in the same order of operations
    # (e.g. epsilon rounded to float32): agreement to 1e-7 still separates every semantic choice
    # (epsilon inside/outside, population vs sample variance, axes, groups) by orders of magnitude
    x = rng.normal(1.0, 2.0, size=(2, 6, 3, 5))
    s = rng.normal(size=(3, 5))
    b = rng.normal(size=(3, 5))
    want = _onnx_run("LayerNormalization", [x, s, b], {"axis": -2, "epsilon": 1e-3}, 17)
    got, _, _ = mvn_ref(x, layer_norm_axes(4, -2), s, b, epsilon=1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)

    sc, bc = rng.normal(size=6), rng.normal(size=6)
    want = _onnx_run("GroupNormalization", [x, sc, bc], {"num_groups": 3, "epsilon": 1e-3, "stash_type": 11}, 21)
    got, _, _ = group_norm_ref(x, 3, sc, bc, epsilon=1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)

    s5 = rng.normal(size=(5,))
    want = _onnx_run("RMSNormalization", [x, s5], {"axis": -1, "epsilon": 1e-3}, 23)
    got, _, _ = mvn_ref(x, layer_norm_axes(4, -1), s5, normalize_mean=False, epsilon=1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)

    want = _onnx_run("InstanceNormalization", [x, sc, bc], {"epsilon": 1e-3}, 6)
    got, _, _ = mvn_ref(x, instance_norm_axes(4, 1), channel_param(sc, 4, 1), channel_param(bc, 4, 1), epsilon=1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)

    x32 = x.astype(np.float32)  # ONNX's MVN: epsilon 1e-9 added to the standard deviation
    want = _onnx_run("MeanVarianceNormalization", [x32], {"axes": [0, 2, 3]}, 13)
    got, _, _ = mvn_ref(x32, (0, 2, 3), epsilon=1e-9, epsilon_mode="outside")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_group_norm_reference_hand_derived():
    # N=1, C=4, two groups of two channels, one spatial element each
    x = np.array([[1.0, 3.0, 10.0, 20.0]])
    y, m, inv = group_norm_ref(x, 2, epsilon=0.0)
    np.testing.assert_array_equal(y, [[-1.0, 1.0, -1.0, 1.0]])
    np.testing.assert_array_equal(m, [[2.0, 15.0]])
    np.testing.assert_array_equal(inv, [[1.0, 0.2]])
    # channels last: the same numbers along the last axis
    y, m, inv = group_norm_ref(x.reshape(1, 1, 4), 2, np.array([1.0, 2.0, 3.0, 4.0]), epsilon=0.0, channel_axis=-1)
    np.testing.assert_array_equal(y, [[[-1.0, 2.0, -3.0, 4.0]]])


# ----------------------------------------------------------------------------------------------
# layer_norm
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("axis", [-1, -2, 1, 0])
def test_layer_norm(rng, dtype, axis):
    shape = (3, 4, 5, 6)
    x = offset_input(rng, shape, dtype)
    axes = layer_norm_axes(4, axis)
    norm_shape = shape[axis % 4:]
    scale = scale_bias_values(rng, norm_shape, dtype)
    bias = scale_bias_values(rng, norm_shape, F32, "bias")
    y, m, inv = simdnorm.layer_norm(x, scale, bias, axis=axis, epsilon=1e-4, return_stats=True)
    assert_like_empty_like(y, x)
    check_mvn(y, x, axes, scale, bias, epsilon=1e-4, stats=(m, inv), context=f"axis={axis}")
    # the MVN call it routes onto
    y2 = simdnorm.mean_variance_normalization(x, axes, scale, bias, epsilon=1e-4)
    np.testing.assert_array_equal(bits(y), bits(y2))
    # default: no scale / bias, last axis, return a bare array
    y3 = simdnorm.layer_norm(x)
    assert isinstance(y3, np.ndarray)
    check_mvn(y3, x, (3,))


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
def test_layer_norm_transformer_shape_layouts(rng, dtype):
    # (batch, tokens, hidden) with a hidden size that is not a multiple of any vector width
    for layout in ("contiguous", "negative", "unaligned", "transposed"):
        x = offset_input(rng, (2, 7, 100), dtype, layout)
        g = scale_bias_values(rng, (100,), dtype)
        b = scale_bias_values(rng, (100,), dtype, "bias")
        out = make_out(x.shape, dtype, "contiguous")
        r = simdnorm.layer_norm(x, g, b, activation="gelu", out=out)
        assert r is out
        check_mvn(out, x, (2,), g, b, activation="gelu", context=layout)


# ----------------------------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("axis", [-1, -2, 0])
def test_rms_norm(rng, dtype, axis):
    shape = (4, 5, 6)
    x = offset_input(rng, shape, dtype)
    axes = layer_norm_axes(3, axis)
    scale = scale_bias_values(rng, shape[axis % 3:], dtype)
    res = simdnorm.rms_norm(x, scale, axis=axis, epsilon=1e-3, return_stats=True)
    assert len(res) == 3
    y, m, inv = res
    assert m is None
    assert inv.dtype == compute_dtype(dtype)
    check_mvn(y, x, axes, scale, normalize_mean=False, epsilon=1e-3, stats=(None, inv), context=f"axis={axis}")
    y2 = simdnorm.mean_variance_normalization(x, axes, scale, normalize_mean=False, epsilon=1e-3)
    np.testing.assert_array_equal(bits(y), bits(y2))
    check_mvn(simdnorm.rms_norm(x), x, (2,), normalize_mean=False)


def test_rms_norm_is_not_mean_subtracting(rng):
    x = offset_input(rng, (3, 64), F32) + 5.0
    y = simdnorm.rms_norm(x)
    # all positive inputs stay positive: the mean was not subtracted
    assert (y > 0).all()
    check_mvn(y, x, (1,), normalize_mean=False)


# ----------------------------------------------------------------------------------------------
# instance_norm
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("ndim", [3, 4, 5])
def test_instance_norm_channels_first(rng, dtype, ndim):
    shape = (2, 5) + tuple(int(s) for s in rng.integers(2, 7, size=ndim - 2))
    x = offset_input(rng, shape, dtype)
    scale = scale_bias_values(rng, (5,), dtype)
    bias = scale_bias_values(rng, (5,), dtype, "bias")
    y, m, inv = simdnorm.instance_norm(x, scale, bias, return_stats=True)
    axes = instance_norm_axes(ndim, 1)
    assert m.shape == (2, 5) + (1,) * (ndim - 2)
    check_mvn(y, x, axes, channel_param(scale, ndim, 1), channel_param(bias, ndim, 1), stats=(m, inv))


@DT
def test_instance_norm_channels_last(rng, dtype):
    nchw = (2, 6, 5, 7)
    nhwc = channels_last_nhwc(rng, nchw, dtype)
    scale = scale_bias_values(rng, (6,), dtype)
    bias = scale_bias_values(rng, (6,), F32, "bias")
    # (a) NHWC array, channel_axis=-1
    y, m, inv = simdnorm.instance_norm(nhwc, scale, bias, channel_axis=-1, return_stats=True)
    assert m.shape == (2, 1, 1, 6)
    check_mvn(y, nhwc, (1, 2), channel_param(scale, 4, -1), channel_param(bias, 4, -1), stats=(m, inv))
    # (b) the same memory viewed as NCHW, channel_axis=1: same numbers, channels-last output
    view = nhwc.transpose(0, 3, 1, 2)
    y2 = simdnorm.instance_norm(view, scale, bias)
    assert_like_empty_like(y2, view)
    np.testing.assert_allclose(y2.transpose(0, 2, 3, 1).astype(np.float64), y.astype(np.float64),
                               rtol=1e-5 if dtype in (F32, F64) else 1e-2, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# group_norm
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("num_groups", [1, 2, 3, 6])
def test_group_norm_channels_first(rng, dtype, num_groups):
    shape = (3, 6, 4, 5)
    x = offset_input(rng, shape, dtype)
    scale = scale_bias_values(rng, (6,), dtype)
    bias = scale_bias_values(rng, (6,), dtype, "bias")
    y, m, inv = simdnorm.group_norm(x, num_groups, scale, bias, epsilon=1e-4, return_stats=True)
    assert_like_empty_like(y, x)
    ref, rm, rinv = group_norm_ref(x, num_groups, scale, bias, epsilon=1e-4)
    # per-element error scale: (|x| + |mean| + std) * |inv * scale| + |bias|, as for MVN
    zs = _group_zscale(x, num_groups, scale, bias, 1, 1e-4)
    check_close(y, ref, zs, dtype=dtype, context=f"G={num_groups}")
    ct = compute_dtype(dtype)
    assert m.shape == inv.shape == (3, num_groups) and m.dtype == inv.dtype == ct
    np.testing.assert_allclose(m.astype(np.float64), rm, rtol=1e-5, atol=1e-5 * 3)
    np.testing.assert_allclose(inv.astype(np.float64), rinv, rtol=4e-5)


def _group_zscale(x, G, scale, bias, channel_axis, eps):
    xs = x.astype(np.float64)
    nd = xs.ndim
    ca = channel_axis % nd
    xm = np.moveaxis(xs, ca, 1)
    n, C = xm.shape[:2]
    xg = xm.reshape((n, G, C // G) + xm.shape[2:])
    red = tuple(range(2, xg.ndim))
    mean = xg.mean(axis=red, keepdims=True)
    std = np.sqrt(((xg - mean) ** 2).mean(axis=red, keepdims=True))
    inv = 1.0 / np.sqrt(std ** 2 + eps)
    spread = (np.abs(xg) + np.abs(mean) + std) * inv
    spread = np.moveaxis(spread.reshape(xm.shape), 1, ca)
    s = np.abs(channel_param(scale, nd, ca)) if scale is not None else 1.0
    b = np.abs(channel_param(bias, nd, ca)) if bias is not None else 0.0
    return spread * s + b


@DT
@pytest.mark.parametrize("num_groups", [2, 4])
def test_group_norm_channels_last(rng, dtype, num_groups):
    nchw = (2, 8, 3, 5)
    nhwc = channels_last_nhwc(rng, nchw, dtype)
    scale = scale_bias_values(rng, (8,), dtype)
    bias = scale_bias_values(rng, (8,), dtype, "bias")
    y, m, inv = simdnorm.group_norm(nhwc, num_groups, scale, bias, channel_axis=-1, return_stats=True)
    ref, rm, rinv = group_norm_ref(nhwc, num_groups, scale, bias, channel_axis=-1)
    check_close(y, ref, _group_zscale(nhwc, num_groups, scale, bias, -1, 1e-5), dtype=dtype)
    assert m.shape == (2, num_groups)
    np.testing.assert_allclose(m.astype(np.float64), rm, rtol=1e-5, atol=3e-5)
    # NHWC memory viewed as NCHW
    view = nhwc.transpose(0, 3, 1, 2)
    y2 = simdnorm.group_norm(view, num_groups, scale, bias)
    assert_like_empty_like(y2, view)
    ref2, _, _ = group_norm_ref(view, num_groups, scale, bias)
    check_close(y2, ref2, _group_zscale(view, num_groups, scale, bias, 1, 1e-5), dtype=dtype)


# Channels-last group norm merges each group's channels into the lanes of the columns path (the
# lanes' statistics combined a group at a time, ops/mvn.cpp). Groups of 3 and 12 channels (tasks of
# 48 lanes are whole groups); a mean 100 std from 0; an outlier in one channel of each sample, whose
# lane alone is summed a second time; samples too large for one cached task (384 channels), whose
# whole rows are summed in chunks.
# Against the reference (poisoned output), statistics included, 1 vs 2 threads bitwise.
def _check_lane_groups(isa, rng, threads, dtype, shape, num_groups):
    from simdnorm import _core

    x = (100.0 + rng.normal(size=shape)).astype(dtype)
    x[:, 0, 0, 5] = 3000.0
    c = shape[-1]
    scale = scale_bias_values(rng, (c,), dtype)
    bias = scale_bias_values(rng, (c,), dtype, "bias")
    view = x.reshape(*shape[:-1], num_groups, c // num_groups)
    plan = _core.explain_mvn(view, (1, 2, 4), None, None, np.empty_like(view), 1e-5, True, True, False,
                             (0, 0.0, 0.0), None, None, -1, False)
    assert plan.startswith(f"columns groups={shape[0]} lanes={c} group_size={shape[1] * shape[2]} "
                           f"lane_group={c // num_groups} lanes_per_task={c} "), plan
    ref, rm, rinv = group_norm_ref(x, num_groups, scale, bias, channel_axis=-1)
    results = []
    for n in (1, 2):
        threads(n)
        out = make_out(shape, dtype)
        y, m, inv = simdnorm.group_norm(x, num_groups, scale, bias, channel_axis=-1, out=out, return_stats=True)
        assert y is out
        check_close(y, ref, _group_zscale(x, num_groups, scale, bias, -1, 1e-5), dtype=dtype,
                    context=f"isa={isa} threads={n}")
        np.testing.assert_allclose(m.astype(np.float64), rm, rtol=1e-6)
        np.testing.assert_allclose(inv.astype(np.float64), rinv, rtol=1e-4)
        results.append((y, m, inv))
    for a, b in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(b))


@DT
@pytest.mark.parametrize("num_groups", [4, 16])
def test_group_norm_channels_last_lane_groups(isa, rng, threads, dtype, num_groups):
    _check_lane_groups(isa, rng, threads, dtype, (3, 20, 30, 48), num_groups)


def test_group_norm_channels_last_lane_groups_summed_in_chunks(isa, rng, threads):
    _check_lane_groups(isa, rng, threads, F32, (2, 70, 70, 384), 32)  # 7.5 MB a sample: chunks of rows


# Small NCHW planes reduced over (0, 2, 3) (MVN, and batch norm training, whose scale and bias are
# copied along the planes for it): channels x planes as lanes, each lane summed around its
# channel's first element and the channel's sums its lanes' added (ops/mvn_columns.h). Channels of
# every kind the sums judge: ordinary, a mean 1e4 std from 0, the first element 1e4 std off the
# mean (the channel summed again around its mean), constant, a NaN; float64 also one near 1e200
# (summed again scaled down). Against the reference (poisoned output), 1 vs 2 threads bitwise.
@DT
@pytest.mark.parametrize("op", ["mvn", "bn_training"])
def test_small_planes_over_the_batch_take_lane_groups(isa, rng, threads, dtype, op):
    from simdnorm import _core

    shape = (9, 6, 5, 7)
    x = rng.normal(size=shape)
    x[:, 1] += 1e4
    x[0, 2, 0, 0] = 1e4
    x[:, 3] = 0.75
    x[4, 4, 2, 3] = np.nan
    if dtype == F64:
        x[:, 5] *= 1e200
    x = x.astype(dtype)
    c = shape[1]
    scale = scale_bias_values(rng, (c,), dtype)
    bias = scale_bias_values(rng, (c,), dtype, "bias")
    if op == "mvn":
        scale4 = bias4 = None
    else:
        scale4, bias4 = (np.asarray(p).reshape(1, c, 1, 1).astype(compute_dtype(dtype)) for p in (scale, bias))
    plan = _core.explain_mvn(x, (0, 2, 3), scale4, bias4, np.empty_like(x), 1e-5, True, True, False, (0, 0.0, 0.0),
                             None, None, -1, False)
    assert plan.startswith(f"columns groups=1 lanes={c * 35} group_size=9 lane_group=35 "), plan
    results = []
    for n in (1, 2):
        threads(n)
        out = make_out(shape, dtype)
        if op == "mvn":
            y, m, inv = simdnorm.mean_variance_normalization(x, axes=(0, 2, 3), out=out, return_stats=True)
            stats = (m, inv)
        else:
            y, m, var = simdnorm.batch_normalization_training(x, scale, bias, out=out)
            inv = 1.0 / np.sqrt(var.astype(np.float64).reshape(1, c, 1, 1) + 1e-5)
            stats = (m.reshape(1, c, 1, 1), inv.astype(var.dtype))
        assert y is out
        ordinary = [k for k in range(c) if k != 5 or dtype != F64]  # (the reference's squares overflow at 1e200)
        with np.errstate(all="ignore"):
            check_mvn(y[:, ordinary], x[:, ordinary], (0, 2, 3), *(None if p is None else p[:, ordinary] for p in (scale4, bias4)),
                      context=f"isa={isa} threads={n}")
        if dtype == F64:  # against the reference of x / 1e200 (epsilon weighs nothing next to a variance of 1e400)
            check_mvn(y[:, 5:], x[:, 5:] / 1e200, (0, 2, 3), *(None if p is None else p[:, 5:] for p in (scale4, bias4)),
                      epsilon=0.0, context=f"isa={isa} threads={n} 1e200")
        finite = [k for k in ordinary if k != 4]  # (the NaN channel: its output checked NaN above)
        check_stats(tuple(s[:, finite] for s in stats), x[:, finite], (0, 2, 3), *mvn_ref(x[:, finite], (0, 2, 3))[1:],
                    context=f"isa={isa} threads={n}")
        assert np.isnan(np.asarray(m, np.float64).ravel()[4])
        results.append((y, m))
    for a, b in zip(*results):
        np.testing.assert_array_equal(bits(a), bits(b))


# The same plans over random shapes around their rule (batches of 8-12, planes of 1-64 elements and
# past), outputs plain, reversed and strided, with and without scale and bias: against the
# reference, 1 vs 2 threads bitwise.
@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["mvn", "mvn_affine", "bn_training"])
def test_small_planes_over_the_batch_random(rng, threads, dtype, op):
    for _ in range(12):
        shape = (int(rng.integers(6, 13)), int(rng.integers(1, 20)), int(rng.integers(1, 10)), int(rng.integers(1, 10)))
        n, c, h, w = shape
        x = (rng.normal(size=shape) * rng.choice([1.0, 100.0]) + rng.choice([0.0, 1e3])).astype(dtype)
        scale = (rng.normal(size=c) + 1.5).astype(compute_dtype(dtype))
        bias = rng.normal(size=c).astype(compute_dtype(dtype))
        s4, b4 = (None, None) if op == "mvn" else (scale.reshape(1, c, 1, 1), bias.reshape(1, c, 1, 1))
        for layout in ("plain", "reversed", "strided"):
            results = []
            for t in (1, 2):
                threads(t)
                out = {"plain": np.full(shape, np.nan, dtype), "reversed": np.full(shape, np.nan, dtype)[::-1, :, ::-1],
                       "strided": np.full((n, c, h, 2 * w), np.nan, dtype)[..., ::2]}[layout]
                if op == "bn_training":
                    y = simdnorm.batch_normalization_training(x, scale, bias, out=out)[0]
                else:
                    y = simdnorm.mean_variance_normalization(x, axes=(0, 2, 3), scale=s4, bias=b4, out=out)
                assert y is out
                check_mvn(y, x, (0, 2, 3), s4, b4, context=f"{shape} {layout} threads={t}")
                results.append(y)
            np.testing.assert_array_equal(bits(results[0]), bits(results[1]), err_msg=f"{shape} {layout}")


# Eight dims: the channel dim viewed as (G, C/G) makes nine, which the engine takes. Channels
# first, last and in the middle; contiguous; every dim strided apart but one of size 1; every dim
# strided apart (no two dims merge: an earlier version refused these); sliced and reversed dims; an
# output of another memory order; in place; statistics; a new output.
@pytest.mark.parametrize("channel_axis", [1, -1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "size1", "unmergeable", "strided", "inplace"])
def test_group_norm_eight_dims(rng, channel_axis, layout):
    shape = [2, 3, 2, 3, 2, 3, 2, 2]
    shape[channel_axis] = 6
    if layout == "size1":
        shape[2 if channel_axis != 2 else 3] = 1
    base = offset_input(rng, tuple(2 * n for n in shape), F32)
    if layout in ("size1", "unmergeable"):  # every dim at step 2: only pairs with a size-1 dim merge
        x = base[(slice(None, None, 2),) * 8]
    elif layout == "strided":  # dims 0 and 1 at step 2, dim 2 reversed
        x = offset_input(rng, tuple(2 * n if d < 2 else n for d, n in enumerate(shape)), F32)[::2, ::2, ::-1]
    else:
        x = np.ascontiguousarray(base[tuple(slice(n) for n in shape)])
    x0 = x.copy()
    scale = scale_bias_values(rng, (6,), F32)
    bias = scale_bias_values(rng, (6,), F32, "bias")
    if layout == "inplace":
        out = x
    else:  # dims 0 and 1 swapped in memory
        out = np.full((x.shape[1], x.shape[0]) + x.shape[2:], np.nan, F32).transpose(1, 0, 2, 3, 4, 5, 6, 7)
    y, m, inv = simdnorm.group_norm(x, 3, scale, bias, channel_axis=channel_axis, out=out, return_stats=True)
    assert y is out
    ref, rm, rinv = group_norm_ref(x0, 3, scale, bias, channel_axis=channel_axis)
    zs = _group_zscale(x0, 3, scale, bias, channel_axis, 1e-5)
    check_close(y, ref, zs, dtype=F32, context=layout)
    assert m.shape == inv.shape == (x.shape[0], 3)
    np.testing.assert_allclose(m.astype(np.float64), rm, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(inv.astype(np.float64), rinv, rtol=4e-5)
    fresh = simdnorm.group_norm(x0, 3, scale, bias, channel_axis=channel_axis)
    assert fresh.shape == x0.shape
    check_close(fresh, ref, zs, dtype=F32, context=f"{layout}, new output")


def test_group_norm_no_copy_of_input(rng):
    # the input is not modified and a 2-D (N, C) input works (groups of channels only)
    x = offset_input(rng, (4, 12), F32)
    x0 = x.copy()
    y = simdnorm.group_norm(x, 3)
    np.testing.assert_array_equal(x, x0)
    ref, _, _ = group_norm_ref(x, 3)
    check_close(y, ref, _group_zscale(x, 3, None, None, 1, 1e-5), dtype=F32)


# ----------------------------------------------------------------------------------------------
# activation / out / return_stats accepted by all four
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["layer_norm", "rms_norm", "instance_norm", "group_norm"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_activation_out_return_stats(rng, which, dtype):
    x = offset_input(rng, (2, 4, 3, 5), dtype)
    name, params = "elu", NONDEFAULT_PARAMS["elu"]
    act = act_arg(name, params)
    out = make_out(x.shape, dtype, "strided")
    if which == "layer_norm":
        r = simdnorm.layer_norm(x, activation=act, out=out, return_stats=True)
        ref = mvn_ref(x, (3,), activation=name, act_params=params)[0]
        zs_axes, nm = (3,), True
    elif which == "rms_norm":
        r = simdnorm.rms_norm(x, activation=act, out=out, return_stats=True)
        ref = mvn_ref(x, (3,), normalize_mean=False, activation=name, act_params=params)[0]
        zs_axes, nm = (3,), False
    elif which == "instance_norm":
        r = simdnorm.instance_norm(x, activation=act, out=out, return_stats=True)
        ref = mvn_ref(x, (2, 3), activation=name, act_params=params)[0]
        zs_axes, nm = (2, 3), True
    else:
        r = simdnorm.group_norm(x, 2, activation=act, out=out, return_stats=True)
        ref = None
        zs_axes, nm = (1, 2, 3), True
    assert isinstance(r, tuple) and len(r) == 3
    assert r[0] is out
    if ref is not None:
        check_mvn(out, x, zs_axes, normalize_mean=nm, activation=name, act_params=params)
    else:
        z, _, _ = group_norm_ref(x, 2)
        check_close(out, z, _group_zscale(x, 2, None, None, 1, 1e-5), name, params, dtype=dtype)
