"""batch_normalization on every memory layout SPEC §1 allows, for the input, the output and the
parameters: contiguous, channels-last (both ways), transposed, permuted, negative steps, strided,
zero strides, unaligned; odd innermost lengths 1..67 at unaligned starts on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import simdnorm
from cases import (
    DT,
    LAYOUTS,
    PARAM_NAMES,
    WRITABLE_LAYOUTS,
    bits,
    bn_param_1d,
    channels_last_nhwc,
    isas_under_test,
    layout_empty,
    make_input,
    make_out,
    odd_sizes,
    param_values,
    unaligned_empty,
)
from reference import BF16, F16, F32, F64, assert_like_empty_like, check_bn, check_mvn, dtype_id

bn = simdnorm.batch_normalization


def p1d(rng, shape, dtype, channel_axis=1):
    return {n: bn_param_1d(rng, n, shape, channel_axis, dtype) for n in PARAM_NAMES}


def test_layout_generators_do_what_they_say(rng):
    shape = (2, 3, 4, 5)
    x = make_input(rng, shape, F32, "channels_last")
    assert x.shape == shape and x.strides[1] == 4 and x.base is not None
    assert make_input(rng, shape, F32, "transposed").flags.f_contiguous
    assert min(make_input(rng, shape, F32, "negative").strides) < 0
    assert 0 in make_input(rng, shape, F32, "zero_stride").strides
    u = make_input(rng, shape, F16, "unaligned")
    assert not u.flags.aligned and u.flags.c_contiguous
    assert u.ctypes.data % 2 == 1
    us = make_input(rng, shape, BF16, "unaligned_strided")
    assert not us.flags.aligned and not us.flags.c_contiguous
    for lay in WRITABLE_LAYOUTS:
        o = make_out(shape, F32, lay)
        assert o.shape == shape and np.isnan(o).all() and o.flags.writeable


@DT
@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_layouts(rng, dtype, layout):
    shape = (3, 5, 4, 7)
    x = make_input(rng, shape, dtype, layout)
    p = p1d(rng, shape, dtype)
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="leaky_relu")
    assert_like_empty_like(y, x)
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="leaky_relu",
             context=f"layout={layout} strides={x.strides}")
    # out= in the same layout (a contiguous one for zero strides)
    out = make_out(shape, dtype, layout if layout != "zero_stride" else "contiguous")
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="leaky_relu", out=out)
    assert r is out
    np.testing.assert_array_equal(bits(out), bits(y))


@DT
@pytest.mark.parametrize("out_layout", WRITABLE_LAYOUTS)
def test_out_layouts(rng, dtype, out_layout):
    shape = (2, 6, 3, 9)
    x = make_input(rng, shape, dtype)
    p = p1d(rng, shape, dtype)
    out = make_out(shape, dtype, out_layout)
    r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], out=out)
    assert r is out
    check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], context=f"out layout={out_layout}")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("in_layout,out_layout", [
    ("channels_last", "contiguous"), ("contiguous", "channels_last"), ("negative", "unaligned"),
    ("unaligned_strided", "transposed"), ("zero_stride", "negative"), ("permuted", "strided")])
def test_mixed_in_out_layouts(rng, dtype, in_layout, out_layout):
    shape = (2, 7, 5, 3)
    x = make_input(rng, shape, dtype, in_layout)
    p = p1d(rng, shape, dtype)
    out = make_out(shape, dtype, out_layout)
    bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="hard_swish", out=out)
    check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="hard_swish")


@DT
@pytest.mark.parametrize("ndim", [3, 4, 5])
def test_channels_last_both_ways(rng, dtype, ndim):
    shape = (2, 19) + tuple(int(s) for s in rng.integers(2, 6, size=ndim - 2))
    # (a) a genuinely NHWC array with channel_axis=-1
    nhwc = channels_last_nhwc(rng, shape, dtype)
    p = p1d(rng, shape, dtype)
    y = bn(nhwc, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)
    assert y.flags.c_contiguous
    check_bn(y, nhwc, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)
    # (b) the same memory viewed as NCHW via transpose, channel_axis=1: the same numbers, and the
    # output is channels-last in memory too
    perm = (0, ndim - 1) + tuple(range(1, ndim - 1))
    nchw = nhwc.transpose(perm)
    y2 = bn(nchw, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=1)
    assert_like_empty_like(y2, nchw)
    assert y2.transpose(np.argsort(perm)).flags.c_contiguous
    np.testing.assert_array_equal(bits(y2.transpose(np.argsort(perm))), bits(y))


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
@pytest.mark.parametrize("ndim", [5, 6, 7, 8])
@pytest.mark.parametrize("layout", ["permuted", "negative", "unaligned_strided", "zero_stride"])
def test_high_rank_layouts(rng, dtype, ndim, layout):
    shape = tuple(int(s) for s in rng.integers(1, 4, size=ndim))
    shape = (shape[0], 3) + shape[2:]
    x = make_input(rng, shape, dtype, layout)
    for ca in (1, -1, ndim // 2):
        p = p1d(rng, shape, dtype, ca)
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca)
        assert_like_empty_like(y, x)
        check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca)


# ----------------------------------------------------------------------------------------------
# parameters in unusual layouts
# ----------------------------------------------------------------------------------------------


def view_1d(rng, values, how):
    """A 1-D view with the given values: negative step, strided, unaligned, or zero stride."""
    c = values.shape[0]
    dt = values.dtype
    if how == "negative":
        base = np.empty(2 * c, dt)
        v = base[::-2]
    elif how == "strided":
        base = np.empty(3 * c, dt)
        v = base[1::3]
    elif how == "unaligned":
        v = unaligned_empty((c,), dt, offset=1)
    elif how == "zero_stride":
        return np.broadcast_to(values[:1], (c,))
    else:
        raise ValueError(how)
    v[...] = values
    return v


@DT
@pytest.mark.parametrize("how", ["negative", "strided", "unaligned", "zero_stride"])
def test_param_views_1d(rng, dtype, how):
    shape = (2, 9, 5, 6)
    x = make_input(rng, shape, dtype)
    for pdt in ([dtype] if dtype == F32 else [dtype, F32]):
        p = {n: view_1d(rng, bn_param_1d(rng, n, shape, 1, pdt), how) for n in PARAM_NAMES}
        y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
        check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], context=f"params {how} {dtype_id(pdt)}")
        # channels-last (vector coefficients along the run)
        xl = make_input(rng, (2, 5, 6, 9), dtype)
        y = bn(xl, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)
        check_bn(y, xl, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1)


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_param_layouts_full_size(rng, dtype, layout):
    # same-rank parameters as large as the input, each stored in the given layout
    shape = (2, 3, 5, 7)
    x = make_input(rng, shape, dtype, "contiguous")
    p = {}
    for n in PARAM_NAMES:
        vals = param_values(rng, n, shape, dtype)
        if layout == "zero_stride":
            p[n] = np.broadcast_to(vals[:, :, :1, :], shape)  # stride 0 along axis 2
        else:
            a = layout_empty(shape, dtype, layout)
            a[...] = vals
            p[n] = a
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="softsign")
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="softsign",
             context=f"param layout {layout}")


def test_zero_stride_same_rank_params_of_full_shape(rng):
    # (1, C, 1, 1) values broadcast to the full input shape: every stride 0 but the channel's
    shape = (3, 4, 6, 5)
    x = make_input(rng, shape, F32, "channels_last")
    p = {n: np.broadcast_to(param_values(rng, n, (1, 4, 1, 1), F32), shape) for n in PARAM_NAMES}
    y = bn(x, p["mean"], p["variance"], p["scale"], p["bias"])
    check_bn(y, x, p["mean"], p["variance"], p["scale"], p["bias"])


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
def test_everything_unaligned(rng, dtype):
    shape = (2, 5, 3, 33)
    x = make_input(rng, shape, dtype, "unaligned")
    p = {n: view_1d(rng, bn_param_1d(rng, n, shape, 1, dtype), "unaligned") for n in PARAM_NAMES}
    out = make_out(shape, dtype, "unaligned")
    bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="silu", out=out)
    check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="silu")


# ----------------------------------------------------------------------------------------------
# odd innermost lengths and unaligned starts, every ISA: the SIMD heads and tails
# ----------------------------------------------------------------------------------------------


def _offset_array(rng, n_shape, dtype, elem_offset, byte_offset):
    """A C-ordered array starting elem_offset elements (+ byte_offset bytes) into a 64-aligned
    buffer."""
    dtype = np.dtype(dtype)
    count = int(np.prod(n_shape))
    raw = np.empty((count + elem_offset + 2) * dtype.itemsize + 64 + byte_offset, np.uint8)
    start = (-raw.ctypes.data) % 64 + elem_offset * dtype.itemsize + byte_offset
    a = np.frombuffer(raw[start:start + count * dtype.itemsize], dtype=dtype, count=count).reshape(n_shape)
    return a


@DT
def test_odd_inner_sizes(isa, rng, dtype):
    starts = [(0, 0), (1, 0), (3, 0), (0, 1)]  # (elements, bytes) past a 64-byte boundary
    for n in odd_sizes():
        for (eo, bo) in starts:
            for variant in ("scalar_coeff", "vector_coeff", "full_params"):
                if variant == "scalar_coeff":
                    shape, ca = (2, 3, n), 1
                    p = {k: bn_param_1d(rng, k, shape, ca, dtype) for k in PARAM_NAMES}
                elif variant == "vector_coeff":
                    shape, ca = (2, n), -1
                    p = {k: bn_param_1d(rng, k, shape, ca, dtype) for k in PARAM_NAMES}
                else:
                    shape, ca = (2, n), 1
                    p = {k: param_values(rng, k, shape, dtype) for k in PARAM_NAMES}
                x = _offset_array(rng, shape, dtype, eo, bo)
                x[...] = make_input(rng, shape, dtype)
                out = _offset_array(rng, shape, dtype, (eo + 1) % 3, bo)
                out[...] = np.nan
                r = bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca, out=out)
                assert r is out
                check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca,
                         context=f"n={n} start={(eo, bo)} {variant} isa={isa}")


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_odd_sizes_strided_inner(isa, rng, dtype):
    # innermost run with a non-unit stride (step 2 and a negative step) for every length
    for n in odd_sizes():
        base = make_input(rng, (3, 2 * n), dtype)
        x = base[:, ::-2]
        mean = param_values(rng, "mean", (3,), dtype)
        var = param_values(rng, "variance", (3,), dtype)
        out = make_out((3, n), dtype, "strided")
        bn(x, mean, var, channel_axis=0, out=out)
        check_bn(out, x, mean, var, channel_axis=0, context=f"n={n} isa={isa}")


def test_out_untouched_outside_view(rng):
    # writing through a strided out must not touch the elements between its strides
    base = np.full((4, 40), 7.0, F32)
    out = base[:, 1::2]
    x = make_input(rng, (4, 20), F32)
    mean = param_values(rng, "mean", (4,), F32)
    var = param_values(rng, "variance", (4,), F32)
    bn(x, mean, var, channel_axis=0, out=out)
    assert (base[:, 0::2] == 7.0).all()
    check_bn(out, x, mean, var, channel_axis=0)


# ----------------------------------------------------------------------------------------------
# byte extents past 2**31 (64-bit strides): views over a large virtual allocation, a few elements
# ----------------------------------------------------------------------------------------------


def _sparse_view(base, rows, cols, row_stride_bytes):
    return np.lib.stride_tricks.as_strided(base, shape=(rows, cols), strides=(row_stride_bytes, base.itemsize),
                                           writeable=True)


def test_byte_extent_over_2gib(rng):
    # 3 GiB of address space each (never touched beyond a few pages, so little resident memory)
    row = 2**30 - 4  # bytes between rows: the last row starts past 2**31 + 2**30
    fx = np.empty(3 * 2**28 + 64, np.float32)
    fo = np.empty(3 * 2**28 + 64, np.float32)
    x = _sparse_view(fx, 4, 7, row)
    out = _sparse_view(fo, 4, 7, row)
    vals = make_input(rng, (4, 7), F32)
    x[...] = vals
    assert x.strides[0] * 3 > 2**31
    mean = bn_param_1d(rng, "mean", (4, 7), 0, F32)
    var = bn_param_1d(rng, "variance", (4, 7), 0, F32)
    out[...] = np.nan
    bn(x, mean, var, channel_axis=0, out=out)
    check_bn(out, vals, mean, var, channel_axis=0)
    # negative strides from the far end, and the allocation's own output
    xr, outr = x[::-1], out[::-1]
    outr[...] = np.nan
    bn(xr, mean, var, channel_axis=0, out=outr)
    check_bn(outr, vals[::-1], mean, var, channel_axis=0)
    # the MVN path (statistics per column across rows 1 GiB apart, and per row)
    check_mvn(simdnorm.mean_variance_normalization(x, 0), vals, 0)
    out[...] = np.nan
    simdnorm.mean_variance_normalization(xr, 1, out=out)
    check_mvn(out, vals[::-1], 1)


# Outputs big enough for streaming stores (input and output over half the last-level cache), at
# phases against a 64-byte line: each row's head and tail line is written in pieces (non-temporal
# 4- and 16-byte stores; plain stores at an odd 2-byte phase), its middle in whole lines. Rows
# back to back share their boundary lines, as do the planes of MVN over (0, 2, 3) across groups.
# Channels-last batch norm runs all its rows as one stream, whole lines but for the first and last.
# Four cases run on every ISA, the rest on the default one.
STREAMED = [
    # (op, row or plane shape, dtype, input offset, output offset in bytes past a line, every ISA);
    # bn-nhwc: the shape is (H, W, C), the channels innermost in memory.
    ("layer", (768,), F32, 16, 16, True),
    ("layer", (768,), F32, 16, 0, False),
    ("layer", (768,), F32, 4, 36, False),
    ("layer", (1000,), F32, 16, 16, False),
    ("layer", (293,), F32, 16, 16, False),  # (rows under 1 KB are not streamed: test_plans.py)
    ("layer", (768,), F16, 16, 16, False),
    ("layer", (1000,), F16, 2, 2, False),
    ("layer", (777,), F16, 6, 10, True),
    ("layer", (768,), BF16, 16, 16, False),
    ("layer", (300,), F64, 8, 8, False),
    ("rms", (768,), F32, 16, 16, False),
    ("bn", (4, 16, 130), F32, 16, 16, False),
    ("bn", (4, 16, 130), F16, 2, 2, True),
    ("bn-nhwc", (4, 4, 64), F16, 0, 16, True),  # channels last: (N, H, W, C) memory
    ("bn-nhwc", (2, 3, 48), F32, 16, 36, False),
    ("mvn023", (4, 56, 56), F32, 16, 16, False),
]


@pytest.mark.parametrize("op,inner,dtype,x_offset,out_offset,every_isa", STREAMED,
                         ids=[f"{o}-{'x'.join(map(str, s))}-{dtype_id(d)}-{a}-{b}" for o, s, d, a, b, _ in STREAMED])
def test_streamed_outputs_at_line_phases(rng, threads, op, inner, dtype, x_offset, out_offset, every_isa):
    from cases import empty_past_line
    from simdnorm import _core

    threads(1)
    itemsize = np.dtype(dtype).itemsize
    threshold = _core.stream_threshold_bytes()
    per_outer = int(np.prod(inner))
    outer = threshold // (2 * itemsize * per_outer) + 2  # input + output just over the threshold
    shape = (outer, *inner) if op != "mvn023" else (inner[0], outer, *inner[1:])  # mvn023: (N, C, H, W)
    x = empty_past_line(shape, dtype, x_offset)
    x[...] = make_input(rng, shape, dtype, loc=3.0)
    out = empty_past_line(shape, dtype, out_offset)
    if op == "bn-nhwc":
        x, out, op = x.transpose(0, 3, 1, 2), out.transpose(0, 3, 1, 2), "bn"
    identity = (0, 0.0, 0.0)
    axes = (0, 2, 3) if op == "mvn023" else (x.ndim - 1,)
    if op == "bn":
        p = p1d(rng, x.shape, dtype)
        assert _core.explain_batch_norm(x, *(v.reshape(1, -1, 1, 1) for v in p.values()), out, 1e-5, identity, 0,
                                        False).endswith("streaming-stores")
    else:
        g = make_input(rng, (1, *inner) if op != "mvn023" else (1, shape[1], 1, 1), dtype)
        b = make_input(rng, g.shape, dtype)
        assert _core.explain_mvn(x, axes, g, b, out, 1e-5, True, True, False, identity, None, None, -1,
                                 False).endswith("streaming-stores")
    previous = simdnorm.isa()
    try:
        for isa in isas_under_test() if every_isa else [previous]:
            simdnorm.set_isa(isa)
            out[...] = np.nan
            context = f"{op} isa={isa}"
            if op == "bn":
                bn(x, p["mean"], p["variance"], p["scale"], p["bias"], out=out)
                check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], context=context)
            elif op == "layer":
                simdnorm.layer_norm(x, g.reshape(-1), b.reshape(-1), out=out)
                check_mvn(out, x, axes, g, b, context=context)
            elif op == "rms":
                simdnorm.rms_norm(x, g.reshape(-1), out=out)
                check_mvn(out, x, axes, g, None, normalize_mean=False, context=context)
            else:
                simdnorm.mean_variance_normalization(x, axes, scale=g, bias=b, out=out)
                check_mvn(out, x, axes, g, b, context=context)
    finally:
        simdnorm.set_isa(previous)


# The streamed loops take their lines in the order that keeps their loads off the low 12 bits of
# their last stores, chosen by where the output sits from the input modulo a page (steps_down in
# kernels/normalize.h): the same bits at every placement, up and down, with the rows' heads peeled
# (the input 80 bytes past a page) and vectors that hold the end of one row and the start of the next
# (batch norm planes of 130), rows of 4 KB (whose sums of a later row step beside the stores).
PAGE_PHASED = [
    ("bn", (16, 130), F32), ("bn", (16, 130), F64), ("bn", (4, 56, 56), F32), ("bn", (4, 56, 56), F16),
    ("bn-nhwc", (4, 48), F32), ("bn-nhwc", (4, 64), BF16),
    ("layer", (768,), F32), ("layer", (1000,), F64), ("rms", (776,), F32), ("rms", (1024,), F32),
    ("instance", (8, 28, 28), F32), ("group", (8, 28, 28), F32), ("mvn023", (4, 56, 56), F32),
    ("bn-train", (16, 28, 28), F32), ("bn-train-nhwc", (28, 16), F32),
]
PAGE_PHASES = [0, 16, 48, 112, 1024, 2040, 2048, 2056, 4032, 4080]


@pytest.mark.parametrize("op,inner,dtype", PAGE_PHASED,
                         ids=[f"{o}-{'x'.join(map(str, s))}-{dtype_id(d)}" for o, s, d in PAGE_PHASED])
def test_streamed_outputs_at_page_phases(rng, threads, op, inner, dtype):
    from cases import empty_at_page_phase
    from simdnorm import _core

    threads(1)
    itemsize = np.dtype(dtype).itemsize
    per_outer = int(np.prod(inner))
    shape = (_core.stream_threshold_bytes() // (2 * itemsize * per_outer) + 2, *inner)
    if op == "mvn023":
        shape = (inner[0], shape[0], *inner[1:])
    x_phase = 80
    x = empty_at_page_phase(shape, dtype, x_phase)
    x[...] = make_input(rng, shape, dtype, loc=3.0)
    c = shape[-1] if op.endswith("nhwc") else shape[1]
    scale, bias = (make_input(rng, (shape[-1] if op in ("layer", "rms") else c,), dtype) for _ in range(2))
    p = p1d(rng, (1, c), dtype)

    def run(out):
        if op.startswith("bn-train"):
            ca = -1 if op.endswith("nhwc") else 1
            return simdnorm.batch_normalization_training(x, scale, bias, channel_axis=ca, out=out)[1:]
        if op.startswith("bn"):
            ca = -1 if op == "bn-nhwc" else 1
            return bn(x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=ca, out=out)
        if op == "layer":
            return simdnorm.layer_norm(x, scale, bias, out=out)
        if op == "rms":
            return simdnorm.rms_norm(x, scale, out=out)
        if op == "instance":
            return simdnorm.instance_norm(x, scale, bias, out=out)
        if op == "group":
            return simdnorm.group_norm(x, 4, scale, bias, out=out)
        return simdnorm.mean_variance_normalization(x, (0, 2, 3), out=out)

    previous = simdnorm.isa()
    try:
        for isa in isas_under_test():
            simdnorm.set_isa(isa)
            check_page_phases(op, x, x_phase, run, scale, bias, p, c, isa)
    finally:
        simdnorm.set_isa(previous)


def check_page_phases(op, x, x_phase, run, scale, bias, p, c, isa):
    """run(out) at each of PAGE_PHASES past x's: the first checked against the reference, every
    other bitwise equal to it."""
    from cases import empty_at_page_phase

    first = None
    for d in PAGE_PHASES:
        out = empty_at_page_phase(x.shape, x.dtype, (x_phase + d) % 4096)
        out[...] = np.nan
        stats = run(out)
        if first is None:
            first = bits(out).copy(), [bits(np.asarray(s)).copy() for s in stats] if op.startswith("bn-train") else []
            if op in ("bn", "bn-nhwc"):
                check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], channel_axis=-1 if op == "bn-nhwc" else 1)
            elif op.startswith("bn-train"):
                axes = tuple(a for a in range(x.ndim) if a != (x.ndim - 1 if op.endswith("nhwc") else 1))
                g = scale.reshape([c if a not in axes else 1 for a in range(x.ndim)])
                check_mvn(out, x, axes, g, bias.reshape(g.shape))
            elif op == "mvn023":
                check_mvn(out, x, (0, 2, 3))
            elif op in ("layer", "rms"):
                check_mvn(out, x, (x.ndim - 1,), scale, bias if op == "layer" else None, normalize_mean=op == "layer")
            elif op == "instance":
                g = scale.reshape(1, -1, 1, 1)
                check_mvn(out, x, (2, 3), g, bias.reshape(g.shape))
            else:  # group norm: MVN over each (C/G, H, W) of (N, G, C/G, H, W)
                grouped = (x.shape[0], 4, c // 4, *x.shape[2:])
                g = scale.reshape(1, 4, c // 4, 1, 1)
                check_mvn(out.reshape(grouped), x.reshape(grouped), (2, 3, 4), g, bias.reshape(g.shape))
            continue
        assert np.array_equal(bits(out), first[0]), f"{op} output at {d} bytes past the input's page phase ({isa})"
        if op.startswith("bn-train"):
            for got, want in zip(stats, first[1]):
                assert np.array_equal(bits(np.asarray(got)), want), f"{op} statistics at {d} ({isa})"


def stream_rows_values(rng, rows, n):
    """Rows for the 16-bit row stream (float64, to be cast): each at its own mean (sd 20) and spread
    (0.5 to 4), and a float32 scale and bias of n."""
    x = rng.normal(0.0, 1.0, (rows, n)) * rng.uniform(0.5, 4.0, (rows, 1)) + rng.normal(0.0, 20.0, (rows, 1))
    return x, rng.uniform(0.5, 2.0, n).astype(F32), rng.normal(0.0, 1.0, n).astype(F32)


# Float16 and bfloat16 rows of whole steps (2W elements: 64 bytes at AVX-512) back to back, up to
# 1024 elements, run as one stream of steps (kernels/fused_rows.h: RowStream): the step that holds
# one row's end and the next row's start is summed and normalized once, its lanes taking each row's
# pivot, sums and coefficients; the first and last steps are masked. Input and output at the same
# and at different phases (the input then takes the output's steps), every ISA (steps of 32, 16 and
# 8 elements), rows split between two threads at any row, rows whose first pass needs a second (the
# first element far from the mean; the kernel leaves them to the op), a constant row (bfloat16: at
# 1e38), a bfloat16 row near 1e30, an inf, and in place.
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("n", [32, 96, 768, 1024])
@pytest.mark.parametrize("x_offset,out_offset", [(0, 0), (16, 16), (16, 32), (48, 0), (2, 50), (0, None)],
                         ids=lambda v: "inplace" if v is None else str(v))
def test_16bit_rows_stream(isa, rng, threads, dtype, n, x_offset, out_offset):
    from cases import empty_past_line

    rows = max(7, 70000 // n + 3)  # past two threads' worth of work: the rows are split
    x = empty_past_line((rows, n), dtype, x_offset)
    x[...], scale, bias = stream_rows_values(rng, rows, n)
    for r in (2, 6, 7, rows - 1):  # pivot far from the mean: a second pass (two in one batch, the last row)
        x[r, 0] = x[r, 1:].mean() + 300.0
    x[3] = x[3, 5]  # constant: bias
    if dtype == BF16:  # float32's range: a constant row whose mean / sqrt(epsilon) overflows, and a row
        x[4] = 1e38  # whose squares overflow float32 (a second pass)
        x[5] *= 1e30
    x[9, 7] = np.inf  # NaN statistics, NaN row
    finite = np.arange(rows) != 9
    x0 = x.copy()
    first = None
    for t in (1, 2):
        threads(t)
        x[...] = x0
        out = x if out_offset is None else empty_past_line((rows, n), dtype, out_offset)
        if out_offset is not None:
            out[...] = np.nan
        y, m, i = simdnorm.layer_norm(x, scale, bias, out=out, return_stats=True)
        assert y is out
        context = f"isa={isa} threads={t}"
        check_mvn(y[finite], x0[finite], 1, scale, bias, stats=(m[finite], i[finite]), stat_rtol=1e-4,
                  context=context)
        assert np.isnan(y[9]).all() and np.isnan(m[9]).all() and np.isnan(i[9]).all(), context
        if first is None:
            first = (y.copy(), m, i)
        else:
            for a, b in zip(first, (y, m, i)):
                assert a.tobytes() == b.tobytes(), f"1 and 2 threads differ: {context}"
    if out_offset is not None:
        out[...] = np.nan
        simdnorm.rms_norm(x, scale, out=out)
        check_mvn(out[finite], x0[finite], 1, scale, None, normalize_mean=False, context=f"rms isa={isa}")
        assert np.isnan(out[9]).all()


# A row's bits do not depend on the rows the stream runs beside it. From its fifth row on, the
# stream sums and normalizes two rows' periods in one loop (kernels/fused_rows.h: run_pair, pairs
# from even rows, where they fit in L1: rows under 1024 elements on a 32 KB L1, up to 1024 on a 48
# KB one), each row taking the operations it takes alone, in the same order. The same rows from
# row 0 and from row 1 (every pair shifted by one row, the phases the same), every ISA; rows whose
# first pass needs a second, in and out of pairs.
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("n", [32, 96, 768, 1024])
def test_16bit_rows_stream_bits_whatever_rows_pair_up(isa, rng, threads, dtype, n):
    from cases import empty_past_line

    rows = 401  # enough rows that a sum rounded differently moves some output's last bit
    x, scale, bias = stream_rows_values(rng, rows, n)
    for r in (6, 9, 10):
        x[r, 0] = x[r, 1:].mean() + 300.0
    x = x.astype(dtype)
    threads(1)
    outs = [empty_past_line(v.shape, dtype, 16) for v in (x, x[1:])]
    for out in outs:
        out[...] = np.nan
    whole = simdnorm.layer_norm(x, scale, bias, out=outs[0], return_stats=True)
    check_mvn(whole[0], x, 1, scale, bias, stats=whole[1:], stat_rtol=1e-4, context=f"isa={isa}")
    later = simdnorm.layer_norm(x[1:], scale, bias, out=outs[1], return_stats=True)
    for name, a, b in zip(("y", "mean", "inv_std"), whole, later):
        assert np.array_equal(bits(a[1:]), bits(b)), f"{name}: rows from 0 and from 1 differ, isa={isa} n={n}"


# RMS norm's rows stream two ways: without an activation it sums the squares alone (the plain sums
# would take the registers that hold two rows' squares); with one, as layer norm's rows with a pivot
# of 0. The squares are the same bits either way, and relu commutes with the rounding to the output
# dtype, so the relu call's output is the plain call's with its negatives made 0, on every ISA, at
# 1 and 2 threads, the rows pairing up or not.
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("n", [32, 96, 768, 1024])
def test_16bit_rms_rows_stream_the_same_squares_with_an_activation(isa, rng, threads, dtype, n):
    from cases import empty_past_line

    rows = 401
    values, scale, _ = stream_rows_values(rng, rows, n)
    x = values.astype(dtype)
    for t in (1, 2):
        threads(t)
        outs = [empty_past_line(x.shape, dtype, 16) for _ in range(2)]
        for out in outs:
            out[...] = np.nan
        plain, inv_rms = simdnorm.rms_norm(x, scale, out=outs[0], return_stats=True)[::2]
        context = f"isa={isa} n={n} threads={t}"
        check_mvn(plain, x, 1, scale, None, normalize_mean=False, stats=(None, inv_rms), stat_rtol=1e-4,
                  context=context)
        relu = simdnorm.rms_norm(x, scale, activation="relu", out=outs[1])
        assert np.array_equal(relu, np.maximum(plain, 0)), f"relu's squares differ: {context}"


# The stream's steps follow the output's phase: a row's bits depend on its data and where the output
# lies against a line, not on where the input lies. The same rows from inputs at every 16 bytes of a
# line and 2 bytes past one, into outputs at two phases, every ISA. (Steps that followed the input,
# as they did, gave other bits from the input 2 bytes past a line at the baseline ISA; at AVX-512
# the bits came out the same at every phase tried, in both builds.)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("n", [96, 768])
def test_16bit_rows_stream_bits_follow_the_output_phase(isa, rng, threads, dtype, n):
    from cases import empty_past_line

    rows = 301
    values, scale, bias = stream_rows_values(rng, rows, n)
    values = values.astype(dtype)
    threads(1)
    for out_offset in (16, 32):
        first = None
        for x_offset in (0, 16, 32, 48, 2):
            x = empty_past_line((rows, n), dtype, x_offset)
            x[...] = values
            out = empty_past_line((rows, n), dtype, out_offset)
            out[...] = np.nan
            got = simdnorm.layer_norm(x, scale, bias, out=out, return_stats=True)
            context = f"isa={isa} x at {x_offset} out at {out_offset}"
            if first is None:
                check_mvn(got[0], values, 1, scale, bias, stats=got[1:], stat_rtol=1e-4, context=context)
                first = got
                continue
            for name, a, b in zip(("y", "mean", "inv_std"), first, got):
                assert np.array_equal(bits(a), bits(b)), f"{name} differs from the input at 0: {context}"


# Channels-last rows whose coefficients are the same for every row (batch norm and instance norm,
# the channels innermost, repeated along runs of ~1024) and that follow each other in memory run as
# one stream of elements (kernels/normalize.h: run_periodic_stream), element j taking the
# coefficients of element j mod n of a row: its steps wrap from one row into the next, its head and
# tail are masked. Checked against the float64 reference and, bit for bit, against the same arrays
# with rows apart (a gap after each pixel's channels: a run per row), at output phases that make
# the rows' boundaries fall anywhere in a step, on every ISA (steps of 32, 16 and 8 elements), with
# one and two threads (the second thread's rows start mid-row). Rows of 2048 and 2049 channels
# whose coefficients, input and output outgrow the L1 run in blocks of columns instead (all rows of
# one block, then the next: run_rows' column_block), both ways; float16 batch norm at 2048 (32 KB a
# row) stays one stream.
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("c", [17, 40, 64, 2048, 2049])
@pytest.mark.parametrize("out_offset", [0, 2, 16, 36])
def test_channels_last_rows_as_one_stream(rng, threads, dtype, c, out_offset):
    from cases import empty_past_line

    n, h, w = (2, 3, 5) if c > 1000 else (3, 48, 5)
    x = make_input(rng, (n, h, w, c), dtype).transpose(0, 3, 1, 2)
    p = {k: v.astype(F32) for k, v in p1d(rng, x.shape, dtype).items()}
    apart = np.empty((n, h, w, c + 3), dtype)[..., :c].transpose(0, 3, 1, 2)  # rows not back to back
    previous = simdnorm.isa()
    try:
        for isa in isas_under_test():
            simdnorm.set_isa(isa)
            for t in (1, 2):
                threads(t)
                context = f"isa={isa} threads={t}"
                out = empty_past_line((n, h, w, c), dtype, out_offset).transpose(0, 3, 1, 2)
                for run in ("bn", "instance"):
                    for y in (out, apart):
                        y[...] = np.nan
                        if run == "bn":
                            bn(x, p["mean"], p["variance"], p["scale"], p["bias"], activation="leaky_relu", out=y)
                        else:
                            simdnorm.instance_norm(x, p["scale"], p["bias"], out=y)
                    if run == "bn":
                        check_bn(out, x, p["mean"], p["variance"], p["scale"], p["bias"], activation="leaky_relu",
                                 context=context)
                    else:
                        check_mvn(out, x, (2, 3), p["scale"].reshape(1, c, 1, 1), p["bias"].reshape(1, c, 1, 1),
                                  context=context)
                    assert np.array_equal(bits(out), bits(apart)), f"{run}: one stream and rows apart differ: {context}"
    finally:
        simdnorm.set_isa(previous)
