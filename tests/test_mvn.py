"""mean_variance_normalization (SPEC §3, §6) against the float64 reference: any subset of axes in
any order, normalize_mean / normalize_variance, epsilon_mode, scale/bias broadcasting and dtypes,
return_stats, activations, every layout, out= / in place / overlap, zero-size dims, every ISA."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import simdnorm
from cases import (
    DT,
    LAYOUTS,
    WRITABLE_LAYOUTS,
    act_arg,
    bits,
    make_input,
    make_out,
    offset_input,
    rand_values,
    scale_bias_values,
)
from reference import (
    BF16,
    F16,
    F32,
    F64,
    NONDEFAULT_PARAMS,
    assert_like_empty_like,
    check_mvn,
    compute_dtype,
    dtype_id,
    mvn_ref,
)

mvn = simdnorm.mean_variance_normalization


# ----------------------------------------------------------------------------------------------
# the reference on hand-derived values
# ----------------------------------------------------------------------------------------------


def test_reference_hand_derived():
    x = np.array([2.0, 4, 4, 4, 5, 5, 7, 9])  # mean 5, population variance 4
    out, mean, inv = mvn_ref(x, 0, epsilon=0.0)
    np.testing.assert_array_equal(out, [-1.5, -0.5, -0.5, -0.5, 0, 0, 1, 2])
    assert mean.shape == (1,) and mean[0] == 5.0 and inv[0] == 0.5
    out, _, inv = mvn_ref(x, 0, epsilon=1.0, epsilon_mode="outside")  # divide by 2 + 1
    np.testing.assert_allclose(out, (x - 5) / 3, rtol=1e-15)
    out, _, inv = mvn_ref(x, 0, epsilon=5.0)  # sqrt(4 + 5) = 3
    np.testing.assert_allclose(out, (x - 5) / 3, rtol=1e-15)
    out, mean, inv = mvn_ref(x, 0, normalize_mean=False, epsilon=0.0)  # rms = sqrt(232 / 8)
    assert mean is None
    np.testing.assert_allclose(out, x / np.sqrt(29.0), rtol=1e-15)
    out, mean, inv = mvn_ref(x, 0, normalize_variance=False)
    assert inv is None
    np.testing.assert_array_equal(out, x - 5)
    # two groups over axis 1 of a (2, 2) input, with scale and bias broadcast
    out, mean, inv = mvn_ref(np.array([[1.0, 3.0], [10.0, 20.0]]), 1, np.array([2.0, 2.0]), np.array([[1.0], [-1.0]]),
                             epsilon=0.0)
    np.testing.assert_array_equal(out, [[-1.0, 3.0], [-3.0, 1.0]])
    np.testing.assert_array_equal(mean, [[2.0], [15.0]])
    np.testing.assert_array_equal(inv, [[1.0], [0.2]])


# ----------------------------------------------------------------------------------------------
# axes
# ----------------------------------------------------------------------------------------------


def all_axes_subsets(nd):
    for r in range(1, nd + 1):
        yield from itertools.combinations(range(nd), r)


@DT
def test_every_axes_subset_4d(rng, dtype):
    shape = (3, 4, 5, 6)
    x = offset_input(rng, shape, dtype)
    for axes in all_axes_subsets(4):
        # any order, and negative spellings
        order = list(rng.permutation(axes))
        spelled = tuple(int(a) - 4 if rng.integers(0, 2) else int(a) for a in order)
        y, m, inv = mvn(x, spelled, return_stats=True)
        assert_like_empty_like(y, x)
        check_mvn(y, x, axes, stats=(m, inv), context=f"axes={spelled}")


@DT
@pytest.mark.parametrize("ndim", range(1, 9))
def test_ranks_random_axes(rng, dtype, ndim):
    shape = tuple(int(s) for s in rng.integers(1, 5, size=ndim))
    while int(np.prod(shape)) > 3000:
        shape = shape[:-1] + (max(1, shape[-1] // 2),)
    x = offset_input(rng, shape, dtype)
    for _ in range(3):
        k = int(rng.integers(1, ndim + 1))
        axes = tuple(int(a) for a in rng.choice(ndim, size=k, replace=False))
        y, m, inv = mvn(x, axes, return_stats=True)
        check_mvn(y, x, axes, stats=(m, inv), context=f"shape={shape} axes={axes}")
    # an int axis
    y = mvn(x, -1)
    check_mvn(y, x, (-1,))


def test_axes_spellings_agree(rng):
    # an int, a tuple, a list, numpy integers, negative and in any order: the same groups
    x = offset_input(rng, (3, 4, 5), F32)
    want = mvn(x, (1, 2))
    for axes in ([2, 1], (-1, -2), (np.int64(1), np.int32(2)), np.array([1, 2])):
        np.testing.assert_array_equal(bits(mvn(x, axes)), bits(want), err_msg=repr(axes))
    np.testing.assert_array_equal(bits(mvn(x, 2)), bits(mvn(x, (2,))))
    np.testing.assert_array_equal(bits(mvn(x, np.int64(-1))), bits(mvn(x, [2])))


# ----------------------------------------------------------------------------------------------
# normalize_mean / normalize_variance / epsilon / epsilon_mode
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("normalize_mean", [True, False])
@pytest.mark.parametrize("normalize_variance", [True, False])
@pytest.mark.parametrize("epsilon_mode", ["inside", "outside"])
def test_flags_and_epsilon_mode(rng, dtype, normalize_mean, normalize_variance, epsilon_mode):
    shape = (2, 3, 7, 9)
    x = offset_input(rng, shape, dtype)
    scale = scale_bias_values(rng, (3, 1, 1), dtype, "scale")
    bias = scale_bias_values(rng, (9,), dtype, "bias")
    for axes, eps in [((2, 3), 1e-5), ((1, 2, 3), 0.3), ((0, 2, 3), 0.0), ((-1,), 2.0)]:
        res = mvn(x, axes, scale, bias, normalize_mean=normalize_mean, normalize_variance=normalize_variance,
                  epsilon=eps, epsilon_mode=epsilon_mode, return_stats=True)
        y, m, inv = res
        check_mvn(y, x, axes, scale, bias, normalize_mean=normalize_mean, normalize_variance=normalize_variance,
                  epsilon=eps, epsilon_mode=epsilon_mode, stats=(m, inv), context=f"axes={axes} eps={eps}")


def test_epsilon_mode_changes_result(rng):
    x = offset_input(rng, (4, 16), F32)
    a = mvn(x, 1, epsilon=0.5, epsilon_mode="inside")
    b = mvn(x, 1, epsilon=0.5, epsilon_mode="outside")
    assert np.abs(a - b).max() > 1e-2


# ----------------------------------------------------------------------------------------------
# scale / bias broadcasting and dtypes
# ----------------------------------------------------------------------------------------------

SB_SHAPES = [
    (2, 3, 4, 5),  # as large as the input
    (1, 3, 1, 1),
    (3, 1, 1),     # fewer leading dims
    (4, 5),        # LayerNorm's normalized shape
    (5,),
    (1,),
    (2, 1, 1, 5),
    (1, 1, 4, 1),
]


@DT
@pytest.mark.parametrize("scale_shape", SB_SHAPES, ids=str)
def test_scale_bias_broadcasting(rng, dtype, scale_shape):
    shape = (2, 3, 4, 5)
    x = offset_input(rng, shape, dtype)
    bias_shape = SB_SHAPES[(SB_SHAPES.index(scale_shape) + 3) % len(SB_SHAPES)]
    for pdt_s, pdt_b in [(dtype, dtype), (F32, dtype), (dtype, F32)]:
        scale = scale_bias_values(rng, scale_shape, pdt_s, "scale")
        bias = scale_bias_values(rng, bias_shape, pdt_b, "bias")
        for axes in [(2, 3), (1,), (0, 2, 3)]:
            y = mvn(x, axes, scale, bias)
            assert y.dtype == dtype
            check_mvn(y, x, axes, scale, bias,
                      context=f"scale {scale_shape} {dtype_id(pdt_s)} bias {bias_shape} {dtype_id(pdt_b)} axes={axes}")


@DT
@pytest.mark.parametrize("which", ["none", "scale", "bias"])
def test_scale_bias_optional_independently(rng, dtype, which):
    shape = (3, 4, 10)
    x = offset_input(rng, shape, dtype)
    scale = scale_bias_values(rng, (4, 10), dtype, "scale") if which == "scale" else None
    bias = scale_bias_values(rng, (10,), dtype, "bias") if which == "bias" else None
    y = mvn(x, (1, 2), scale, bias) if which != "bias" else mvn(x, (1, 2), bias=bias)
    check_mvn(y, x, (1, 2), scale, bias)


@DT
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_no_scale_bias_is_unit_scale_zero_bias_bitwise(isa, rng, dtype, layout, activation):
    # Without scale and bias the kernel computes fma(x - mean, 1/std, 0), one multiply fewer than
    # fma((x - mean) * (1/std), scale, bias) with a scale of 1 and a bias of 0: the same values.
    # The axes take each path (explain_mvn): the rows pipeline ((3,), (2, 3), all four axes), a
    # group of several runs normalized while the next is summed ((0, 2, 3): 1536 elements, 3 KB
    # in float16, past the 2 KB under which groups go in batches), batches of groups ((0, 3)),
    # and lanes ((1,); channels-last, every set but (1,) and all four).
    shape = (4, 5, 16, 24)
    x = offset_input(rng, shape, dtype, layout)
    one = np.ones((1,), np.float32)
    zero = np.zeros((1,), np.float32)
    for axes in [(3,), (2, 3), (0, 2, 3), (0, 3), (1,), (0, 1, 2, 3)]:
        plain = mvn(x, axes, activation=activation)
        check_mvn(plain, x, axes, activation=activation, context=f"isa={isa} layout={layout} axes={axes}")
        unit = mvn(x, axes, one, zero, activation=activation)
        np.testing.assert_array_equal(bits(plain), bits(unit), err_msg=f"isa={isa} layout={layout} axes={axes}")


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_scale_bias_strided_views(rng, dtype):
    x = offset_input(rng, (2, 3, 6, 8), dtype)
    sbase = scale_bias_values(rng, (6, 16), dtype, "scale")
    scale = sbase[::-1, ::2]                       # negative and strided
    bias = np.broadcast_to(scale_bias_values(rng, (1, 8), F32, "bias"), (6, 8))  # zero stride
    y = mvn(x, (2, 3), scale, bias)
    check_mvn(y, x, (2, 3), scale, bias)


# ----------------------------------------------------------------------------------------------
# return_stats
# ----------------------------------------------------------------------------------------------


@DT
def test_return_stats_shapes_and_types(rng, dtype):
    x = offset_input(rng, (2, 3, 4, 5), dtype)
    ct = compute_dtype(dtype)
    y, m, inv = mvn(x, (1, 3), return_stats=True)
    assert m.shape == inv.shape == (2, 1, 4, 1) and m.dtype == inv.dtype == ct
    check_mvn(y, x, (1, 3), stats=(m, inv))
    y2, m2, inv2 = mvn(x, (1, 3), normalize_mean=False, return_stats=True)
    assert m2 is None and inv2.shape == (2, 1, 4, 1)
    check_mvn(y2, x, (1, 3), normalize_mean=False, stats=(m2, inv2))
    y3, m3, inv3 = mvn(x, (1, 3), normalize_variance=False, return_stats=True)
    assert inv3 is None and m3.shape == (2, 1, 4, 1)
    check_mvn(y3, x, (1, 3), normalize_variance=False, stats=(m3, inv3))
    # without return_stats: a bare array, the same numbers
    y4 = mvn(x, (1, 3))
    assert isinstance(y4, np.ndarray)
    np.testing.assert_array_equal(bits(y4), bits(y))


# ----------------------------------------------------------------------------------------------
# activations
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("name", ["relu", "leaky_relu", "elu", "sigmoid", "tanh", "gelu", "silu",
                                  "softplus", "shrink", "clip", "hard_swish", "thresholded_relu"])
def test_activations(isa, rng, dtype, name):
    params = NONDEFAULT_PARAMS.get(name)
    x = offset_input(rng, (2, 3, 5, 11), dtype)
    scale = scale_bias_values(rng, (5, 11), dtype, "scale")
    bias = scale_bias_values(rng, (3, 1, 1), dtype, "bias")
    for axes in [(2, 3), (0, 2, 3)]:
        out = make_out(x.shape, dtype)
        r = mvn(x, axes, scale, bias, activation=act_arg(name, params), out=out)
        assert r is out
        check_mvn(out, x, axes, scale, bias, activation=name, act_params=params, context=f"isa={isa} axes={axes}")


# ----------------------------------------------------------------------------------------------
# layouts (input and out), every ISA
# ----------------------------------------------------------------------------------------------

AXES_CASES = [(3,), (2, 3), (1, 2, 3), (0, 2, 3), (1,), (0,), (0, 1, 2, 3)]


@DT
@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_layouts(isa, rng, dtype, layout):
    shape = (3, 4, 6, 17)
    x = offset_input(rng, shape, dtype, layout)
    for axes in AXES_CASES:
        y, m, inv = mvn(x, axes, return_stats=True)
        assert_like_empty_like(y, x)
        check_mvn(y, x, axes, stats=(m, inv), context=f"isa={isa} layout={layout} axes={axes}")


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("out_layout", WRITABLE_LAYOUTS)
def test_out_layouts(rng, dtype, out_layout):
    shape = (2, 5, 4, 9)
    x = offset_input(rng, shape, dtype, "channels_last")
    for axes in [(3,), (1,), (0, 2, 3)]:
        out = make_out(shape, dtype, out_layout)
        r = mvn(x, axes, out=out)
        assert r is out
        check_mvn(out, x, axes, context=f"out={out_layout} axes={axes}")


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_odd_group_sizes(isa, rng, dtype):
    # rows (reduce innermost) and columns (reduce outer, keep innermost) of every length 1..67
    for n in range(1, 68):
        x = offset_input(rng, (3, n), dtype)
        y, m, inv = mvn(x, 1, return_stats=True)
        check_mvn(y, x, 1, stats=(m, inv), context=f"rows n={n} isa={isa}")
        y, m, inv = mvn(x, 0, return_stats=True)
        check_mvn(y, x, 0, stats=(m, inv), context=f"columns n={n} isa={isa}")
        xu = make_input(rng, (2, n), dtype, "unaligned", loc=1.5)
        s = scale_bias_values(rng, (n,), dtype, "scale")
        y = mvn(xu, -1, s)
        check_mvn(y, xu, -1, s, context=f"unaligned n={n} isa={isa}")


# Long rows with a scale and bias (two rows and the two arrays over 48 KB: float32 from 3072,
# 16-bit from 4096) run two rows in step, an odd count's last row on its own
# (kernels/fused_rows.h: pipeline_rows); a single row never pairs. Each row must get the bits it
# gets alone, at line phases that give the rows masked heads and tails.
LONG_ROWS = [(F32, 3072), (F32, 4160), (F16, 4096), (BF16, 4096)]


@pytest.mark.parametrize("dtype,n", LONG_ROWS, ids=[f"{dtype_id(d)}-{n}" for d, n in LONG_ROWS])
@pytest.mark.parametrize("rows", [5, 6])
def test_long_rows_in_pairs_match_single_rows(isa, rng, threads, dtype, n, rows):
    from cases import empty_past_line

    threads(1)
    x = empty_past_line((rows, n), dtype, 16)
    x[...] = make_input(rng, (rows, n), dtype, loc=2.0)
    g = scale_bias_values(rng, (n,), dtype, "scale")
    b = scale_bias_values(rng, (n,), dtype, "bias")
    for op in ("layer", "rms"):
        out = empty_past_line((rows, n), dtype, 36)
        out[...] = np.nan
        call = (lambda v, o: simdnorm.layer_norm(v, g, b, out=o)) if op == "layer" else \
            (lambda v, o: simdnorm.rms_norm(v, g, out=o))
        call(x, out)
        context = f"{op} rows={rows} n={n} isa={isa}"
        if op == "layer":
            check_mvn(out, x, 1, g, b, context=context)
        else:
            check_mvn(out, x, 1, g, None, normalize_mean=False, context=context)
        for r in range(rows):
            alone = empty_past_line((1, n), dtype, 36)
            call(x[r:r + 1], alone)
            assert np.array_equal(bits(alone[0]), bits(out[r])), f"{context}: row {r} differs from the row alone"
    # in place: the bits of the same input into a separate output
    inplace = empty_past_line((rows, n), dtype, 16)
    inplace[...] = x
    simdnorm.layer_norm(inplace, g, b, out=inplace)
    expected = empty_past_line((rows, n), dtype, 16)
    simdnorm.layer_norm(x, g, b, out=expected)
    assert np.array_equal(bits(inplace), bits(expected)), f"in place rows={rows} n={n} isa={isa}"


# A pair of long rows reads its first row's scale and bias: rows whose scale and bias differ (MVN
# over the last axis with parameters of the input's full shape) must not pair up. (They did: every
# second row took the first's bias; the whole-space fuzzer found it.)
@pytest.mark.parametrize("dtype,n", LONG_ROWS, ids=[f"{dtype_id(d)}-{n}" for d, n in LONG_ROWS])
def test_long_rows_with_their_own_scale_and_bias(isa, rng, threads, dtype, n):
    rows = 4
    x = make_input(rng, (rows, n), dtype, loc=0.5)
    s = scale_bias_values(rng, (rows, n), dtype, "scale")
    b = scale_bias_values(rng, (rows, n), dtype, "bias")
    out = np.full((rows, n), np.nan, dtype)
    mvn(x, -1, s, b, out=out)
    check_mvn(out, x, -1, s, b, context=f"n={n} isa={isa}")


# ----------------------------------------------------------------------------------------------
# out=, in place, overlap
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("axes", [(2,), (0, 2), (1,)], ids=str)
def test_in_place(rng, dtype, axes):
    x = offset_input(rng, (4, 6, 33), dtype)
    x0 = x.copy()
    r = mvn(x, axes, out=x)
    assert r is x
    check_mvn(x, x0, axes)


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
@pytest.mark.parametrize("shift", [1, -1, 5, -40])
@pytest.mark.parametrize("axes", [(2,), (0, 2)], ids=str)
def test_overlap_shifted_output(rng, dtype, shift, axes):
    shape = (3, 4, 40)
    n = int(np.prod(shape))
    buf = rand_values(rng, (n + abs(shift),), dtype, loc=1.0)
    x = (buf[shift:] if shift > 0 else buf[:n]).reshape(shape)
    out = (buf[:n] if shift > 0 else buf[-shift:]).reshape(shape)
    x0 = x.copy()
    scale = scale_bias_values(rng, (40,), dtype, "scale")
    r = mvn(x, axes, scale, out=out)
    assert r is out
    check_mvn(out, x0, axes, scale, context=f"shift={shift}")


@pytest.mark.parametrize("which", ["scale", "bias"])
def test_overlap_output_with_parameter(rng, which):
    shape = (4, 32)
    x = offset_input(rng, shape, F32)
    buf = np.empty(int(np.prod(shape)) + 32 + 5, F32)
    out = buf[:128].reshape(shape)
    pv = buf[5:37]
    vals = scale_bias_values(rng, (32,), F32, which)
    pv[...] = vals
    kw = {which: pv}
    r = mvn(x, 1, out=out, **kw)
    assert r is out
    check_mvn(out, x, 1, **{which: vals})


# ----------------------------------------------------------------------------------------------
# zero-size dims, constant groups, NaN
# ----------------------------------------------------------------------------------------------


@DT
@pytest.mark.parametrize("shape,axes", [((0, 3, 4), (1, 2)), ((2, 0, 4), (2,)), ((2, 3, 0), (2,)),
                                        ((2, 3, 0), (0, 1)), ((0,), (0,))], ids=str)
def test_zero_size(dtype, shape, axes):
    x = np.empty(shape, dtype)
    y = mvn(x, axes)
    assert y.shape == shape and y.dtype == dtype
    out = np.empty(shape, dtype)
    assert mvn(x, axes, out=out) is out
    y, m, inv = mvn(x, axes, return_stats=True)
    kept = tuple(1 if d in axes else s for d, s in enumerate(shape))
    assert y.shape == shape and m.shape == kept and inv.shape == kept


@DT
def test_constant_groups(dtype):
    # zero variance: with epsilon > 0 the output is exactly bias (finite), scale notwithstanding
    x = np.empty((3, 4, 50), dtype)
    x[0] = 3.25
    x[1] = -7.5
    x[2] = 0.125
    bias = np.array([0.5, -1.0, 2.0, 0.0], dtype).reshape(4, 1)
    scale = np.array([2.0, -3.0, 1.0, 0.5], dtype).reshape(4, 1)
    y, m, inv = mvn(x, (1, 2), scale, bias, return_stats=True)
    assert np.isfinite(y.astype(np.float64)).all()
    check_mvn(y, x, (1, 2), scale, bias, stats=(m, inv))
    np.testing.assert_array_equal(m.ravel(), np.array([3.25, -7.5, 0.125]))
    # and without scale: exactly bias up to the rounding of x * (1/sqrt(eps))
    y = mvn(x, (1, 2), bias=bias, epsilon=1e-3).astype(np.float64)
    np.testing.assert_allclose(y, np.broadcast_to(bias.astype(np.float64), y.shape), rtol=0, atol=1e-2)


def test_nan_in_group_stays_in_group(rng):
    x = offset_input(rng, (3, 20), F32)
    x[1, 7] = np.nan
    y = mvn(x, 1)
    assert np.isnan(y[1]).all()
    check_mvn(y[[0, 2]], x[[0, 2]], 1)


# ----------------------------------------------------------------------------------------------
# the checker rejects near-miss semantics
# ----------------------------------------------------------------------------------------------


def test_checker_rejects_wrong_semantics(rng):
    x = offset_input(rng, (4, 6, 9), F32)
    axes = (2,)
    good = mvn_ref(x, axes)[0].astype(F32)
    check_mvn(good, x, axes)
    xs = x.astype(np.float64)
    m = xs.mean(axis=2, keepdims=True)
    wrong = {
        "sample variance": (xs - m) / np.sqrt(xs.var(axis=2, ddof=1, keepdims=True) + 1e-5),
        "epsilon outside": (xs - m) / (np.sqrt(xs.var(axis=2, keepdims=True)) + 1e-5) * 1.0001,
        "other axes": mvn_ref(x, (1, 2))[0],
        "no mean": mvn_ref(x, axes, normalize_mean=False)[0],
    }
    for what, w in wrong.items():
        with pytest.raises(AssertionError):
            check_mvn(w.astype(F32), x, axes, context=what)
    # statistics: a mean off by 1e-3 of the standard deviation is caught
    _, mean, inv = mvn_ref(x, axes)
    with pytest.raises(AssertionError):
        check_mvn(good, x, axes, stats=((mean + 1e-3 * 2.0).astype(F32), inv.astype(F32)))
    with pytest.raises(AssertionError):
        check_mvn(good, x, axes, stats=(mean.astype(F32), (inv * (1 + 1e-3)).astype(F32)))


@pytest.mark.parametrize("n", [1, 3])
def test_kernel_takes_statistics_equal_up_to_size_one_dims(rng, n):
    # The torch route hands group norm's (N, G) statistics to the kernel as they are, for the split
    # view's (N, G, 1, 1, 1): any rank whose shape agrees once size-1 dims are dropped, any strides;
    # a shape that does not agree is refused, never read as another.
    from simdnorm import _core
    from reference import group_norm_ref

    g, x = 4, make_input(rng, (n, 8, 5, 3), F32, loc=2.0)
    y_ref, m_ref, s_ref = group_norm_ref(x, g)
    args = lambda out, m, s: (x, (2, 3, 4), None, None, out, 1e-5, True, True, False, (0, 0.0, 0.0), m, s, 1,  # noqa: E731
                              False, None, g)
    kept = [np.full((n, g), np.nan, F32), np.full((g, n), np.nan, F32).T, np.full((1, n, 1, g, 1), np.nan, F32)]
    if n == 1:
        kept.append(np.full((g,), np.nan, F32))
    for m in kept:
        s, out = np.full_like(m, np.nan), np.full_like(x, np.nan)
        _core.mvn(*args(out, m, s))
        np.testing.assert_allclose(out, y_ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(m.reshape(n, g), m_ref, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(s.reshape(n, g), s_ref, rtol=2e-6)
    for shape in [(g, n) if n > 1 else (g, 2), (n, g, 2), (n * g + 1,), (n, 2 * g)]:
        m = np.full(shape, np.nan, F32)
        with pytest.raises(ValueError, match="reduced dims 1"):
            _core.mvn(*args(np.full_like(x, np.nan), m, None))
